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
time on the wire if nothing overlapped. With --rounds N each variant runs N times, the variants taking turns: a
row's step is the median of its rounds (its bytes a median run's), and its ratio to DDP the median of its rounds'
ratios to DDP's step of the same round.

DiLoCo's rows beside the no-sync floor: the same diloco_resnet.py run with every sync skipped (this
file started by torchrun with --no-sync-worker first), its computation alone, at H = 20 and over H = 100's
steps; "x floor" is a row's step over its floor's (H = 100's for H = 100 rows) of the same round, and each
DiLoCo row says what one sync hands (its largest fragment) and what node 0's link carried per sync.

    python benchmarks/slow_links.py --rates 100 --only DDP "DiLoCo H = 8" "DiLoCo H = 20" \
        "Streaming DiLoCo H = 8*" "Streaming DiLoCo H = 20*" "no-sync*" --accuracy-rate 0 --rounds 2
    python benchmarks/slow_links.py --rates 10 --only "DiLoCo H = 100" "Streaming DiLoCo H = 100*" \
        "no-sync floor (DiLoCo H = 100*" --accuracy-rate 0 --rounds 2
    python benchmarks/slow_links.py --sweep "Streaming DiLoCo H = 8, F = 4, TAU = 1" --seeds 0 1 2
    python benchmarks/slow_links.py --frontier

--sweep measures accuracy at equal samples instead, on this machine's loopback (2 ranks; a run's
training is the same at any link rate, and its time at a rate is its steps times the rows' step):
SWEEP's settings, each seed a run, into runs/slow_links/sweep.json. --frontier then puts each setting's
accuracy after each epoch against its training minutes at each rate measured (results.json keeps every row
measured), printed and drawn in benchmarks/slow_links_frontier.png.

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
    ("DiLoCo H = 8", "diloco_resnet.py", ["--local-steps", "8"], 1, (2, 18)),
    ("Streaming DiLoCo H = 8, F = 4, TAU = 1", "diloco_resnet.py",
     ["--local-steps", "8", "--fragments", "4", "--sync-delay", "1"], 1, (2, 18)),
    ("no-sync floor (DiLoCo H = 20, syncs skipped)", NO_SYNC, ["--local-steps", "20"], 1, (2, 22)),
    ("DiLoCo H = 100", "diloco_resnet.py", ["--local-steps", "100", "--train-samples", "8192"], 1, (2, 102)),
    ("Streaming DiLoCo H = 100, F = 5, TAU = 15", "diloco_resnet.py",
     ["--local-steps", "100", "--fragments", "5", "--sync-delay", "15", "--train-samples", "8192"], 1, (2, 102)),
    ("Streaming DiLoCo H = 100, F = 5, TAU = 19", "diloco_resnet.py",
     ["--local-steps", "100", "--fragments", "5", "--sync-delay", "19", "--train-samples", "8192"], 1, (2, 102)),
    ("no-sync floor (DiLoCo H = 100, syncs skipped)", NO_SYNC, ["--local-steps", "100", "--train-samples", "8192"], 1,
     (2, 102)),
    ("FSDP, 2 nodes x 2", "fsdp_resnet.py", [], 2, (2, 5)),
    ("HSDP, 2 nodes x 2", "fsdp_resnet.py", ["--hsdp"], 2, (2, 5)),
]


