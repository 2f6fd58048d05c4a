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

DiLoCo's rows beside the no-sync floor: the same diloco_resnet.py run with every sync skipped (this
file started by torchrun with --no-sync-worker first), its computation alone; "x floor" is a row's
step over the floor's of the same round, and each DiLoCo row says what one sync hands (its largest
fragment) and what node 0's link carried per sync.

    python benchmarks/slow_links.py --rates 10 100 --only DDP "DiLoCo H = 20" "Streaming*" \
        "no-sync*" --accuracy-rate 0 --rounds 2
    python benchmarks/slow_links.py --sweep "Streaming DiLoCo H = 20" --seeds 0 1 2

--sweep measures accuracy at equal samples instead, on this machine's loopback (2 ranks; a run's
training is the same at any link rate, and its time at a rate is its steps times the rows' step):
SWEEP's settings, each seed a run, into runs/slow_links/sweep.json.

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
# The no-sync floor: diloco_resnet.py with every sync skipped (this file, run by torchrun with this switch first).
NO_SYNC = "benchmarks/slow_links.py --no-sync-worker"
VARIANTS = [   # label, script, flags, processes per node, (K1, K2)
    ("DDP", "ddp_resnet.py", [], 1, (2, 6)),
    ("DDP + bf16", "ddp_resnet.py", ["--comm-hook", "bf16"], 1, (2, 6)),
    ("DDP + PowerSGD rank 4", "ddp_resnet.py", ["--comm-hook", "powersgd", "--powersgd-start", "2"], 1, (2, 8)),
    ("DDP + PowerSGD rank 1", "ddp_resnet.py", ["--comm-hook", "powersgd", "--powersgd-start", "2",
                                                "--powersgd-rank", "1"], 1, (2, 8)),
    ("DiLoCo H = 10", "diloco_resnet.py", ["--local-steps", "10"], 1, (2, 12)),
    ("DiLoCo H = 50", "diloco_resnet.py", ["--local-steps", "50"], 1, (2, 52)),
    ("DiLoCo H = 20", "diloco_resnet.py", ["--local-steps", "20"], 1, (2, 22)),
    ("Streaming DiLoCo H = 20, F = 4, TAU = 4", "diloco_resnet.py",
     ["--local-steps", "20", "--fragments", "4", "--sync-delay", "4"], 1, (2, 22)),
    ("no-sync floor (DiLoCo H = 20, syncs skipped)", NO_SYNC, ["--local-steps", "20"], 1, (2, 22)),
    ("DiLoCo H = 100", "diloco_resnet.py", ["--local-steps", "100", "--train-samples", "8192"], 1, (2, 102)),
    ("Streaming DiLoCo H = 100, F = 5, TAU = 15", "diloco_resnet.py",
     ["--local-steps", "100", "--fragments", "5", "--sync-delay", "15", "--train-samples", "8192"], 1, (2, 102)),
    ("Streaming DiLoCo H = 100, F = 5, TAU = 19", "diloco_resnet.py",
     ["--local-steps", "100", "--fragments", "5", "--sync-delay", "19", "--train-samples", "8192"], 1, (2, 102)),
    ("FSDP, 2 nodes x 2", "fsdp_resnet.py", [], 2, (2, 5)),
    ("HSDP, 2 nodes x 2", "fsdp_resnet.py", ["--hsdp"], 2, (2, 5)),
]


FLOOR = "no-sync floor (DiLoCo H = 20, syncs skipped)"
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
                                  *[os.path.join(ROOT, script.split()[0])] + script.split()[1:]] + base + flags
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
            "epochs": m["epochs"], "every": (m["config"].get("local_steps") or 1) // (m["config"].get("fragments") or 1),
            "largest_fragment_bytes": m["epochs"][-1].get("largest_fragment_bytes")}


