"""Every approach side by side, at the same global batch, on whatever hardware is here.

    bash run_all.sh bench      (or: python benchmarks/bench.py)

Each of our scripts runs twice, for W and for W+N optimizer steps, and the rate is N batches over
the difference of the two training times: start-up, data loading and the first (warm-up) steps
cancel out. The d2l originals (benchmarks/original_*.py) time N steps after W themselves. Rates
are ratios to the single-device run of the same model, measured minutes apart on the same machine.
"""
import gzip, json, os, platform, shutil, subprocess, sys, tempfile
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY, TORCHRUN = [sys.executable], [sys.executable, "-m", "torch.distributed.run", "--standalone"]
DATA = os.path.join(ROOT, "data")
OUT = os.path.join(ROOT, "runs", "bench")

def ours(command, batch, warmup, steps, threads):
    """Steady-state samples/s of one of our scripts, from two runs."""
    seconds = []
    for max_steps in (warmup, warmup + steps):
        out = os.path.join(OUT, "tmp")
        subprocess.run(command + ["--batch-size", str(batch), "--max-steps", str(max_steps), "--epochs", "1",
                                  "--test-samples", "100", "--data-dir", DATA, "--out", out],
                       cwd=ROOT, check=True, capture_output=True, env=env(threads))
        seconds.append(json.load(open(os.path.join(out, "metrics.json")))["epochs"][-1]["seconds"])
    return steps * batch / (seconds[1] - seconds[0])

def original(script, batch, warmup, steps, threads, torchvision_root):
    result = subprocess.run(PY + [os.path.join("benchmarks", script), "--data-dir", torchvision_root,
                                  "--batch-size", str(batch), "--warmup", str(warmup), "--steps", str(steps)],
                            cwd=ROOT, check=True, capture_output=True, text=True, env=env(threads))
    return json.loads(result.stdout.splitlines()[-1])["samples_per_s"]

def env(threads):
    e = {**os.environ}
    e.pop("OMP_NUM_THREADS", None)
    if threads:   # torchrun gives each worker 1 thread; a single process gets the whole machine
        e["OMP_NUM_THREADS"] = str(threads)
    return e

def torchvision_layout():
    """The originals read through torchvision's dataset class, which wants unpacked files."""
    root = tempfile.mkdtemp(prefix="fmnist-")
    raw = os.path.join(root, "FashionMNIST", "raw")
    os.makedirs(raw)
    for name in os.listdir(DATA):
        if name.endswith(".gz"):
            with gzip.open(os.path.join(DATA, name)) as src, open(os.path.join(raw, name[:-3]), "wb") as dst:
                shutil.copyfileobj(src, dst)
    return root

def machine():
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)} x {names[0]}, torch {torch.__version__}"
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                 platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return f"{model}, {len(os.sched_getaffinity(0))} cores, no GPU, torch {torch.__version__}"

def main():
    os.makedirs(OUT, exist_ok=True)
    cores, gpus = len(os.sched_getaffinity(0)), torch.cuda.device_count()
    tv_root = torchvision_layout()
    lenet = dict(batch=256, warmup=5, steps=40)
    resnet = dict(batch=64, warmup=2, steps=8) if not gpus else dict(batch=256, warmup=10, steps=50)
    rows = []   # (model, approach, devices, backend, processes x threads, samples/s)
    def add(model, approach, devices, backend, layout, rate):
        rows.append((model, approach, devices, backend, layout, rate))
        print(f"  {model:8} {approach:34} {rate:9,.0f} samples/s", flush=True)

    print(f"benchmark on {machine()}", flush=True)
    one = "1 GPU" if gpus else "CPU"
    add("LeNet", "single device (scratch, 1 replica)", one, "-", f"1 x {cores}",
        ours(PY + ["scratch_lenet.py", "--devices", "1"], threads=None, **lenet))
    n = max(gpus, 2)
    add("LeNet", f"scratch, {n} replicas in one process", f"{n} x {'GPU' if gpus else 'CPU'}", "-", f"1 x {cores}",
        ours(PY + ["scratch_lenet.py", "--devices", str(n)], threads=None, **lenet))
    add("LeNet", f"scratch under torchrun, ring allreduce", f"{n} x {'GPU' if gpus else 'CPU'}",
        "nccl" if gpus else "gloo", f"{n} x {max(1, cores // n) if not gpus else 1}",
        ours(TORCHRUN + [f"--nproc_per_node={n}", "scratch_lenet.py"], threads=None, **lenet))
    if not gpus:
        add("LeNet", "d2l original (DataLoader, 2 workers)", "2 x CPU", "-", f"1 x {cores}",
            original("original_lenet.py", lenet["batch"], lenet["warmup"], lenet["steps"], None, tv_root))
    add("ResNet18", "single device (ddp_resnet, 1 process)", one, "gloo" if not gpus else "nccl", f"1 x {cores}",
        ours(PY + ["ddp_resnet.py"], threads=None, **resnet))
    add("ResNet18", f"DDP, {n} ranks", f"{n} x {'GPU' if gpus else 'CPU'}", "nccl" if gpus else "gloo",
        f"{n} x 1", ours(TORCHRUN + [f"--nproc_per_node={n}", "ddp_resnet.py"], threads=None, **resnet))
    add("ResNet18", f"DataParallel, {max(gpus, 1)} device(s)", f"{max(gpus, 1)} x {'GPU' if gpus else 'CPU'}",
        "DataParallel", f"1 x {cores}", ours(PY + ["dp_resnet.py"], threads=None, **resnet))
    if not gpus:
        add("ResNet18", "d2l original (DataParallel, DataLoader)", "1 x CPU", "DataParallel", f"1 x {cores}",
            original("original_resnet.py", resnet["batch"], resnet["warmup"], resnet["steps"], None, tv_root))
    shutil.rmtree(tv_root)

    base = {model: rate for model, approach, *_, rate in reversed(rows) if approach.startswith("single")}
    print(f"\nbenchmark on {machine()}; LeNet batch {lenet['batch']}, ResNet-18 batch {resnet['batch']}")
    print(f"{'model':9}{'approach':42}{'devices':11}{'backend':14}{'procs x threads':17}{'samples/s':>10}{'ratio':>7}")
    for model, approach, devices, backend, layout, rate in rows:
        print(f"{model:9}{approach:42}{devices:11}{backend:14}{layout:17}{rate:10,.0f}{rate / base[model]:7.2f}")
    json.dump({"machine": machine(), "rows": rows}, open(os.path.join(OUT, "bench.json"), "w"), indent=1)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    labels = [f"{model}: {approach}" for model, approach, *_ in rows]
    ratios = [rate / base[model] for model, *_, rate in rows]
    ax.barh(labels[::-1], ratios[::-1], color=["tab:blue" if m == "LeNet" else "tab:orange" for m, *_ in rows][::-1])
    for y, (ratio, row) in enumerate(zip(ratios[::-1], rows[::-1])):
        ax.text(ratio, y, f" {ratio:.2f}x ({row[-1]:,.0f}/s)", va="center", fontsize=8)
    ax.axvline(1, color="gray", lw=0.8)
    ax.set_xlabel("samples/s relative to one device, same model and global batch")
    ax.set_title(machine(), fontsize=9)
    ax.set_xlim(0, max(ratios) * 1.35)
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "runs", "summary.png"), dpi=100)
    print(f"wrote runs/summary.png and {os.path.relpath(OUT, ROOT)}/bench.json")

if __name__ == "__main__":
    main()
