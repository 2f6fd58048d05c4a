"""Every approach side by side, at the same global batch, on whatever hardware is here.

    bash run_all.sh bench      (or: python benchmarks/bench.py)

Each of our scripts runs twice, for W and for W+N optimizer steps, and the rate is N batches over
the difference of the two training times: start-up, data loading and the first (warm-up) steps
cancel out. The d2l originals (benchmarks/original_*.py) time N steps after W themselves. The
approaches take turns, round after round, and each figure is the median of its rounds; ratios are
to the single-device run of the same model. Draws the step times side by side in benchmarks/bench.png
and writes runs/bench/bench.json.
"""
import json, os, platform, statistics, subprocess, sys, time
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY, TORCHRUN = [sys.executable], [sys.executable, "-m", "torch.distributed.run", "--standalone"]
DATA = os.path.join(ROOT, "data")
OUT = os.path.join(ROOT, "runs", "bench")
ROUNDS = 3   # shared machines are noisy: each figure is the median of this many runs

def ours(command, batch, warmup, steps):
    """Steady-state samples/s of one of our scripts, from two runs. With --compile a first,
    uncounted run fills torch.compile's cache, so both counted runs compile equally fast."""
    seconds = []
    for max_steps in ([warmup] if "--compile" in command else []) + [warmup, warmup + steps]:
        out = os.path.join(OUT, next(os.path.basename(c)[:-3] for c in command if c.endswith(".py")))
        subprocess.run(command + ["--batch-size", str(batch), "--max-steps", str(max_steps), "--epochs", "1",
                                  "--test-samples", "100", "--data-dir", DATA, "--out", out],
                       cwd=ROOT, check=True, capture_output=True, env=ENV)
        seconds.append(json.load(open(os.path.join(out, "metrics.json")))["epochs"][-1]["seconds"])
    return steps * batch / (seconds[-1] - seconds[-2])

def original(script, batch, warmup, steps):
    """Steady-state samples/s of a d2l original, which times itself after its warm-up."""
    result = subprocess.run(PY + [os.path.join("benchmarks", script), "--data-dir", DATA,
                                  "--batch-size", str(batch), "--warmup", str(warmup), "--steps", str(steps)],
                            cwd=ROOT, check=True, capture_output=True, text=True, env=ENV)
    return json.loads(result.stdout.splitlines()[-1])["samples_per_s"]

# torchrun gives each of its workers 1 thread; a single process gets every core.
ENV = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}

def machine():
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)} x {names[0]}, torch {torch.__version__}"
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                 platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return f"{model}, {os.cpu_count()} cores, no GPU, torch {torch.__version__}"

