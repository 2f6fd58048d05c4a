"""What every script shares and is not its lesson: devices and joining the group, Fashion-MNIST in
memory, evaluation, a timer, the common flags and the outputs. `python common.py` prepares the data.

torch.distributed.nn is imported before any group exists on purpose: it binds group.WORLD as a
default argument when first imported (DDP imports it); bound to a live group, it kept the group's
threads running past destroy_process_group, and finished ranks aborted at random at exit."""
import argparse, contextlib, datetime, gzip, io, json, math, os, shutil, socket, struct, sys, time
import torch
import torch.distributed as dist
import torch.distributed.nn   # noqa: F401  (before any group exists: see the top)
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
        sys.exit(f"rank {rank}: error: {processes_on_this_node} processes{each} on this node but "
                 f"{torch.cuda.device_count()} GPUs; start at most one per GPU, or use gloo on CPU "
                 f"with CUDA_VISIBLE_DEVICES=")

def rendezvous_store(timeout_s):
    """The store of torchrun's env:// (MASTER_ADDR:MASTER_PORT), waiting `timeout_s` for every rank.
    init_process_group's `timeout` would bound every collective too, and end a step in which rank 0
    writes a long checkpoint (tests/test_faults.py measures both bounds apart)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=datetime.timedelta(seconds=timeout_s)))
    except (RuntimeError, ValueError) as e:
        sys.exit(f"rank {rank}: error: the process group at {os.environ.get('MASTER_ADDR')}:"
                 f"{os.environ.get('MASTER_PORT')} (world size {world_size}) did not form within "
                 f"{timeout_s:g} s; were all ranks started? ({str(e).splitlines()[0]})")
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)   # none of a dead try's keys

# ---------------------------------------------------------------- Fashion-MNIST in memory
FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
         "t10k-labels-idx1-ubyte.gz")
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
MEAN, STD = 0.2860, 0.3530    # of the training images, for inputs near zero mean, unit variance

def find_files(data_dir):   # the four files as given, or as torchvision leaves them (unpacked)
    for d in (data_dir, os.path.join(data_dir, "FashionMNIST", "raw")):
        paths = [p if os.path.isfile(p) else p[:-3] for p in (os.path.join(d, f) for f in FILES)]
        if all(os.path.isfile(p) for p in paths):
            return paths

def prepare_fashion_mnist(data_dir):
    """Make the four files available in data_dir: there, torchvision's download, or Debian's
    package (other gzip bytes than torchvision's md5 list, the same images). None, or what to do."""
    with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):   # its long failure output: the fix is below
        if not find_files(data_dir):
            import torchvision
            torchvision.datasets.FashionMNIST(data_dir, download=True)
    if not find_files(data_dir) and all(os.path.isfile(os.path.join(DEBIAN_DIR, f)) for f in FILES):
        try:
            os.makedirs(data_dir, exist_ok=True)
            for f in FILES:
                shutil.copyfile(os.path.join(DEBIAN_DIR, f), os.path.join(data_dir, f + ".tmp"))
                os.replace(os.path.join(data_dir, f + ".tmp"), os.path.join(data_dir, f))
        except OSError as e:
            return f"error: cannot copy Fashion-MNIST into {data_dir}: {e}"
    if find_files(data_dir):
        return None
    return (f"error: Fashion-MNIST is not in {os.path.abspath(data_dir)} and could not be downloaded. Do one "
            f"of:\n- put these four files there (from https://github.com/zalandoresearch/fashion-mnist):\n  "
            + "\n  ".join(FILES) + f"\n- on Debian/Ubuntu: sudo apt-get install dataset-fashion-mnist (files land "
            f"in {DEBIAN_DIR}, found automatically)\n- on a machine with internet: python -c \"import torchvision; "
            f"torchvision.datasets.FashionMNIST('{data_dir}', download=True)\", then copy the folder")

def read_idx(path, shape):
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            raw = f.read()
        ndim = raw[3]
        dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
        if raw[:3] != b"\0\0\x08" or dims[1:] != shape or len(raw) != 4 + 4 * ndim + math.prod(dims):
            raise ValueError("not an IDX file of the expected shape")
    except (OSError, EOFError, ValueError, IndexError, struct.error) as e:
        sys.exit(f"error: {path} is truncated or corrupt ({e}); delete it and run again")
    return torch.frombuffer(bytearray(raw[4 + 4 * ndim:]), dtype=torch.uint8).view(dims)

