"""Where a run of ddp_resnet.py spends its time, phase by phase, from the command to its `done:` line and exit.

    python benchmarks/phases.py                   # the README's full run, timed (about 30 s on one H200)
    python benchmarks/phases.py --quick --repeats 3   # a small part, 2 epochs, 3 runs (2 CPU cores: ~2 min)
    python benchmarks/phases.py --nproc 2 -- --batch-size 1024 --amp --channels-last   # ddp_resnet.py's flags

It runs `torchrun --standalone --nproc_per_node=N benchmarks/phases.py FLAGS`; each rank imports ddp_resnet and
calls its main(FLAGS), the page's functions wrapped to note the time where they start or end (the page is not
changed). The table's phases run from one of rank 0's notes to the next, so they add up to the whole: from the
moment the command starts to its `done:` line, then to torchrun's return (rank 0's exit told apart through /proc).
The one change to the run: a CUDA synchronisation after the first --first-steps steps, which times them apart from
the steady ones. Below the table: the page's own training seconds (its epoch lines') and what lies outside them;
what its checkpoints and outputs spent in torch.save and in fsync. --repeats N: each phase's median of N runs.
"""
import argparse, collections, contextlib, functools, json, os, platform, statistics, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["--train-samples", "256", "--test-samples", "250", "--batch-size", "64", "--epochs", "2"]
NOTES = []   # (what happened since the previous note, when it ended)
DONE = "the done: line"
WRITES = collections.defaultdict(float)   # (file, "torch.save" or "fsync"): seconds
WRITING = [None]   # the file common.save_atomically is writing


# ---------------------------------------------------------------- in each rank: the page, its functions wrapped
def process_start():   # when this process started (Linux's /proc), on time.time()'s clock; else None
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22, starttime, in clock ticks since boot
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError):
        return None


def note(what, when=None):
    NOTES.append((what, when or time.time()))


def wrap(owner, name, before=None, after=None):
    """owner.name, noting `before` as it starts and `after` as it returns: a text, or a function of its arguments
    that gives one (or None: no note)."""
    real = getattr(owner, name)
    @functools.wraps(real)
    def noted(*args, **kwargs):
        if before:
            what = before(*args, **kwargs) if callable(before) else before
            if what:
                note(what)
        result = real(*args, **kwargs)
        if after:
            what = after(*args, **kwargs) if callable(after) else after
            if what:
                note(what)
        return result
    setattr(owner, name, noted)


def timed_into(owner, name, kind):   # owner.name's seconds added to WRITES[(the file being written, kind)]
    real = getattr(owner, name)
    @functools.wraps(real)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            WRITES[(WRITING[0], kind)] += time.perf_counter() - start
    setattr(owner, name, timed)


