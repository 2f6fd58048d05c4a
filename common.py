"""What the scripts share and a user rarely edits: the device and the group, the data and its
loaders, a stop every rank agrees on, where a run is, atomic writes and the outputs.

Importing it defines names and does nothing else.
"""
import argparse, contextlib, dataclasses, datetime, difflib, functools, gc, glob, hashlib
import importlib.util
import json, math, multiprocessing, os, pathlib, re, signal, socket, subprocess, sys, time
import traceback
import torch
import torch.distributed as dist
# Imported before any group exists. Imported after one (as DDP, torch.compile and torchvision
# import it), its functions keep that group as a default argument past destroy_process_group,
# and gloo's threads then abort the interpreter's exit.
import torch.distributed.nn  # noqa: F401
from torch.distributed.rendezvous import rendezvous
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Subset
from torch.utils.data import TensorDataset


# ---------------------------------------------------------------- the device and the group
def ranks_from_srun():
    """Inside an srun step of several tasks and without torchrun's variables, the step's tasks as
    torchrun's ranks: srun then starts one group, not a training per task. An sbatch or salloc
    shell sets SLURM_NTASKS too, but no SLURM_STEP_NUM_TASKS."""
    env = os.environ
    if "RANK" in env or env.get("SLURM_STEP_NUM_TASKS", "1") == "1":
        return
    # "2(x3),1": two tasks on each of the step's first three nodes, one on the fourth.
    tasks_per_node = []
    for tasks, nodes in re.findall(r"(\d+)(?:\(x(\d+)\))?", env["SLURM_STEP_TASKS_PER_NODE"]):
        tasks_per_node += [tasks] * int(nodes or 1)
    # Rank 0's node is the step's first, at the address SLURM uses for it (NodeAddr): a hostname
    # may resolve to a loopback address. scontrol shows the nodes in the step's order.
    nodes = subprocess.check_output(["scontrol", "show", "node", env["SLURM_STEP_NODELIST"]],
                                    text=True)
    # A port of the job and the step, below Linux's ephemeral ports (32768 and up): two jobs on
    # one node, or two steps of one job, rarely share one.
    port = 10000 + (int(env["SLURM_JOB_ID"]) + 1000 * int(env["SLURM_STEP_ID"])) % 20000
    env.update(RANK=env["SLURM_PROCID"], LOCAL_RANK=env["SLURM_LOCALID"],
               WORLD_SIZE=env["SLURM_STEP_NUM_TASKS"],
               LOCAL_WORLD_SIZE=tasks_per_node[int(env["SLURM_NODEID"])],
               MASTER_ADDR=re.search(r"NodeAddr=(\S+)", nodes)[1], MASTER_PORT=str(port))


def default_to_one_process():
    """Inside an srun step of several tasks, its tasks; else, started without a launcher, a group
    of one, on a port the OS picks."""
    ranks_from_srun()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="0")


def pick_device(backend, gpus_each=1, cuda=None):
    """This process's device: the first of its `gpus_each` GPUs on its node, or the CPU."""
    processes_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    rank = os.environ.get("RANK", 0)
    if cuda is None:
        cuda = torch.cuda.is_available()
    if not cuda:
        if backend == "nccl":
            sys.exit(f"rank {rank}: error: --backend nccl needs GPUs, and this machine has none")
        # torchrun sets OMP_NUM_THREADS=1; started otherwise, the ranks of a node share its cores.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, torch.get_num_threads() // processes_here))
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    # A launcher that shows each process its own GPUs alone (srun --gpus-per-task) numbers them
    # from 0 in every process.
    if gpus == gpus_each and os.environ.get("CUDA_VISIBLE_DEVICES"):
        processes_here, local_rank = 1, 0
    if backend == "nccl" and processes_here * gpus_each > gpus:
        sys.exit(f"rank {rank}: error: {processes_here} processes x {gpus_each} GPUs on this node, "
                 f"which has {gpus}; start at most one per GPU, or let them share: --backend gloo")
    device = torch.device("cuda", local_rank * gpus_each % gpus)
    torch.cuda.set_device(device)
    return device


def one_rank_per_gpu(device):
    """Refuses two ranks of an NCCL group on one GPU, in one line that names the host and the GPU,
    before NCCL's own "Duplicate GPU detected", whatever CUDA_VISIBLE_DEVICES showed each process.
    Asked over a gloo group of its own: the first NCCL call would fail first."""
    group = dist.new_group(backend="gloo")
    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    gpus = every_rank(mine, dist.get_world_size(), group)
    dist.destroy_process_group(group)
    first = {}
    for rank, gpu in enumerate(gpus):
        first.setdefault(gpu, rank)
    shared = [(first[gpu], rank, gpu) for rank, gpu in enumerate(gpus) if first[gpu] != rank]
    if shared:
        earlier, rank, (host, gpu) = shared[0]
        sys.exit(f"rank {earlier}: error: ranks {earlier} and {rank} are both on GPU {gpu} of "
                 f"{host}: start at most one process per GPU, or let them share it: --backend "
                 f"gloo" if dist.get_rank() == earlier else 1)


