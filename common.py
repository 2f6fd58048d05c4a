"""What the scripts share that is not their lesson: the group, the loaders, accuracy, the stop, writes, outputs."""
import argparse, atexit, contextlib, gc, glob, hashlib, json, math, multiprocessing, os, pathlib, signal, sys, time
import traceback
import torch
import torch.distributed as dist
import torch.distributed.nn   # noqa: F401  before any group: imported after one (as DDP, torch.compile, torchvision
# do), its functions keep it as a default argument past destroy_process_group, and gloo's threads abort the exit
from torch.distributed.rendezvous import rendezvous
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, TensorDataset
from matplotlib.figure import Figure   # curves.png, drawn without pyplot: no display, no window

# ---------------------------------------------------------------- the device and the group
def default_to_one_process():   # no launcher: a group of one, on any free port
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="0")

def pick_device(backend, gpus_each=1, cuda=None):
    here, local_rank = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        if backend == "nccl":
            sys.exit(f"rank {os.environ.get('RANK', 0)}: error: --backend nccl needs GPUs, and this machine has none")
        if "OMP_NUM_THREADS" not in os.environ:   # torchrun sets 1; started otherwise, a node's ranks share its cores
            torch.set_num_threads(max(1, torch.get_num_threads() // here))
        return torch.device("cpu")
    if torch.cuda.device_count() == gpus_each and os.environ.get("CUDA_VISIBLE_DEVICES"):
        here, local_rank = 1, 0   # the launcher shows each process its own GPUs alone (srun --gpus-per-task): 0 .. K-1
    if backend == "nccl" and here * gpus_each > torch.cuda.device_count():
        sys.exit(f"rank {os.environ['RANK']}: error: {here} processes x {gpus_each} GPUs on this node, which has "
                 f"{torch.cuda.device_count()}; start at most one per GPU, or let them share: --backend gloo")
    device = torch.device("cuda", local_rank * gpus_each % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device

def attempt_store():
    """torchrun's store (env://), this attempt's keys apart from the last one's, whose addresses are gone. Each
    node's agent counts its restarts alone (pytorch#135712): on several nodes, let the scheduler restart a job."""
    store, _, _ = next(rendezvous("env://", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])))
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)

@contextlib.contextmanager
def leaving_the_group():
    try:
        yield
    except BaseException as e:   # its frames hold the DDP wrap: freed after the group, it could hang (torch 2.9)
        traceback.clear_frames(e.__traceback__)
        raise
    finally:   # a group alive at the interpreter's exit can abort it
        if dist.is_initialized():
            gc.collect()   # the group's last users first: a DDP wrap is a cycle of references, freed only by gc
            dist.destroy_process_group()

def every_rank(value, world_size):   # [rank 0's value, rank 1's, ...]
    values = [None] * world_size
    dist.all_gather_object(values, value)
    return values

def load_on_every_rank(load, world_size):
    """load() on each node's first process, then on its others (a download happens once a node). A refusal
    (SystemExit) on any rank ends every rank at once: that rank says why."""
    loaded = problem = None
    for first in (True, False):
        if (os.environ.get("LOCAL_RANK", "0") == "0") == first:
            try:
                loaded = load()
            except SystemExit as e:
                problem = e.code
        failed = [rank for rank, p in enumerate(every_rank(problem, world_size)) if p]
        if failed:
            sys.exit(problem or f"stopping: rank {failed[0]} cannot go on (its line says why)")
    return loaded

# ---------------------------------------------------------------- data: Fashion-MNIST, images, batches
MEAN, STD = 0.2860, 0.3530    # of Fashion-MNIST's training images, for inputs near zero mean, unit variance