def measure(script, flags, procs_per_node, rate_mbit, k1, k2):
    a, b = (run_on_cluster(script, flags, procs_per_node, rate_mbit, k) for k in (k1, k2))
    between = lambda key: (b[key] - a[key]) / (k2 - k1)   # the steps from K1 to K2
    return {"step_s": between("seconds"), "link_bytes_per_step": between("tx"),
            "sent_bytes_per_step": (b["sent_per_step"] * k2 - a["sent_per_step"] * k1) / (k2 - k1),
            "sent_by_run": [a["sent_by"], b["sent_by"]], "steps": (k1, k2),
            "link_bytes_per_sync": between("tx") * b["every"], "largest_fragment_bytes": b["largest_fragment_bytes"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=int, nargs="+", default=[100], help="link rates, Mbit/s")
    p.add_argument("--only", nargs="+", help="variants by label; one ending with * stands for every label it starts")
    p.add_argument("--accuracy-rate", type=int, default=100, help="Mbit/s of the accuracy runs (0: none)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every variant, taking turns; the median is shown")
    p.add_argument("--sweep", nargs="+", metavar="LABEL", help="instead: the accuracy of SWEEP's settings whose label "
                   "starts with one of these, on this machine's loopback (the training is the same at any link rate)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="--sweep: a run for each")
    args = p.parse_args(argv)
    if args.sweep:
        return sweep([s for s in SWEEP if s[0].startswith(tuple(args.sweep))], args.seeds)
    problem = simulated_cluster.unavailable()
    if problem:
        sys.exit(f"{problem}; this benchmark needs it")
    common.fashion_mnist(os.path.join(ROOT, "data"))
    os.makedirs(OUT, exist_ok=True)
    chosen = lambda label: label in args.only or label.startswith(tuple(o[:-1] for o in args.only if o[-1] == "*"))
    variants = [v for v in VARIANTS if not args.only or chosen(v[0])]
    results = {}
    print(f"slow links on {os.cpu_count()} cores: ResNet-18, global batch 64, 2 simulated nodes; a step's time = "
          f"the difference of two runs' training seconds over their difference in steps", flush=True)
    for rate in args.rates:
        print(f"\n{rate} Mbit/s per node link{'':27}s/step   x DDP  x floor   MB handed/step (rank)   "
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
            for key, base in (("x_ddp", "DDP"), ("x_floor", FLOOR)):   # over its step of the same round, the median
                if base in runs:
                    r[key] = statistics.median(a["step_s"] / b["step_s"] for a, b in zip(runs[label], runs[base]))
            results.setdefault(label, {})[rate] = r
            wire_s = r["link_bytes_per_step"] * 8 / (rate * 1e6)
            print(f"  {label:50}{r['step_s']:7.2f}{r.get('x_ddp', float('nan')):8.2f}"
                  f"{r.get('x_floor', float('nan')):9.2f}{r['sent_bytes_per_step'] / 1e6:17.2f}"
                  f"{r['link_bytes_per_step'] / 1e6:24.2f}{wire_s:22.2f}", flush=True)
        for label, *_ in variants:   # DiLoCo's syncs: node 0's link per sync, beside the largest fragment handed
            r = results[label][rate]
            if r["largest_fragment_bytes"] and "floor" not in label:
                print(f"  {label:50}a sync: {r['largest_fragment_bytes'] / 1e6:.2f} MB its largest fragment, "
                      f"{r['link_bytes_per_sync'] / 1e6:.2f} MB over node 0's link (mean)", flush=True)
        json.dump(results, open(os.path.join(OUT, "results.json"), "w"), indent=1)
    if args.accuracy_rate:
        accuracy(results, args.accuracy_rate)
        json.dump(results, open(os.path.join(OUT, "results.json"), "w"), indent=1)
    print(f"\nwrote {os.path.relpath(OUT, ROOT)}/results.json", flush=True)


# Settings whose accuracy --sweep measures at ACCURACY_FLAGS' 96 steps: label, script, flags.
SWEEP = [("DDP", "ddp_resnet.py", []), ("DiLoCo H = 10", "diloco_resnet.py", ["--local-steps", "10"]),
         ("DiLoCo H = 20", "diloco_resnet.py", ["--local-steps", "20"])] + [
    (f"Streaming DiLoCo H = {h}, F = {f}, TAU = {tau}, ALPHA = {alpha}, outer lr {lr}", "diloco_resnet.py",
     ["--local-steps", str(h), "--fragments", str(f), "--sync-delay", str(tau), "--fragment-alpha", str(alpha),
      "--outer-lr", str(lr)])
    for h, f, tau, alpha, lr in [(20, 4, 4, 0.0, 0.7), (20, 4, 4, 0.5, 0.7), (20, 4, 1, 0.0, 0.7), (8, 4, 1, 0.0, 0.7),
                                 (8, 4, 1, 0.5, 0.7), (20, 4, 4, 0.5, 0.4), (20, 4, 4, 0.5, 1.0), (40, 4, 9, 0.0, 0.7),
                                 (100, 5, 15, 0.0, 0.7), (100, 5, 15, 0.5, 0.7)]] + [
    ("DiLoCo H = 100", "diloco_resnet.py", ["--local-steps", "100"])]


def sweep(settings, seeds):
    """Each setting's test accuracy after each of ACCURACY_FLAGS' 6 epochs, one torchrun of 2 ranks per seed, on the
    loopback: a run's training is the same at any link rate (its time per step is the rows' measure)."""
    path = os.path.join(OUT, "sweep.json")
    os.makedirs(OUT, exist_ok=True)
    done = json.load(open(path)) if os.path.exists(path) else {}
    print(f"accuracy sweep: {' '.join(ACCURACY_FLAGS)}, 2 ranks; test accuracy after each epoch", flush=True)
    for label, script, flags in settings:
        for seed in seeds:
            with tempfile.TemporaryDirectory() as out:
                subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                os.path.join(ROOT, script)] + ACCURACY_FLAGS + flags
                               + ["--seed", str(seed), "--out", out, "--data-dir", os.path.join(ROOT, "data")],
                               cwd=ROOT, check=True, capture_output=True)
                epochs = json.load(open(os.path.join(out, "metrics.json")))["epochs"]
            done.setdefault(label, {})[str(seed)] = [e["test_acc"] for e in epochs]
            json.dump(done, open(path, "w"), indent=1)
            print(f"  {label:62} seed {seed}: " + " ".join(f"{e['test_acc']:.3f}" for e in epochs), flush=True)
    print(f"wrote {os.path.relpath(path, ROOT)}", flush=True)


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


def no_sync_worker(argv):
    """diloco_resnet.py with every sync skipped, nothing sent: the floor under a sync's cost."""
    import diloco_resnet
    diloco_resnet.Outer.after_step = lambda self, raw_model, step: (0, 0)
    diloco_resnet.main(argv)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--no-sync-worker"]:
        no_sync_worker(sys.argv[2:])
    else:
        main()
