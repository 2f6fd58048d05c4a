"""What every script shares and is not its lesson: devices and joining the group, Fashion-MNIST in
memory, evaluation, a timer, the common flags and the outputs."""
import argparse, contextlib, datetime, gzip, io, json, math, os, shutil, socket, struct, sys, time
import torch
import torch.distributed as dist
import torch.distributed.nn   # noqa: F401  first: imported after a group exists (DDP does), it kept the group's
                              # threads alive past destroy_process_group, and finished ranks aborted at exit
from torch.distributed.rendezvous import rendezvous

# ---------------------------------------------------------------- devices, backend, joining the group
def pick_backend(cuda=None, platform=sys.platform):
    # NCCL exists only for CUDA on Linux; gloo runs everywhere else (on Windows set USE_LIBUV=0).
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return "nccl" if cuda and platform.startswith("linux") else "gloo"

def free_port():
    with socket.socket() as s:   # port 0: the OS picks one nobody uses, so two jobs never collide
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def share_cores(processes_on_this_machine):
    # torchrun exports OMP_NUM_THREADS=1; when we start the processes ourselves, split the cores.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // processes_on_this_machine))

def default_to_one_process():
    """Run by plain `python script.py` (no launcher): describe a group of one on this machine."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))

def check_gpu_count(processes_on_this_node, gpus_each=1, rank=0):   # before NCCL's "Duplicate GPU detected"
    if processes_on_this_node * gpus_each > torch.cuda.device_count():
        each = f" x {gpus_each} GPUs each" if gpus_each > 1 else ""
        sys.exit(f"rank {rank}: error: {processes_on_this_node} processes{each} on this node but {torch.cuda.device_count()} "
                 f"GPUs; start at most one per GPU, or use gloo on CPU with CUDA_VISIBLE_DEVICES=")

def rendezvous_store(timeout_s):
    """torchrun's env:// store, waiting `timeout_s` for every rank (init_process_group's bounds collectives too)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=datetime.timedelta(seconds=timeout_s)))
    except (RuntimeError, ValueError) as e:
        sys.exit(f"rank {rank}: error: the process group at {os.environ.get('MASTER_ADDR')}:"
                 f"{os.environ.get('MASTER_PORT')} (world size {world_size}) did not form within "
                 f"{timeout_s:g} s; were all ranks started? ({str(e).splitlines()[0]})")
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)   # none of a dead try's keys

# ---------------------------------------------------------------- Fashion-MNIST in memory
FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
MEAN, STD = 0.2860, 0.3530    # of the training images, for inputs near zero mean, unit variance

def find_files(data_dir):   # the four files as given, or as torchvision leaves them (unpacked)
    for d in (data_dir, os.path.join(data_dir, "FashionMNIST", "raw")):
        paths = [p if os.path.isfile(p) else p[:-3] for p in (os.path.join(d, f) for f in FILES)]
        if all(os.path.isfile(p) for p in paths):
            return paths

def prepare_fashion_mnist(data_dir):
    """None once data_dir has the files (there, downloaded, or Debian's, same images), else what to do."""
    with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):   # its long failure output: the fix is below
        if not find_files(data_dir):
            import torchvision
            torchvision.datasets.FashionMNIST(data_dir, download=True)
    if not find_files(data_dir) and all(os.path.isfile(os.path.join(DEBIAN_DIR, f)) for f in FILES):
        try:
            os.makedirs(data_dir, exist_ok=True)
            for f in FILES:   # copied, then renamed: never half a file
                shutil.copyfile(os.path.join(DEBIAN_DIR, f), os.path.join(data_dir, f + ".tmp"))
                os.replace(os.path.join(data_dir, f + ".tmp"), os.path.join(data_dir, f))
        except OSError as e:
            return f"error: cannot copy Fashion-MNIST into {data_dir}: {e}"
    return None if find_files(data_dir) else (
        f"error: Fashion-MNIST is not in {os.path.abspath(data_dir)} and could not be downloaded. Do one "
        f"of:\n- put these four files there (from https://github.com/zalandoresearch/fashion-mnist):\n  "
        + "\n  ".join(FILES) + f"\n- on Debian/Ubuntu: sudo apt-get install dataset-fashion-mnist (files land "
        f"in {DEBIAN_DIR}, found automatically)\n- on a machine with internet: python -c \"import torchvision; "
        f"torchvision.datasets.FashionMNIST('{data_dir}', download=True)\", then copy the folder")

def read_idx(path, shape):
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            raw = f.read()
        dims = struct.unpack(f">{(ndim := raw[3])}I", raw[4:4 + 4 * ndim])
        if raw[:3] != b"\0\0\x08" or dims[1:] != shape or len(raw) != 4 + 4 * ndim + math.prod(dims):
            raise ValueError("not an IDX file of the expected shape")
    except (OSError, EOFError, ValueError, IndexError, struct.error) as e:
        sys.exit(f"error: {path} is truncated or corrupt ({e}); delete it and run again")
    return torch.frombuffer(bytearray(raw[4 + 4 * ndim:]), dtype=torch.uint8).view(dims)