def fashion_mnist(data_dir=None, train_samples=None, test_samples=None):
    """(training set, test set, 10): torchvision's FashionMNIST, the first N images of each, normalised. It is
    downloaded only into the default folder, ./data: a folder you name, mistyped too, is never filled."""
    from torchvision.datasets import FashionMNIST
    raw = os.path.join(data_dir or "data", "FashionMNIST", "raw")
    if data_dir and not os.path.isdir(data_dir):
        found = "is not a folder" if os.path.exists(data_dir) else "does not exist"
        sys.exit(f"error: --data-dir {data_dir} {found}")
    if data_dir and not os.path.isdir(raw):
        sys.exit(f"error: --data-dir {data_dir} holds neither Fashion-MNIST ({raw}) nor, for the ResNet scripts, "
                 f"train/ and val/ (a subfolder of images per class)")
    sets = []
    for train, n in ((True, train_samples), (False, test_samples)):
        try:
            data = FashionMNIST(data_dir or "data", train=train, download=not data_dir)
        except Exception as e:
            sys.exit(f"error: cannot read Fashion-MNIST in {os.path.abspath(raw)} ({' '.join(str(e).split())[:200]})."
                     f" Do one of:\n- bash run_all.sh (as root on Debian or Ubuntu it unpacks dataset-fashion-mnist"
                     f" there)\n- on a machine with internet: python -c \"import torchvision; torchvision.datasets."
                     f"FashionMNIST('data', download=True)\", then copy data/ here")
        images = data.data[:n].float().div_(255).sub_(MEAN).div_(STD)   # in place: no temporaries of 190 MB
        sets.append(TensorDataset(images.unsqueeze(1), data.targets[:n]))
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"data: Fashion-MNIST from {os.path.abspath(raw)}", flush=True)
    return sets[0], sets[1], 10

def read_image(path, mode=None):   # in `mode`, else gray or RGB as it is; PIL's errors do not all name the file
    from PIL import Image
    try:
        with Image.open(path) as image:
            return image.convert(mode or ("L" if image.mode in ("1", "L") else "RGB"))   # a truncated one fails here
    except Exception as e:
        raise RuntimeError(f"error: cannot read {path} ({' '.join(str(e).split())[:200]}): replace or remove it")

def check_batch(global_batch, world_size, train_samples, rank, asked=None):
    if asked and train_samples > asked and rank == 0:
        print(f"note: datasets() gave {train_samples} training samples: it does not apply --train-samples {asked}",
              flush=True)
    if global_batch % world_size:
        sys.exit(f"error: --batch-size {global_batch} does not divide by the {world_size} ranks" if rank == 0 else 1)
    if train_samples < global_batch:
        sys.exit(f"error: {train_samples} training samples are fewer than --batch-size {global_batch}"
                 if rank == 0 else 1)
    return global_batch // world_size

class Seeded(Dataset):
    """`dataset`'s items, each drawn with torch's generator seeded from (seed, epoch, index): the same augmentation
    at any world size and number of workers, and after a resume. The epoch is in memory the workers share."""
    def __init__(self, dataset, seed):
        self.dataset, self.seed, self.epoch = dataset, seed, torch.zeros(1, dtype=torch.int64).share_memory_()
    def __len__(self):
        return len(self.dataset)
    def __getitem__(self, index):
        key = f"{self.seed} {int(self.epoch)} {index}".encode()   # any --seed, to the 64 bits manual_seed takes
        with torch.random.fork_rng(devices=[]):   # the caller's generator as it was
            torch.default_generator.manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big"))
            return self.dataset[index]

class ResumableSampler(DistributedSampler):
    """One order per epoch from seed + epoch; rank r's k-th batch is positions r, r+W, ... of block k of it: the
    same global batches at any world size. set_epoch(epoch, start) begins at batch `start` (a resume)."""
    def __init__(self, dataset, rank_batch, rank, world_size, seed):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
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

STOP_SIGNALS = [getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name)]   # Windows: no USR1

def ignore_stop_signals(worker_id):   # SLURM signals every process: the rank decides, and ends its workers
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)

@atexit.register
def kill_workers():   # they ignore SIGTERM, which multiprocessing would send them at exit, then wait for ever
    for child in multiprocessing.active_children():
        child.kill()