def rank_side(flags, first_steps, notes_path):
    started = process_start()
    if started:
        note("torchrun: its python, import torch, the rendezvous, the rank's start", started)
    import torch
    note("the rank's python, import torch")
    sys.path.insert(0, ROOT)
    import common
    import ddp_resnet
    note("import ddp_resnet: torchvision, common (matplotlib), torch.distributed")
    epochs, steps, evaluated, finishing = [0], [0], [False], [False]   # what the notes say depends on them

    def synchronize():
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def step_notes():   # train_step: a note after the first `first_steps`, synchronised
        evaluated[0] = False
        steps[0] += 1
        if steps[0] == first_steps:
            synchronize()
            return f"the banner, the first batch, the first {first_steps} step(s) (synchronised)"
        return None

    def epoch_start(*args, **kwargs):
        epochs[0] += 1
        evaluated[0] = True
        if epochs[0] == 1 and steps[0] > first_steps:
            return f"epoch 1: its other {steps[0] - first_steps} steps"
        return f"epoch {epochs[0]}: its steps" + ("" if epochs[0] > 1 else " (the first ones included)")

    def writing(write, path):
        WRITING[0] = os.path.basename(path)
        return None

    def written(write, path):   # the outputs by name; any other file is the checkpoint
        name = os.path.basename(path)
        outputs = {"metrics.json": None, "curves.png": None,   # the note after each says it
                   "model.pt": "the last barrier, metrics.json, curves.png (drawn, saved), model.pt (the "
                               "weights to the CPU)"}
        if name in outputs and finishing[0]:
            return outputs[name]
        if name in outputs:   # each epoch's metrics.json and curves.png: the checkpoint's note says them
            return None
        if evaluated[0]:
            return (f"epoch {epochs[0]}: its line, metrics.json, curves.png, the checkpoint ({name}: gathered, "
                    f"saved, synced)")
        return f"epoch {epochs[0] + 1}: steps, then a checkpoint ({name}) at step {steps[0]}"

    wrap(common, "pick_device", after="the device (on CUDA: its context, set_device)")
    wrap(common, "load_on_every_rank", before="the process group, the stop vote's (on CUDA: NCCL's, gloo's)",
         after="the data (datasets(), on every rank)")
    wrap(ddp_resnet, "wrap", before="the loaders, the model on the device, the optimizer, the metrics",
         after="the DDP wrap (rank 0's weights broadcast)")
    wrap(ddp_resnet, "train_step", after=lambda *a, **k: step_notes())
    wrap(ddp_resnet, "evaluate", before=epoch_start,
         after=lambda *a, **k: f"epoch {epochs[0]}: the evaluation (BatchNorm's buffers, the test set)")
    wrap(common, "save_atomically", before=writing, after=written)
    wrap(common, "finish", before=lambda *a, **k: finishing.__setitem__(0, True), after=DONE)
    timed_into(torch, "save", "torch.save")
    timed_into(common, "fsync", "fsync")
    ddp_resnet.main(flags)
    note("after it: leaving the group (gc.collect, destroy_process_group)")
    if int(os.environ.get("RANK", 0)) == 0:   # whole or not at all: the command reads it while this rank exits
        with open(notes_path + ".tmp", "w") as f:
            json.dump({"notes": NOTES, "writes": [[*k, v] for k, v in WRITES.items()], "steps": steps[0],
                       "machine": machine(torch), "pid": os.getpid()}, f)
        os.replace(notes_path + ".tmp", notes_path)


def machine(torch):
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    model = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), model)
    return f"{model}, {os.cpu_count()} cores, no GPU, torch {torch.__version__}"


# ---------------------------------------------------------------- the command, and the table
def phases_of(run, command_start, returned):
    """[(phase, seconds)] from the rank's notes and the command's start and end; the done: line's at its place."""
    notes = [("", command_start)] + [tuple(n) for n in run["notes"]]
    if run.get("exited"):
        notes.append(("after it: the rank's python exits", run["exited"]))
    notes.append(("after it: torchrun's end" if run.get("exited") else "after it: the rank's exit, torchrun's end",
                  returned))
    return [(what, when - before) for (_, before), (what, when) in zip(notes, notes[1:])]


def table(runs):
    """Each phase's median over the runs (and each run's seconds, if more than one), its share of the median time
    from the command to the done: line, then that time and the time to the end."""
    names = [what for what, _ in runs[0]]
    done = names.index(DONE)
    columns = [[seconds for _, seconds in phases] for phases in runs]
    to_done = statistics.median(sum(c[:done + 1]) for c in columns)
    width = max(map(len, names))
    each = f"  {'runs':>{8 * len(runs)}}" if len(runs) > 1 else ""
    lines = [f"{'phase':{width}} {'s':>7} {'share':>6}{each}"]
    for i, name in enumerate(names):
        seconds = statistics.median(c[i] for c in columns)
        values = "  " + "".join(f"{c[i]:8.2f}" for c in columns) if len(runs) > 1 else ""
        lines.append(f"{name:{width}} {seconds:7.2f} {100 * seconds / to_done:5.1f}%{values}")
        if i == done:
            totals = "  " + "".join(f"{sum(c[:done + 1]):8.2f}" for c in columns) if len(runs) > 1 else ""
            lines.append(f"{'= from the command to its done: line':{width}} {to_done:7.2f} 100.0%{totals}")
    to_end = [sum(c) for c in columns]
    lines.append(f"{'= from the command to its end':{width}} {statistics.median(to_end):7.2f}" +
                 ("         " + "".join(f"{t:8.2f}" for t in to_end) if len(runs) > 1 else ""))
    return lines


