"""What every script needs and is not its lesson: the device and the group, the data through DistributedSampler
and DataLoader, accuracy, one line from every rank when one fails, a stop all ranks agree on, the outputs."""
import argparse, atexit, contextlib, datetime, gzip, hashlib, json, math, multiprocessing, os, shutil, signal
import socket, struct, sys, threading, time, traceback, zlib
import torch
import torch.distributed as dist
import torch.distributed.nn   # noqa: F401  before any group exists: imported later, it kept gloo alive at exit
from torch.distributed.rendezvous import rendezvous
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

# ---------------------------------------------------------------- the device and the group
def pick_backend(cuda=None, platform=sys.platform):
    # NCCL exists only for CUDA on Linux; gloo runs everywhere else (on Windows set USE_LIBUV=0), on CPU and
    # CUDA tensors alike (--backend gloo lets several ranks share one GPU).
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return "nccl" if cuda and platform.startswith("linux") else "gloo"

def free_port():
    with socket.socket() as s:   # port 0: the OS picks one nobody uses, so two jobs never collide
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def default_to_one_process():
    """Run by plain `python script.py` (no launcher): a group of one on this machine."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))

def cpu_share(processes):
    """This process's share of the cores it may run on (os.sched_getaffinity exists on Linux only)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // processes)

