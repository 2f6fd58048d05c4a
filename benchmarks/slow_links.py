"""Training over slow links, timed on the simulated cluster: what DDP, its compression hooks, DiLoCo,
FSDP and HSDP cost per step when the network between the machines is slow. Needs root.

    python benchmarks/slow_links.py                        # 100 Mbit/s and the accuracy runs: ~40 min, 2 cores
    python benchmarks/slow_links.py --rates 10 1000 --accuracy-rate 0   # 10 Mbit/s ~55 min (its flat
                                                           # FSDP alone ~20), 1000 Mbit/s ~18

Every variant runs the real script under torchrun, one torchrun per simulated node (2 nodes x 1
process; FSDP and HSDP 2 x 2), ResNet-18 on Fashion-MNIST, global batch 64, one thread per
process. A step's time is the difference of two runs' training seconds (metrics.json: the loop
alone, no start-up, no evaluation), K1 and K2 steps, over K2 - K1: DDP's first step (its buckets
rebuilt) and PowerSGD's plain steps fall in the first K1. Bytes: what each rank handed to
collectives per step (metrics.json's sent_bytes_per_step, the same difference), and what node 0's
link carried per step (its eth0 tx_bytes, the same difference), beside that link's bytes / rate: the step's
time on the wire if nothing overlapped. With --rounds N each variant runs N times, the variants taking turns: a row
is its median run, and its ratio to DDP the median of its rounds' ratios to DDP's step of the same round.

Then accuracy at an equal number of samples (`--accuracy-rate`, default 100 Mbit/s): DDP, DDP +
PowerSGD rank 4 (its default 10 plain steps first) and DiLoCo H = 10 each train 6 epochs of 1,024
Fashion-MNIST images (96 steps of 64, 6,144 samples), tested on 1,000 after every epoch; printed
side by side, and drawn against the training seconds in benchmarks/slow_links_accuracy.png.
Writes runs/slow_links/results.json.
"""
import argparse, json, os, socket, statistics, subprocess, sys, tempfile
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
import common, simulated_cluster

OUT = os.path.join(ROOT, "runs", "slow_links")
BASE = ["--batch-size", "64", "--train-samples", "4096", "--test-samples", "100", "--epochs", "1", "--workers", "0"]
VARIANTS = [   # label, script, flags, processes per node, (K1, K2)
    ("DDP", "ddp_resnet.py", [], 1, (2, 6)),
    ("DDP + bf16", "ddp_resnet.py", ["--comm-hook", "bf16"], 1, (2, 6)),
    ("DDP + PowerSGD rank 4", "ddp_resnet.py", ["--comm-hook", "powersgd", "--powersgd-start", "2"], 1, (2, 8)),
    ("DDP + PowerSGD rank 1", "ddp_resnet.py", ["--comm-hook", "powersgd", "--powersgd-start", "2",
                                                "--powersgd-rank", "1"], 1, (2, 8)),
    ("DiLoCo H = 10", "diloco_resnet.py", ["--local-steps", "10"], 1, (2, 12)),
    ("DiLoCo H = 50", "diloco_resnet.py", ["--local-steps", "50"], 1, (2, 52)),
    ("FSDP, 2 nodes x 2", "fsdp_resnet.py", [], 2, (2, 5)),
    ("HSDP, 2 nodes x 2", "fsdp_resnet.py", ["--hsdp"], 2, (2, 5)),
]


ACCURACY = [("DDP", "ddp_resnet.py", []), ("DDP + PowerSGD rank 4", "ddp_resnet.py", ["--comm-hook", "powersgd"]),
            ("DiLoCo H = 10", "diloco_resnet.py", ["--local-steps", "10"])]
ACCURACY_FLAGS = ["--batch-size", "64", "--train-samples", "1024", "--test-samples", "1000", "--epochs", "6",
                  "--workers", "0"]



