"""ddp_resnet.py on a CPU with and without `--amp --channels-last` (bf16 autocast, NHWC), side by side.

    python benchmarks/cpu_amp.py              # the README's first ResNet command, 3 seeds each way (~10 min, 2 cores)
    python benchmarks/cpu_amp.py --full       # and one epoch of the README's full run each way (~30 min, 2 cores)

The first rows run the README's first ResNet command (2 ranks under torchrun, 2,048 images, batch 64, one epoch),
seeds 0, 1, 2, each seed's two runs back to back (the machine's drift hits both alike). Per run: the seconds from
the command to its exit, the epoch's samples/s (metrics.json: the training steps alone) and the test accuracy.
--full: one epoch of the README's full run (`torchrun --standalone --nproc_per_node=1 ddp_resnet.py`, 60,000
images, batch 256) each way, its epoch seconds. bf16 is fast only on a CPU with bf16 units (avx512_bf16, AMX);
elsewhere it is emulated: the first line says which this CPU has.
"""
import argparse, json, os, platform, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST = ["--nproc_per_node=2", "ddp_resnet.py", "--train-samples", "2048", "--test-samples", "1000",
         "--batch-size", "64", "--epochs", "1"]
FULL = ["--nproc_per_node=1", "ddp_resnet.py", "--epochs", "1"]
FAST = ["--amp", "--channels-last"]


def cpu():
    """The CPU's name and the bf16 units its flags list."""
    name, flags = platform.processor() or "CPU", set()
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    units = [f for f in ("avx512_bf16", "amx_bf16") if f in flags] or ["none: bf16 is emulated"]
    return f"{name}, {os.cpu_count()} cores, bf16 units: {', '.join(units)}"


def run(command, out, logs=None):
    """(seconds from the command to its exit, the epoch's samples/s, its seconds, the test accuracy);
    the run's output kept in the folder `logs`, if given."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone"] + command +
                            ["--data-dir", os.path.join(ROOT, "data"), "--out", out], cwd=ROOT,
                            capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode:
        sys.exit(result.stderr[-3000:])
    if logs:
        os.makedirs(logs, exist_ok=True)
        with open(os.path.join(logs, os.path.basename(out) + ".log"), "w") as f:
            f.write(result.stdout)
    epoch = json.load(open(os.path.join(out, "metrics.json")))["epochs"][-1]
    return seconds, epoch["samples_per_s"], epoch["seconds"], epoch["test_acc"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="runs each way of the first command")
    p.add_argument("--full", action="store_true", help="also one epoch of the full run each way")
    p.add_argument("--logs", help="a folder for each run's output")
    args = p.parse_args()
    import torch
    print(f"{cpu()}; torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"first command: torchrun --standalone {' '.join(FIRST)} [--seed N] [{' '.join(FAST)}]")
    print(f"{'seed':>4} {'flags':>24} {'s, command':>11} {'samples/s':>10} {'test acc':>9}")
    rows = {"default": [], " ".join(FAST): []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for flags in ([], FAST):
                result = run(FIRST + ["--seed", str(seed)] + flags, os.path.join(tmp, f"first-seed{seed}-{len(flags)}"),
                             args.logs)
                rows[" ".join(flags) or "default"].append(result)
                print(f"{seed:4d} {' '.join(flags) or 'default':>24} {result[0]:11.1f} {result[1]:10.1f} "
                      f"{result[3]:9.4f}", flush=True)
        base, fast = ([statistics.median(r[i] for r in rows[k]) for i in range(4)] for k in rows)
        print(f"medians: {base[0]:.1f} s against {fast[0]:.1f} s ({base[0] / fast[0]:.2f}x from the command to "
              f"its exit), {base[1]:.1f} against {fast[1]:.1f} samples/s ({fast[1] / base[1]:.2f}x in the "
              f"training steps); test acc {base[3]:.4f} against {fast[3]:.4f}")
        if args.full:
            print(f"full run, one epoch: torchrun --standalone {' '.join(FULL)} [{' '.join(FAST)}]")
            epochs = {}
            for flags in ([], FAST):
                result = run(FULL + flags, os.path.join(tmp, f"full-{len(flags)}"), args.logs)
                epochs[" ".join(flags) or "default"] = result
                print(f"  {' '.join(flags) or 'default':>24}: epoch {result[2] / 60:.1f} min, {result[1]:.1f} "
                      f"samples/s, test acc {result[3]:.4f}", flush=True)
            ratio = epochs["default"][2] / epochs[" ".join(FAST)][2]
            print(f"  {ratio:.2f}x: {' '.join(FAST)} against the default, one epoch of the full run")


if __name__ == "__main__":
    main()
