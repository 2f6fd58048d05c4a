"""ddp_resnet.py's training step on one GPU, side by side: precision (fp32, TF32, bf16 autocast), channels_last,
fused SGD, torch.compile (and its CUDA graphs), batches of 256, 512 and 1024. For each row: samples/s, TFLOP/s and
their share of the GPU's dense peak, and the share of the step the GPU is busy. Without a GPU: the FLOP count of
a training sample and one line, exit status 0.

    python benchmarks/gpu_speed.py            # 15 rows, about 3-4 minutes on one H100 (the 2 compile rows: ~1 min each)
    python benchmarks/gpu_speed.py --quick    # 3 rows, no compiling, under a minute
    python benchmarks/gpu_speed.py --rows default,bf16+cl+fused+compile@1024
    python benchmarks/gpu_speed.py --quick --profile runs/profile   # first a torch.profiler trace of 3 rows' steps

A row is settings joined by "+", then "@batch" (default 256): default (torch's own settings, as ddp_resnet.py
runs today: convolutions in TF32, cuDNN's default; matmuls in fp32), fp32 (convolutions in fp32 too), tf32
(matmuls in TF32 too), bf16 (autocast, --amp), cl (channels_last, --channels-last), fused (SGD's fused kernel;
CUDA's default is foreach), compile (torch.compile, --compile), cudagraphs (mode "reduce-overhead"), autotune
(mode "max-autotune-no-cudagraphs": minutes of autotuning), bare (train_step alone; without it each step also
takes the loop's work around it), gpudata (the training images held in the GPU's memory, each batch indexed there),
cudnn (torch.backends.cudnn.benchmark: cuDNN times its algorithms for each new shape, in the warm-up steps).

Each row: ResNet-18 for 1x28x28 images (common.classifier), ddp_resnet.make_optimizer at lr 0.05 x batch/256, wrapped
in DDP over an NCCL group of one as ddp_resnet.wrap makes it, as `torchrun --nproc_per_node=1 ddp_resnet.py` runs; each
step is ddp_resnet.train_step with the loop's work around it: the next batch from common.train_loader over 60,000
images in the CPU's memory (random ones: the speed does not depend on the pixels), pinned and copied to the GPU
without waiting, scheduler.step() and the stop vote (common.StopSignal.vote(): a gloo all_reduce of a CPU tensor
started without waiting, the last step's read). --warmup steps
(compiling, cuDNN's choices, the allocator) are left out; then --repeats runs of --steps steps between two CUDA
synchronisations, the median. FLOPs: FlopCounterMode over one forward and
backward of the eager model (matmuls and convolutions, 2 per multiply-add, as peaks count them). GPU busy: the time
covered by kernels and copies in torch.profiler's trace of 5 steps, over the timed step. Syncs: the calls in one
step that make the CPU wait for the GPU, as torch.cuda.set_sync_debug_mode finds them.

--profile DIR: before the table, each of --profile-rows (the README's step at 256, bf16+cl+fused at 256 and 1024)
takes --warmup steps, then 3 under torch.profiler; DIR gets each row's Chrome trace (trace_ROW.json.gz, for
ui.perfetto.dev) and summary (profile_ROW.txt: the top ops by device time and by host time), whose first line,
printed too, says what binds the step: the host's time in it (Python, dispatch, launches, waits), each part's (the
next batch, train_step, scheduler.step, the stop vote), against the device's busy time, kernels and host syncs.
On a CPU it profiles there (use small rows: --profile-rows default@8 --warmup 1), then says there is no table.
"""
import argparse, dataclasses, gc, itertools, os, statistics, sys, time, warnings
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import record_function
from torch.utils.data import TensorDataset
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common
import ddp_resnet
from ddp_resnet import train_step

ROWS = ("default,fp32,tf32,bf16,cl,bf16+cl,bf16+cl+fused,default+bare,default+gpudata,bf16+cl+fused+bare,default@512,"
        "default@1024,bf16+cl+fused@512,bf16+cl+fused@1024,bf16+cl+fused+compile,bf16+cl+fused+cudagraphs")