def summary(run, metrics, to_done, first_steps):
    training = sum(e["seconds"] for e in metrics["epochs"])
    first = next(when - before for (_, before), (what, when) in zip(run["notes"], run["notes"][1:])
                 if f"the first {first_steps} step(s)" in what)
    steady = (training - first) / max(1, run["steps"] - first_steps)
    lines = [f"training, the page's own epoch seconds: {training:.2f} s ({run['steps']} steps, "
             f"{metrics['samples_per_s']:,.0f} samples/s); outside it: {to_done - training:.2f} s of {to_done:.2f}",
             f"the first {first_steps} step(s): {first:.2f} s; a steady step: {1000 * steady:.1f} ms, so the first "
             f"ones cost {first - first_steps * steady:.2f} s more than steady steps"]
    by_file = collections.defaultdict(dict)
    for name, kind, seconds in run["writes"]:
        by_file[name][kind] = seconds
    files = [f"{name} " + ", ".join(f"{kind} {seconds:.2f}" for kind, seconds in sorted(kinds.items()))
             for name, kinds in by_file.items()]
    lines.append("in torch.save and fsync, s (each file's writes summed): " + "; ".join(files))
    return lines


def rank_exit(job, notes_path):
    """Waits for the command; returns when rank 0's process ended (gone, or a zombie for torchrun to reap), once
    its notes say which it is; None where /proc cannot say."""
    pid = exited = None
    while job.poll() is None:
        time.sleep(0.005)
        if pid is None and os.path.exists(notes_path):
            pid = json.load(open(notes_path))["pid"]
        if pid and exited is None:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    gone = f.read().rsplit(")", 1)[1].split()[0] in "ZX"
            except OSError:
                gone = True
            if gone:
                exited = time.time()
    return exited


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=1, help="torchrun's --nproc_per_node")
    p.add_argument("--quick", action="store_true", help=f"ddp_resnet.py {' '.join(QUICK)} first")
    p.add_argument("--first-steps", type=int, help="steps timed apart at the start (default 10; --quick: 2)")
    p.add_argument("--repeats", type=int, default=1, help="runs of the command, one after another")
    p.add_argument("--json", help="also write the notes and the table here")
    p.add_argument("flags", nargs="*", help="ddp_resnet.py's flags, after --")
    args = p.parse_args(argv)
    first_steps = args.first_steps or (2 if args.quick else 10)
    flags = (QUICK if args.quick else []) + args.flags
    if "--out" not in flags:
        flags += ["--out", os.path.join("runs", "phases")]
    out = flags[len(flags) - 1 - flags[::-1].index("--out") + 1]
    notes_path = os.path.join(ROOT, out, "phases_notes.json")
    os.makedirs(os.path.dirname(notes_path), exist_ok=True)
    command = ["torchrun", "--standalone", f"--nproc_per_node={args.nproc}", "ddp_resnet.py", *flags]
    print(f"phases: {' '.join(command)}  (as benchmarks/phases.py)", flush=True)
    env = {**os.environ, "PHASES_NOTES": notes_path, "PHASES_FIRST_STEPS": str(first_steps), "PYTHONUNBUFFERED": "1"}
    runs = []
    for _ in range(args.repeats):
        with contextlib.suppress(FileNotFoundError):
            os.remove(notes_path)
        start = time.time()
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc_per_node={args.nproc}", os.path.abspath(__file__), *flags], cwd=ROOT, env=env)
        exited = rank_exit(job, notes_path)
        returned = time.time()
        if job.returncode:
            print(f"phases: the run ended with exit status {job.returncode}")
            return 1
        run = {**json.load(open(notes_path)), "exited": exited}
        metrics = json.load(open(os.path.join(ROOT, out, "metrics.json")))
        phases = phases_of(run, start, returned)
        to_done = sum(seconds for _, seconds in phases[:[w for w, _ in phases].index(DONE) + 1])
        runs.append((to_done, phases, run, metrics))
    to_done, _, run, metrics = sorted(runs, key=lambda r: r[0])[len(runs) // 2]   # the median run's details
    lines = table([phases for _, phases, _, _ in runs]) + summary(run, metrics, to_done, first_steps)
    repeats = ""
    if args.repeats > 1:
        repeats = f", {args.repeats} runs (the median of each phase; below the table, the median run's figures)"
    print(f"\nphases of {' '.join(command)}\non {run['machine']}, {time.strftime('%Y-%m-%d')}{repeats}\n\n" +
          "\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "table": lines, "runs": [{**r, "phases": p} for _, p, r, _ in runs]}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    if "PHASES_NOTES" in os.environ:   # a rank, started by torchrun
        rank_side(sys.argv[1:], int(os.environ["PHASES_FIRST_STEPS"]), os.environ["PHASES_NOTES"])
    else:
        sys.exit(main())