def loader(dataset, batches, device, workers=0, **options):
    """Batches in pinned memory for the GPU, each copied as the step begins, without waiting. Tensors in memory:
    one indexing a batch. Any other Dataset: in `workers` processes forked by a fork server that has imported
    torchvision once (one forked from a rank whose gloo threads hold a lock can hang)."""
    if isinstance(dataset, TensorDataset):
        return DataLoader(dataset, sampler=batches, batch_size=None, pin_memory=device.type == "cuda")
    context = None
    if workers and sys.platform == "linux":
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["__main__", "torchvision"])
    return DataLoader(dataset, batch_sampler=batches, num_workers=workers, pin_memory=device.type == "cuda",
                      worker_init_fn=ignore_stop_signals, multiprocessing_context=context, **options)

def train_loader(dataset, global_batch, seed, rank, world_size, device, workers=0):
    """(loader, sampler): this rank's 1/W of every global batch; call sampler.set_epoch(epoch, start) each epoch."""
    if not isinstance(dataset, TensorDataset):
        dataset = Seeded(dataset, seed)
    sampler = ResumableSampler(dataset, global_batch // world_size, rank, world_size, seed)
    batches = BatchSampler(sampler, global_batch // world_size, drop_last=True)
    return loader(dataset, batches, device, workers, persistent_workers=workers > 0), sampler

def test_loader(dataset, rank, world_size, device, workers=0, batch_size=500):
    """This rank's slice, each image once (DistributedSampler repeats or drops some), as many batches on all ranks."""
    mine = torch.arange(len(dataset)).tensor_split(world_size)[rank]
    chunks = [c.tolist() for c in mine.tensor_split(max(1, math.ceil(len(dataset) / world_size / batch_size)))]
    return loader(dataset, chunks, device, min(workers, len(chunks)))

@torch.no_grad()
def accuracy(predict, batches, device, world_size):
    """[correct, count] over this rank's (X, y) batches, summed over ranks (divided by the caller): integers on
    `device` (a count made on the CPU could not be summed with CUDA's), exact at any size."""
    totals = torch.zeros(2, device=device, dtype=torch.int64)
    for X, y in batches:
        y = y.to(device, non_blocking=True)
        totals[0] += (predict(X.to(device, non_blocking=True)).argmax(1) == y).sum()
        totals[1] += len(y)   # a Python number: added on the device, no copy
    if world_size > 1:
        dist.all_reduce(totals)
    return totals.tolist()

# ---------------------------------------------------------------- the model and the recipe
def resnet(arch, classes, seed, channels=3, image_size=224, **options):
    """Up to 64x64 pixels: a 3x3 stride-1 stem and no max-pool (torchvision's shrink 32x32 to 8x8 at once)."""
    import torchvision
    torch.manual_seed(seed)   # every rank the same weights
    net = torchvision.models.get_model(arch, num_classes=classes, **options)   # torchvision's: zero_init_residual, ...
    small = image_size <= 64
    if small or channels != 3:
        net.conv1 = torch.nn.Conv2d(channels, net.conv1.out_channels, kernel_size=3 if small else 7,
                                    stride=1 if small else 2, padding=1 if small else 3, bias=False)
        torch.nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")   # as torchvision's
    if small:
        net.maxpool = torch.nn.Identity()
    return net

def sgd_recipe(net, lr, weight_decay, warmup_steps, total_steps, nesterov=False):
    """SGD with momentum, a linear warm-up (large batches diverge without one), then cosine to zero; no
    weight decay on BatchNorm and biases (the 1-D parameters: decaying them only fights the normalisation)."""
    params = list(net.parameters())
    optimizer = torch.optim.SGD([{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
                                 {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}],
                                lr=lr, momentum=0.9, nesterov=nesterov)
    def factor(step):   # of optimizer step `step`, counted from 0
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

# ---------------------------------------------------------------- a stop all ranks agree on, and the resume
PREEMPTED = 75   # EX_TEMPFAIL, "try again later": not 0 (a finished training), not 1 (something broke)

class StopSignal:
    """SIGTERM and SIGUSR1 only note the signal; agreed() takes the largest noted by any rank, on a gloo group of
    its own (CPU tensors whatever the backend): all stop after the same step. A rank stuck with a dead peer never
    gets there: it is the scheduler's to kill."""
    noted = 0   # the number of the signal this process received; 0: none (a handler holds no group alive)
    def __init__(self):
        StopSignal.noted = 0
        self.group = dist.new_group(backend="gloo")
        for signum in STOP_SIGNALS:
            signal.signal(signum, StopSignal.note)
    @staticmethod
    def note(signum, frame):
        StopSignal.noted = signum
    def agreed(self):   # the name of a signal any rank received, or None: the same on every rank
        flag = torch.tensor([StopSignal.noted])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return signal.Signals(flag.item()).name if flag.item() else None

def sync(path):   # a file's or folder's contents to disk (a rename is durable once its folder is synced)
    with contextlib.suppress(OSError):   # a folder cannot be opened on Windows, nor synced on some file systems
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

def save_atomically(write, path):
    """write(tmp), sync, rename, sync the folder: after a crash the file is the old or the new one. A failed write
    removes its temporary file; a killed one's is removed by the next save of `path`."""
    for left in glob.glob(f"{glob.escape(path)}.tmp[0-9]*"):   # as large as the file: retries would fill a disk
        os.remove(left)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        sync(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    sync(os.path.dirname(os.path.abspath(path)))

# flags that do not change the batches or the steps (others are refused); "BatchNorm's batch" changes them a little
MAY_DIFFER = ("out", "checkpoint", "checkpoint_every", "resume", "max_steps", "workers", "data_dir",
              "test_samples", "compile", "channels_last", "accum_steps", "backend", "BatchNorm's batch")

def resume_check(saved, here, path, master, may_differ=MAY_DIFFER):
    differ = [f"{k} {saved.get(k)} there, {v} here" for k, v in here.items()
              if k not in may_differ and saved.get(k) != v]
    if differ:
        sys.exit(f"error: cannot resume from {path}: it was written with other training flags ({'; '.join(differ)}); "
                 f"use the same, or start without --resume" if master else 1)

def position_text(epoch, batch_in_epoch, steps_per_epoch):   # of a checkpoint: at the start of `epoch`, or inside it
    if batch_in_epoch:
        return f"epoch {epoch} at batch {batch_in_epoch}/{steps_per_epoch}"
    return f"epoch {epoch - 1} done"

def resume_position(saved, flags, path, steps_per_epoch, final_step, master):
    resume_check(saved["flags"], flags, path, master)
    position = {k: saved[k] for k in ("epoch", "batch_in_epoch", "step", "totals", "seconds")}
    if position["step"] >= final_step:
        if master:
            print(f"nothing to train: {path} is at step {position['step']}, and this run ends at step {final_step}")
        return None
    before, now = saved["flags"].get("BatchNorm's batch"), flags.get("BatchNorm's batch")
    if master:
        where = position_text(position["epoch"], position["batch_in_epoch"], steps_per_epoch)
        print(f"resumed from {path}: {where}, step {position['step']}", flush=True)
    if master and before != now:
        print(f"note: BatchNorm now normalises {now} images at a time, {before} before: the run goes on close to, "
              f"not the same as, one never stopped (the same ranks x --accum-steps keep it the same)", flush=True)
    return position

# ---------------------------------------------------------------- the command line and the outputs
def checked(kind, positive):   # an argparse type: a number of `kind`, above 0 (`positive`) or at least 0
    def parse(text):
        value = kind(text)
        if value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"must be {'positive' if positive else '0 or more'}, got {text}")
        return value
    parse.__name__ = kind.__name__   # argparse says "invalid int value: 'abc'"
    return parse

positive_int, positive_float = checked(int, True), checked(float, True)
non_negative_int, non_negative_float = checked(int, False), checked(float, False)

class Timer:   # seconds since start (plus `already`, counted before a restart), after queued GPU work
    def __init__(self, device, already=0.0):
        self.device, self.start = device, time.perf_counter() - already
    def __call__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.start

def nbytes(*tensors):   # what a collective is handed
    return sum(t.numel() * t.element_size() for t in tensors)

def new_metrics(script, args, devices, backend, world_size, test_samples):   # `devices`: one per replica
    each = len(devices) // world_size
    return {"script": os.path.basename(script), "config": vars(args), "devices": [str(d) for d in devices],
            "backend": backend, "world_size": world_size, "test_samples": test_samples, "epochs": [],
            "layout": f"{world_size} process{'es' * (world_size > 1)} x {each} replica{'s' * (each > 1)}"}

def record_epoch(metrics, epoch, totals, seconds, tested, verbose):   # totals: summed loss, hits, samples
    loss_sum, hits, samples = totals.tolist()
    correct, count = tested   # accuracy()'s: test_count shows each test image counted once, over all ranks
    line = {"epoch": epoch, "train_loss": loss_sum / samples, "train_acc": hits / samples, "test_acc": correct / count,
            "test_count": count, "samples": samples, "samples_per_s": samples / seconds, "seconds": seconds}
    metrics["epochs"].append(line)
    if verbose:
        print(f"epoch {epoch:3d}  loss {line['train_loss']:.4f}  train acc {line['train_acc']:.4f}  test acc "
              f"{line['test_acc']:.4f}  {line['samples_per_s']:,.0f} samples/s  {seconds:.1f} s", flush=True)

def finish(metrics, steps, seconds, state_dict, sent_per_step):
    by = {k: round(v) for k, v in sent_per_step.items()}
    epochs, out = metrics["epochs"], metrics["config"]["out"]
    metrics.update(steps=steps, seconds=seconds, test_acc=epochs[-1]["test_acc"], sent_bytes_by_collective=by,
                   samples_per_s=sum(e["samples"] for e in epochs) / sum(e["seconds"] for e in epochs),
                   sent_bytes_per_step=sum(by.values()))
    text = json.dumps(metrics, indent=1)
    save_atomically(lambda tmp: pathlib.Path(tmp).write_text(text), f"{out}/metrics.json")
    weights = {k: v.detach().cpu() for k, v in state_dict.items()}
    save_atomically(lambda tmp: torch.save(weights, tmp), f"{out}/model.pt")
    fig = Figure(figsize=(9, 3.5), layout="tight")
    ax_loss, ax_acc = fig.subplots(1, 2)
    for ax, key, style in ((ax_loss, "train_loss", "o-"), (ax_acc, "train_acc", "o-"), (ax_acc, "test_acc", "s-")):
        ax.plot([e["epoch"] for e in epochs], [e[key] for e in epochs], style, label=key.replace("_", " "))
        ax.set(xlabel="epoch", xlim=(epochs[0]["epoch"] - 0.5, epochs[-1]["epoch"] + 0.5))
        ax.locator_params(axis="x", integer=True, min_n_ticks=1)   # whole epochs: no tick at 2.5
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{metrics['script']}: {len(metrics['devices'])} x {metrics['devices'][0]} ({metrics['backend']})")
    save_atomically(lambda tmp: fig.savefig(tmp, format="png", dpi=100), f"{out}/curves.png")
    print(f"done: {steps} steps on {len(metrics['devices'])} x {'+'.join(sorted(set(metrics['devices'])))} "
          f"({metrics['backend']}): test acc {metrics['test_acc']:.4f} on {metrics['test_samples']} test samples, "
          f"{metrics['samples_per_s']:,.0f} samples/s, {seconds:.1f} s, {metrics['sent_bytes_per_step'] / 1e6:.3g} MB "
          f"to collectives per step and rank; wrote {out}/{{metrics.json,curves.png,model.pt}}", flush=True)
