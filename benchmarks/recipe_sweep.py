"""The large-batch recipe, decided by measurement: ddp_resnet.py's full 5-epoch run on one GPU for a few candidate
settings, 3 seeds each, in one table (test accuracies, their mean and min, seconds, samples/s).

    python benchmarks/recipe_sweep.py            # 6 settings x 3 seeds: about 3 minutes on one H200 (estimated)
    python benchmarks/recipe_sweep.py --quick    # 2 settings x 2 seeds on 128 images, 1 epoch: a CPU, ~1 minute
    python benchmarks/recipe_sweep.py --settings "1024 w1" "1024 w1 nzs" --seeds 0 1 2 3 4

Each run is the page's own: ddp_resnet.main(flags), with the setting's flags and --seed, called one after another
in this one process, so the imports and CUDA's start are paid once, not per run (each run forms and leaves its own
process group, as a command does). Two things differ from the README's command, neither in the training: the
data is read once and handed to every run (ddp_resnet.datasets, wrapped), and --out is on tmpfs (/dev/shm), where
the page writes its checkpoints and outputs as usual without waiting for a disk. On a GPU every run also takes
--amp --channels-last. Per run: the last epoch's test accuracy, the seconds from main()'s call to its done: line,
the training seconds (the epoch lines') and samples/s; the first run also pays cuDNN's first choices, so the
table's seconds are the median of the seeds'. Without a GPU and without --quick: the plan and its estimated time,
nothing run, exit status 0.

Settings: the global batch, "w" warm-up epochs, "lr" the --lr for 256 samples (scaled with the batch; 0.05 if not
named), then n (--nesterov), z (--zero-init-residual), s (--label-smoothing 0.1). Speed alone (fused SGD,
cudnn.benchmark, compiling) is gpu_speed.py's.
"""
import argparse, contextlib, gc, json, os, statistics, sys, tempfile, time
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common
import ddp_resnet

SETTINGS = [   # (name, ddp_resnet.py's flags), in the order they run: a --budget cut leaves the last ones out
    ("1024 w1", ["--batch-size", "1024", "--warmup-epochs", "1"]),
    ("1024 w1 nz", ["--batch-size", "1024", "--warmup-epochs", "1", "--nesterov", "--zero-init-residual"]),
    ("1024 w1 nzs", ["--batch-size", "1024", "--warmup-epochs", "1", "--nesterov", "--zero-init-residual",
                     "--label-smoothing", "0.1"]),
    ("1024 w1 lr.025 nzs", ["--batch-size", "1024", "--warmup-epochs", "1", "--lr", "0.025", "--nesterov",
                            "--zero-init-residual", "--label-smoothing", "0.1"]),
    ("1024 w2 lr.1 nzs", ["--batch-size", "1024", "--warmup-epochs", "2", "--lr", "0.1", "--nesterov",
                          "--zero-init-residual", "--label-smoothing", "0.1"]),
    ("512 w1 nzs", ["--batch-size", "512", "--warmup-epochs", "1", "--nesterov", "--zero-init-residual",
                    "--label-smoothing", "0.1"]),
]
GPU_FLAGS = ["--amp", "--channels-last"]
QUICK = {"settings": ["1024 w1", "1024 w1 nzs"], "seeds": [0, 1],
         "flags": ["--train-samples", "128", "--test-samples", "100", "--epochs", "1"], "batch_over": 32}
# Seconds of training on one H200 with --amp --channels-last (full runs of 2026-11-27, torch 2.11, no warm-up), and
# a guess at each run's seconds outside its training in this process: for the plan's estimate only.
H200_TRAINING, OUTSIDE = {512: 9.6, 1024: 5.9}, 3.0


def batch_of(flags):
    return int(flags[flags.index("--batch-size") + 1])


def quick_flags(flags):   # the setting at 1/32 of its batch, on a few images
    batch = batch_of(flags) // QUICK["batch_over"]
    scaled = list(flags)
    scaled[scaled.index("--batch-size") + 1] = str(batch)
    return scaled + QUICK["flags"]


def run_once(flags, out):
    """ddp_resnet.main(flags + --out), timed from its call to its done: line; figures from its metrics.json."""
    done, real_finish = [], common.finish
    def finish(*args, **kwargs):   # the page's own, then the time
        real_finish(*args, **kwargs)
        done.append(time.perf_counter())
    common.finish = finish
    start = time.perf_counter()
    try:
        ddp_resnet.main(flags + ["--out", out])
    finally:
        common.finish = real_finish
        gc.collect()   # the run's DDP wrap, a cycle of references: its memory now, not in a later run
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    return {"test_acc": metrics["test_acc"], "to_done": done[0] - start, "samples_per_s": metrics["samples_per_s"],
            "training": sum(e["seconds"] for e in metrics["epochs"]), "train_loss": metrics["epochs"][-1]["train_loss"]}


def data_read_once():
    """ddp_resnet.datasets, wrapped: each run's data as the page makes it, read from disk for the first run only."""
    real, read = ddp_resnet.datasets, {}
    def datasets(args):
        key = (args.data_dir, args.train_samples, args.test_samples)
        if key not in read:
            read[key] = real(args)
        return read[key]
    ddp_resnet.datasets = datasets