def load_fashion_mnist(data_dir, train_samples=None, test_samples=None):
    """{"train": (images, labels), "test": ...}, the first N of each: images float (N, 1, 28, 28),
    normalised, labels int64 (in a group: faults.fashion_mnist_on_every_node)."""
    problem = prepare_fashion_mnist(data_dir)
    if problem:
        sys.exit(problem)
    paths, out = find_files(data_dir), {}
    for i, (split, n) in enumerate((("train", train_samples), ("test", test_samples))):
        images, labels = read_idx(paths[2 * i], (28, 28))[:n], read_idx(paths[2 * i + 1], ())[:n].long()
        out[split] = (((images.float() / 255) - MEAN) / STD).unsqueeze(1), labels
    return out

def epoch_batches(num_samples, batch_size, seed, epoch):
    """The epoch's global batches as rows of sample indices, drawn from (seed, epoch) alone: the
    same sequence on every rank at any world size. The partial last batch is dropped."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[: num_samples // batch_size * batch_size].view(-1, batch_size)

# ---------------------------------------------------------------- evaluation and timing
def eval_chunks(num_samples, rank, world_size, batch_size):
    """This rank's slice of the split (nothing counted twice), in as many batches as the largest
    slice needs: every rank makes as many forwards (with FSDP a forward is a collective)."""
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

def broadcast_buffers(module):
    """BatchNorm's running statistics, rank 0's on every rank (those model.pt holds)."""
    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)

class Timer:
    """Seconds since start (plus `already`, counted before a restart), after queued GPU work."""
    def __init__(self, device, already=0.0):
        self.device, self.start = device, time.perf_counter() - already
    def __call__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.start

class Progress:
    """A line at most every `every` s, with the time left until batch `last` (where this run stops in
    the epoch); `first`: the batches done before a restart, not in this run's rate."""
    def __init__(self, epoch, batches, enabled, first=0, last=None, every=10.0):
        self.epoch, self.batches, self.enabled, self.every = epoch, batches, enabled, every
        self.first, self.last = first, batches if last is None else last
        self.start = self.last_print = time.perf_counter()
    def __call__(self, batch):
        now = time.perf_counter()
        if self.enabled and now - self.last_print >= self.every and batch < self.last:
            self.last_print, eta = now, (now - self.start) / (batch - self.first) * (self.last - batch)
            print(f"  epoch {self.epoch} batch {batch}/{self.batches}  ETA {eta:.0f} s", flush=True)

# ---------------------------------------------------------------- command line
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
    """The flags every script shares. `resnet`: --amp, --channels-last, and --lr given for 256
    samples; `distributed`: --init-timeout; `folders`: --data-dir may be an image folder."""
    of_folder = " (of a folder: N spread evenly over its classes)" if folders else ""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=positive_int, default=epochs, help="passes over the training set")
    p.add_argument("--batch-size", type=positive_int, default=batch_size,
                   help="global batch: summed over all replicas or ranks")
    p.add_argument("--lr", type=positive_float, default=lr, help="learning rate for 256 samples, scaled linearly with "
                   "the global batch (Goyal et al.)" if resnet else "learning rate")
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

def rank_batch_size(batch_size, world_size, train_samples, master, what="training samples"):
    """The global batch divided by the world size: one command line, the same training at any size."""
    rank_batch = batch_size // world_size
    if rank_batch == 0:
        sys.exit(f"error: --batch-size {batch_size} is smaller than the world size {world_size}" if master else 1)
    if rank_batch * world_size != batch_size and master:
        print(f"note: --batch-size {batch_size} does not divide by {world_size} ranks: each takes "
              f"{rank_batch}, a global batch of {rank_batch * world_size}", flush=True)
    if train_samples < rank_batch * world_size:
        sys.exit(f"error: {train_samples} {what} are fewer than one global batch of "
                 f"{rank_batch * world_size}; use more samples, a smaller batch or fewer ranks" if master else 1)
    return rank_batch

# ---------------------------------------------------------------- outputs
def check_out_dir(out):
    """Fail before training, not after it, when the outputs cannot be written (or drawn)."""
    try:
        import matplotlib   # noqa: F401  (curves.png is drawn with it at the end)
    except ImportError:
        sys.exit("error: matplotlib is missing, and curves.png is drawn with it: pip install matplotlib")
    try:
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, ".write-test"), "w").close()
        os.remove(os.path.join(out, ".write-test"))
    except OSError as e:
        sys.exit(f"error: cannot write to --out {out}: {e.strerror}")
    remove_leftovers(out)

def remove_leftovers(folder):
    """Delete the `NAME.tmp<pid>` files of writers killed mid-write (save_atomically's), unless that
    process still runs."""
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        pid = name.rpartition(".tmp")[2]
        if ".tmp" in name and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))