QUICK = "default,bf16+cl+fused,bf16+cl+fused@1024"
PROFILE = "default,bf16+cl+fused,bf16+cl+fused@1024"   # the README's step, and the bf16 step at 256 and 1024
PARTS = ("next batch", "train_step", "scheduler.step", "stop vote")   # the labels make_step gives a step's parts
LABELS = ("step",) + PARTS
TRAIN_IMAGES, EPOCHS = 60_000, 5   # Fashion-MNIST's training set; ddp_resnet.py's default epochs (the schedule)

# Dense tensor-core TF32 and BF16, and FP32 (no tensor cores), in TFLOP/s, from NVIDIA's datasheets ("NVIDIA H100
# Tensor Core GPU", "NVIDIA H200 Tensor Core GPU", "NVIDIA A100 Tensor Core GPU"): they list TF32 and BF16 with
# sparsity, twice these. The first name found in the device's name is taken: H100 80GB HBM3 is the SXM5 card.
PEAKS = {"H100 PCIe": {"tf32": 378, "bf16": 756, "fp32": 51},
         "H100 NVL": {"tf32": 418, "bf16": 835, "fp32": 60},
         "H200 NVL": {"tf32": 418, "bf16": 835, "fp32": 60},
         "H100": {"tf32": 495, "bf16": 989, "fp32": 67},
         "H200": {"tf32": 495, "bf16": 989, "fp32": 67},
         "A100": {"tf32": 156, "bf16": 312, "fp32": 19.5}}

@dataclasses.dataclass
class Row:
    name: str
    batch: int = 256
    precision: str = "default"   # default, fp32 or tf32 (for what autocast leaves in float32 too)
    amp: bool = False
    channels_last: bool = False
    fused: bool = False
    compile: str = None   # torch.compile's mode, or None
    bare: bool = False
    gpudata: bool = False
    cudnn_benchmark: bool = False

SETTINGS = {"default": {}, "fp32": {"precision": "fp32"}, "tf32": {"precision": "tf32"}, "bf16": {"amp": True},
            "cl": {"channels_last": True}, "fused": {"fused": True}, "compile": {"compile": "default"},
            "cudagraphs": {"compile": "reduce-overhead"}, "autotune": {"compile": "max-autotune-no-cudagraphs"},
            "bare": {"bare": True}, "gpudata": {"gpudata": True}, "cudnn": {"cudnn_benchmark": True}}

def parse_rows(text):   # "default,bf16+cl@512" -> [Row, Row]
    rows = []
    for name in text.split(","):
        settings, _, batch = name.partition("@")
        unknown = [s for s in settings.split("+") if s not in SETTINGS]
        if unknown or (batch and not batch.isdigit()):
            raise argparse.ArgumentTypeError(f"{name!r}: settings are {', '.join(SETTINGS)}, then @batch")
        row = Row(name, batch=int(batch or 256))
        for setting in settings.split("+"):
            for field, value in SETTINGS[setting].items():
                setattr(row, field, value)
        rows.append(row)
    return rows

# ---------------------------------------------------------------- FLOPs, counted
def resnet18():   # ddp_resnet.py's model for Fashion-MNIST: a 3x3 stride-1 stem and no max-pool
    torch.manual_seed(0)
    return common.classifier("resnet18", 10, channels=1, image_size=28)