def plan(settings, seeds):
    """What the sweep would run on one H200, and about how long it would take."""
    lines, total = [], 0.0
    for name, flags in settings:
        seconds = len(seeds) * (H200_TRAINING[batch_of(flags)] + OUTSIDE)
        total += seconds
        command = f"ddp_resnet.py {' '.join(flags + GPU_FLAGS)}"
        lines.append(f"  {name:20} {command} x {len(seeds)} seeds, ~{seconds:.0f} s")
    return lines, total


def table(results, seeds):
    lines = [f"{'setting':20} {' '.join(f'seed {s:<3}' for s in seeds)} {'mean':>7} {'min':>7} {'s to done':>9} "
             f"{'training s':>10} {'samples/s':>10}"]
    for name, runs in results.items():
        accuracies = [f"{runs[s]['test_acc']:.4f}  " if s in runs else "-       " for s in seeds]
        done = list(runs.values())
        if not done:
            continue
        acc = [r["test_acc"] for r in done]
        lines.append(f"{name:20} {' '.join(accuracies)} {statistics.mean(acc):7.4f} {min(acc):7.4f} "
                     f"{statistics.median(r['to_done'] for r in done):9.1f} "
                     f"{statistics.median(r['training'] for r in done):10.1f} "
                     f"{statistics.median(r['samples_per_s'] for r in done):10,.0f}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [name for name, _ in SETTINGS]
    p.add_argument("--settings", nargs="+", choices=names, metavar="NAME", help=f"default: all of {', '.join(names)}")
    p.add_argument("--seeds", nargs="+", type=int, help="each setting's seeds (default 0 1 2; --quick: 0 1)")
    p.add_argument("--quick", action="store_true", help="2 settings x 2 seeds at 1/32 of the batch on 128 images")
    p.add_argument("--budget", type=float, default=240, help="seconds: no run starts after them")
    p.add_argument("--data-dir", help="ddp_resnet.py's --data-dir")
    p.add_argument("--json", help="also write every run's figures here")
    p.add_argument("--logs", help="a folder for each run's own output (its epoch lines); default: not kept")
    args = p.parse_args(argv)
    chosen = args.settings or (QUICK["settings"] if args.quick else names)
    seeds = args.seeds or (QUICK["seeds"] if args.quick else [0, 1, 2])
    settings = [(name, flags) for name, flags in SETTINGS if name in chosen]
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        lines, total = plan(settings, seeds)
        print("recipe_sweep: no GPU here, nothing run. On one GPU it would train ddp_resnet.py's full run (5 epochs "
              f"of Fashion-MNIST) for each of:\n" + "\n".join(lines) +
              f"\nabout {total:.0f} s on one H200 in all (--budget {args.budget:g} s: no run starts after it); "
              f"--quick runs a tiny version here")
        return 0
    data_read_once()
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    common.default_to_one_process()   # a group of one per run, on a free port
    device = torch.cuda.get_device_name(0) if cuda else "CPU (--quick)"
    print(f"recipe_sweep: {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; {len(settings)} settings "
          f"x seeds {' '.join(map(str, seeds))}{', each with ' + ' '.join(GPU_FLAGS) if cuda else ''}", flush=True)
    results, started = {name: {} for name, _ in settings}, time.monotonic()
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=folder, prefix="recipe_sweep") as out:
        for name, flags in settings:
            flags = quick_flags(flags) if args.quick else flags + GPU_FLAGS
            flags += ["--data-dir", args.data_dir] if args.data_dir else []
            for seed in seeds:
                if time.monotonic() - started > args.budget:
                    print(f"{name:20} seed {seed}: skipped, past --budget {args.budget:g} s", flush=True)
                    continue
                slug = f"{name.replace(' ', '_').replace('.', '')}_seed{seed}"
                log = os.path.join(args.logs, slug + ".log") if args.logs else os.devnull
                with open(log, "w") as f, contextlib.redirect_stdout(f):   # its epoch lines: a log, the table here
                    try:
                        results[name][seed] = figures = run_once(flags + ["--seed", str(seed)],
                                                                 os.path.join(out, slug))
                    except (Exception, SystemExit) as e:   # one run's failure leaves the others theirs
                        figures = e
                if isinstance(figures, BaseException):
                    print(f"{name:20} seed {seed}: failed: {type(figures).__name__}: {figures}", flush=True)
                else:
                    print(f"{name:20} seed {seed}: test acc {figures['test_acc']:.4f}, {figures['to_done']:.1f} s to "
                          f"done:, {figures['training']:.1f} s training, {figures['samples_per_s']:,.0f} samples/s",
                          flush=True)
    print("\n" + "\n".join(table(results, seeds)))
    print(f"\ns to done: from ddp_resnet.main()'s call to its done: line, in this process (no interpreter, imports or "
          f"torchrun; the data read once); training s: its epoch lines' sum; both medians over the seeds. "
          f"Flags: " + "; ".join(f"{name}: {' '.join(flags)}" for name, flags in settings) +
          f"\nrecipe_sweep: {time.monotonic() - started:.0f} s in all", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({name: {str(s): r for s, r in runs.items()} for name, runs in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