def load_fashion_mnist(data_dir, train_samples=None, test_samples=None):
    """{"train": (images, labels), "test": ...}: N x 1 x 28 x 28 floats, normalised, and int64 labels."""
    problem = prepare_fashion_mnist(data_dir)
    if problem:
        sys.exit(problem)
    paths, out = find_files(data_dir), {}
    for i, (split, n) in enumerate((("train", train_samples), ("test", test_samples))):
        images, labels = read_idx(paths[2 * i], (28, 28))[:n], read_idx(paths[2 * i + 1], ())[:n].long()
        out[split] = (((images.float() / 255) - MEAN) / STD).unsqueeze(1), labels
    return out

def epoch_batches(num_samples, batch_size, seed, epoch):
    """Rows of sample indices, drawn from (seed, epoch) alone: the same at any world size; no partial batch."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[: num_samples // batch_size * batch_size].view(-1, batch_size)

# ---------------------------------------------------------------- evaluation and timing
def eval_chunks(num_samples, rank, world_size, batch_size):
    """This rank's slice (nothing counted twice), in as many batches on every rank (an FSDP forward is a collective)."""
    mine = torch.arange(num_samples).tensor_split(world_size)[rank]
    return mine.tensor_split(max(1, math.ceil(math.ceil(num_samples / world_size) / batch_size)))

@torch.no_grad()
def accuracy(predict, batches, device, world_size):
    """[correct, count] over this rank's (X, y) batches, summed over ranks before dividing."""
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for X, y in batches:
        y = y.to(device, non_blocking=True)
        totals += torch.stack([(predict(X.to(device, non_blocking=True)).argmax(1) == y).sum(), torch.tensor(len(y))])
    if world_size > 1:
        dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()

def evaluate(predict, images, labels, device, rank=0, world_size=1, batch_size=1000):
    chunks = eval_chunks(len(labels), rank, world_size, batch_size)
    return accuracy(predict, ((images[idx], labels[idx]) for idx in chunks), device, world_size)

class Timer:
    """Seconds since start (plus `already`, counted before a restart), after queued GPU work."""
    def __init__(self, device, already=0.0):
        self.device, self.start = device, time.perf_counter() - already
    def __call__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.start

class Progress:
    """A line at most every `every` s with the time left until batch `last`, not counting `first` (done before)."""
    def __init__(self, epoch, batches, enabled, first=0, last=None, every=10.0):
        self.epoch, self.batches, self.enabled, self.every = epoch, batches, enabled, every
        self.first, self.last = first, batches if last is None else last
        self.start = self.last_print = time.perf_counter()
    def __call__(self, batch):
        now = time.perf_counter()
        if self.enabled and now - self.last_print >= self.every and batch < self.last:
            self.last_print, eta = now, (now - self.start) / (batch - self.first) * (self.last - batch)
            print(f"  epoch {self.epoch} batch {batch}/{self.batches}  ETA {eta:.0f} s", flush=True)

# ---------------------------------------------------------------- command line and outputs
def at_least(kind, zero_allowed):
    def parse(text):
        value = kind(text)
        if not (value >= 0 if zero_allowed else value > 0):
            raise argparse.ArgumentTypeError(f"must be {'0 or more' if zero_allowed else 'positive'}, got {text}")
        return value
    return parse

positive_int, positive_float = at_least(int, False), at_least(float, False)
non_negative_int, non_negative_float = at_least(int, True), at_least(float, True)

def base_parser(script, description, epochs, batch_size, lr, data=True, resnet=False, distributed=False,
                folders=False):
    """The flags all share; `resnet`: --amp, --channels-last, --lr per 256 samples; `folders`: image folders."""
    of_folder = " (of a folder: N spread evenly over its classes)" if folders else ""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=positive_int, default=epochs, help="passes over the training set")
    p.add_argument("--batch-size", type=positive_int, default=batch_size,
                   help="global batch: summed over all replicas or ranks")
    p.add_argument("--lr", type=positive_float, default=lr, help="learning rate" + resnet * " for 256 samples, scaled "
                   "linearly with the global batch (Goyal et al.)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the batch order")
    if data:
        p.add_argument("--data-dir", default="data", help="where Fashion-MNIST is (or will be put)" +
                       (", or a folder with train/ and val/, one subfolder of images per class" if folders else ""))
    p.add_argument("--out", default=os.path.join("runs", os.path.splitext(os.path.basename(script))[0]),
                   help="folder for metrics.json, curves.png and model.pt")
    p.add_argument("--max-steps", type=positive_int, help="stop after this many optimizer steps")
    p.add_argument("--train-samples", type=positive_int, help="use only the first N training images" + of_folder)
    p.add_argument("--test-samples", type=positive_int, help="use only the first N test images" + of_folder)
    if resnet:
        p.add_argument("--amp", action="store_true", help="bfloat16 mixed precision")
        p.add_argument("--channels-last", action="store_true", help="NHWC memory layout (faster convolutions on GPUs)")
    if distributed:
        p.add_argument("--init-timeout", type=positive_float, default=300,
                       help="seconds to wait for every rank to join (collectives afterwards: torch's default)")
    return p

