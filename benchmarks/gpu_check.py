"""Every script briefly on this machine's GPUs, with its GPU flags: one table (row, layout, backend, exit
status, test accuracy, samples/s), exit status 1 if any row failed. Without a GPU: one line, exit status 0.

    python benchmarks/gpu_check.py                  # 2 rows at a time (not yet timed on a GPU)
    python benchmarks/gpu_check.py --jobs 1         # one row at a time, each row's samples/s its own: ~6 minutes
    python benchmarks/gpu_check.py --only ddp_toy   # the rows whose name starts so

NCCL rows run one rank per GPU, at most two. Gloo rows run two ranks on whatever GPUs there are (on one GPU
they share it) with CUDA tensors: how a one-GPU machine tries several ranks. scratch_ring.py and
fsdp_resnet.py refuse gloo with CUDA tensors in one line (gloo cannot send them point to point; FSDP2 over
gloo crashed with them), and their rows check that refusal. Also: --amp, --channels-last, --compile,
--sync-bn, compressed gradients, an image folder read by DataLoader workers, a SIGTERM stop of ddp_resnet.py
and its --resume, and the README's full run, `torchrun --nproc_per_node=1 ddp_resnet.py`. ft_ddp_resnet.py trains
on the CPU by design and has no row. Each row's output is in runs/gpu_check/<row>.log; samples/s of a short
row include its first steps (cuDNN's autotuning, compiling). A row is mostly start-up (Python, CUDA, NCCL, cuDNN),
which the CPU's cores do, so --jobs rows run at a time, sharing the GPU (their samples/s then too); the stop and its
resume run in turn, and the README's full run alone, last.
"""
import argparse, concurrent.futures, json, os, re, signal, subprocess, sys, threading, time
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "runs", "gpu_check")
SHORT = ["--epochs", "1", "--train-samples", "10240", "--test-samples", "2000"]   # 40 steps of 256
IMAGES = (2560, 500)   # training and validation images written as PNG files
RESNET_IMAGES = ["--batch-size", "128", "--image-size", "32", "--workers", "2", "--epochs", "1"]

def rows(gpus):
    """(name, launcher, script and flags, what it must say): launcher is "python" or the number of torchrun
    processes; a row that must be refused names the line it is refused with."""
    n = min(gpus, 2)
    nccl, gloo = (n, ["--backend", "nccl"]), (2, ["--backend", "gloo"])
    return [
        ("scratch_lenet", "python", ["scratch_lenet.py", *SHORT], None),
        ("scratch_ring --overlap --compile", nccl[0], ["scratch_ring.py", *nccl[1], "--overlap", "--compile",
                                                       *SHORT], None),
        ("scratch_ring, gloo refused", gloo[0], ["scratch_ring.py", *gloo[1], *SHORT],
         "gloo cannot send CUDA tensors point to point"),
        ("dp_resnet --amp --channels-last", "python", ["dp_resnet.py", "--amp", "--channels-last", *SHORT], None),
        ("ddp_toy", nccl[0], ["ddp_toy.py", *nccl[1]], None),
        ("ddp_toy, mp.spawn", "python", ["ddp_toy.py", "--world-size", "2", *gloo[1]], None),
        ("ddp_resnet", nccl[0], ["ddp_resnet.py", *nccl[1], *SHORT], None),
        # --sync-bn syncs the statistics across ranks: at one rank (one GPU) it is plain BatchNorm, and the row says so
        (f"ddp_resnet --amp --channels-last --sync-bn{'' if n > 1 else ' (1 rank: no sync)'} --compile", nccl[0],
         ["ddp_resnet.py", *nccl[1], "--amp", "--channels-last", "--sync-bn", "--compile", *SHORT], None),
        ("ddp_resnet --comm-hook powersgd", gloo[0],
         ["ddp_resnet.py", *gloo[1], "--comm-hook", "powersgd", "--powersgd-start", "2", *SHORT], None),
        ("ddp_resnet --comm-hook bf16", nccl[0], ["ddp_resnet.py", *nccl[1], "--comm-hook", "bf16", *SHORT], None),
        ("ddp_resnet, image folder", nccl[0],
         ["ddp_resnet.py", *nccl[1], "--data-dir", os.path.join(OUT, "images"), *RESNET_IMAGES], None),
        ("fsdp_resnet --amp --channels-last", nccl[0], ["fsdp_resnet.py", *nccl[1], "--amp", "--channels-last",
                                                        *SHORT], None),
        ("fsdp_resnet, gloo refused", gloo[0], ["fsdp_resnet.py", *gloo[1], *SHORT],
         "FSDP2 over gloo crashes with CUDA tensors"),
        ("diloco_resnet --amp --channels-last", nccl[0],
         ["diloco_resnet.py", *nccl[1], "--amp", "--channels-last", "--local-steps", "5", *SHORT], None),
        ("diloco_resnet", gloo[0], ["diloco_resnet.py", *gloo[1], "--local-steps", "5", *SHORT], None),
    ]

def stop_and_resume(gpus):
    """ddp_resnet.py stopped by SIGTERM once its checkpoint of step 20 is written, then resumed: two ranks,
    over NCCL where there are two GPUs, else sharing one over gloo."""
    layout = ["--backend", "nccl"] if gpus > 1 else ["--backend", "gloo"]
    return 2, ["ddp_resnet.py", *layout, "--epochs", "1", "--checkpoint-every", "20"]