def flops_per_sample(batch=256):
    """(forward, backward) FLOPs of one training sample, counted by FlopCounterMode on the meta device (shapes
    only: it runs anywhere, at once). Matmuls and convolutions only; BatchNorm, ReLU and SGD are a few % more."""
    net = resnet18().to("meta")
    X = torch.empty(batch, 1, 28, 28, device="meta")
    y = torch.zeros(batch, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as forward:
        loss = F.cross_entropy(net(X), y)
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return forward.get_total_flops() / batch, backward.get_total_flops() / batch

# ---------------------------------------------------------------- one row
def set_precision(precision):   # torch's defaults: cuDNN's convolutions in TF32, matmuls in fp32
    torch.backends.cudnn.allow_tf32 = precision != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"

def batches(images, labels, batch, device, on_device):
    """Batches on the device as ddp_resnet.py takes them from common.train_loader: the data in the CPU's memory,
    each batch pinned there and copied without waiting. on_device: the data held on the GPU instead, each batch's
    indices copied from pinned memory without waiting and indexed there."""
    if on_device:
        images, labels = images.to(device), labels.to(device)
        while True:
            for index in torch.randperm(len(images))[:len(images) // batch * batch].split(batch):
                index = index.pin_memory() if device.type == "cuda" else index
                yield images[index.to(device, non_blocking=True)], labels[index.to(device, non_blocking=True)]
    loader, sampler = common.train_loader(TensorDataset(images, labels), batch, 0, 0, 1, device)
    for epoch in itertools.count(1):
        sampler.set_epoch(epoch)
        for X, y in loader:
            yield X.to(device, non_blocking=True), y.to(device, non_blocking=True)

def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def seconds_per_step(step, steps, device):
    synchronize(device)   # nothing queued: the clock starts with the first step's work
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / steps

def kernel_time(step, steps, device):
    """(seconds a step the GPU is busy, kernels and copies a step): the union of their intervals in a trace."""
    synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as trace:
        for _ in range(steps):
            step()
        synchronize(device)
    return busy_and_kernels(trace, steps)

def is_device_work(event):   # a kernel or a copy, not a label's span (torch.profiler draws those on the GPU too)
    labelled = event.name in LABELS or getattr(event, "is_user_annotation", False)
    return event.device_type == DeviceType.CUDA and not labelled

def busy_and_kernels(trace, steps):   # (seconds a step the device is busy, kernels and copies a step) of a trace
    spans = sorted((e.time_range.start, e.time_range.end) for e in trace.events() if is_device_work(e))
    busy, reached = 0, float("-inf")
    for start, end in spans:   # overlapping kernels (other streams) count once
        if end > reached:
            busy += end - max(start, reached)
            reached = end
    return busy / 1e6 / steps, len(spans) / steps

def host_syncs(step, device):
    """How often one step makes the CPU wait for the GPU (an .item(), a copy from pageable memory, ...)."""
    if device.type != "cuda":
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")   # each such call warns
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)

def make_step(row, device, stop, data):
    """A function that takes one of the row's steps, as ddp_resnet.py's loop takes them, each part of it labelled
    for torch.profiler (a few microseconds a step when no profiler runs)."""
    set_precision(row.precision)
    torch.backends.cudnn.benchmark = row.cudnn_benchmark
    if row.compile:
        torch.compiler.reset()   # each row compiles its own model, as a run does
    memory_format = torch.channels_last if row.channels_last else torch.contiguous_format
    net = resnet18().to(device, memory_format=memory_format)
    steps_per_epoch = TRAIN_IMAGES // row.batch
    # no --compile: the row compiles with its mode
    flags = ddp_resnet.parse_args(["--batch-size", str(row.batch), "--epochs", str(EPOCHS)] +
                                  (["--amp"] if row.amp else []))
    optimizer, scheduler = ddp_resnet.make_optimizer(net, flags, steps_per_epoch)
    for group in optimizer.param_groups:
        group["fused"] = row.fused   # what SGD(..., fused=True) sets
    ddp_model, _ = ddp_resnet.wrap(net, flags, device, "nccl" if device.type == "cuda" else "gloo", False)
    model = torch.compile(ddp_model, mode=row.compile) if row.compile else ddp_model
    totals = common.Sums.on(device, loss=0, correct=0, samples=0, **common.NORM_SUMS)
    # The step's number, which seeds what it draws.
    numbers = itertools.count()
    drawn = batches(*data, row.batch, device, row.gpudata)
    X_fixed, y_fixed = next(drawn)
    X_fixed = X_fixed.contiguous(memory_format=memory_format)

    def step():
        with record_function("step"):
            if row.bare:
                train_step(model, optimizer, X_fixed, y_fixed, next(numbers), flags, totals)
                return
            with record_function("next batch"):
                X, y = next(drawn)
                X = X.contiguous(memory_format=memory_format)
            with record_function("train_step"):
                train_step(model, optimizer, X, y, next(numbers), flags, totals)
            with record_function("scheduler.step"):
                scheduler.step()
            with record_function("stop vote"):
                stop.vote()
    return step

def time_row(row, device, stop, data, args):
    """(seconds a step, GPU-busy seconds a step, kernels a step, host syncs a step) of this row's steps."""
    step = make_step(row, device, stop, data)
    for _ in range(args.warmup):
        step()
    seconds = statistics.median(seconds_per_step(step, args.steps, device) for _ in range(args.repeats))
    busy, kernels = kernel_time(step, 5, device)
    return seconds, busy, kernels, host_syncs(step, device)


def profile_row(row, step, steps, device, folder):
    """torch.profiler over `steps` steps: the Chrome trace (open it in ui.perfetto.dev) and a summary, both in
    `folder`; the summary's first lines are returned. What binds a step: the host's time in it (Python, dispatch,
    launches, waits) against the device's busy time; each part's; the top ops by device time and by host time."""
    name = row.name.replace("+", "_").replace("@", "_at_")
    synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as trace:
        for _ in range(steps):
            step()
        synchronize(device)
    wall = (time.perf_counter() - start) / steps
    trace.export_chrome_trace(os.path.join(folder, f"trace_{name}.json.gz"))
    averages = {event.key: event for event in trace.key_averages() if event.device_type == DeviceType.CPU}
    busy, kernels = busy_and_kernels(trace, steps)
    host = averages["step"].cpu_time_total / 1e6 / steps
    parts = ", ".join(f"{part} {averages[part].cpu_time_total / 1e3 / steps:.2f}" for part in PARTS if part in averages)
    lines = [f"profile {row.name} (batch {row.batch}), {steps} steps under torch.profiler on {device}: a step "
             f"{1000 * wall:.2f} ms; the host in it {1000 * host:.2f} ms (its parts, ms: {parts}); the device busy "
             f"{1000 * busy:.2f} ms, {kernels:.0f} kernels and copies; host syncs {host_syncs(step, device)}"]
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    tables = [f"top ops by {sort}, then by cpu_time_total (the parts included); times for all {steps} steps",
              trace.key_averages().table(sort_by=sort, row_limit=20),
              trace.key_averages().table(sort_by="cpu_time_total", row_limit=20)]
    with open(os.path.join(folder, f"profile_{name}.txt"), "w") as f:
        f.write("\n".join(lines + tables) + "\n")
    return lines

# ---------------------------------------------------------------- the table
def peak_of(name):
    return next((peaks for key, peaks in PEAKS.items() if key in name), None)

def precision_of(row):   # which peak a row's convolutions can reach
    if row.amp:
        return "bf16"
    return "fp32" if row.precision == "fp32" else "tf32"

def row_line(row, seconds, busy, kernels, syncs, flops, peaks, base, wall):
    rate = row.batch / seconds
    tflops = flops * rate / 1e12
    share = f"{100 * tflops / peaks[precision_of(row)]:5.1f}% {precision_of(row)}" if peaks else "-"
    versus = f"{base / seconds * row.batch / 256:5.2f}x" if base else "-"
    kernel_share = f"{100 * busy / seconds:4.0f}%" if kernels else "-"
    return (f"{row.name:28} {rate:10,.0f} {1000 * seconds:8.2f} {versus:>9} {tflops:8.1f} {share:>11} "
            f"{kernel_share:>8} {kernels:8.0f} {syncs:5d} {wall:5.0f}")

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=parse_rows, default=ROWS, help=f"comma-separated rows (default: {ROWS})")
    p.add_argument("--quick", action="store_true", help=f"rows {QUICK}, 3 repeats: no compiling")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (compiling in them)")
    p.add_argument("--steps", type=int, default=20, help="steps in a timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per row, the median taken")
    p.add_argument("--budget", type=float, default=180, help="seconds: no row starts after them")
    p.add_argument("--profile", metavar="DIR", help="first profile --profile-rows into DIR (on a CPU too)")
    p.add_argument("--profile-rows", type=parse_rows, default=PROFILE, help=f"default: {PROFILE}")
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled per row, after --warmup")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.repeats = parse_rows(QUICK), 3
    forward, backward = flops_per_sample()
    flops = forward + backward
    print(f"gpu_speed: ResNet-18 for 1x28x28 images, {flops / 1e9:.3f} GFLOP per training sample (forward "
          f"{forward / 1e9:.3f}, backward {backward / 1e9:.3f}; FlopCounterMode)", flush=True)
    if not torch.cuda.is_available() and not args.profile:
        print("gpu_speed: no GPU here, nothing to time")
        return 0
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)   # of one
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    stop = common.StopSignal()
    data = (torch.randn(TRAIN_IMAGES, 1, 28, 28), torch.randint(10, (TRAIN_IMAGES,)))
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        for row in args.profile_rows:
            step = make_step(row, device, stop, data)
            for _ in range(args.warmup):
                step()
            print("\n".join(profile_row(row, step, args.profile_steps, device, args.profile)), flush=True)
            del step
            gc.collect()   # the row's DDP wrap, a cycle of references
        print(f"gpu_speed: traces and summaries in {args.profile}", flush=True)
    if device.type != "cuda":
        print("gpu_speed: no GPU here, the table not timed")
        dist.destroy_process_group()
        return 0
    name = torch.cuda.get_device_name(device)
    peaks = peak_of(name)
    known = ", ".join(f"{k} {v:g}" for k, v in peaks.items()) if peaks else "not in PEAKS: no share of peak"
    print(f"gpu_speed: {name} (dense peaks in TFLOP/s: {known}), torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version()}, {time.strftime('%Y-%m-%d')}; {args.warmup} warm-up steps, median "
          f"of {args.repeats} x {args.steps} steps", flush=True)
    print(f"\n{'row':28} {'samples/s':>10} {'ms/step':>8} {'x default':>9} {'TFLOP/s':>8} {'of peak':>11} "
          f"{'GPU busy':>8} {'kernels':>8} {'syncs':>5} {'s':>5}", flush=True)
    started, base = time.monotonic(), None
    for row in args.rows:
        if time.monotonic() - started > args.budget:
            print(f"{row.name:28} skipped: past --budget {args.budget:g} s", flush=True)
            continue
        begin = time.monotonic()
        try:
            seconds, busy, kernels, syncs = time_row(row, device, stop, data, args)
        except Exception as e:   # one row's failure (a compile mode, memory) leaves the others their rows
            print(f"{row.name:28} failed: {type(e).__name__}: {' '.join(str(e).split())[:150]}", flush=True)
            continue
        finally:
            gc.collect()   # the row's DDP wrap is a cycle of references: its memory goes now, not in a later row
            torch.cuda.empty_cache()
        if row.name == "default":
            base = seconds
        print(row_line(row, seconds, busy, kernels, syncs, flops, peaks, base, time.monotonic() - begin), flush=True)
    print(f"\nx default: samples/s over the default row's (batch 256). of peak: TFLOP/s over the dense peak of the "
          f"precision the convolutions run in. GPU busy: kernel time over the step. kernels and syncs (the CPU "
          f"waiting for the GPU): per step. s: the row's own seconds, compiling included.\n"
          f"gpu_speed: {time.monotonic() - started:.0f} s in all")
    gc.collect()
    dist.destroy_process_group()
    return 0

if __name__ == "__main__":
    sys.exit(main())