def attempt_store():
    """torchrun's store (env://), with this attempt's keys apart from the last attempt's, whose
    addresses are gone: without it, a restart under torchrun --max-restarts connects to them and
    fails. Each node's agent counts its restarts alone (pytorch#135712): on several nodes, let the
    scheduler restart a job."""
    store, _, _ = next(rendezvous("env://", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])))
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)


@contextlib.contextmanager
def leaving_the_group():
    """Runs the training, then leaves the process group, whether it ended, stopped or failed."""
    try:
        yield
    except BaseException as e:
        # Its frames hold the DDP wrap and the loaders. Cleared now, the loaders end their workers
        # at once: left to the garbage collector, torch's queues close before the workers are
        # told, and the exit waits for them for ever (they ignore SIGTERM). Freed only after the
        # group, the wrap could hang (torch 2.9).
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        # A group still alive at the interpreter's exit can abort it. Its last users go first:
        # a DDP wrap is a cycle of references, which only the collector frees.
        if dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()


def every_rank(value, world_size, group=None):
    """[rank 0's value, rank 1's, ...], on every rank."""
    values = [None] * world_size
    dist.all_gather_object(values, value, group=group)
    return values


def load_on_every_rank(load, world_size):
    """load() on each node's first process, then on its others, so that a download happens once a
    node. A refusal (SystemExit) on any rank ends every rank at once; that rank says why. The
    ranks that wait for a load wait as long as it takes, on a gloo group of their own: a scan of
    a million files on network storage can outlast the default group's timeout (NCCL's: 10
    minutes)."""
    # A day: a load is as slow as the storage. A rank that dies still ends the wait at once, as
    # gloo sees its connection close.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1))
    loaded = problem = None
    for first in (True, False):
        if (os.environ.get("LOCAL_RANK", "0") == "0") == first:
            try:
                loaded = load()
            except SystemExit as e:
                problem = e.code
        failed = [rank for rank, p in enumerate(every_rank(problem, world_size, group)) if p]
        if failed:
            sys.exit(problem or f"stopping: rank {failed[0]} cannot go on (its line says why)")
    dist.destroy_process_group(group)
    return loaded


# ---------------------------------------------------------------- data: Fashion-MNIST, images
# The mean and standard deviation of Fashion-MNIST's training images: inputs near 0, spread 1.
MEAN, STD = 0.2860, 0.3530


def fashion_mnist(data_dir=None, train_samples=None, test_samples=None):
    """(training set, test set, 10): torchvision's FashionMNIST, the first N images of each,
    normalised. It is downloaded only into the default folder, ./data: a folder you name, a
    mistyped one too, is never filled."""
    from torchvision.datasets import FashionMNIST
    raw = os.path.join(data_dir or "data", "FashionMNIST", "raw")
    if data_dir and not os.path.isdir(data_dir):
        found = "is not a folder" if os.path.exists(data_dir) else "does not exist"
        sys.exit(f"error: --data-dir {data_dir} {found}")
    if data_dir and not os.path.isdir(raw):
        sys.exit(f"error: --data-dir {data_dir} holds neither Fashion-MNIST ({raw}) nor, for the "
                 f"ResNet scripts, train/ and val/ (a subfolder of images per class)")
    sets = []
    for train, n in ((True, train_samples), (False, test_samples)):
        try:
            data = FashionMNIST(data_dir or "data", train=train, download=not data_dir)
        except Exception as e:
            sys.exit(f"error: cannot read Fashion-MNIST in {os.path.abspath(raw)} ({one_line(e)})."
                     f" Do one of:\n- bash run_all.sh (as root on Debian or Ubuntu it unpacks"
                     f" dataset-fashion-mnist there)\n- on a machine with internet: python -c"
                     f" \"import torchvision; torchvision.datasets.FashionMNIST('data',"
                     f" download=True)\", then copy data/ here")
        # Normalised in place: no temporary copies of 190 MB.
        images = data.data[:n].float().div_(255).sub_(MEAN).div_(STD)
        sets.append(TensorDataset(images.unsqueeze(1), data.targets[:n]))
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"data: Fashion-MNIST from {os.path.abspath(raw)}", flush=True)
    return sets[0], sets[1], 10