def command(launcher, flags, data_dir, out):
    start = [sys.executable] if launcher == "python" else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={launcher}"]
    data = [] if "--data-dir" in flags or flags[0] == "ddp_toy.py" else ["--data-dir", data_dir]
    return start + flags + data + ["--out", out]

def run(name, launcher, flags, data_dir, timeout, out=None, until=None):
    """One row: its exit status, its metrics (None when it wrote none) and its output, kept in
    runs/gpu_check/<name>.log. `until`: a line to wait for in its output, then SIGTERM to every process
    torchrun started (as SLURM signals every process of a job). A crash prints its Python stack
    (PYTHONFAULTHANDLER)."""
    slug = re.sub(r"\W+", "_", name).strip("_")
    out = out or os.path.join(OUT, slug)
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(OUT, slug + ".log")
    with open(log_path, "w") as log:
        job = subprocess.Popen(command(launcher, flags, data_dir, out), cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
        try:
            if until:
                deadline = time.monotonic() + timeout
                while until not in open(log_path).read() and job.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                for pid in children_of(job.pid):
                    os.kill(pid, signal.SIGTERM)
            status = job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            status = f"timeout {timeout} s"
    path = os.path.join(out, "metrics.json")
    metrics = json.load(open(path)) if os.path.exists(path) and not until else None
    return status, metrics, open(log_path).read()

def children_of(pid):   # read from /proc, never by name
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except OSError:
            pass
    return found

def row_line(name, launcher, flags, status, metrics, seconds):
    layout = "1 process" if launcher == "python" else f"torchrun x {launcher}"
    backend = metrics["backend"] if metrics else next((flags[i + 1] for i, f in enumerate(flags) if f == "--backend"),
                                                      "")
    acc = f"{metrics['test_acc']:.4f}" if metrics else "-"
    rate = f"{metrics['samples_per_s']:,.0f}" if metrics else "-"
    return f"{name:52} {layout:12} {backend[:22]:22} {str(status):>6} {acc:>8} {rate:>10} {seconds:6.0f}"

def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "data"), help="where Fashion-MNIST is")
    parser.add_argument("--only", help="only the rows whose name starts with this")
    parser.add_argument("--timeout", type=float, default=240, help="seconds a row may take")
    parser.add_argument("--jobs", type=int, default=2, help="rows run at a time, sharing the GPU (1: each alone)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no GPU here, nothing to check (bash run_all.sh test proves the CPU path)")
        return 0
    gpus = torch.cuda.device_count()
    print(f"gpu_check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, {args.jobs} row(s) at a time", flush=True)
    table = [row for row in rows(gpus) if not args.only or row[0].startswith(args.only)]
    if any("image folder" in row[0] for row in table):
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        from write_images import write_images
        write_images(args.data_dir, os.path.join(OUT, "images"), IMAGES[0], IMAGES[1])
    print(f"\n{'row':52} {'layout':12} {'backend':22} {'exit':>6} {'test acc':>8} {'samples/s':>10} {'s':>6}")
    failed, started, printing = [], time.monotonic(), threading.Lock()
    def check(name, launcher, flags, passed, **how):
        begin = time.monotonic()
        status, metrics, log = run(name, launcher, flags, args.data_dir, args.timeout, **how)
        with printing:
            print(row_line(name, launcher, flags, status, metrics, time.monotonic() - begin), flush=True)
        if not passed(status, metrics, log):
            failed.append((name, log))
    def row_check(name, launcher, flags, refusal):
        if refusal:   # one line, status 1, before any training
            check(name, launcher, flags, lambda status, m, log: status == 1 and refusal in log and "epoch" not in log)
        else:
            check(name, launcher, flags, lambda status, metrics, log: status == 0 and metrics is not None)
    def stop_then_resume():
        launcher, flags = stop_and_resume(gpus)
        out = os.path.join(OUT, "ddp_resnet_stop")
        check("ddp_resnet SIGTERM after step 20", launcher, flags, lambda status, m, log: (
            "stopped by SIGTERM at step" in log and "exitcode  : 75" in log), out=out, until="checkpoint: step 20 ")
        check("ddp_resnet --resume", launcher, flags + ["--resume"], lambda status, metrics, log: (
            status == 0 and "resumed from" in log), out=out)
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        done = []
        if not args.only or "ddp_resnet stop".startswith(args.only):   # the longest chain first
            done.append(pool.submit(stop_then_resume))
        done += [pool.submit(row_check, *row) for row in table]
        for future in done:
            future.result()
    if not args.only or "ddp_resnet, the README's".startswith(args.only):   # alone: its seconds are the README's
        check("ddp_resnet, the README's full run (5 epochs)", 1, ["ddp_resnet.py"],
              lambda status, metrics, log: status == 0 and metrics is not None, out=os.path.join(OUT, "full"))
    for name, log in failed:
        print(f"\n== {name}: the end of its output\n" + "\n".join(log.splitlines()[-25:]))
    print(f"\ngpu_check: {len(failed)} row(s) failed, {time.monotonic() - started:.0f} s in all")
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