def pick_device(backend, gpus_each=1, cuda=None):
    """A GPU when there are any: LOCAL_RANK x gpus_each, one process per GPU with NCCL (which refuses two on
    one: "Duplicate GPU detected"), shared in turn with gloo; else the CPU, with this process's share of it."""
    here, local_rank = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        if backend == "nccl":
            sys.exit(f"rank {os.environ.get('RANK', 0)}: error: --backend nccl needs GPUs, and this machine has none")
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(cpu_share(here))
        return torch.device("cpu")
    if backend == "nccl" and here * gpus_each > torch.cuda.device_count():
        each = f" x {gpus_each} GPUs each" if gpus_each > 1 else ""
        sys.exit(f"rank {os.environ['RANK']}: error: {here} processes{each} on this node but "
                 f"{torch.cuda.device_count()} GPUs; start at most one per GPU, or let them share: --backend gloo")
    device = torch.device("cuda", local_rank * gpus_each % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device

def rendezvous_store(timeout_s):
    """torchrun's env:// store, waiting `timeout_s` for every rank (init_process_group's would bound collectives)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=datetime.timedelta(seconds=timeout_s)))
    except (RuntimeError, ValueError) as e:
        sys.exit(f"rank {rank}: error: the process group at {os.environ.get('MASTER_ADDR')}:"
                 f"{os.environ.get('MASTER_PORT')} (world size {world_size}) did not form within "
                 f"{timeout_s:g} s; were all ranks started? ({str(e).splitlines()[0]})")
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)   # no stale keys

# ---------------------------------------------------------------- the data: Fashion-MNIST, or your folders
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
    """None once data_dir has the files (there, downloaded, or Debian's: the same), else what to do."""
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        return f"error: --data-dir {data_dir} is not a folder"
    with contextlib.suppress(Exception), contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):
        if not find_files(data_dir):   # quiet: its long failure has a fix below
            import torchvision
            torchvision.datasets.FashionMNIST(data_dir, download=True)
    if not find_files(data_dir) and all(os.path.isfile(os.path.join(DEBIAN_DIR, f)) for f in FILES):
        try:   # Debian's package: the same files
            os.makedirs(data_dir, exist_ok=True)
            for name in FILES:
                copy = lambda tmp: shutil.copyfile(os.path.join(DEBIAN_DIR, name), tmp)
                save_atomically(copy, os.path.join(data_dir, name))
        except OSError as e:
            return f"error: cannot copy Fashion-MNIST into {data_dir}: {e}"
    return None if find_files(data_dir) else (
        f"error: Fashion-MNIST is not in {os.path.abspath(data_dir)} and could not be downloaded. Do one of:\n"
        f"- put these four files there (from https://github.com/zalandoresearch/fashion-mnist):\n  "
        + "\n  ".join(FILES) + f"\n- on Debian/Ubuntu: sudo apt-get install dataset-fashion-mnist (found in "
        f"{DEBIAN_DIR})\n- on a machine with internet: python -c \"import torchvision; "
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

def fashion_mnist(data_dir, train_samples=None, test_samples=None, rank=0, world_size=1):
    """TensorDatasets (train, test); each node's first process prepares its disk, all check they hold the same."""
    first_here = int(os.environ.get("LOCAL_RANK", rank)) == 0
    check_together(prepare_fashion_mnist(data_dir) if first_here else None, rank, world_size)
    def load():
        paths, splits = find_files(data_dir), []
        for images, labels, n in ((paths[0], paths[1], train_samples), (paths[2], paths[3], test_samples)):
            pixels = read_idx(images, (28, 28))[:n].float() / 255
            splits.append(TensorDataset(((pixels - MEAN) / STD).unsqueeze(1), read_idx(labels, ())[:n].long()))
        return splits
    data, problem = problem_of(load)
    check_together(problem, rank, world_size, same=data and ", ".join(
        f"{len(d)} images, labels crc {zlib.crc32(d.tensors[1].numpy().tobytes())}" for d in data))
    return data

class SeededImages(torch.utils.data.Dataset):
    """Any dataset whose transforms draw random numbers, drawing them from (seed, epoch, index): each image
    augmented alike at any world size, with any number of workers, and after a resume. The epoch lives in
    shared memory: the sampler sets it, and the workers (which hold copies of this object) see it."""
    def __init__(self, dataset, seed):
        self.dataset, self.seed, self.epoch = dataset, seed, torch.zeros(1, dtype=torch.int64).share_memory_()

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        with torch.random.fork_rng(devices=[]):   # the caller's generator as it was
            key = f"{self.seed} {int(self.epoch)} {index}".encode()   # any --seed, to the 64 bits manual_seed takes
            torch.default_generator.manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big"))
            return self.dataset[index]

def image_folders(data_dir, image_size, channels, augment, seed, train_samples, test_samples, rank=0, world_size=1):
    """ImageFolders of data_dir/train (randomly cropped and flipped, SeededImages) and data_dir/val; N samples
    of a folder are spread over it evenly (its files are sorted by class)."""
    from torchvision import datasets, transforms as T
    mean, std = ((MEAN,), (STD,)) if channels == 1 else ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    finish = [T.Grayscale(channels), T.ToTensor(), T.Normalize(mean, std)]
    fixed = T.Compose([T.Resize(image_size), T.CenterCrop(image_size)] + finish)
    random = T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()] + finish)
    def load():
        made = []
        for split, transform, n in (("train", random if augment else fixed, train_samples),
                                    ("val", fixed, test_samples)):
            try:
                made.append(datasets.ImageFolder(os.path.join(data_dir, split), transform, loader=read_image))
            except (FileNotFoundError, OSError) as e:   # no class folders, a class without images
                sys.exit(f"error: {os.path.join(data_dir, split)}: {e}")
            if n and n < len(made[-1].samples):
                made[-1].samples = [made[-1].samples[i * len(made[-1].samples) // n] for i in range(n)]
                made[-1].targets = [label for _, label in made[-1].samples]
        if made[0].classes != made[1].classes:
            only = " ".join(sorted(set(made[0].classes) ^ set(made[1].classes)))
            sys.exit(f"error: {data_dir}/train and {data_dir}/val have other class folders ({only} in one only): "
                     f"give both the same")
        return made
    data, problem = problem_of(load)
    names = data and " ".join(os.path.relpath(path, data_dir) for d in data for path, _ in d.samples)
    check_together(problem, rank, world_size, same=data and f"{len(data[0])} training, {len(data[1])} validation "
                   f"images of {len(data[0].classes)} classes, names crc {zlib.crc32(names.encode())}")
    return SeededImages(data[0], seed), data[1]

class UnreadableImage(Exception):   # raised in a worker, it arrives with the worker's traceback as its text
    def line(self):
        return str(self)[str(self).rfind("error: cannot read "):].strip()

def read_image(path):
    from PIL import Image
    try:
        with Image.open(path) as image:
            return image.convert("RGB")   # decodes the whole file: a truncated one fails here
    except Exception as e:
        raise UnreadableImage(f"error: cannot read {path} ({' '.join(str(e).split())[:200]}): replace or remove it")

def check_batch(global_batch, world_size, train_samples, rank):
    """The per-rank batch; one the ranks cannot share, or more than the samples, refused by rank 0."""
    problem = None
    if global_batch % world_size:
        problem = f"error: --batch-size {global_batch} does not divide by the {world_size} ranks"
    elif train_samples < global_batch:
        problem = f"error: {train_samples} training samples are fewer than --batch-size {global_batch}"
    if problem:
        sys.exit(problem if rank == 0 else 1)
    if train_samples % global_batch and rank == 0:
        print(f"note: {train_samples} training images make {train_samples // global_batch} global batches of "
              f"{global_batch} per epoch: {train_samples % global_batch} are left out of each epoch (other ones "
              f"each epoch, drawn with the order)", flush=True)
    return global_batch // world_size

# ---------------------------------------------------------------- which data, which model, which recipe
def datasets(args, rank, world_size, device):
    """(train, test, model name, classes): your images when args.data_dir holds train/ and val/, else
    Fashion-MNIST, its training set on `device`; every rank checks what its node holds."""
    folders = [s for s in ("train", "val") if os.path.isdir(os.path.join(args.data_dir, s))]
    if folders:
        arch = args.arch or "resnet18"
        size = args.image_size or (28 if arch == "fashion_resnet18" else 224)
        train_set, test_set = image_folders(args.data_dir, size, 1 if arch == "fashion_resnet18" else 3,
                                            not args.no_augment, args.seed, args.train_samples, args.test_samples,
                                            rank, world_size)
        if rank == 0:
            print(f"data: {args.data_dir}: {len(train_set)} training and {len(test_set)} validation images of "
                  f"{len(test_set.classes)} classes from disk, {size}x{size}, {args.workers} worker(s) per rank, "
                  f"{'random crop and flip' if not args.no_augment else 'no augmentation'}", flush=True)
        return train_set, test_set, arch, len(test_set.classes)
    if os.path.isdir(args.data_dir) and os.listdir(args.data_dir) and not find_files(args.data_dir):
        sys.exit(f"error: {args.data_dir} holds neither Fashion-MNIST's four IDX files nor train/ and val/ folders of "
                 f"images (one subfolder per class); point --data-dir at one of these" if rank == 0 else 1)
    if args.arch not in (None, "fashion_resnet18") or args.image_size not in (None, 28):
        sys.exit("error: Fashion-MNIST trains fashion_resnet18 on 28x28 images; for --arch or --image-size, give "
                 "an image folder" if rank == 0 else 1)
    train_set, test_set = fashion_mnist(args.data_dir, args.train_samples, args.test_samples, rank, world_size)
    if rank == 0:
        print(f"data: Fashion-MNIST in memory ({len(train_set)} training, {len(test_set)} test images)", flush=True)
    return TensorDataset(*(t.to(device) for t in train_set.tensors)), test_set, "fashion_resnet18", 10

def resnet(arch, num_classes, seed):
    """A torchvision model; fashion_resnet18 is ResNet-18 for 1x28x28 images: a 3x3 stride-1 stem and no
    max-pool, so small images are not shrunk 4x at once. The seed gives every rank the same weights."""
    import torchvision
    torch.manual_seed(seed)
    net = torchvision.models.get_model(arch.removeprefix("fashion_"), num_classes=num_classes)
    if arch == "fashion_resnet18":
        net.conv1 = torch.nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
        torch.nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")   # as torchvision's
        net.maxpool = torch.nn.Identity()
    return net

def sgd_recipe(net, lr, weight_decay, warmup_steps, total_steps):
    """SGD with momentum, a linear warm-up (large batches diverge without one), then cosine to zero; no
    weight decay on BatchNorm and biases (the 1-D parameters: decaying them only fights the normalisation)."""
    params = list(net.parameters())
    optimizer = torch.optim.SGD([{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
                                 {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}],
                                lr=lr, momentum=0.9)
    def factor(step):   # of optimizer step `step`, counted from 0
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

# ---------------------------------------------------------------- batches, and accuracy over all ranks
class ResumableSampler(DistributedSampler):
    """One order per epoch from seed + epoch; rank r's k-th batch is positions r, r+W, ... of block k of it: the
    same global batches at any world size. set_epoch(epoch, start) begins at batch `start` (a resume)."""
    def __init__(self, dataset, rank_batch, rank, world_size, seed):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.rank_batch, self.start = rank_batch, 0
    def set_epoch(self, epoch, start=0):
        super().set_epoch(epoch)
        self.start = start
        if isinstance(self.dataset, SeededImages):
            self.dataset.epoch.fill_(epoch)
    def __iter__(self):
        return iter(list(super().__iter__())[self.start * self.rank_batch:])
    def __len__(self):
        return super().__len__() - self.start * self.rank_batch

def ignore_stop_signals(worker_id):   # SLURM signals every process: the rank decides, and ends its workers
    for name in ("SIGTERM", "SIGUSR1"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)

def kill_workers():   # at exit: they ignore SIGTERM, which multiprocessing would send them and wait on for ever
    if hasattr(signal, "SIGCHLD"):   # else DataLoader's handler reports these kills as failures
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        child.kill()

class IndexTensors:
    """Batches of indices as tensors on the device of the data they index, copied from pinned memory without
    waiting (indexing with a list copies it to the GPU synchronously, once per tensor indexed)."""
    def __init__(self, batches, device):
        self.batches, self.device = batches, device
    def __iter__(self):
        for batch in self.batches:
            index = torch.tensor(batch)
            if self.device.type == "cuda":
                index = index.pin_memory()
            yield index.to(self.device, non_blocking=True)
    def __len__(self):
        return len(self.batches)

def loader(dataset, batches, device, workers=0, **options):
    """Batches of indices: in memory, one indexing each; from disk, in workers forked by a fork server that has
    imported torchvision once (a rank forked while gloo's threads hold a lock can hang)."""
    if isinstance(dataset, TensorDataset):
        return DataLoader(dataset, sampler=IndexTensors(batches, dataset.tensors[0].device), batch_size=None)
    context = None
    if workers:
        atexit.register(kill_workers)
        if sys.platform == "linux":
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["__main__", "torchvision"])   # (which imports PIL)
    return DataLoader(dataset, batch_sampler=batches, num_workers=workers, pin_memory=device.type == "cuda",
                      worker_init_fn=ignore_stop_signals, multiprocessing_context=context, **options)

def train_loader(dataset, global_batch, seed, rank, world_size, device, workers=0):
    """(loader, sampler): this rank's 1/W of every global batch; sampler.set_epoch(epoch, start) each epoch."""
    sampler = ResumableSampler(dataset, global_batch // world_size, rank, world_size, seed)
    batches = BatchSampler(sampler, global_batch // world_size, drop_last=True)
    return loader(dataset, batches, device, workers, persistent_workers=workers > 0), sampler

def test_loader(dataset, rank, world_size, device, workers=0, batch_size=500):
    """This rank's slice, each image once (DistributedSampler repeats or drops some), as many batches on all ranks."""
    mine = torch.arange(len(dataset)).tensor_split(world_size)[rank]
    chunks = [c.tolist() for c in mine.tensor_split(max(1, -(-len(dataset) // world_size // batch_size)))]
    return loader(dataset, chunks, device, min(workers, len(chunks)))

@torch.no_grad()
def accuracy(predict, batches, device, world_size):
    """[correct, count] over this rank's (X, y) batches, summed over ranks before dividing. Both counts live
    on `device` (CUDA refuses to stack a CPU tensor with its own) as integers: exact at any size."""
    totals = torch.zeros(2, device=device, dtype=torch.int64)
    for X, y in batches:
        y = y.to(device, non_blocking=True)
        totals[0] += (predict(X.to(device, non_blocking=True)).argmax(1) == y).sum()
        totals[1] += len(y)   # a Python number: added on the device, no copy
    if world_size > 1:
        dist.all_reduce(totals)
    correct, count = totals.tolist()
    return correct / count

# ---------------------------------------------------------------- a rank fails: one line from every rank
def tell_the_launcher(line):   # torchrun shows the first failed worker's error file; `record` skips SystemExit
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)

@contextlib.contextmanager
def one_line_per_rank(checkpoint=None):
    """A rank's own error (its SystemExit line, an unreadable image) goes to torchrun; a rank ending because of
    another (exit 1, a lost peer) ends a second later, so torchrun names that one. A bug keeps its traceback."""
    try:
        yield
    except (SystemExit, UnreadableImage) as e:
        line = e.line() if isinstance(e, UnreadableImage) else e.code
        if isinstance(line, str):
            tell_the_launcher(line)
        elif line == 1:   # another rank says why: this one ends a second later, so torchrun names that one
            time.sleep(1.0)
        if dist.is_initialized():   # a group left alive into the interpreter's exit can abort it (SIGABRT)
            traceback.clear_frames(e.__traceback__)   # their locals go first: a DDP wrap freeing the group can hang
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        raise SystemExit(line) from None
    except RuntimeError as e:
        words = ("gloo", "NCCL", "Connection closed", "Connection reset")
        if not dist.is_initialized() or not (isinstance(e, dist.DistError) or any(w in str(e) for w in words)):
            raise
        reason = " ".join(str(e).split()).split("] ", 1)[-1].split(". ")[0][:160]   # gloo: "[file:line] ..."
        time.sleep(1.0)
        print(f"rank {dist.get_rank()}: stopping: another rank failed or left ({reason}); " + (
            f"run again with --resume to go on from the last checkpoint, {checkpoint}"
            if checkpoint and os.path.exists(checkpoint) else "nothing was saved to resume from"), file=sys.stderr,
            flush=True)
        raise SystemExit(1) from None

def problem_of(check):   # (check(), None), or (None, the line it exits with)
    try:
        return check(), None
    except SystemExit as e:
        return None, e.code if isinstance(e.code, str) else f"error: exit status {e.code}"

def check_together(problem, rank, world_size, same=None):
    """Each rank's problem (a line or None) and `same` (equal on all) to all: one node's problem ends every rank."""
    told = [(problem, same)] * world_size
    if world_size > 1:
        dist.all_gather_object(told, (problem, same))
    problems = [p for p, _ in told]
    other = next((r for r, (_, s) in enumerate(told) if s != told[0][1]), None)   # a rank whose `same` differs
    if not any(problems) and other is not None:
        problems[0] = (f"error: rank {other} sees other data than rank 0 ({told[other][1]}; rank 0: {told[0][1]}): "
                       f"every node's --data-dir must hold the same")
    if any(problems):
        first = next(r for r, p in enumerate(problems) if p)
        if rank != first and not problems[rank]:
            print(f"rank {rank}: stopping: rank {first} cannot go on (its line says why)", file=sys.stderr, flush=True)
        if rank != first:
            raise SystemExit(1)
        alone = problems.count(problems[first]) < world_size   # some ranks only: the line names this one
        raise SystemExit(f"rank {rank} ({socket.gethostname()}): {problems[first]}" if alone else problems[first])

# ---------------------------------------------------------------- a stop that all ranks agree on
PREEMPTED = 75   # EX_TEMPFAIL, "try again later": not 0 (a finished training), not 1 (something broke)

class StopSignal:
    """SIGTERM and SIGUSR1 only note the signal; each step boundary reads the MAX of the flags sent (by a gloo
    group of its own) at the one before: all ranks stop at one step, and none waits. A rank stuck with a dead
    peer never returns to Python, where handlers run: a thread woken at once by the signal (set_wakeup_fd)
    ends it with its line unless a stop is agreed within 10 s plus three of the longest steps."""
    def __init__(self, checkpoint):
        self.signal = 0   # the number of the signal this rank noted; 0: none
        self.pending = None   # (the flag's allreduce started at the last boundary, its tensor)
        self.answer = None   # what the ranks agreed at the last boundary: a signal's name or None
        self.longest, self.boundary = 0.0, time.monotonic()   # the longest step so far, for the watchdog's grace
        self.group = dist.new_group(backend="gloo")   # the flags' own group: CPU tensors whatever the backend
        self.rank, self.wake = dist.get_rank(), None
        for name in ("SIGTERM", "SIGUSR1"):
            if hasattr(signal, name):   # Windows has no SIGUSR1
                signal.signal(getattr(signal, name), self.note)
        if os.name == "posix":
            wake_read, self.wake = os.pipe()   # the C-level handler writes each signal's number here
            os.set_blocking(self.wake, False)
            signal.set_wakeup_fd(self.wake)
            threading.Thread(target=self.watchdog, args=(wake_read, checkpoint), daemon=True).start()

    def note(self, signum, frame):
        self.signal = signum

    def watchdog(self, wake_read, checkpoint):
        while (byte := os.read(wake_read, 1)) and byte[0] != signal.SIGTERM:
            pass
        if byte:   # else the write end closed: the run is over
            time.sleep(grace := 10.0 + 3 * self.longest)
            if self.answer is None and self.group is not None:
                print(f"rank {self.rank}: stopping: SIGTERM came and the ranks did not agree to stop within "
                      f"{grace:.0f} s (another rank failed, left or hangs); --resume goes on from {checkpoint}",
                      file=sys.stderr, flush=True)
                os._exit(1)
        os.close(wake_read)

    def agreed(self, now=False):
        """The signal any rank noted a step ago (`now`: until now), or None: the same on every rank."""
        self.longest, self.boundary = max(self.longest, time.monotonic() - self.boundary), time.monotonic()
        flag = torch.tensor([0.0])
        if self.pending:
            self.pending[0].wait()
            flag = self.pending[1]
        if now and not flag.item():
            dist.all_reduce(flag := torch.tensor([float(self.signal)]), op=dist.ReduceOp.MAX, group=self.group)
        self.answer = signal.Signals(int(flag.item())).name if flag.item() else None
        flag = torch.tensor([float(self.signal)])
        self.pending = None if self.answer else (dist.all_reduce(flag, dist.ReduceOp.MAX, self.group, True), flag)
        return self.answer
    def close(self):   # nothing in flight when the groups go, and no reference that keeps gloo's threads
        if self.wake is not None:
            signal.set_wakeup_fd(-1)
            os.close(self.wake)   # ends the watchdog
            self.wake = None
        if self.pending:
            self.pending[0].wait()
        self.pending = self.group = None

def stopped(signal_name, step, checkpoint, master):
    """The agreed stop, said and handed to torchrun (which counts exit status 75 as a failure): PREEMPTED."""
    line = (f"stopped by {signal_name} at step {step}, checkpoint written; exit status {PREEMPTED} (not finished, "
            f"nothing failed): run again with --resume to go on from {checkpoint}")
    if master:
        print(line, flush=True)
    tell_the_launcher(line)
    return PREEMPTED

def sync(path):   # a file's or folder's contents to the disk (a rename is durable once its folder is synced)
    with contextlib.suppress(OSError):   # a folder cannot be opened on Windows
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

def save_atomically(write, path):
    """write(tmp), sync, rename, sync the folder: after a crash the file is the old or the new one."""
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    sync(tmp)
    os.replace(tmp, path)
    sync(os.path.dirname(os.path.abspath(path)))

# what does not change the batches or the steps (as the world size does not)
MAY_DIFFER = ("out", "checkpoint", "checkpoint_every", "resume", "max_steps", "workers", "init_timeout", "data_dir",
              "test_samples", "compile", "channels_last", "accum_steps", "backend")

def resume_check(saved, here, path, master, may_differ=MAY_DIFFER):
    """A resume goes on exactly where the checkpoint was: other training flags are refused, in one line."""
    differ = [f"{k} {saved.get(k)} there, {v} here" for k, v in here.items()
              if k not in may_differ and saved.get(k) != v]
    if differ:
        sys.exit(f"error: cannot resume from {path}: it was written with other training flags ({'; '.join(differ)}); "
                 f"use the same, or start without --resume" if master else 1)

def resume_position(saved, flags, path, steps_per_epoch, max_steps, last_step, master):
    """Where a checkpoint goes on (its flags checked), said in one line; None when nothing is left to train."""
    resume_check(saved["flags"], flags, path, master)
    position = {k: saved[k] for k in ("epoch", "batch_in_epoch", "step", "totals", "seconds")}
    if position["step"] >= min(max_steps or last_step, last_step):
        limit = f"--max-steps {max_steps}" if max_steps and max_steps < last_step else f"the last step, {last_step}"
        if master:
            print(f"nothing to train: {path} is at step {position['step']}, at or past {limit}", flush=True)
        return None
    where = (f"epoch {position['epoch']} at batch {position['batch_in_epoch']}/{steps_per_epoch}"
             if position["batch_in_epoch"] else f"epoch {position['epoch'] - 1} done")
    if master:
        print(f"resumed from {path}: {where}, step {position['step']}", flush=True)
    return position

# ---------------------------------------------------------------- the command line and the outputs
def checked(kind, positive):
    """An argparse type: a number of `kind`, above 0 (`positive`) or at least 0."""
    def parse(text):
        value = kind(text)
        if value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"must be {'positive' if positive else '0 or more'}, got {text}")
        return value
    return parse

positive_int, positive_float = checked(int, True), checked(float, True)
non_negative_int, non_negative_float = checked(int, False), checked(float, False)

def check_out_dir(out):
    """Fail before training, not after it, when the outputs cannot be written (or drawn)."""
    try:
        import matplotlib   # noqa: F401  curves.png is drawn with it at the end
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, ".write-test"), "w"):
            pass
        os.remove(os.path.join(out, ".write-test"))
    except ImportError:
        sys.exit("error: matplotlib is missing, and curves.png is drawn with it: pip install matplotlib")
    except OSError as e:
        sys.exit(f"error: cannot write to --out {out}: {e.strerror}")

class Timer:
    """Seconds since start (plus `already`, counted before a restart), after queued GPU work."""
    def __init__(self, device, already=0.0):
        self.device, self.start = device, time.perf_counter() - already
    def __call__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.start

def nbytes(*tensors):   # what a collective is handed
    return sum(t.numel() * t.element_size() for t in tensors)

def every_rank(value, world_size):
    """[rank 0's value, rank 1's, ...]: each rank's own (a device, its replicas' devices)."""
    values = [value] * world_size
    if world_size > 1:
        dist.all_gather_object(values, value)
    return values

def new_metrics(script, args, devices, backend, world_size, test_samples):
    """The record of a run (metrics.json); `devices` names one device per replica."""
    each = len(devices) // world_size
    return {"script": os.path.basename(script), "config": vars(args), "devices": [str(d) for d in devices],
            "backend": backend, "world_size": world_size, "test_samples": test_samples, "epochs": [],
            "layout": f"{world_size} process{'es' * (world_size > 1)} x {each} replica{'s' * (each > 1)}"}

def record_epoch(metrics, epoch, totals, seconds, test_acc, verbose):
    """totals: [summed loss, correct, samples], already summed over all replicas."""
    loss_sum, hits, samples = totals.tolist()
    metrics["epochs"].append(e := {"epoch": epoch, "train_loss": loss_sum / samples, "train_acc": hits / samples,
                                   "test_acc": test_acc, "samples": samples, "samples_per_s": samples / seconds,
                                   "seconds": seconds})
    if verbose:
        print(f"epoch {epoch:3d}  loss {e['train_loss']:.4f}  train acc {e['train_acc']:.4f}  test acc {test_acc:.4f}  "
              f"{e['samples_per_s']:,.0f} samples/s  {seconds:.1f} s", flush=True)

def finish(metrics, steps, seconds, state_dict, sent_per_step):
    """metrics.json, model.pt, curves.png and the closing line (rank 0); sent_per_step: bytes by collective."""
    from matplotlib.figure import Figure   # drawn without pyplot: no display, no window, no global state
    by = {k: round(v) for k, v in sent_per_step.items()}
    epochs, out = metrics["epochs"], metrics["config"]["out"]
    metrics.update(steps=steps, seconds=seconds, test_acc=epochs[-1]["test_acc"], sent_bytes_by_collective=by,
                   samples_per_s=sum(e["samples"] for e in epochs) / sum(e["seconds"] for e in epochs),
                   sent_bytes_per_step=sum(by.values()))
    save_atomically(lambda tmp: open(tmp, "w").write(json.dumps(metrics, indent=1)), f"{out}/metrics.json")
    weights = {k: v.detach().cpu() for k, v in state_dict.items()}
    save_atomically(lambda tmp: torch.save(weights, tmp), f"{out}/model.pt")
    fig = Figure(figsize=(9, 3.5))
    ax_loss, ax_acc = fig.subplots(1, 2)
    for ax, key, style in ((ax_loss, "train_loss", "o-"), (ax_acc, "train_acc", "o-"), (ax_acc, "test_acc", "s-")):
        ax.plot([e["epoch"] for e in epochs], [e[key] for e in epochs], style, label=key.replace("_", " "))
        ax.set_xlabel("epoch"), ax.grid(alpha=0.3), ax.legend()
    fig.suptitle(f"{metrics['script']}: {len(metrics['devices'])} x {metrics['devices'][0]} ({metrics['backend']})")
    fig.tight_layout()
    save_atomically(lambda tmp: fig.savefig(tmp, format="png", dpi=100), f"{out}/curves.png")
    print(f"done: {steps} steps on {len(metrics['devices'])} x {'+'.join(sorted(set(metrics['devices'])))} "
          f"({metrics['backend']}, {metrics['layout']}): test acc {metrics['test_acc']:.4f} on "
          f"{metrics['test_samples']} test samples, {metrics['samples_per_s']:,.0f} samples/s, {seconds:.1f} s, "
          f"{metrics['sent_bytes_per_step'] / 1e6:.3g} MB to collectives per step and rank; "
          f"wrote {out}/{{metrics.json,curves.png,model.pt}}", flush=True)