def image_folders(data_dir, train_transforms, test_transforms, train_samples=None,
                  test_samples=None):
    """(training set, test set, number of classes) of `data_dir`/train and `data_dir`/val, one
    subfolder of images per class (torchvision's ImageFolder). Each set's transforms are followed
    by ToTensor and a normalisation: Fashion-MNIST's for gray images, ImageNet's for colour ones.
    Every image is read in the mode of the first one."""
    from torchvision import transforms as T
    from torchvision.datasets import ImageFolder
    folders = []
    for split in ("train", "val"):
        try:
            folders.append(ImageFolder(os.path.join(data_dir, split)))
        except OSError as e:
            # No class folders, or a class without images: torchvision's message names it.
            sys.exit(f"error: {os.path.join(data_dir, split)}: {e}")
    train, val = folders
    if train.classes != val.classes:
        sys.exit(f"error: {data_dir}/train and {data_dir}/val have other class folders "
                 f"({' '.join(sorted(set(train.classes) ^ set(val.classes)))} in one only)")
    mode = read_image(train.samples[0][0]).mode
    normalize = T.Normalize((MEAN,), (STD,))
    if mode == "RGB":
        normalize = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    sets = []
    for folder, transforms, n in ((train, train_transforms, train_samples),
                                  (val, test_transforms, test_samples)):
        folder.loader = functools.partial(read_image, mode=mode)
        folder.transform = T.Compose(transforms + [T.ToTensor(), normalize])
        # N images spread over the classes: a folder's images are sorted by class.
        if n and n < len(folder):
            folder = Subset(folder, [i * len(folder) // n for i in range(n)])
        sets.append(folder)
    return sets[0], sets[1], len(train.classes)


def read_image(path, mode=None):
    """The image at `path` in `mode`, else gray or RGB as it is. PIL's errors do not all name the
    file; these do."""
    from PIL import Image
    try:
        with Image.open(path) as image:
            # A truncated file fails here, where its pixels are read.
            return image.convert(mode or ("L" if image.mode in ("1", "L") else "RGB"))
    except Exception as e:
        raise RuntimeError(f"error: cannot read {path} ({one_line(e)}): replace or remove it")


def one_line(error, limit=200):
    """An error's message on one line, at most `limit` characters (cut ones end with "...")."""
    text = " ".join(str(error).split())
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return text


def check_batch(global_batch, world_size, train_samples, rank, asked=None):
    """The per-rank batch, or a refusal in one line (said by rank 0) when it cannot be made."""
    if asked and train_samples > asked and rank == 0:
        print(f"note: datasets() gave {train_samples} training samples: it does not apply "
              f"--train-samples {asked}", flush=True)
    if global_batch % world_size:
        sys.exit(f"error: --batch-size {global_batch} does not divide by the {world_size} ranks"
                 if rank == 0 else 1)
    if train_samples < global_batch:
        sys.exit(f"error: {train_samples} training samples are fewer than --batch-size "
                 f"{global_batch}" if rank == 0 else 1)
    return global_batch // world_size


# ---------------------------------------------------------------- batches
class Seeded(Dataset):
    """`dataset`'s items, each drawn with torch's generator seeded from (seed, epoch, index): the
    same augmentation at any world size and number of workers, and after a resume. The epoch sits
    in memory the workers share."""
    def __init__(self, dataset, seed):
        self.dataset, self.seed = dataset, seed
        self.epoch = torch.zeros(1, dtype=torch.int64).share_memory_()

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        # The caller's generator is left as it was.
        with torch.random.fork_rng(devices=[], device_type="cpu"):
            torch.default_generator.manual_seed(seed_from(self.seed, int(self.epoch), index))
            return self.dataset[index]


def seed_from(*numbers):
    """A seed for torch's generators from any numbers (any --seed too), hashed to the 64 bits
    manual_seed takes: other numbers, unrelated draws."""
    key = hashlib.blake2b(" ".join(map(str, numbers)).encode(), digest_size=8)
    return int.from_bytes(key.digest(), "big")


def seed_the_step(seed, step, micro_batch):
    """Seeds what a micro-batch's forward and backward draw (dropout, stochastic depth, mixup) from
    (seed, step, its number among all ranks' micro-batches), on the CPU and this process's GPU: a
    resume draws what the run never stopped would have, and the draws follow the images wherever
    the same micro-batches are cut. Not the generators' states in the checkpoint: those are a
    rank's, and would not survive another world size. A GPU generator's seed is set on the host:
    it waits for nothing."""
    seed = seed_from(seed, "step", step, micro_batch)
    torch.default_generator.manual_seed(seed)
    # Not torch.manual_seed, which queues a call for every kind of device torch knows (0.25 ms).
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


class ResumableSampler(DistributedSampler):
    """One order per epoch from seed and epoch; rank r's k-th batch is positions r, r+W, ... of
    block k of it: the same global batches at any world size. set_epoch(epoch, start) begins at
    batch `start`, for a resume."""
    def __init__(self, dataset, rank_batch, rank, world_size, seed):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                         drop_last=True)
        self.rank_batch, self.start = rank_batch, 0

    def set_epoch(self, epoch, start=0):
        super().set_epoch(epoch)
        self.start = start
        if isinstance(self.dataset, Seeded):
            self.dataset.epoch.fill_(epoch)

    def __iter__(self):
        return iter(list(super().__iter__())[self.start * self.rank_batch:])

    def __len__(self):
        return super().__len__() - self.start * self.rank_batch


# Windows has no SIGUSR1.
STOP_SIGNALS = [getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name)]