def check_out_dir(out):
    """Fail before training, not after it, when the outputs cannot be written (or drawn)."""
    try:
        import matplotlib   # noqa: F401  (curves.png is drawn with it at the end)
    except ImportError:
        sys.exit("error: matplotlib is missing, and curves.png is drawn with it: pip install matplotlib")
    try:
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, ".write-test"), "w").close(), os.remove(os.path.join(out, ".write-test"))
    except OSError as e:
        sys.exit(f"error: cannot write to --out {out}: {e.strerror}")

def new_metrics(script, args, devices, backend, world_size, test_samples):
    """The record a run writes to metrics.json; `devices` names one device per replica."""
    each = len(devices) // world_size
    return {"script": os.path.basename(script), "config": vars(args), "devices": [str(d) for d in devices],
            "backend": backend, "world_size": world_size, "test_samples": test_samples, "epochs": [],
            "layout": f"{world_size} process{'es' * (world_size > 1)} x {each} replica{'s' * (each > 1)}"}

def record_epoch(metrics, epoch, totals, seconds, test_acc, verbose):
    """totals: [summed loss, correct, samples], already summed over all replicas."""
    loss_sum, hits, samples = totals.tolist()
    e = {"epoch": epoch, "train_loss": loss_sum / samples, "train_acc": hits / samples,
         "test_acc": test_acc, "samples": samples, "samples_per_s": samples / seconds, "seconds": seconds}
    metrics["epochs"].append(e)
    if verbose:
        print(f"epoch {epoch:3d}  loss {e['train_loss']:.4f}  train acc {e['train_acc']:.4f}  "
              f"test acc {test_acc:.4f}  {e['samples_per_s']:,.0f} samples/s  {seconds:.1f} s", flush=True)

def nbytes(*tensors):   # what a collective is handed
    return sum(t.numel() * t.element_size() for t in tensors)

def finish(metrics, steps, seconds, state_dict, sent_per_step):
    """metrics.json, curves.png, model.pt and the closing line (rank 0); sent_per_step: bytes by "collective (group)"."""
    by, epochs = {k: round(v) for k, v in sent_per_step.items()}, metrics["epochs"]
    metrics.update(steps=steps, seconds=seconds, test_acc=epochs[-1]["test_acc"], sent_bytes_by_collective=by,
                   samples_per_s=sum(e["samples"] for e in epochs) / sum(e["seconds"] for e in epochs),
                   sent_bytes_per_step=sum(by.values()))
    out = metrics["config"]["out"]
    def replace(write, name):   # written whole, then renamed: a crash leaves the old file, never half of one
        write(os.path.join(out, name + ".tmp"))
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    replace(lambda tmp: open(tmp, "w").write(json.dumps(metrics, indent=1)), "metrics.json")
    replace(lambda tmp: torch.save({k: v.detach().cpu() for k, v in state_dict.items()}, tmp), "model.pt")
    import matplotlib
    matplotlib.use("Agg")   # no display needed
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, style in ((ax_loss, "train_loss", "o-"), (ax_acc, "train_acc", "o-"), (ax_acc, "test_acc", "s-")):
        ax.plot([e["epoch"] for e in epochs], [e[key] for e in epochs], style, label=key.replace("_", " "))
    for ax in (ax_loss, ax_acc):
        ax.set_xlabel("epoch"), ax.grid(alpha=0.3), ax.legend()
    fig.suptitle(f"{metrics['script']}: {len(metrics['devices'])} x {metrics['devices'][0]} ({metrics['backend']})")
    fig.tight_layout()
    replace(lambda tmp: fig.savefig(tmp, format="png", dpi=100), "curves.png")
    plt.close(fig)
    print(f"done: {steps} steps on {len(metrics['devices'])} x {'+'.join(sorted(set(metrics['devices'])))} "
          f"({metrics['backend']}, {metrics['layout']}): test acc {metrics['test_acc']:.4f} on "
          f"{metrics['test_samples']} test samples, {metrics['samples_per_s']:,.0f} samples/s, {seconds:.1f} s, "
          f"{metrics['sent_bytes_per_step'] / 1e6:.3g} MB to collectives per step and rank; "
          f"wrote {out}/{{metrics.json,curves.png,model.pt}}", flush=True)