def main():
    os.makedirs(OUT, exist_ok=True)
    cores, gpus = os.cpu_count(), torch.cuda.device_count()
    # A GPU runs a LeNet step in a few ms: it needs more steps than a CPU for the difference of
    # two runs to stand out of their start-up noise (an epoch has 234 steps of 256).
    lenet = dict(batch=256, warmup=5, steps=40) if not gpus else dict(batch=256, warmup=30, steps=200)
    resnet = dict(batch=128, warmup=1, steps=3) if not gpus else dict(batch=256, warmup=10, steps=50)
    n, kind = gpus or 2, "GPU" if gpus else "CPU"   # every GPU, or 2 CPU replicas/ranks
    backend = "nccl" if gpus else "gloo"
    one = "1 GPU" if gpus else "CPU"
    approaches = [   # model, approach, devices, backend, processes x threads, how to measure
        ("LeNet", "single device (scratch, 1 replica)", one, "-", f"1 x {cores}",
         lambda: ours(PY + ["scratch_lenet.py", "--devices", "1"], **lenet)),
        ("LeNet", f"scratch, {n} replicas in one process", f"{n} x {kind}", "-", f"1 x {cores}",
         lambda: ours(PY + ["scratch_lenet.py", "--devices", str(n)], **lenet)),
        ("LeNet", f"scratch, {n} replicas, --compile", f"{n} x {kind}", "-", f"1 x {cores}",
         lambda: ours(PY + ["scratch_lenet.py", "--devices", str(n), "--compile"], **lenet)),
        ("LeNet", "scratch_ring under torchrun, ring allreduce", f"{n} x {kind}", backend, f"{n} x 1",
         lambda: ours(TORCHRUN + [f"--nproc_per_node={n}", "scratch_ring.py"], **lenet)),
        ("ResNet18", "single device (ddp_resnet, 1 process)", one, backend, f"1 x {cores}",
         lambda: ours(PY + ["ddp_resnet.py"], **resnet)),
        ("ResNet18", f"DDP, {n} ranks", f"{n} x {kind}", backend, f"{n} x 1",
         lambda: ours(TORCHRUN + [f"--nproc_per_node={n}", "ddp_resnet.py"], **resnet)),
        ("ResNet18", f"FSDP2, {n} ranks", f"{n} x {kind}", backend, f"{n} x 1",
         lambda: ours(TORCHRUN + [f"--nproc_per_node={n}", "fsdp_resnet.py"], **resnet)),
        ("ResNet18", f"DataParallel, {max(gpus, 1)} device(s)", f"{max(gpus, 1)} x {kind}", "DataParallel",
         f"1 x {cores}", lambda: ours(PY + ["dp_resnet.py"], **resnet)),
    ]
    if not gpus:   # the d2l originals, as published, for the CPU comparison
        approaches.insert(4, ("LeNet", "d2l original (DataLoader, 2 workers)", "2 x CPU", "-", f"1 x {cores}",
                              lambda: original("original_lenet.py", **lenet)))
        approaches.append(("ResNet18", "d2l original (DataParallel, DataLoader)", "1 x CPU", "DataParallel",
                           f"1 x {cores}", lambda: original("original_resnet.py", **resnet)))
    print(f"benchmark on {machine()}: {ROUNDS} rounds, each approach once per round", flush=True)
    rates = {a[1]: [] for a in approaches}
    for round_ in range(1, ROUNDS + 1):   # interleaved, so a slow minute hits every approach alike
        for model, approach, *_, measure in approaches:
            rates[approach].append(measure())
            print(f"  round {round_}  {model:8} {approach:45} {rates[approach][-1]:8,.0f} samples/s", flush=True)
    rows = [(model, approach, devices, backend, layout, statistics.median(rates[approach]))
            for model, approach, devices, backend, layout, _ in approaches]
    base = {model: rate for model, approach, *_, rate in reversed(rows) if approach.startswith("single")}
    print(f"\nbenchmark on {machine()}; LeNet batch {lenet['batch']}, ResNet-18 batch {resnet['batch']}")
    print(f"{'model':9}{'approach':45}{'devices':11}{'backend':14}{'procs x threads':17}{'samples/s':>10}"
          f"{'ratio':>7}  runs")
    for model, approach, devices, backend, layout, rate in rows:
        runs = "/".join(f"{r:,.0f}" for r in rates[approach])
        print(f"{model:9}{approach:45}{devices:11}{backend:14}{layout:17}{rate:10,.0f}"
              f"{rate / base[model]:7.2f}  {runs}")
    if not gpus:   # our LeNet step against the original's, per sample
        original_rate = statistics.median(rates["d2l original (DataLoader, 2 workers)"])
        for approach in (f"scratch, {n} replicas in one process", f"scratch, {n} replicas, --compile"):
            print(f"{approach} / d2l original: {statistics.median(rates[approach]) / original_rate:.2f}x")
    held = json.load(open(os.path.join(OUT, "fsdp_resnet", "metrics.json")))["bytes_per_rank"]
    model_bytes = sum(h["params"] for h in held)   # the shards of all ranks: the model once
    print(f"per rank, parameters + gradients + momentum: DDP {3 * model_bytes / 1e6:.0f} MB (the whole "
          f"model, three times), FSDP2 {sum(held[0].values()) / 1e6:.0f} MB (rank 0's shards, 1/{n})")
    if n > 1:   # one rank sends nothing
        handed, ring = {}, {}
        for script in ("ddp_resnet", "fsdp_resnet"):
            by_collective = json.load(open(os.path.join(OUT, script, "metrics.json")))["sent_bytes_by_collective"]
            handed[script], ring[script] = sum(by_collective.values()) / 1e6, ring_bytes(by_collective, n) / 1e6
        print(f"per step and rank, handed to collectives: DDP {handed['ddp_resnet']:.1f} MB, FSDP2 "
              f"{handed['fsdp_resnet']:.1f} MB; sent over a ring: DDP {ring['ddp_resnet']:.1f} MB, FSDP2 "
              f"{ring['fsdp_resnet']:.1f} MB ({ring['fsdp_resnet'] / ring['ddp_resnet']:.2f}x)")
    json.dump({"machine": machine(), "rows": rows, "runs": rates}, open(os.path.join(OUT, "bench.json"), "w"), indent=1)
    draw(rows, base, {"LeNet": lenet["batch"], "ResNet18": resnet["batch"]})

def ring_bytes(by_collective, n):
    """What a rank sends over a ring of n for what it hands each collective: an all-reduce 2(n-1)/n of it, a
    reduce-scatter (n-1)/n, an all-gather its shard to each of the n-1 others."""
    share = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": n - 1}
    return sum(share[name.split()[0]] * nbytes for name, nbytes in by_collective.items())

def draw(rows, base, batch):
    """A panel per model: each approach's time per step at the model's global batch, our scripts in blue."""
    from matplotlib.figure import Figure
    models = list(dict.fromkeys(row[0] for row in rows))
    fig = Figure(figsize=(9, 0.42 * len(rows) + 2))
    axes = fig.subplots(len(models), 1, height_ratios=[sum(r[0] == m for r in rows) for m in models])
    for ax, model in zip(axes, models):
        mine = [row for row in rows if row[0] == model][::-1]   # the first row on top
        ms = [1000 * batch[model] / rate for *_, rate in mine]
        colors = ["tab:gray" if "original" in row[1] else "tab:blue" for row in mine]
        ax.barh([row[1] for row in mine], ms, color=colors)
        for y, (t, row) in enumerate(zip(ms, mine)):
            ax.text(t, y, f" {t:,.0f} ms ({row[-1] / base[model]:.2f}x one device's rate)", va="center", fontsize=8)
        ax.set_xlim(0, max(ms) * 1.55)
        ax.set_title(f"{model}, global batch {batch[model]}: time per step (shorter is faster)", fontsize=9)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"{machine()}, {time.strftime('%Y-%m-%d')}: the median of {ROUNDS} rounds", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "benchmarks", "bench.png"), dpi=100)
    print(f"wrote benchmarks/bench.png and {os.path.relpath(OUT, ROOT)}/bench.json")

if __name__ == "__main__":
    main()