def ignore_stop_signals(worker_id):
    """A loader worker's start. SLURM signals every process of a job: the rank decides when to
    stop, and its loaders end their workers."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def loader(dataset, batches, device, workers=0, **options):
    """Batches in pinned memory for the GPU, each copied as the step begins, without waiting.
    Tensors in memory: one indexing a batch. Any other Dataset: read by `workers` processes,
    forked by a fork server that has imported torchvision once (a worker forked from a rank whose
    gloo threads hold a lock can hang). Its workers end when the loader is freed."""
    pin = device.type == "cuda"
    if isinstance(dataset, TensorDataset):
        return DataLoader(dataset, sampler=batches, batch_size=None, pin_memory=pin)
    context = None
    if workers and sys.platform == "linux":
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["__main__", "torchvision"])
    return DataLoader(dataset, batch_sampler=batches, num_workers=workers, pin_memory=pin,
                      worker_init_fn=ignore_stop_signals, multiprocessing_context=context,
                      **options)


def train_loader(dataset, global_batch, seed, rank, world_size, device, workers=0):
    """(loader, sampler): this rank's 1/W of every global batch. Call sampler.set_epoch(epoch,
    start) before each epoch."""
    if not isinstance(dataset, TensorDataset):
        dataset = Seeded(dataset, seed)
    rank_batch = global_batch // world_size
    sampler = ResumableSampler(dataset, rank_batch, rank, world_size, seed)
    batches = BatchSampler(sampler, rank_batch, drop_last=True)
    return loader(dataset, batches, device, workers, persistent_workers=workers > 0), sampler


def test_loader(dataset, rank, world_size, device, workers=0, batch_size=500):
    """This rank's slice of the test set, each image once over all ranks (DistributedSampler
    repeats or drops some), in as many batches on every rank."""
    mine = torch.arange(len(dataset)).tensor_split(world_size)[rank]
    chunks = mine.tensor_split(max(1, math.ceil(len(dataset) / world_size / batch_size)))
    chunks = [chunk.tolist() for chunk in chunks]
    workers = min(workers, len(chunks))
    # Its workers stay from one evaluation to the next.
    return loader(dataset, chunks, device, workers, persistent_workers=workers > 0)


class Sums(dict):
    """Running sums by name (an epoch's loss, its right answers, its samples), kept as tensors on
    the device: adding to them waits for nothing. A name that begins with "max_" keeps a largest
    value instead. total() reads them over all ranks, where the run waits anyway."""
    @classmethod
    def on(cls, device, **start):
        """The sums named in `start`, from its values: Sums.on(device, loss=0, samples=0)."""
        values = torch.tensor(list(start.values()), dtype=torch.float64, device=device)
        return cls(zip(start, values))

    def total(self):
        """{name: its sum over all ranks, or its largest}: all_reduce, which waits for them all."""
        values = torch.stack(list(self.values()))
        largest = torch.tensor([name.startswith("max_") for name in self], device=values.device)
        if dist.is_initialized():
            maxima = values.clone()
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
            dist.all_reduce(values)
            values = torch.where(largest, maxima, values)
        return dict(zip(self, values.tolist()))

    def restart(self, suffix):
        """The sums whose names end with `suffix` back to 0, on every rank."""
        for name, value in self.items():
            if name.endswith(suffix):
                value.zero_()


# The gradient's norm before clipping: summed, counted and at its largest, over the epoch and since
# the last progress line ("_line").
NORM_SUMS = dict.fromkeys(["grad_norm", "norms", "max_grad_norm", "grad_norm_line", "norms_line",
                           "max_grad_norm_line"], 0)


def add_norm(sums, norm):
    """A step's gradient norm into the epoch's sums and those since the last progress line."""
    for window in ("", "_line"):
        sums["grad_norm" + window] += norm
        sums["norms" + window] += 1
        sums["max_grad_norm" + window] = torch.maximum(sums["max_grad_norm" + window], norm)


def norms(trained, window=""):
    """The gradient norm's mean and largest, by name, from sums over all ranks: the epoch's, or
    since the last progress line (window "_line"); nothing without --clip-grad-norm."""
    if not trained.get("norms" + window):
        return {}
    return {"grad_norm": trained["grad_norm" + window] / trained["norms" + window],
            "max_grad_norm": trained["max_grad_norm" + window]}


# ---------------------------------------------------------------- the model
@contextlib.contextmanager
def evaluating(model):
    """`model` in evaluation mode inside; after, each of its modules in the mode it was in before,
    not the whole model in training mode: a part you put in eval mode (a frozen BatchNorm, which
    keeps its statistics) stays in it."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    yield
    for module, training in modes.items():
        module.training = training


def classifier(arch, classes, channels=3, image_size=224, **options):
    """torchvision's classification model `arch` (resnet18, efficientnet_b0, ...; none of its
    weights: nothing is downloaded) for `channels` x `image_size` images, or a refusal in one line
    with what would work. `options` are torchvision's (zero_init_residual, dropout, ...). Seed
    torch first: the same seed, the same weights."""
    import torchvision
    models = torchvision.models.list_models(module=torchvision.models)
    try:
        if arch not in models:
            close = ", ".join(difflib.get_close_matches(arch, models, 3, 0.5)) or "none"
            raise ValueError(f"not one of torchvision's classification models (closest: {close}; "
                             f"all: torchvision.models.list_models(module=torchvision.models))")
        net = tried(arch, classes, channels, image_size, dict(options))
    except Exception as e:
        why = one_line(e)
        # The smallest image size it takes, tried on the meta device: no memory, no time.
        sizes = [n for n in (32, 64, 128, 224, 299) if n > image_size and arch in models
                 and fits(arch, classes, channels, n, options)]
        if sizes:
            n = sizes[0]
            why += f" (it takes {n}x{n} images; image folders: --image-size {n})"
        sys.exit(f"error: --arch {arch} for {channels}x{image_size}x{image_size} images: {why}"
                 if int(os.environ.get("RANK", 0)) == 0 else 1)
    return net.train()


def tried(arch, classes, channels, image_size, options):
    """torchvision's `arch` for these images, tried on two blank ones. Its stem, the first
    convolution, takes `channels`; up to 64 pixels it keeps the image's size (3x3, stride 1, and no
    ResNet max-pool), where torchvision's would shrink 32x32 to 8x8 at once. ViT and MaxViT are
    built for the image size instead, and their stem, which cuts the image into patches, stays.
    GoogLeNet and Inception v3 are built without the auxiliary outputs their training forward
    would return."""
    import torchvision
    fixed = arch.startswith(("vit_", "maxvit"))
    if arch.startswith("vit_"):
        options["image_size"] = image_size
    if arch.startswith("maxvit"):
        options["input_size"] = (image_size, image_size)
    if arch in ("googlenet", "inception_v3"):
        options.update(aux_logits=False, init_weights=True)
    net = torchvision.models.get_model(arch, weights=None, num_classes=classes, **options)
    name, stem = next((n, m) for n, m in net.named_modules() if isinstance(m, torch.nn.Conv2d))
    small = image_size <= 64 and not fixed
    if small or channels != 3:
        shape = (stem.kernel_size, stem.stride, stem.padding)
        if small:
            shape = (3, 1, 1)
        net.set_submodule(name, torch.nn.Conv2d(channels, stem.out_channels, *shape,
                                                bias=stem.bias is not None))
        # As torchvision initialises a ResNet's.
        torch.nn.init.kaiming_normal_(net.get_submodule(name).weight, mode="fan_out",
                                      nonlinearity="relu")
    if small and hasattr(net, "maxpool"):
        net.maxpool = torch.nn.Identity()
    # Two blank images, in evaluation mode (nothing drawn, no statistics moved): a model that
    # cannot take these images is refused now, not at the first step.
    with torch.no_grad():
        logits = net.eval()(torch.zeros(2, channels, image_size, image_size))
    if logits.shape != (2, classes):
        raise ValueError(f"it gives {tuple(logits.shape)} for 2 images")
    return net


def fits(arch, classes, channels, image_size, options):
    """Whether `arch` takes such images, tried on the meta device (no weights are made)."""
    try:
        with torch.device("meta"):
            tried(arch, classes, channels, image_size, dict(options))
    except Exception:
        return False
    return True


# ---------------------------------------------------------------- a stop every rank agrees on
# EX_TEMPFAIL, "try again later": not 0 (a finished training), not 1 (something broke).
PREEMPTED = 75


class StopSignal:
    """SIGTERM and SIGUSR1 only note the signal. The ranks vote on a gloo group of their own (CPU
    tensors, whatever the backend) for the largest signal any of them noted, and for a progress
    line rank 0 asks for. vote() starts a step's vote without waiting and reads the last step's,
    which has long arrived: every rank stops, or prints, after the same step, and no step waits
    for the others. agreed() votes and waits, where the run waits anyway. A rank stuck with a dead
    peer never votes: it is the scheduler's to kill."""
    # The signal this process received; 0: none. Kept on the class: a handler holds no group.
    noted = 0

    def __init__(self):
        StopSignal.noted = 0
        self.group = dist.new_group(backend="gloo")
        self.ballot = self.counting = None
        for signum in STOP_SIGNALS:
            signal.signal(signum, StopSignal.note)

    @staticmethod
    def note(signum, frame):
        StopSignal.noted = signum

    def vote(self, line=False):
        """The last step's vote, the same on every rank: (the name of a signal, or None; whether
        to print a line). This step's vote starts, without waiting; `line`: this rank asks for
        one."""
        last = self.count()
        self.ballot = torch.tensor([StopSignal.noted, int(line)])
        self.counting = dist.all_reduce(self.ballot, op=dist.ReduceOp.MAX, group=self.group,
                                        async_op=True)
        return last

    def count(self):
        """The vote under way, counted (it waits only if the vote has not arrived yet); without
        one, (None, False)."""
        if self.counting is None:
            return None, False
        self.counting.wait()
        self.counting = None
        signum, line = self.ballot.tolist()
        if signum == 0:
            return None, bool(line)
        return signal.Signals(signum).name, bool(line)

    def agreed(self):
        """The name of a signal any rank noted, or None: voted now, and waited for."""
        self.vote()
        signalled, _ = self.count()
        return signalled


def say_stopped(signalled, step, checkpoint, master):
    if master:
        print(f"stopped by {signalled} at step {step}, checkpoint written; exit status 75 (not "
              f"finished, nothing failed): run again with --resume to go on from {checkpoint}",
              flush=True)


# ---------------------------------------------------------------- where a run is, and its resume
@dataclasses.dataclass
class Position:
    """Where a run is: `step` optimizer steps done, `batch_in_epoch` of them in `epoch`, with the
    epoch's sums over all ranks and its seconds so far. A checkpoint keeps one."""
    epoch: int = 1
    batch_in_epoch: int = 0
    step: int = 0
    # Sums.total() of the epoch so far: set only inside an epoch.
    sums: dict = None
    seconds: float = 0.0

    def where(self, steps_per_epoch):
        if self.batch_in_epoch:
            return f"epoch {self.epoch} at batch {self.batch_in_epoch}/{steps_per_epoch}"
        return f"epoch {self.epoch - 1} done"


def check_keys(state, wanted, script):
    """Refuses a checkpoint of another page, naming it, or one without the keys this page reads, in
    one line that names them and those it holds instead."""
    written_by = state.get("script", script)
    if written_by != script:
        raise ValueError(f"it was written by {written_by}, which keeps other state: resume it with "
                         f"{written_by}, or start {script} without --resume")
    missing = wanted - state.keys()
    if missing:
        raise ValueError(f"it lacks {', '.join(sorted(missing))} and holds "
                         f"{', '.join(sorted(state.keys() - wanted))}: it was written by another "
                         f"script, or by an older version of this one")


def states(things):
    """What a checkpoint keeps of `things` (the model, its optimizer, the schedule, and yours): each
    one's state and its kind, by name."""
    return {name: {"kind": type(thing).__name__, "state": thing.state_dict()}
            for name, thing in things.items()}


def load_states(things, saved, path, master):
    """Each of `things` loads its state from `saved` (what states() kept), by name; one of another
    kind (an AdamW's state for an SGD, another model's weights), or none, is refused in one line."""
    for name, thing in things.items():
        kept = saved.get(name, {"kind": "nothing"})
        try:
            if kept["kind"] != type(thing).__name__:
                raise TypeError(f"{kept['kind']} there, {type(thing).__name__} here")
            thing.load_state_dict(kept["state"])
        except Exception as e:
            sys.exit(f"error: cannot resume from {path}: its {name} is not this run's "
                     f"({one_line(e)})" if master else 1)


def resume_check(saved, here, path, master):
    """Refuses, in one line, a checkpoint written with other training flags."""
    differ = [f"{k} {saved.get(k)} there, {v} here" for k, v in here.items() if saved.get(k) != v]
    if differ:
        sys.exit(f"error: cannot resume from {path}: it was written with other training flags "
                 f"({'; '.join(differ)}); use the same, or start without --resume" if master else 1)


def resume_position(saved, flags, path, final_step, master):
    """The position a checkpoint holds, or None when this run has nothing left to train: its
    training flags compared first, before anything is loaded."""
    # The micro-batches may be cut otherwise: the run then goes on close to the same.
    resume_check({**saved["flags"], "micro_batches": flags.get("micro_batches")}, flags, path,
                 master)
    position = Position(**saved["position"])
    if position.step >= final_step:
        if master:
            print(f"nothing to train: {path} is at step {position.step}, and this run ends at step "
                  f"{final_step}")
        return None
    return position


def say_resumed(saved, flags, path, position, steps_per_epoch, master):
    """Rank 0's line once a checkpoint is loaded, and a note if its micro-batches were cut
    otherwise."""
    before, now = saved["flags"].get("micro_batches"), flags.get("micro_batches")
    if master:
        print(f"resumed from {path}: {position.where(steps_per_epoch)}, step {position.step}",
              flush=True)
    if master and before != now:
        print(f"note: each global batch is now cut into {now} micro-batch(es), {before} before: "
              f"BatchNorm's statistics and what the step draws (dropout, ...) go on close to, not "
              f"the same as, a run never stopped (the same ranks x --accum-steps keep them the "
              f"same)", flush=True)
    return position


# ---------------------------------------------------------------- files
def fsync(path):
    """A file's or folder's contents to disk: a rename is durable once its folder is synced."""
    # A folder cannot be opened on Windows, nor synced on some file systems.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_atomically(write, path):
    """write(tmp), fsync, rename, fsync the folder: after a crash the file is the old one or the
    new one. A failed write removes its temporary file; a killed one's goes at the next save."""
    # Each is as large as the file: retries would fill the disk.
    for left in glob.glob(f"{glob.escape(path)}.tmp[0-9]*"):
        os.remove(left)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync(os.path.dirname(os.path.abspath(path)))


# ---------------------------------------------------------------- the command line
def checked(kind, positive):
    """An argparse type: a finite number of `kind`, above 0 if `positive`, else at least 0."""
    def parse(text):
        value = kind(text)
        # nan passes every comparison, and inf overflows what is computed from it.
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(
                f"must be {'positive' if positive else '0 or more'}, got {text}")
        return value
    # argparse then says "invalid int value: 'abc'".
    parse.__name__ = kind.__name__
    return parse


positive_int, positive_float = checked(int, True), checked(float, True)
non_negative_int, non_negative_float = checked(int, False), checked(float, False)


def every(text):
    """An argparse type: "100" (steps), "10s" (seconds) or "0" (never)."""
    if not re.fullmatch(r"\d+s?", text):
        raise argparse.ArgumentTypeError(f"a number of steps (100) or of seconds (10s), got {text}")
    return text


def flags_of(group, args):
    """The values in `args` of the flags defined in the argparse group `group`."""
    return {action.dest: getattr(args, action.dest) for action in group._group_actions}


# ---------------------------------------------------------------- time, bytes and the outputs
class Timer:
    """Seconds since it started, plus `already` (counted before a restart), once the GPU's queued
    work is done."""
    def __init__(self, device, already=0.0):
        self.device = device
        self.start = time.perf_counter() - already

    def __call__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.start


class Progress:
    """Rank 0's line inside an epoch: the step of the run's, the epoch's loss and accuracy so far
    over all ranks, the learning rate, samples/s since the last line (or the epoch's start), the
    time spent and left. Every N steps (`every` "100") or N seconds ("10s": rank 0's clock, which
    the stop vote carries to the other ranks); "0": none."""
    def __init__(self, every, step, final_step, global_batch, master):
        self.seconds = float(every[:-1]) if every.endswith("s") else 0.0
        self.steps = 0 if every.endswith("s") else int(every)
        self.final_step, self.global_batch, self.master = final_step, global_batch, master
        self.first_step = self.last_step = step
        self.started = self.last_time = self.asked_at = time.perf_counter()

    def asks(self):
        """Whether rank 0 asks for a line after this step: it last asked `seconds` ago. (The line
        comes a step later, when the vote that carries the ask is read.)"""
        now = time.perf_counter()
        if not (self.master and self.seconds > 0 and now - self.asked_at >= self.seconds):
            return False
        self.asked_at = now
        return True

    def due(self, step, voted):
        """Whether this step prints: every N steps, or when the vote says rank 0 asked."""
        if self.steps:
            return step % self.steps == 0
        return voted

    def new_epoch(self, step):
        """An epoch starts at `step`: the next line's samples/s counts from here, not the
        evaluation and checkpoint before it."""
        self.last_step, self.last_time = step, time.perf_counter()

    def spent(self):
        """Seconds since the loop started."""
        return time.perf_counter() - self.started

    def say(self, here, trained, lr, **fields):
        """The line, from rank 0: `trained` is the epoch's sums so far over all ranks (with the
        gradient's norms, their mean and largest since the last line); `fields` are a page's own
        numbers, by name (top5=0.93)."""
        fields = {**norms(trained, "_line"), **fields}
        now = time.perf_counter()
        rate = (here.step - self.last_step) * self.global_batch / (now - self.last_time)
        spent = now - self.started
        left = spent / (here.step - self.first_step) * (self.final_step - here.step)
        self.last_step, self.last_time = here.step, now
        more = "".join(f"  {name.replace('_', ' ')} {value:.4g}" for name, value in fields.items())
        if self.master:
            print(f"  step {here.step:{len(str(self.final_step))}d}/{self.final_step}  epoch "
                  f"{here.epoch}  loss {trained['loss'] / trained['samples']:.4f}  acc "
                  f"{trained['correct'] / trained['samples']:.4f}  lr {lr:.4g}{more}  "
                  f"{rate:,.0f} samples/s  {clock(spent)} spent, {clock(left)} left", flush=True)


def clock(seconds):
    """Seconds as h:mm:ss, or m:ss under an hour."""
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}:{minutes:02d}:{seconds:02d}"
    return f"{minutes}:{seconds:02d}"


