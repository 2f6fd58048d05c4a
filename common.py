"""What the scripts share and is not the lesson: the rendezvous and device checks, Fashion-MNIST held in
memory, evaluation, a timer, stopping and resuming, the common command line and the output files.

`python common.py --data-dir DIR` only prepares the data (run_all.sh uses it).

torch.distributed.nn is imported here, before any process group exists, on purpose: it binds
group.WORLD as a default argument when first imported. DDP imports it (through torch._dynamo);
after init_process_group, that default would keep the group and its threads alive past
destroy_process_group, running while the interpreter shuts down, which is when finished ranks
were seen to abort at random."""
import argparse, atexit, contextlib, ctypes, datetime, gzip, io, json, math, multiprocessing, os, shutil, signal, socket, struct, sys, threading, time, types, zlib
import torch
import torch.distributed as dist
import torch.distributed.nn   # noqa: F401  (before any group exists: see the top)
from torch.distributed.rendezvous import rendezvous
from PIL import Image

# ---------------------------------------------------------------- devices, backend, processes
def pick_backend(cuda=None, platform=sys.platform):
    # NCCL exists only for CUDA on Linux; gloo runs everywhere else (on Windows set USE_LIBUV=0).
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return "nccl" if cuda and platform.startswith("linux") else "gloo"

def free_port():
    with socket.socket() as s:   # port 0: the OS picks one nobody uses, so two jobs never collide
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def cpu_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

def share_cores(processes_on_this_machine):
    # torchrun exports OMP_NUM_THREADS=1; when we start the processes ourselves, split the cores.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, cpu_cores() // processes_on_this_machine))

def keep_freed_memory():
    """glibc's malloc hands big freed buffers back to the system, and the next step pays a page
    fault per 4 KiB to take them again: about a fifth of a LeNet step on CPU. Ask it to keep them,
    as MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ would. Where there is no glibc, nothing."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)

def default_to_one_process():
    """Run by plain `python script.py` (no launcher): describe a group of one on this machine."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))

def check_gpu_count(processes_on_this_node, gpus_each=1, rank=0):
    """Exit, saying what to do, when this node starts more processes than it has GPUs for: NCCL
    would otherwise fail later with "Duplicate GPU detected"."""
    if processes_on_this_node * gpus_each > torch.cuda.device_count():
        each = f" x {gpus_each} GPUs each" if gpus_each > 1 else ""
        sys.exit(f"rank {rank}: error: {processes_on_this_node} processes{each} on this node but "
                 f"{torch.cuda.device_count()} GPUs; start at most one per GPU, or use gloo on CPU "
                 f"with CUDA_VISIBLE_DEVICES=")