# A variant's floor: the no-sync run of H = 100 for a variant of H = 100 (its steps), else of H = 20.
FLOOR = {label: f"no-sync floor (DiLoCo H = {100 if '100' in flags[1:2] else 20}, syncs skipped)"
         for label, _, flags, *_ in VARIANTS}
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", type=int, nargs="+", default=[100], help="link rates, Mbit/s")
    p.add_argument("--only", nargs="+", help="variants by label; one ending with * stands for every label it starts")
    p.add_argument("--accuracy-rate", type=int, default=100, help="Mbit/s of the accuracy runs (0: none)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every variant, taking turns; the median is shown")
    p.add_argument("--sweep", nargs="+", metavar="LABEL", help="instead: the accuracy of SWEEP's settings whose label "
                   "starts with one of these, on this machine's loopback (the training is the same at any link rate)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="--sweep: a run for each")
    p.add_argument("--frontier", action="store_true", help="instead: the sweep's accuracy against its time at each "
                   "rate measured (sweep.json, results.json), printed and drawn")
    args = p.parse_args(argv)
    if args.sweep:
        return sweep([s for s in SWEEP if s[0].startswith(tuple(args.sweep))], args.seeds)
    if args.frontier:
        return frontier()
    problem = simulated_cluster.unavailable()
    if problem:
        sys.exit(f"{problem}; this benchmark needs it")
    common.fashion_mnist(os.path.join(ROOT, "data"))
    os.makedirs(OUT, exist_ok=True)
    chosen = lambda label: label in args.only or label.startswith(tuple(o[:-1] for o in args.only if o[-1] == "*"))
    variants = [v for v in VARIANTS if not args.only or chosen(v[0])]
    # Earlier runs' rows stay (the frontier below reads them); a variant measured again replaces its own.
    path = os.path.join(OUT, "results.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
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
        for label, *_ in variants:   # the median step (bytes from a median run), every round's steps beside it
            r = sorted(runs[label], key=lambda run: run["step_s"])[(args.rounds - 1) // 2]
            r["step_s_rounds"] = [run["step_s"] for run in runs[label]]
            r["step_s"] = statistics.median(r["step_s_rounds"])
            # Over its step of the same round, the median.
            for key, base in (("x_ddp", "DDP"), ("x_floor", FLOOR[label])):
                if base in runs:
                    r[key] = statistics.median(a["step_s"] / b["step_s"] for a, b in zip(runs[label], runs[base]))
            results.setdefault(label, {})[str(rate)] = r
            wire_s = r["link_bytes_per_step"] * 8 / (rate * 1e6)
            print(f"  {label:50}{r['step_s']:7.2f}{r.get('x_ddp', float('nan')):8.2f}"
                  f"{r.get('x_floor', float('nan')):9.2f}{r['sent_bytes_per_step'] / 1e6:17.2f}"
                  f"{r['link_bytes_per_step'] / 1e6:24.2f}{wire_s:22.2f}", flush=True)
        for label, *_ in variants:   # DiLoCo's syncs: node 0's link per sync, beside the largest fragment handed
            r = results[label][str(rate)]
            if r["largest_fragment_bytes"] and "floor" not in label:
                print(f"  {label:50}a sync: {r['largest_fragment_bytes'] / 1e6:.2f} MB its largest fragment, "
                      f"{r['link_bytes_per_sync'] / 1e6:.2f} MB over node 0's link (mean)", flush=True)
        json.dump(results, open(path, "w"), indent=1)
    if args.accuracy_rate:
        accuracy(results, args.accuracy_rate)
        json.dump(results, open(path, "w"), indent=1)
    print(f"\nwrote {os.path.relpath(OUT, ROOT)}/results.json", flush=True)


# Settings whose accuracy --sweep measures at ACCURACY_FLAGS' 96 steps: label, script, flags.
SWEEP = [("DDP", "ddp_resnet.py", []), ("DiLoCo H = 20", "diloco_resnet.py", ["--local-steps", "20"])] + [
    (f"Streaming DiLoCo H = {h}, F = {f}, TAU = {tau}, ALPHA = {alpha}, outer lr {lr}, momentum {m}",
     "diloco_resnet.py",
     ["--local-steps", str(h), "--fragments", str(f), "--sync-delay", str(tau), "--fragment-alpha", str(alpha),
      "--outer-lr", str(lr), "--outer-momentum", str(m)])
    for h, f, tau, alpha, lr, m in [
        (20, 4, 4, 0.0, 0.7, 0.9), (20, 4, 4, 0.5, 0.7, 0.9), (8, 4, 1, 0.0, 0.7, 0.9), (20, 4, 4, 0.5, 0.4, 0.9),
        (40, 4, 9, 0.0, 0.7, 0.9), (100, 5, 15, 0.0, 0.7, 0.9), (20, 4, 4, 0.5, 1.0, 0.0), (20, 4, 4, 0.5, 0.7, 0.5),
        (8, 2, 3, 0.5, 1.0, 0.0), (8, 4, 1, 0.5, 1.0, 0.0), (16, 4, 3, 0.5, 1.0, 0.0), (12, 4, 2, 0.5, 1.0, 0.0),
        (8, 4, 1, 0.0, 1.0, 0.0)]] + [
    ("DiLoCo H = 20, outer lr 1.0, momentum 0.0", "diloco_resnet.py",
     ["--local-steps", "20", "--outer-lr", "1.0", "--outer-momentum", "0"]),
    ("DiLoCo H = 8, outer lr 1.0, momentum 0.0", "diloco_resnet.py",
     ["--local-steps", "8", "--outer-lr", "1.0", "--outer-momentum", "0"]),
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


def frontier():
    """Each swept setting's mean test accuracy after each epoch against the training minutes to it at each link rate:
    the epoch's steps times the step measured for its row (the row of its H, F and TAU: ALPHA and the outer optimizer
    do not change a step's time). Drawn in benchmarks/slow_links_frontier.png."""
    paths = [os.path.join(OUT, name) for name in ("sweep.json", "results.json")]
    if not all(map(os.path.exists, paths)):
        names = " and ".join(os.path.relpath(path, ROOT) for path in paths)
        sys.exit(f"--frontier reads {names}: run --sweep, and the rows (--rates), first")
    swept, rows = (json.load(open(path)) for path in paths)
    flag = lambda name: int(ACCURACY_FLAGS[ACCURACY_FLAGS.index(name) + 1])
    steps = flag("--train-samples") // flag("--batch-size")   # an epoch's
    rates = sorted({rate for label, row in rows.items() if label != "accuracy" for rate in row}, key=int)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt, matplotlib.ticker
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.5), squeeze=False)
    curves = {label: [statistics.mean(c) for c in zip(*seeds.values())] for label, seeds in swept.items()}
    # The mark: the best end of a setting other than DDP's over 3 seeds or more; each setting's minutes to it.
    mark = max((c[-1] for label, c in curves.items() if label != "DDP" and len(swept[label]) >= 3), default=1.0)
    print(f"frontier: mean test accuracy after the last epoch (seeds), training minutes at each rate to it, and to "
          f"{mark:.3f} (the best end over 3 seeds but DDP's)", flush=True)
    drawn = {}
    for label, curve in curves.items():
        row = label.split(", ALPHA")[0].split(", outer")[0]
        minutes = {rate: [(e + 1) * steps * rows[row][rate]["step_s"] / 60 for e in range(len(curve))]
                   for rate in rates if rate in rows.get(row, {})}
        reached = next((e for e, acc in enumerate(curve) if acc >= mark - 1e-9), None)
        times = "  ".join(f"{rate} Mbit/s {m[-1]:6.1f} min" + (f" ({m[reached]:.1f} to the mark)"
                                                              if reached is not None else "")
                          for rate, m in minutes.items())
        print(f"  {label:82}{curve[-1]:.3f} ({len(swept[label])})  {times or 'no step measured'}", flush=True)
        # Drawn: each row's setting of most seeds (3 at most), of those the best end.
        drawn[row] = max(drawn.get(row, ()), (min(len(swept[label]), 3), curve[-1], label, minutes))
    # Each measured row's best setting, a colour each.
    for colour, (*_, label, minutes) in enumerate(d for d in drawn.values() if d[-1]):
        for ax, rate in zip(axes[0], rates):
            if rate in minutes:
                ax.plot(minutes[rate], curves[label], "o-", color=f"C{colour}",
                        label=f"{label} ({len(swept[label])} seed{'s' * (len(swept[label]) > 1)})")
    for ax, rate in zip(axes[0], rates):
        ax.set(xscale="log", xlabel="training minutes (2 simulated nodes, 2 CPU cores)", ylabel="test accuracy",
               title=f"{rate} Mbit/s: ResNet-18, Fashion-MNIST, {flag('--epochs')} epochs of {steps} steps")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "benchmarks", "slow_links_frontier.png"), dpi=100)
    print("wrote benchmarks/slow_links_frontier.png", flush=True)


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