def sync(path):
    """A file's or folder's contents from the page cache to the disk (a rename is durable only
    once its folder is synced). Where folders cannot be opened (Windows), nothing."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

def save_atomically(write, path):
    """write(tmp), sync, rename, sync the folder: after a crash or a power loss the file is the
    old one or the new one, never a part of one."""
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    sync(tmp)
    os.replace(tmp, path)
    sync(os.path.dirname(os.path.abspath(path)))

def new_metrics(script, args, devices, backend, world_size, test_samples):
    """The record a run writes to metrics.json; `devices` names one device per replica."""
    per_process = len(devices) // world_size
    layout = f"{world_size} process{'es' * (world_size > 1)} x {per_process} replica{'s' * (per_process > 1)}"
    return {"script": os.path.basename(script), "config": vars(args), "devices": [str(d) for d in devices],
            "backend": backend, "world_size": world_size, "layout": layout, "test_samples": test_samples,
            "epochs": []}

def record_epoch(metrics, epoch, totals, seconds, test_acc, verbose):
    """totals: [summed loss, correct, samples], already summed over all replicas."""
    loss_sum, hits, samples = totals.tolist()
    e = {"epoch": epoch, "train_loss": loss_sum / samples, "train_acc": hits / samples,
         "test_acc": test_acc, "samples": samples, "samples_per_s": samples / seconds, "seconds": seconds}
    metrics["epochs"].append(e)
    if verbose:
        print(f"epoch {epoch:3d}  loss {e['train_loss']:.4f}  train acc {e['train_acc']:.4f}  "
              f"test acc {test_acc:.4f}  {e['samples_per_s']:,.0f} samples/s  {seconds:.1f} s", flush=True)

def record_sent(metrics, per_step):
    """per_step: the bytes this rank hands to collectives per training step, by "collective (group)"."""
    by = {k: round(v) for k, v in per_step.items()}
    metrics.update(sent_bytes_per_step=sum(by.values()), sent_bytes_by_collective=by)

def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)

def finish(metrics, steps, seconds, state_dict):
    """The summary, metrics.json, curves.png, model.pt (CPU tensors) and the closing line; rank 0 only."""
    samples = sum(e["samples"] for e in metrics["epochs"])
    metrics.update(steps=steps, seconds=seconds, test_acc=metrics["epochs"][-1]["test_acc"],
                   samples_per_s=samples / sum(e["seconds"] for e in metrics["epochs"]))
    out = metrics["config"]["out"]
    save_atomically(lambda tmp: open(tmp, "w").write(json.dumps(metrics, indent=1)), os.path.join(out, "metrics.json"))
    save_atomically(lambda tmp: torch.save({k: v.detach().cpu() for k, v in state_dict.items()}, tmp),
                    os.path.join(out, "model.pt"))
    import matplotlib
    matplotlib.use("Agg")   # no display needed
    import matplotlib.pyplot as plt
    epochs = [e["epoch"] for e in metrics["epochs"]]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax_loss.plot(epochs, [e["train_loss"] for e in metrics["epochs"]], "o-", label="train loss")
    ax_acc.plot(epochs, [e["train_acc"] for e in metrics["epochs"]], "o-", label="train acc")
    ax_acc.plot(epochs, [e["test_acc"] for e in metrics["epochs"]], "s-", label="test acc")
    for ax in (ax_loss, ax_acc):
        ax.set_xlabel("epoch"), ax.grid(alpha=0.3), ax.legend()
    fig.suptitle(f"{metrics['script']}: {len(metrics['devices'])} x {metrics['devices'][0]} ({metrics['backend']})")
    fig.tight_layout()
    save_atomically(lambda tmp: fig.savefig(tmp, format="png", dpi=100), os.path.join(out, "curves.png"))
    plt.close(fig)
    print(f"done: {steps} steps on {len(metrics['devices'])} x {'+'.join(sorted(set(metrics['devices'])))} "
          f"({metrics['backend']}, {metrics['layout']}): test acc {metrics['test_acc']:.4f} on "
          f"{metrics['test_samples']} test samples, {metrics['samples_per_s']:,.0f} samples/s, {seconds:.1f} s, "
          f"{metrics.get('sent_bytes_per_step', 0) / 1e6:.3g} MB to collectives per step and rank; "
          f"wrote {out}/{{metrics.json,curves.png,model.pt}}", flush=True)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Prepare Fashion-MNIST in --data-dir.")
    parser.add_argument("--data-dir", default="data")
    sys.exit(prepare_fashion_mnist(parser.parse_args().data_dir))