def rendezvous_store(timeout_s):
    """The key-value store through which the ranks find each other, at MASTER_ADDR:MASTER_PORT
    (torchrun, ddp_toy.py's spawn or default_to_one_process set them). `timeout_s` bounds the wait for
    every rank to join; it is not the collectives' timeout (init_process_group's own default, 10
    min on NCCL and 30 on gloo), so a short one never ends a job whose rank 0 is writing a
    checkpoint. After a torchrun restart the store still holds the dead workers' addresses: a
    key prefix per attempt keeps the new workers from dialling them."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if sys.platform == "win32":
        os.environ.setdefault("USE_LIBUV", "0")   # some Windows builds of torch lack libuv
    try:
        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=datetime.timedelta(seconds=timeout_s)))
    except (RuntimeError, ValueError) as e:
        sys.exit(f"rank {rank}: error: the process group at {os.environ.get('MASTER_ADDR')}:"
                 f"{os.environ.get('MASTER_PORT')} (world size {world_size}) did not form within "
                 f"{timeout_s:g} s; were all ranks started? ({str(e).splitlines()[0]})")
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)

# ---------------------------------------------------------------- when a rank fails: one line from every rank
def tell_the_launcher(line):
    """torchrun's summary shows the first failed worker's error file as the "Root Cause"; a worker
    that ends with a one-line error (a SystemExit, which torch's `record` does not write) writes
    it here, in the JSON form that torch.distributed.elastic documents, with the line as its text."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)

def broken_group(e):
    """Whether an error says the process group broke (a peer died, left or timed out) rather
    than a bug of this rank: c10d's own error types, or gloo's and NCCL's messages."""
    return dist.is_initialized() and (isinstance(e, dist.DistError) or any(
        word in str(e) for word in ("gloo", "NCCL", "Connection closed", "Connection reset")))

def where_to_resume(checkpoint):
    if not checkpoint:
        return "nothing was saved to resume from"
    if os.path.exists(checkpoint):
        return f"run again with --resume to go on from the last checkpoint, {checkpoint}"
    return f"no checkpoint at {checkpoint} on this node"

@contextlib.contextmanager
def one_line_per_rank(checkpoint=None):
    """Every rank of a distributed run ends with one line, never a traceback. A rank's own error
    (a SystemExit with its line, raised anywhere in the run) is said and handed to torchrun. A
    rank whose collective fails because another rank failed or left says so, and where the last
    checkpoint is; it waits a second first, so that the launcher sees the rank that failed
    first and names it the root cause (its summary orders failures by whole seconds)."""
    try:
        yield
    except SystemExit as e:
        if isinstance(e.code, str):
            tell_the_launcher(e.code)
        raise
    except RuntimeError as e:
        if not broken_group(e):
            raise
        reason = " ".join(str(e).split())
        reason = reason.split("] ", 1)[-1].split(". ")[0][:160]   # gloo: "[file:line] Connection closed by peer ..."
        rank = dist.get_rank()
        time.sleep(1.0)
        print(f"rank {rank}: stopping: another rank failed or left ({reason}); {where_to_resume(checkpoint)}",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None

def problem_of(check, *args):
    """(what check(*args) returns, None), or (None, the line it exits with): the checks below
    exit with their line in a run of one; in a group, every rank's line is shared first."""
    try:
        return check(*args), None
    except SystemExit as e:
        return None, e.code if isinstance(e.code, str) else f"error: exit status {e.code}"

def check_together(problem, rank, world_size, same=None):
    """Before training, every rank hears every other rank's problem (its line, or None) and what
    it sees (`same`: what must be equal on every rank, such as its data), in one collective, so
    that a problem one node alone has ends every rank at once instead of leaving the others
    waiting for a timeout. If any rank has a problem, all exit with status 1: each problem is
    said once, by the first rank that has it (naming it when others do not have it), and each
    rank without one says which rank stopped the run."""
    told = [(problem, same)]
    if world_size > 1:
        told = [None] * world_size
        dist.all_gather_object(told, (problem, same))
    problems = [p for p, _ in told]
    if not any(problems) and any(s != told[0][1] for _, s in told):
        other = next(r for r, (_, s) in enumerate(told) if s != told[0][1])
        problems = [f"error: rank {other} sees other data than rank 0 ({told[other][1]}; rank 0: {told[0][1]}): "
                    f"every node's --data-dir must hold the same"] * world_size
    if not any(problems):
        return
    mine = problems[rank]
    if mine is None:
        first = next(r for r, p in enumerate(problems) if p)
        print(f"rank {rank}: stopping: rank {first} cannot go on (its line says why)", file=sys.stderr, flush=True)
        raise SystemExit(1)
    if problems.index(mine) != rank:   # said by an earlier rank
        raise SystemExit(1)
    everywhere = all(p == mine for p in problems)
    raise SystemExit(mine if everywhere else f"rank {rank} ({socket.gethostname()}): {mine}")

# ---------------------------------------------------------------- Fashion-MNIST in memory
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
MEAN, STD = 0.2860, 0.3530    # of the training images, for inputs near zero mean, unit variance

def _find_files(data_dir):   # the files as given, or as torchvision leaves them (unpacked)
    for d in (data_dir, os.path.join(data_dir, "FashionMNIST", "raw")):
        paths = [os.path.join(d, f) for pair in FILES.values() for f in pair]
        paths = [p if os.path.isfile(p) else p[:-3] for p in paths]
        if all(os.path.isfile(p) for p in paths):
            return paths

def prepare_fashion_mnist(data_dir):
    """Make the four files available under data_dir; return None, or what to do about it."""
    if _find_files(data_dir):
        return None
    try:   # torchvision's download, quietly: its failure output is long and the fix is below
        import torchvision
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            torchvision.datasets.FashionMNIST(data_dir, download=True)
        return None
    except Exception:
        pass
    try:   # Debian's copy: different gzip bytes from torchvision's md5 list, the same images
        if all(os.path.isfile(os.path.join(DEBIAN_DIR, f)) for p in FILES.values() for f in p):
            os.makedirs(data_dir, exist_ok=True)
            for f in (f for pair in FILES.values() for f in pair):
                shutil.copyfile(os.path.join(DEBIAN_DIR, f), os.path.join(data_dir, f + ".tmp"))
                os.replace(os.path.join(data_dir, f + ".tmp"), os.path.join(data_dir, f))
            return None
    except OSError as e:
        return f"error: cannot copy Fashion-MNIST into {data_dir}: {e}"
    names = "\n  ".join(f for pair in FILES.values() for f in pair)
    return (f"error: Fashion-MNIST is not in {os.path.abspath(data_dir)} and could not be "
            f"downloaded. Do one of:\n- put these four files there (from "
            f"https://github.com/zalandoresearch/fashion-mnist):\n  {names}\n"
            f"- on Debian/Ubuntu: sudo apt-get install dataset-fashion-mnist "
            f"(files land in {DEBIAN_DIR}, found automatically)\n"
            f"- on a machine with internet: python -c \"import torchvision; "
            f"torchvision.datasets.FashionMNIST('{data_dir}', download=True)\", then copy the folder")

def _read_idx(path, shape):
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

def load_fashion_mnist(data_dir, train_samples=None, test_samples=None, rank=0, world_size=1):
    """Both splits as tensors: images float (N, 1, 28, 28) normalised, labels int64. Each node's
    first process prepares the files on that node's disk (nodes need not share one); then every
    rank reads its own and all check that they hold the same images."""
    first_here = int(os.environ.get("LOCAL_RANK", rank)) == 0
    check_together(prepare_fashion_mnist(data_dir) if first_here else None, rank, world_size)
    out, problem = problem_of(_read_fashion_mnist, data_dir, train_samples, test_samples)
    check_together(problem, rank, world_size, same=out and ", ".join(
        f"{len(y)} {split} images, labels crc {zlib.crc32(y.numpy().tobytes())}" for split, (_, y) in out.items()))
    return out

def _read_fashion_mnist(data_dir, train_samples, test_samples):
    paths, out = _find_files(data_dir), {}
    for i, (split, n) in enumerate((("train", train_samples), ("test", test_samples))):
        images = _read_idx(paths[2 * i], (28, 28))[:n]
        labels = _read_idx(paths[2 * i + 1], ())[:n].long()
        out[split] = (((images.float() / 255) - MEAN) / STD).unsqueeze(1), labels
    return out

def rank_shares(num_samples, global_batch, seed, epoch, rank, world_size, start=0, stop=None):
    """Rows of this rank's sample indices, one per global batch of the epoch, from batch `start`
    to `stop`: its 1/world_size of each of epoch_batches' rows."""
    batches = epoch_batches(num_samples, global_batch, seed, epoch)[start:stop]
    return batches.view(len(batches), world_size, global_batch // world_size)[:, rank]

def epoch_batches(num_samples, batch_size, seed, epoch):
    """The epoch's global batches as rows of sample indices, drawn from (seed, epoch) alone, so
    every rank and every world size sees the same sequence. The partial last batch is dropped."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[: num_samples // batch_size * batch_size].view(-1, batch_size)

# ---------------------------------------------------------------- your own images: a folder read by DataLoader workers
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
FASHION_CLASSES = ("t-shirt_top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                   "ankle_boot")

def data_kind(data_dir):
    """"folder" when data_dir holds train/ and val/, "fashion-mnist" when it holds the IDX files or
    nothing yet (they are then fetched); anything else exits, saying what the folder lacks."""
    has = [s for s in ("train", "val") if os.path.isdir(os.path.join(data_dir, s))]
    if len(has) == 2:
        return "folder"
    if has:
        missing = {"train", "val"} - set(has)
        sys.exit(f"error: {data_dir} has {has[0]}/ but no {missing.pop()}/: an image folder needs both, "
                 f"each with one subfolder per class")
    if _find_files(data_dir) or not os.path.isdir(data_dir) or not os.listdir(data_dir):
        return "fashion-mnist"
    sys.exit(f"error: {data_dir} holds neither Fashion-MNIST's four IDX files nor train/ and val/ folders "
             f"of images (one subfolder per class); point --data-dir at one of these")

def scan_image_folder(data_dir):
    """The class names and each split's (path, class index) list, classes and files sorted by name
    (as torchvision's ImageFolder does). Hidden files are skipped; anything else that is not an
    image, an empty class, or classes that differ between train/ and val/ exit, naming the path."""
    def refuse(message):
        sys.exit(f"error: {message}")
    splits = {}
    for split in ("train", "val"):
        root = os.path.join(data_dir, split)
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        if not classes:
            refuse(f"{root} has no class folders: put each class's images in a subfolder named after it")
        samples = []
        for label, name in enumerate(classes):
            folder = os.path.join(root, name)
            files = sorted(e.name for e in os.scandir(folder) if e.is_file() and not e.name.startswith("."))
            for f in files:
                if not f.lower().endswith(IMAGE_EXTENSIONS):
                    refuse(f"{os.path.join(folder, f)} is not an image ({' '.join(IMAGE_EXTENSIONS)}): "
                           f"move it out of {folder}")
            if not files:
                refuse(f"{folder} holds no images: add its images or remove the empty class folder")
            samples += [(os.path.join(folder, f), label) for f in files]
        splits[split] = (classes, samples)
    (train_classes, train), (val_classes, val) = splits["train"], splits["val"]
    if train_classes != val_classes:   # both sorted: they differ only in which classes they hold
        only = lambda a, b: ", ".join(sorted(set(a) - set(b))) or "none"
        refuse(f"{data_dir}/train and {data_dir}/val have different classes (only in train/: "
               f"{only(train_classes, val_classes)}; only in val/: {only(val_classes, train_classes)}): "
               f"give both the same class folders")
    return train_classes, train, val

class UnreadableImage(Exception):
    """A file that cannot be decoded. Raised in a DataLoader worker, it comes back to the training
    process as this type with the worker's traceback as its text; `line()` is our one line of it."""
    def line(self):
        text = str(self)
        return text[text.rfind("error: cannot read "):].strip()

class ImageFiles(torch.utils.data.Dataset):
    """Images from disk, decoded and transformed where the DataLoader calls it (its workers). It is
    indexed by (epoch, index) pairs: each sample's random crop and flip are drawn from (seed,
    epoch, index) alone. So a sample is augmented alike at any world size, any number of workers
    and after a resume; different samples, on any rank or in any worker, draw differently. (Seeding
    each worker's generator instead, from (seed, rank, worker), makes the draws depend on how work
    is divided, and a resume exact only if every worker's generator state were saved.)"""
    def __init__(self, samples, transform, mode, seed):
        self.samples, self.transform, self.mode, self.seed = samples, transform, mode, seed

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, epoch_and_index):
        epoch, index = epoch_and_index
        path, label = self.samples[index]
        try:
            with Image.open(path) as image:
                image = image.convert(self.mode)   # decodes the whole file: truncation shows here
        except Exception as e:   # PIL says "cannot identify image file", "image file is truncated", ...
            raise UnreadableImage(f"error: cannot read {path} ({' '.join(str(e).split())[:200]}): "
                                  f"replace or remove the file") from None
        with torch.random.fork_rng(devices=[]):   # leaves the caller's generator as it was
            torch.default_generator.manual_seed(((self.seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63)
            return self.transform(image), label

def image_transforms(image_size, one_channel, augment):
    """Training: random crop (8-100% of the area, resized) and flip, when `augment`; otherwise and
    for evaluation: the shorter side resized to image_size and the centre cut out. Normalised
    with Fashion-MNIST's statistics for a one-channel model, else ImageNet's (torchvision's)."""
    from torchvision import transforms as T
    mean, std = ((MEAN,), (STD,)) if one_channel else (IMAGENET_MEAN, IMAGENET_STD)
    finish = [T.ToTensor(), T.Normalize(mean, std)]
    fixed = T.Compose([T.Resize(image_size), T.CenterCrop(image_size)] + finish)
    random = T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()] + finish)
    return (random if augment else fixed), fixed

class RankBatches(torch.utils.data.Sampler):
    """This rank's share of each global batch of `epoch_batches` (the in-memory path's batches),
    from batch `start` to `stop` of the epoch: a resume starts at the batch the training loop had
    reached. The loop counts the batches it has taken, so batches that workers had fetched
    ahead and never handed over do not count. (torchdata's StatefulDataLoader saves a loader's
    position and its workers' state; here the batches are a function of (seed, epoch) and the
    augmentation of (seed, epoch, index), so an offset is all a resume needs.)"""
    def __init__(self, num_samples, global_batch, seed, rank, world_size):
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.rank, self.world_size = rank, world_size
        self.set_epoch(1)

    def set_epoch(self, epoch, start=0, stop=None):   # what DistributedSampler.set_epoch is for, and the offset
        self.epoch, self.start, self.stop = epoch, start, stop

    def __len__(self):
        return len(range(self.num_samples // self.global_batch)[self.start:self.stop])

    def __iter__(self):
        for share in rank_shares(self.num_samples, self.global_batch, self.seed, self.epoch, self.rank,
                                 self.world_size, self.start, self.stop).tolist():
            yield [(self.epoch, i) for i in share]

class MemoryBatches:
    """Fashion-MNIST held on the device: each epoch, this rank's share of every global batch,
    sliced from the permutation of (seed, epoch)."""
    def __init__(self, images, labels, global_batch, seed, rank, world_size, device, memory_format):
        self.images, self.labels, self.num_samples = images.to(device), labels.to(device), len(labels)
        self.global_batch, self.seed, self.rank, self.world_size = global_batch, seed, rank, world_size
        self.memory_format = memory_format

    def __len__(self):   # batches per epoch; the last partial one is dropped
        return self.num_samples // self.global_batch

    def epoch(self, epoch, start, stop):
        shares = rank_shares(self.num_samples, self.global_batch, self.seed, epoch, self.rank, self.world_size,
                             start, stop).to(self.labels.device)   # one copy an epoch, none per step
        for idx in shares:
            yield self.images[idx].contiguous(memory_format=self.memory_format), self.labels[idx]

def leave_stop_signals_to_the_rank(worker_id):
    """DataLoader workers ignore SIGTERM and SIGUSR1. SLURM signals every process of a job, the
    workers too, and a worker killed by it makes its rank raise "DataLoader worker is killed by
    signal" mid-step instead of stopping at the agreed step boundary. The rank's own handler
    decides, and the rank ends its workers itself when it exits (end_workers_at_exit)."""
    for name in ("SIGTERM", "SIGUSR1"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)

def end_workers_at_exit():
    """At the interpreter's exit, multiprocessing ends its daemonic children (DataLoader workers
    are) with SIGTERM and waits for them: ours ignore SIGTERM, and the wait would last for ever
    (seen: a rank that met a truncated image hung). End them with SIGKILL first, however the run
    ends (done, stopped, failed); atexit runs this before multiprocessing's own handler, which
    was registered earlier."""
    def kill_daemonic_children():
        if hasattr(signal, "SIGCHLD"):   # DataLoader's SIGCHLD handler would report these kills as failures
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in multiprocessing.active_children():
            if child.daemon:
                child.kill()
    atexit.register(kill_daemonic_children)

def from_workers(iterator):
    """A DataLoader iterator's batches; an image a worker could not read ends the run with its
    one line."""
    try:
        yield from iterator
    except UnreadableImage as e:   # from a worker, with its traceback as text
        raise SystemExit(e.line()) from None

class FolderBatches:
    """The same batches read from disk: DataLoader workers decode and augment this rank's share
    of each global batch; pinned memory and non-blocking copies on CUDA; the workers live
    across epochs."""
    def __init__(self, dataset, global_batch, seed, rank, world_size, device, memory_format, workers):
        self.sampler = RankBatches(len(dataset), global_batch, seed, rank, world_size)
        self.loader = torch.utils.data.DataLoader(dataset, batch_sampler=self.sampler, num_workers=workers,
                                                  pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                                                  worker_init_fn=leave_stop_signals_to_the_rank)
        self.global_batch, self.num_samples = global_batch, len(dataset)
        self.device, self.memory_format = device, memory_format
        end_workers_at_exit()

    def __len__(self):
        return self.num_samples // self.global_batch

    def epoch(self, epoch, start, stop):
        self.sampler.set_epoch(epoch, start, stop)
        for X, y in from_workers(iter(self.loader)):   # the same workers every epoch (persistent)
            yield (X.to(self.device, non_blocking=True).contiguous(memory_format=self.memory_format),
                   y.to(self.device, non_blocking=True))

def evaluate_folder(predict, dataset, device, rank=0, world_size=1, batch_size=250, workers=0):
    """Accuracy on a folder split, as `evaluate` scores the in-memory one (the same slices),
    its images read by workers."""
    chunks = eval_chunks(len(dataset), rank, world_size, batch_size)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=[[(0, i) for i in c.tolist()] for c in chunks],
                                         num_workers=min(workers, len(chunks)), pin_memory=device.type == "cuda",
                                         worker_init_fn=leave_stop_signals_to_the_rank)
    return accuracy(predict, from_workers(iter(loader)), device, world_size)

def spread(samples, n):
    """n of the samples, evenly spaced: a folder's list is sorted by class, and its first n would
    all come from the first classes (--train-samples, --test-samples)."""
    return samples if n is None or n >= len(samples) else [samples[i * len(samples) // n] for i in range(n)]

def load_data(args, rank, world_size, device, memory_format, master):
    """What --data-dir holds, ready to train on: the training batches, evaluate(model) -> accuracy
    (every rank calls it), the model's name and number of classes. Fashion-MNIST's IDX
    files are held in memory (the fastest for data that small); a folder of images is read by
    --workers DataLoader workers. The global batch is fixed here; what it leaves out is said."""
    # Each rank checks what its node holds (each node may have its own disk); all hear every problem.
    def check_kind():
        if master:
            check_out_dir(args.out)
        kind = data_kind(args.data_dir)   # told to every rank below: the nodes must agree on it
        if kind == "fashion-mnist" and (args.arch not in (None, "fashion_resnet18") or args.image_size not in (None, 28)):
            sys.exit("error: Fashion-MNIST's IDX files train fashion_resnet18 on 28x28 images; for --arch or "
                     "--image-size, write them as an image folder first (python common.py --write-images DIR)")
        return kind
    kind, problem = problem_of(check_kind)
    check_together(problem, rank, world_size, same=f"{args.data_dir} holds {kind}")
    arch = args.arch or ("fashion_resnet18" if kind == "fashion-mnist" else "resnet18")
    one_channel = arch == "fashion_resnet18"
    if kind == "fashion-mnist":
        data = load_fashion_mnist(args.data_dir, args.train_samples, args.test_samples, rank, world_size)
        (X_train, y_train), (X_test, y_test) = data["train"], data["test"]
        rank_batch = rank_batch_size(args.batch_size, world_size, len(y_train), master)
        train = MemoryBatches(X_train, y_train, rank_batch * world_size, args.seed, rank, world_size, device,
                              memory_format)
        evaluate_on_test = lambda model: evaluate(model, X_test, y_test, device, rank, world_size)
        said = f"Fashion-MNIST in memory ({len(y_train)} training, {len(y_test)} test images)"
        classes, test_samples = 10, len(y_test)
    else:
        found, problem = problem_of(scan_image_folder, args.data_dir)
        names, train_samples, val_samples = found or ([], [], [])
        listing = " ".join(os.path.relpath(path, args.data_dir) for path, _ in train_samples + val_samples)
        check_together(problem, rank, world_size, same=f"{len(train_samples)} training, {len(val_samples)} validation "
                       f"images of {len(names)} classes, names crc {zlib.crc32(listing.encode())}")
        train_samples, val_samples = spread(train_samples, args.train_samples), spread(val_samples, args.test_samples)
        if len(val_samples) < world_size:
            sys.exit(f"error: {args.data_dir}/val has {len(val_samples)} images, fewer than the {world_size} ranks; "
                     f"add images or use fewer ranks" if master else 1)
        size = args.image_size or (28 if one_channel else 224)
        train_transform, val_transform = image_transforms(size, one_channel, augment=not args.no_augment)
        mode = "L" if one_channel else "RGB"
        rank_batch = rank_batch_size(args.batch_size, world_size, len(train_samples), master,
                                     what=f"images in {args.data_dir}/train")
        train = FolderBatches(ImageFiles(train_samples, train_transform, mode, args.seed),
                              rank_batch * world_size, args.seed, rank, world_size, device, memory_format,
                              args.workers)
        val = ImageFiles(val_samples, val_transform, mode, args.seed)
        evaluate_on_test = lambda model: evaluate_folder(model, val, device, rank, world_size, workers=args.workers)
        said = (f"{args.data_dir}: {len(train_samples)} training and {len(val_samples)} validation images of "
                f"{len(names)} classes from disk, {size}x{size} {mode}, {args.workers} worker(s) per rank, "
                f"{'random crop and flip' if not args.no_augment else 'no augmentation'}")
        classes, test_samples = len(names), len(val_samples)
    dropped = train.num_samples % train.global_batch
    if master:
        print(f"data: {said}", flush=True)
        if dropped:
            print(f"note: {len(train) * train.global_batch + dropped} training images make {len(train)} global "
                  f"batches of {train.global_batch} per epoch: {dropped} are left out of each epoch "
                  f"(other ones each epoch, drawn with the order)", flush=True)
    return types.SimpleNamespace(train=train, evaluate=evaluate_on_test, arch=arch, classes=classes,
                                 test_samples=test_samples)

def make_model(arch, num_classes, seed):
    """fashion_resnet18, or a torchvision classification model by name (its registry) with
    num_classes outputs. The seed fixes the initial weights: the same on every rank."""
    if arch == "fashion_resnet18":
        return fashion_resnet18(seed, num_classes)
    import torchvision
    torch.manual_seed(seed)
    return torchvision.models.get_model(arch, num_classes=num_classes)

def arch_name(text):
    """--arch: fashion_resnet18 or one of torchvision's classification models."""
    import torchvision
    known = ["fashion_resnet18"] + torchvision.models.list_models(module=torchvision.models)
    if text not in known:
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; fashion_resnet18 or one of torchvision's: "
                                         f"{', '.join(known[1:])}")
    return text

# ---------------------------------------------------------------- the large-batch recipe
def param_groups(net, weight_decay):
    """Weight decay on the weights of convolutions and linear layers only, not on BatchNorm's
    scales and shifts nor on biases (the 1-D parameters): decaying those only fights the
    normalisation (Jia et al. 2018; He et al., "Bag of Tricks", 2019)."""
    params = list(net.parameters())
    return [{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]

def scaled_lr(lr_per_256, global_batch):
    """The linear scaling rule (Goyal et al., "Accurate, Large Minibatch SGD", 2017): --lr is given
    for 256 samples; k times the batch takes k times the learning rate."""
    return lr_per_256 * global_batch / 256

def lr_schedule(optimizer, warmup_steps, total_steps, kind):
    """Stepped after every optimizer step: a linear warm-up to the scaled rate over the first
    `warmup_steps` (large batches diverge without it: Goyal et al.), then `kind`: cosine to zero at
    `total_steps`, step (a tenth at 1/3 and again at 2/3 of the rest), or constant. The total comes
    from --epochs, never --max-steps: a run stopped early and resumed follows one schedule."""
    def factor(step):   # the multiplier for optimizer step `step` (0-based)
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        done = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return {"cosine": 0.5 * (1 + math.cos(math.pi * min(done, 1.0))),
                "step": 0.1 ** min(2, int(done * 3)), "constant": 1.0}[kind]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

def continue_schedule(optimizer, scheduler, lr, weight_decay, step):
    """After a resume the optimizer's state (momentum) is the checkpoint's, and its learning
    rate, weight decay and schedule are this run's flags, taken up at `step`: the schedule is a
    function of the step, so with the same flags this is where the checkpoint's would be, and
    with other ones they apply from here. (The optimizer's and a scheduler's saved state would
    bring back the checkpoint's rate whatever --lr says.)"""
    for group, decay in zip(optimizer.param_groups, (weight_decay, 0.0)):   # as param_groups makes them
        group.update(initial_lr=lr, weight_decay=decay)
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    scheduler.last_epoch = step - 1
    scheduler.step()   # sets every group's rate for step `step`

# ---------------------------------------------------------------- the ResNet-18 of dp_resnet and ddp_resnet
def fashion_resnet18(seed, num_classes=10):
    """torchvision's ResNet-18 for 1x28x28 images: a 3x3 stride-1 stem and no max-pool, so the
    small images are not shrunk 4x before the first block. The seed fixes the initial weights."""
    import torchvision
    torch.manual_seed(seed)
    net = torchvision.models.resnet18(num_classes=num_classes)
    net.conv1 = torch.nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    torch.nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")   # as torchvision does
    net.maxpool = torch.nn.Identity()
    return net

# ---------------------------------------------------------------- evaluation and timing
def eval_chunks(num_samples, rank, world_size, batch_size):
    """This rank's evaluation batches: its own slice of the split (no padding, so nothing is
    counted twice), cut into as many batches as the largest slice needs, so that every rank makes
    the same number of forward passes: with FSDP a forward is a collective (it gathers weights)."""
    mine = torch.arange(num_samples).tensor_split(world_size)[rank]
    return mine.tensor_split(max(1, math.ceil(math.ceil(num_samples / world_size) / batch_size)))

@torch.no_grad()
def accuracy(predict, batches, device, world_size):
    """[correct, count] over this rank's (X, y) batches, summed over ranks before dividing."""
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for X, y in batches:
        y = y.to(device, non_blocking=True)
        totals[0] += (predict(X.to(device, non_blocking=True)).argmax(1) == y).sum()
        totals[1] += len(y)
    if world_size > 1:
        dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()

def evaluate(predict, images, labels, device, rank=0, world_size=1, batch_size=1000):
    """Accuracy on the whole split held in memory, every image counted once at any world size."""
    chunks = eval_chunks(len(labels), rank, world_size, batch_size)
    return accuracy(predict, ((images[idx], labels[idx]) for idx in chunks), device, world_size)

def broadcast_buffers(module):
    """BatchNorm's running statistics are updated by each rank's own batches; give every rank
    rank 0's (those its model.pt holds) before evaluating, so the accuracy is that model's."""
    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)

class Timer:
    """Seconds of wall-clock time, waiting for queued GPU work first (CUDA runs asynchronously).
    `already`: seconds counted before a restart, for an epoch resumed in the middle."""
    def __init__(self, device, already=0.0):
        self.device, self.start = device, time.perf_counter() - already
    def __call__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.start

class Progress:
    """A line at most every `every` seconds inside a long epoch, with the time left until the
    last batch this run does in it (`last`: the epoch's end, or where --max-steps stops it);
    `first`: the batches done before a restart, which this run's rate does not include."""
    def __init__(self, epoch, batches, enabled, first=0, last=None, every=10.0):
        self.epoch, self.batches, self.enabled, self.every = epoch, batches, enabled, every
        self.first, self.last = first, batches if last is None else last
        self.start = self.last_print = time.perf_counter()
    def __call__(self, batch):
        now = time.perf_counter()
        if self.enabled and now - self.last_print >= self.every and batch < self.last:
            self.last_print, eta = now, (now - self.start) / (batch - self.first) * (self.last - batch)
            print(f"  epoch {self.epoch} batch {batch}/{self.batches}  ETA {eta:.0f} s", flush=True)

# ---------------------------------------------------------------- what each rank sends
class SentBytes:
    """The bytes this rank hands to collectives in its training steps, counted from the tensors it
    passes, by collective and group: the input of an allreduce or a reduce-scatter, a rank's own
    shard of an all-gather, the tensor of a broadcast. What crosses the wire follows from it: a
    ring allreduce of n bytes over W ranks sends 2 (W-1)/W n from each rank, a reduce-scatter of
    n bytes (W-1)/W n, an all-gather of shards of s bytes (W-1) s."""
    def __init__(self):
        self.counts, self.each_step, self.counting = {}, {}, True   # each_step: bytes known to go every step

    @contextlib.contextmanager
    def paused(self):
        """Not counted: what is sent outside the training steps (scratch_ring.py's evaluation)."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def add(self, collective, group, *tensors):
        if not self.counting:
            return
        key = f"{collective} ({group})"
        self.counts[key] = self.counts.get(key, 0) + sum(t.numel() * t.element_size() for t in tensors)

    def count_all_reduce(self, *modules, group):
        """Count every allreduce that code in `modules` starts through their `dist.all_reduce`:
        PyTorch's DDP communication hooks (default_hooks, powerSGD_hook) start theirs that way,
        in the hook and in its futures' callbacks, where no wrapper of the hook could see them."""
        counter = self
        class Counted(types.ModuleType):   # torch.distributed, with all_reduce counted
            def __getattr__(self, name):
                return getattr(dist, name)
            def all_reduce(self, tensor, *args, **kwargs):
                counter.add("all_reduce", group, tensor)
                return dist.all_reduce(tensor, *args, **kwargs)
        for module in modules:
            module.dist = Counted("torch.distributed")

    @classmethod
    def of_ddp(cls, ddp_model, world_size, hooked=False):
        """What DDP sends per step. Without a communication hook DDP allreduces every gradient
        once per step in its own buckets: the gradients' bytes, counted here once (none with one
        rank). With one (`hooked`), the allreduces of PyTorch's hooks are counted as they go."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        sent = cls()
        if hooked:
            sent.count_all_reduce(default_hooks, powerSGD_hook, group=f"{world_size} ranks")
        elif world_size > 1:
            sent.each_step[f"all_reduce ({world_size} ranks)"] = sum(
                p.numel() * p.element_size() for p in ddp_model.parameters() if p.requires_grad)
        return sent

    @classmethod
    def of_fsdp(cls, model, mesh, gathered_as):
        """What FSDP2 sends per step, from the sizes of the sharded parameters (its collectives
        run inside FSDP, where no public API counts them; a test checks these sums against what
        torch.distributed is handed). For every sharded module (a unit), each rank hands its
        shard of the unit's parameters, dim 0 padded to a multiple of the shard group, to an
        all-gather before forward and again before backward (the root unit's stay gathered in
        between), in `gathered_as(unit)`'s dtype; the unit's whole padded gradient (fp32) to a
        reduce-scatter; and on a 2-D mesh (HSDP) its shard of that sum to an all-reduce across
        the replicas."""
        from torch.distributed.fsdp import FSDPModule
        sent, shards = cls(), mesh.size(mesh.ndim - 1)
        group = (lambda dim: f"{dim} group of {mesh.size(['replicate', 'shard'].index(dim))}") if mesh.ndim > 1 else (
            lambda dim: f"{shards} ranks")
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        def add(collective, dim, nbytes):
            key = f"{collective} ({group(dim)})"
            sent.each_step[key] = sent.each_step.get(key, 0) + nbytes
        for unit in units:
            below = {id(p) for other in units if other is not unit and any(other is m for m in unit.modules())
                     for p in other.parameters()}   # those of the units inside this one
            shard = sum(math.ceil(p.shape[0] / shards) * math.prod(p.shape[1:])
                        for p in unit.parameters() if id(p) not in below)   # elements, padded
            add("all_gather", "shard", (1 if unit is model else 2) * shard * gathered_as(unit).itemsize)
            add("reduce_scatter", "shard", shards * shard * 4)
            if mesh.ndim > 1:
                add("all_reduce", "replicate", shard * 4)
        return sent

    def record(self, metrics, steps):
        """metrics["sent_bytes_per_step"]: the mean over this run's `steps`, and by collective."""
        by = {**{k: round(v / steps) for k, v in self.counts.items()}, **self.each_step} if steps else {}
        metrics.update(sent_bytes_per_step=sum(by.values()), sent_bytes_by_collective=by)

# ---------------------------------------------------------------- preemption and resuming
PREEMPTED = 75   # EX_TEMPFAIL, "try again later": not 0, which a scheduler or a pipeline would take
                 # for a finished training, and not 1, which says something broke

class StopRequest:
    """SIGTERM (preemption, requeue, torchrun shutting down) and SIGUSR1 (sbatch --signal, ahead
    of the time limit) only note the signal; the ranks decide together, at a step boundary: a
    rank that stopped alone would leave the others waiting in the next collective for ever.

    The decision costs no waiting. At each boundary a rank reads the allreduce (MAX) of the flags
    that it started at the previous boundary, long finished since, and starts the next one, on a
    gloo group of its own over CPU tensors (no GPU sync, never queued behind the gradients). All
    ranks read the same answer after the same step, one step after a signal is first noted.

    A SIGTERM can also mean that the launcher is ending the job because another rank failed
    (torchrun does so). A rank blocked in a collective with the failed one never returns to
    Python, where the handler runs (NCCL waits out its timeout): a thread that the signal wakes
    at once ends the rank with its line when the ranks have not agreed to stop within a grace of
    10 s plus three of the longest steps so far."""
    def __init__(self, checkpoint=None):
        self.signal, self.pending, self.answer, self.watching, self.wake = 0, None, None, True, None
        self.longest_step, self.boundary, self.rank = 0.0, time.monotonic(), dist.get_rank()
        self.group = dist.new_group(backend="gloo")
        for name in ("SIGTERM", "SIGUSR1"):
            if hasattr(signal, name):   # Windows has no SIGUSR1
                signal.signal(getattr(signal, name), self._note)
        if hasattr(signal, "SIGTERM") and os.name == "posix":
            wake_read, self.wake = os.pipe()   # the C-level handler writes the signal's number here
            os.set_blocking(self.wake, False)
            signal.set_wakeup_fd(self.wake)
            threading.Thread(target=self._watch, args=(wake_read, checkpoint), daemon=True).start()

    def _note(self, signum, frame):
        self.signal = signum

    def _watch(self, wake_read, checkpoint):
        while (byte := os.read(wake_read, 1)) and byte[0] != signal.SIGTERM:
            pass
        if not byte:   # the write end closed: the run is over
            os.close(wake_read)
            return
        grace = 10.0 + 3 * self.longest_step
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.answer or not self.watching:
                return
            time.sleep(0.1)
        print(f"rank {self.rank}: stopping: SIGTERM came and the ranks did not agree to stop within "
              f"{grace:.0f} s (another rank failed, left or hangs); {where_to_resume(checkpoint)}",
              file=sys.stderr, flush=True)
        os._exit(1)

    def agreed(self):
        """The signal any rank had noted one step ago (the same answer on every rank), or None."""
        now, answer = time.monotonic(), None
        self.longest_step, self.boundary = max(self.longest_step, now - self.boundary), now
        if self.pending:
            work, flag = self.pending
            work.wait()
            answer = signal.Signals(int(flag.item())).name if flag.item() else None
        self.pending = None
        if not answer:
            flag = torch.tensor([float(self.signal)])
            self.pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        self.answer = answer
        return answer

    def close(self):
        """Wait for the flag's last allreduce (nothing may be in flight when the groups go) and
        let go of the group: the signal handlers keep this object alive, and a group object still
        referenced keeps gloo's threads running past destroy_process_group."""
        self.watching = False
        if self.wake is not None:
            signal.set_wakeup_fd(-1)
            os.close(self.wake)   # ends the watching thread
            self.wake = None
        if self.pending:
            self.pending[0].wait()
        self.pending = self.group = None

class Checkpointing:
    """Where the run is, saved: every `every` steps inside an epoch, at each epoch's end, where
    --max-steps stops it, and when a signal is agreed on (then every rank exits with PREEMPTED).
    `save(position)` is the script's own writer, called on every rank. A position: the epoch under
    way, its batches done, the global step, the epoch's partial totals (summed over ranks) and
    seconds, and what the batches are drawn from."""
    def __init__(self, save, path, every, drawn_from, final_step, master, recipe=None):
        self.save_fn, self.path, self.every, self.drawn_from, self.recipe = save, path, every, drawn_from, recipe
        self.final_step, self.master, self.stop = final_step, master, StopRequest(path)
        if master:
            remove_leftovers(path)

    def save(self, epoch, batch_in_epoch, step, totals, seconds, batches):
        partial = totals.clone()
        dist.all_reduce(partial)   # every rank's sums so far
        self.save_fn({"epoch": epoch, "batch_in_epoch": batch_in_epoch, "step": step,
                      "totals": partial.tolist(), "seconds": seconds, "drawn_from": self.drawn_from,
                      "recipe": self.recipe})
        if self.master:
            print(f"  checkpoint: step {step} (epoch {epoch}, batch {batch_in_epoch}/{batches})", flush=True)

    def after_step(self, epoch, batch_in_epoch, batches, step, totals, timer):
        """Save every `every` steps; on an agreed signal save and exit. The run's last step goes
        on to its evaluation and outputs (seconds), whatever was signalled."""
        if step == self.final_step:
            return
        signalled = self.stop.agreed()
        if signalled or (self.every and step % self.every == 0 and batch_in_epoch < batches):
            self.save(epoch, batch_in_epoch, step, totals, timer(), batches)
        if signalled:
            line = (f"stopped by {signalled} at step {step}, checkpoint written; exit status {PREEMPTED} (not finished, "
                    f"nothing failed): run again with --resume to go on from {self.path}")
            if self.master:
                print(line, flush=True)
            tell_the_launcher(line)   # torchrun counts 75 as a failure: its summary then shows this line
            dist.destroy_process_group()
            raise SystemExit(PREEMPTED)

    def epoch_done(self, epoch, step):
        self.save_fn({"epoch": epoch + 1, "batch_in_epoch": 0, "step": step, "totals": [0.0] * 3,
                      "seconds": 0.0, "drawn_from": self.drawn_from,
                      "recipe": self.recipe})

    def close(self):   # at the end of the run, before the group goes
        self.stop.close()

def recipe_of(args):
    """The flags of the large-batch recipe, kept in checkpoints to say what a resume changes."""
    return {"--lr": args.lr, "--weight-decay": args.weight_decay, "--schedule": args.schedule,
            "--warmup-epochs": args.warmup_epochs, "--epochs": args.epochs}

def resume_position(saved, drawn_from, args, steps_per_epoch, master):
    """The position a loaded checkpoint goes on from, said in one line; None when nothing is
    left to train (the caller leaves the group and returns). Exits, saying why, when the
    checkpoint stopped inside an epoch and this run would draw other batches. At an epoch's end
    other batches are fine: the run goes on from the next epoch, its steps counted in this run's
    batches. Other recipe flags (--lr, ...) are said, and apply from here (continue_schedule)."""
    position = {k: saved[k] for k in ("epoch", "batch_in_epoch", "step", "totals", "seconds")}
    path = args.checkpoint
    differ = ", ".join(f"{k} {saved['drawn_from'][k]} there, {v} here"
                       for k, v in drawn_from.items() if saved["drawn_from"][k] != v)
    if position["batch_in_epoch"] and differ:
        raise SystemExit(f"error: cannot resume from {path}: it stopped inside epoch {position['epoch']}, and "
                         f"this run draws other batches ({differ}); use the same --batch-size, --seed and "
                         f"--train-samples, or start without --resume" if master else 1)
    if differ:   # at an epoch's end: the epochs done are what counts, in this run's steps
        position["step"] = (position["epoch"] - 1) * steps_per_epoch
        if master:
            print(f"note: {path} was written with other batches ({differ}); it finished epoch "
                  f"{position['epoch'] - 1}, which is step {position['step']} in this run's batches", flush=True)
    changed = [f"{k} {v} (was {saved['recipe'][k]})" for k, v in recipe_of(args).items()
               if saved.get("recipe") and saved["recipe"].get(k, v) != v]
    if changed and master:
        print(f"note: resumed with {', '.join(changed)}: applied from step {position['step']} on", flush=True)
    if args.max_steps and position["step"] >= args.max_steps:
        nothing = f"it is at step {position['step']}, at or past --max-steps {args.max_steps}"
    elif position["epoch"] > args.epochs:
        nothing = f"it has finished epoch {position['epoch'] - 1} of --epochs {args.epochs}"
    else:
        if master:
            where = (f"epoch {position['epoch'] - 1} done" if not position["batch_in_epoch"] else
                     f"epoch {position['epoch']} at batch {position['batch_in_epoch']}/{steps_per_epoch}")
            print(f"resumed from {path}: {where}, step {position['step']}", flush=True)
        return position
    if master:
        print(f"nothing to train: {path}: {nothing}", flush=True)
    return None

def rng_state(device):
    """The random number generators that this process uses: the CPU's, and its own GPU's."""
    return {"cpu_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}

def restore_rng(state, device):
    """Every rank takes the saving rank's state (all ranks start from one seed). A GPU state
    goes to this rank's own GPU; on a machine without one there is none to restore."""
    torch.set_rng_state(state["cpu_rng"].cpu())
    if device.type == "cuda" and state.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(state["cuda_rng"].cpu(), device)

# ---------------------------------------------------------------- command line and outputs
def _at_least(kind, zero_allowed):
    def parse(text):
        value = kind(text)
        if not (value >= 0 if zero_allowed else value > 0):
            raise argparse.ArgumentTypeError(f"must be {'0 or more' if zero_allowed else 'positive'}, got {text}")
        return value
    return parse

positive_int, positive_float = _at_least(int, False), _at_least(float, False)
non_negative_int, non_negative_float = _at_least(int, True), _at_least(float, True)

def base_parser(script, description, epochs, batch_size, lr, data=True, resnet=False, distributed=False,
                recipe=False):
    """The flags every training script shares; each script adds its own. `resnet`: --amp and
    --channels-last, and --lr given for 256 samples (scaled_lr); `distributed`: --init-timeout;
    `recipe`: the learning-rate schedule, the weight decay, and the model and loading of image
    folders."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=positive_int, default=epochs, help="passes over the training set")
    p.add_argument("--batch-size", type=positive_int, default=batch_size,
                   help="global batch: summed over all replicas or ranks")
    p.add_argument("--lr", type=positive_float, default=lr, help="learning rate for 256 samples, scaled linearly with "
                   "the global batch (Goyal et al.)" if resnet else "learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the batch order")
    if data:
        p.add_argument("--data-dir", default="data", help="where Fashion-MNIST is (or will be put)" +
                       (", or a folder with train/ and val/, one subfolder of images per class" if recipe else ""))
    p.add_argument("--out", default=os.path.join("runs", os.path.splitext(os.path.basename(script))[0]),
                   help="folder for metrics.json, curves.png and model.pt")
    p.add_argument("--max-steps", type=positive_int, help="stop after this many optimizer steps")
    p.add_argument("--train-samples", type=positive_int, help="use only the first N training images" +
                   (" (of a folder: N spread evenly over its classes)" if recipe else ""))
    p.add_argument("--test-samples", type=positive_int, help="use only the first N test images" +
                   (" (of a folder: N spread evenly over its classes)" if recipe else ""))
    if recipe:   # the large-batch recipe and data from disk (ddp_resnet.py, fsdp_resnet.py)
        p.add_argument("--warmup-epochs", type=non_negative_float, default=0.0,
                       help="raise the learning rate linearly from ~0 over these epochs (5 for batches of 8k)")
        p.add_argument("--schedule", choices=("cosine", "step", "constant"), default="cosine",
                       help="after the warm-up: cosine to 0 at the last epoch, a tenth at 1/3 and 2/3, or constant")
        p.add_argument("--weight-decay", type=non_negative_float, default=5e-4,
                       help="on convolution and linear weights (none on BatchNorm and biases)")
        p.add_argument("--arch", type=arch_name, metavar="NAME",
                       help="a torchvision model for an image folder (default resnet18); IDX data: fashion_resnet18")
        p.add_argument("--image-size", type=positive_int, help="image folders: images resized and cropped "
                       "to this (default 224; 28 for fashion_resnet18)")
        p.add_argument("--workers", type=non_negative_int, default=2, help="DataLoader worker processes per rank reading "
                       "an image folder (0: in the training process)")
        p.add_argument("--no-augment", action="store_true",
                       help="image folders: no random crop and flip in training (centre crop as in evaluation)")
    if resnet:
        p.add_argument("--amp", action="store_true", help="bfloat16 mixed precision")
        p.add_argument("--channels-last", action="store_true", help="NHWC memory layout (faster convolutions on GPUs)")
    if distributed:
        p.add_argument("--init-timeout", type=positive_float, default=300,
                       help="seconds to wait for every rank to join (collectives afterwards: torch's default)")
    return p

def rank_batch_size(batch_size, world_size, train_samples, master, what="training samples"):
    """Each rank's batch: the global batch divided by the world size, so one command line is
    the same training at any world size (the learning rate follows the global batch, never the
    world size)."""
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

def check_out_dir(out):
    """Fail before training, not after it, when the outputs cannot be written (or drawn)."""
    try:
        import matplotlib   # noqa: F401  (curves.png is drawn with it at the end)
    except ImportError:
        sys.exit("error: matplotlib is missing, and curves.png is drawn with it: pip install matplotlib")
    try:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, ".write-test"), "w"):
            pass
        os.remove(os.path.join(out, ".write-test"))
    except OSError as e:
        sys.exit(f"error: cannot write to --out {out}: {e.strerror}")
    for name in ("metrics.json", "model.pt", "curves.png"):
        remove_leftovers(os.path.join(out, name))

def sync(path):
    """Push a file's or a folder's contents from the page cache to the disk (a rename is durable
    only once its folder is synced). Where folders cannot be opened (Windows), nothing."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

def save_atomically(write, path):
    """write(tmp_path), then rename: a crash mid-write leaves the previous file intact, and after a
    power loss or a node's crash the file is the old one or the new one, never an empty one (the
    new bytes are on disk before the rename, and the rename before this returns)."""
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    sync(tmp)
    os.replace(tmp, path)
    sync(os.path.dirname(os.path.abspath(path)))

def remove_leftovers(path):
    """Delete the `path.tmp<pid>` files that writers killed mid-write left, unless that process
    still runs (a run started beside this one, writing)."""
    folder, name = os.path.split(os.path.abspath(path))
    for entry in os.listdir(folder) if os.path.isdir(folder) else []:
        pid = entry[len(name) + 4:] if entry.startswith(name + ".tmp") else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, entry))

def write_outputs(out, metrics, state_dict):
    """metrics.json, curves.png (loss and accuracy per epoch) and model.pt (CPU tensors)."""
    def write_json(tmp):
        with open(tmp, "w") as f:
            json.dump(metrics, f, indent=1)
    save_atomically(write_json, os.path.join(out, "metrics.json"))
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

def finish(metrics, steps, seconds, state_dict):
    """Summary, outputs and the closing line; rank 0 alone calls it."""
    samples = sum(e["samples"] for e in metrics["epochs"])
    metrics.update(steps=steps, seconds=seconds, test_acc=metrics["epochs"][-1]["test_acc"],
                   samples_per_s=samples / sum(e["seconds"] for e in metrics["epochs"]))
    write_outputs(metrics["config"]["out"], metrics, state_dict)
    devices = sorted(set(metrics["devices"]))
    print(f"done: {steps} steps on {len(metrics['devices'])} x {'+'.join(devices)} "
          f"({metrics['backend']}, {metrics['layout']}): test acc "
          f"{metrics['test_acc']:.4f} on {metrics['test_samples']} test samples, "
          f"{metrics['samples_per_s']:,.0f} samples/s, {seconds:.1f} s, "
          f"{metrics.get('sent_bytes_per_step', 0) / 1e6:.3g} MB to collectives per step and rank; "
          f"wrote {metrics['config']['out']}/{{metrics.json,curves.png,model.pt}}", flush=True)

def write_images(data_dir, out, train_samples=None, test_samples=None):
    """Fashion-MNIST as an image folder: out/train/<class>/<index>.png and out/val/... (the test
    set), one grayscale 28x28 PNG per image, classes named with their label first so that sorting
    keeps the label order."""
    problem = prepare_fashion_mnist(data_dir)
    if problem:
        sys.exit(problem)
    paths = _find_files(data_dir)
    for i, (split, n) in enumerate((("train", train_samples), ("val", test_samples))):
        images = _read_idx(paths[2 * i], (28, 28))[:n]
        labels = _read_idx(paths[2 * i + 1], ())[:n]
        for label, name in enumerate(FASHION_CLASSES):
            os.makedirs(os.path.join(out, split, f"{label}_{name}"), exist_ok=True)
        for index, (image, label) in enumerate(zip(images, labels.tolist())):
            Image.frombytes("L", (28, 28), image.numpy().tobytes()).save(
                os.path.join(out, split, f"{label}_{FASHION_CLASSES[label]}", f"{index:05d}.png"))
        print(f"wrote {len(labels)} images to {os.path.join(out, split)}")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Prepare Fashion-MNIST in --data-dir; with --write-images, "
                                                 "also write it as a folder of PNG files (train/, val/).")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--write-images", metavar="DIR", help="write DIR/train/<class>/*.png and DIR/val/...")
    parser.add_argument("--train-samples", type=positive_int, help="only the first N training images")
    parser.add_argument("--test-samples", type=positive_int, help="only the first N test images")
    args = parser.parse_args()
    if args.write_images:
        write_images(args.data_dir, args.write_images, args.train_samples, args.test_samples)
    else:
        sys.exit(prepare_fashion_mnist(args.data_dir))