def peak_memory(device):
    """The most GPU memory this process has held for tensors, in bytes; None on a CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device)


def nbytes(*tensors):
    """The bytes of `tensors`: what a collective is handed."""
    return sum(t.numel() * t.element_size() for t in tensors)


def new_metrics(script, args, devices, backend, world_size, test_samples):
    """metrics.json's contents, without epochs yet (`devices`: one per replica); rank 0 makes
    --out. Refuses to start without matplotlib, which draws curves.png."""
    master = int(os.environ.get("RANK", 0)) == 0
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit("error: matplotlib is not installed, and curves.png is drawn with it: "
                 "pip install -r requirements.txt" if master else 1)
    if master:
        os.makedirs(args.out, exist_ok=True)
    replicas = len(devices) // world_size
    return {"script": os.path.basename(script), "config": vars(args),
            "devices": [str(d) for d in devices], "backend": backend, "world_size": world_size,
            "test_samples": test_samples, "epochs": [],
            "layout": f"{world_size} process{'es' * (world_size > 1)} x {replicas} "
                      f"replica{'s' * (replicas > 1)}"}


def epoch_record(epoch, trained, seconds, tested):
    """An epoch's line of metrics.json, from the training's sums over all ranks (loss, correct,
    samples, and the gradient's norms: their mean and largest) and what the evaluation measured."""
    return {"epoch": epoch, "train_loss": trained["loss"] / trained["samples"],
            "train_acc": trained["correct"] / trained["samples"], **tested,
            "samples": trained["samples"], "samples_per_s": trained["samples"] / seconds,
            "seconds": seconds, **norms(trained)}


def write_outputs(metrics):
    """metrics.json and curves.png in --out, each written whole or not at all."""
    out, text = metrics["config"]["out"], json.dumps(metrics, indent=1)
    save_atomically(lambda tmp: pathlib.Path(tmp).write_text(text), f"{out}/metrics.json")
    # Drawn without pyplot: no display, no window.
    from matplotlib.figure import Figure
    epochs = metrics["epochs"]
    numbers = [e["epoch"] for e in epochs]
    fig = Figure(figsize=(9, 3.5), layout="tight")
    ax_loss, ax_acc = fig.subplots(1, 2)
    for ax, key, style in ((ax_loss, "train_loss", "o-"), (ax_loss, "test_loss", "s-"),
                           (ax_acc, "train_acc", "o-"), (ax_acc, "test_acc", "s-")):
        ax.plot(numbers, [e[key] for e in epochs], style, label=key.replace("_", " "))
        ax.set(xlabel="epoch", xlim=(numbers[0] - 0.5, numbers[-1] + 0.5))
        # Whole epochs: no tick at 2.5.
        ax.locator_params(axis="x", integer=True, min_n_ticks=1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{metrics['script']}: {len(metrics['devices'])} x {metrics['devices'][0]} "
                 f"({metrics['backend']})")
    save_atomically(lambda tmp: fig.savefig(tmp, format="png", dpi=100), f"{out}/curves.png")


def finish(metrics, steps, seconds, state_dict, sent_per_step):
    """The run's end: metrics.json, curves.png and model.pt in --out, and the closing line."""
    epochs, out = metrics["epochs"], metrics["config"]["out"]
    sent = {k: round(v) for k, v in sent_per_step.items()}
    samples_per_s = sum(e["samples"] for e in epochs) / sum(e["seconds"] for e in epochs)
    metrics.update(steps=steps, seconds=seconds, test_acc=epochs[-1]["test_acc"],
                   sent_bytes_by_collective=sent, sent_bytes_per_step=sum(sent.values()),
                   samples_per_s=samples_per_s)
    write_outputs(metrics)
    weights = {k: v.detach().cpu() for k, v in state_dict.items()}
    save_atomically(lambda tmp: torch.save(weights, tmp), f"{out}/model.pt")
    peaks = [peak for peak in metrics.get("peak_memory_bytes") or [] if peak is not None]
    memory = f", {max(peaks) / 1e9:.2f} GB peak GPU memory (the most of any rank)" if peaks else ""
    devices = metrics["devices"]
    print(f"done: {steps} steps on {len(devices)} x {'+'.join(sorted(set(devices)))} "
          f"({metrics['backend']}): test acc {metrics['test_acc']:.4f} on "
          f"{metrics['test_samples']} test samples, {samples_per_s:,.0f} samples/s, "
          f"{seconds:.1f} s, {metrics['sent_bytes_per_step'] / 1e6:.3g} MB to collectives per step "
          f"and rank{memory}; wrote {out}/{{metrics.json,curves.png,model.pt}}", flush=True)