def free_port():   # port 0: the OS picks one no one listens on now
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def run_on_cluster(script, flags, procs_per_node, rate_mbit, steps=None, base=BASE):
    """One run on a fresh 2-node cluster: training seconds, steps, sent bytes per step, node 0's
    tx bytes, and the epochs' records."""
    with tempfile.TemporaryDirectory() as out, simulated_cluster.SimulatedCluster(2, rate_mbit) as cluster:
        port = free_port()
        env = cluster.env(OMP_NUM_THREADS="1")
        jobs = [cluster.popen(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                                  f"--nproc_per_node={procs_per_node}", f"--node-rank={i}",
                                  f"--master-addr={cluster.addresses[0]}", f"--master-port={port}",
                                  os.path.join(ROOT, script)] + base + flags
                              + (["--max-steps", str(steps)] if steps else [])
                              + ["--out", out, "--data-dir", os.path.join(ROOT, "data")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for i in range(2)]
        outputs = [job.communicate(timeout=3600) for job in jobs]
        if any(job.returncode for job in jobs):
            sys.exit(f"{script} {' '.join(flags)} failed:\n" + "\n".join(err[-2000:] for _, err in outputs))
        tx = int(cluster.run(0, ["cat", "/sys/class/net/eth0/statistics/tx_bytes"]).stdout)
        m = json.load(open(os.path.join(out, "metrics.json")))
    return {"seconds": sum(e["seconds"] for e in m["epochs"]), "steps": m["steps"],
            "sent_per_step": m["sent_bytes_per_step"], "sent_by": m["sent_bytes_by_collective"], "tx": tx,
            "epochs": m["epochs"]}


def measure(script, flags, procs_per_node, rate_mbit, k1, k2):
    a, b = (run_on_cluster(script, flags, procs_per_node, rate_mbit, k) for k in (k1, k2))
    between = lambda key: (b[key] - a[key]) / (k2 - k1)   # the steps from K1 to K2
    return {"step_s": between("seconds"), "link_bytes_per_step": between("tx"),
            "sent_bytes_per_step": (b["sent_per_step"] * k2 - a["sent_per_step"] * k1) / (k2 - k1),
            "sent_by_run": [a["sent_by"], b["sent_by"]], "steps": (k1, k2)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=int, nargs="+", default=[100], help="link rates, Mbit/s")
    p.add_argument("--only", nargs="+", help="variants whose label starts with one of these")
    p.add_argument("--accuracy-rate", type=int, default=100, help="Mbit/s of the accuracy runs (0: none)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every variant, taking turns; the median is shown")
    args = p.parse_args(argv)
    problem = simulated_cluster.unavailable()
    if problem:
        sys.exit(f"{problem}; this benchmark needs it")
    common.fashion_mnist(os.path.join(ROOT, "data"))
    os.makedirs(OUT, exist_ok=True)
    variants = [v for v in VARIANTS if not args.only or v[0].startswith(tuple(args.only))]
    results = {}
    print(f"slow links on {os.cpu_count()} cores: ResNet-18, global batch 64, 2 simulated nodes; a step's time = "
          f"the difference of two runs' training seconds over their difference in steps", flush=True)
    for rate in args.rates:
        print(f"\n{rate} Mbit/s per node link{'':27}s/step   x DDP   MB handed/step (rank)   "
              f"MB over node 0's link/step   link MB/rate (s)", flush=True)
        runs = {label: [] for label, *_ in variants}
        for round_ in range(1, args.rounds + 1):   # in turn, so a slow minute hits every variant alike
            for label, script, flags, procs, (k1, k2) in variants:
                if rate <= 10 and "PowerSGD" not in label and "DiLoCo" not in label:
                    k1, k2 = 1, 3   # a minute a step or more: the difference of 2 steps
                runs[label].append(measure(script, flags, procs, rate, k1, k2))
                if args.rounds > 1:
                    print(f"  round {round_}  {label:42}{runs[label][-1]['step_s']:7.2f}", flush=True)
        for label, *_ in variants:   # the round with the median step, every round's steps beside it
            r = sorted(runs[label], key=lambda run: run["step_s"])[(args.rounds - 1) // 2]
            r["step_s_rounds"] = [run["step_s"] for run in runs[label]]
            if "DDP" in runs:   # over DDP's step of the same round, the median of the rounds
                r["x_ddp"] = statistics.median(a["step_s"] / b["step_s"] for a, b in zip(runs[label], runs["DDP"]))
            results.setdefault(label, {})[rate] = r
            wire_s = r["link_bytes_per_step"] * 8 / (rate * 1e6)
            print(f"  {label:50}{r['step_s']:7.2f}{r.get('x_ddp', float('nan')):8.2f}"
                  f"{r['sent_bytes_per_step'] / 1e6:17.2f}{r['link_bytes_per_step'] / 1e6:24.2f}{wire_s:22.2f}",
                  flush=True)
        json.dump(results, open(os.path.join(OUT, "results.json"), "w"), indent=1)
    if args.accuracy_rate:
        accuracy(results, args.accuracy_rate)
        json.dump(results, open(os.path.join(OUT, "results.json"), "w"), indent=1)
    print(f"\nwrote {os.path.relpath(OUT, ROOT)}/results.json", flush=True)


def accuracy(results, rate):
    """Test accuracy after each epoch, against the training seconds so far, at an equal number of samples."""
    print(f"\naccuracy at {rate} Mbit/s: {' '.join(ACCURACY_FLAGS)} (96 steps), test accuracy after each epoch "
          f"(training seconds so far)", flush=True)
    curves = results.setdefault("accuracy", {})
    for label, script, flags in ACCURACY:
        r = run_on_cluster(script, flags, 1, rate, base=ACCURACY_FLAGS)
        seconds = [sum(e["seconds"] for e in r["epochs"][:i + 1]) for i in range(len(r["epochs"]))]
        curves[label] = {"seconds": seconds, "test_acc": [e["test_acc"] for e in r["epochs"]],
                         "samples": sum(e["samples"] for e in r["epochs"]), "link_bytes": r["tx"]}
        print(f"  {label:24}" + "  ".join(f"{e['test_acc']:.3f} ({s:.0f} s)" for e, s in zip(r["epochs"], seconds)) +
              f"   {r['tx'] / 1e9:.2f} GB over node 0's link", flush=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, c in curves.items():
        ax.plot(c["seconds"], c["test_acc"], "o-", label=label)
    ax.set(xlabel="training seconds (2 simulated nodes, 2 CPU cores)", ylabel="test accuracy",
           title=f"ResNet-18, Fashion-MNIST, {rate} Mbit/s links, 96 steps of 64")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "benchmarks", "slow_links_accuracy.png"), dpi=100)


if __name__ == "__main__":
    main()
