"""ResNet-18 on Fashion-MNIST or your own data with DistributedDataParallel: the script to copy.

    python ddp_resnet.py                          # one process, no launcher needed
    torchrun --nproc_per_node=2 ddp_resnet.py     # one process per GPU (or 2 on CPU, gloo)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        ddp_resnet.py
    torchrun --nproc_per_node=8 ddp_resnet.py --data-dir DIR --workers 8 --batch-size 1024 \\
        --warmup-epochs 2

Your data goes in datasets() below: DIR holds train/ and val/, one subfolder of images per class
(torchvision's ImageFolder, read by DataLoader workers); Fashion-MNIST is held in memory instead.
Either way DistributedSampler gives each rank its share of the same global batches at any world
size. Your model goes in make_model(). The optimizer and its schedule are in make_optimizer(): SGD
with momentum, the learning rate given for 256 samples and scaled with the global batch, warmed
up, then decayed along a cosine (Goyal et al. 2017).

SIGTERM or SIGUSR1 stops every rank after the same step, with a checkpoint. --resume goes on from
it: the same training as a run never stopped, BatchNorm's statistics and what the step draws
(dropout) included, when each global batch is cut into as many micro-batches (the same ranks x
--accum-steps); else a close one, and the run says so. Copy it with common.py. Lines only DDP
needs are tagged `# DDP:`.
"""
import argparse, contextlib, dataclasses, math, os, time, warnings
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from torchvision import transforms as T
import common


# ---------------------------------------------------------------- the flags
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
training = parser.add_argument_group("training", "what --resume must repeat: these choose the "
                                     "batches, the steps and the weights")
training.add_argument("--epochs", type=common.positive_int, default=5,
                      help="passes over the training set")
training.add_argument("--batch-size", type=common.positive_int, default=256,
                      help="global batch, over all ranks")
training.add_argument("--lr", type=common.positive_float, default=0.05,
                      help="SGD's learning rate for 256 samples, scaled linearly with the global "
                      "batch (make_optimizer(): the rule goes with the optimizer)")
training.add_argument("--warmup-epochs", type=common.non_negative_float, default=0.0,
                      help="epochs of the learning rate's linear ramp-up")
training.add_argument("--nesterov", action="store_true", help="Nesterov momentum")
training.add_argument("--label-smoothing", type=common.non_negative_float, default=0.0,
                      help="of the loss, 0 to 1")
training.add_argument("--zero-init-residual", action="store_true",
                      help="each residual block starts as the identity")
training.add_argument("--weight-decay", type=common.non_negative_float, default=5e-4,
                      help="on the weights, not on biases or BatchNorm")
training.add_argument("--seed", type=int, default=0,
                      help="seeds the weights, the batch order and the augmentation")
training.add_argument("--arch", default="resnet18", help="a torchvision classifier (resnet18, "
                      "resnet50, efficientnet_b0, ...), its stem made for your images")
training.add_argument("--image-size", type=common.positive_int, default=224,
                      help="image folders: resized and cropped to it")
training.add_argument("--no-augment", action="store_true",
                      help="image folders: no random crop and flip")
training.add_argument("--train-samples", type=common.positive_int, help="only N training images")
training.add_argument("--amp", action="store_true", help="bfloat16 mixed precision")
training.add_argument("--clip-grad-norm", type=common.positive_float, metavar="MAX",
                      help="scale the averaged gradient down to this total norm, when above it "
                      "(the progress line shows its norm before: the mean and the largest of the "
                      "steps since the line before or the epoch's start; metrics.json the epoch's)")
training.add_argument("--sync-bn", action="store_true",
                      help="BatchNorm statistics over all ranks (CUDA only)")
training.add_argument("--comm-hook", choices=("bf16", "fp16", "powersgd"),
                      help="compress the gradients DDP sends")
training.add_argument("--powersgd-rank", type=common.positive_int, default=4,
                      help="PowerSGD: the rank of the factors")
training.add_argument("--powersgd-start", type=int, default=10,
                      help="PowerSGD: plain allreduce for this many steps first (at least 2; "
                      "PyTorch suggests ~10%% of the training)")
parser.add_argument("--data-dir", help="a folder with train/ and val/, one subfolder of images "
                    "per class, or with Fashion-MNIST (FashionMNIST/raw/); default: ./data, "
                    "where Fashion-MNIST is downloaded")
parser.add_argument("--workers", type=common.non_negative_int, default=2,
                    help="DataLoader's (not for data in memory)")
parser.add_argument("--test-samples", type=common.positive_int, help="only N test images")
parser.add_argument("--max-steps", type=common.positive_int,
                    help="stop after this many optimizer steps")
parser.add_argument("--accum-steps", type=common.positive_int, default=1,
                    help="gradient accumulation's micro-batches")
parser.add_argument("--channels-last", action="store_true",
                    help="NHWC memory layout (faster convolutions on GPUs)")
parser.add_argument("--compile", action="store_true", help="torch.compile the model")
parser.add_argument("--deterministic", action="store_true", help="CUDA: cuDNN's deterministic "
                    "algorithms, not its autotuner's fastest (the same bits again, slower)")
parser.add_argument("--backend", choices=("nccl", "gloo"),
                    help="default: nccl on CUDA, else gloo (can share a GPU)")
parser.add_argument("--print-every", type=common.every, default="10s", help="a progress line "
                    "every N steps (100) or N seconds (10s, the default); 0: none")
parser.add_argument("--out", default="runs/ddp_resnet",
                    help="folder for metrics.json, curves.png and model.pt")
parser.add_argument("--checkpoint", help="written by rank 0 after every epoch, every "
                    "--checkpoint-every steps, where the run stops and on SIGTERM/SIGUSR1 "
                    "(default: <out>/checkpoint.pt)")
parser.add_argument("--checkpoint-every", type=common.positive_int,
                    help="also every N steps, inside epochs")
parser.add_argument("--resume", action="store_true", help="go on from --checkpoint (as rank 0 "
                    "sees it), mid-epoch too, at any world size with the same training flags; "
                    "without one, start at step 0")


def parse_args(argv=None):
    args = parser.parse_args(argv)
    if args.powersgd_start < 2:
        parser.error(f"argument --powersgd-start: must be 2 or more (DDP rebuckets after step 1), "
                     f"got {args.powersgd_start}")
    if args.label_smoothing > 1:
        parser.error(f"argument --label-smoothing: must be at most 1, got "
                     f"{args.label_smoothing:g}")
    args.checkpoint = args.checkpoint or os.path.join(args.out, "checkpoint.pt")
    # Taken, it would fail at the run's first save, after training.
    if os.path.isdir(args.checkpoint) or args.checkpoint.endswith(("/", os.sep)):
        raise SystemExit(f"error: --checkpoint {args.checkpoint} is a folder: ddp_resnet.py "
                         "keeps its checkpoint in a file (name one: DIR/checkpoint.pt)")
    return args


# ---------------------------------------------------------------- your data goes here
def datasets(args):
    """(training set, test set, number of classes): replace this body with your own Datasets. Any
    whose items are (image tensor [C, H, W], label) will do: the model is made for their images'
    shape. It runs on every rank, and each must make the same sets: seed whatever they draw when
    made (torch.Generator().manual_seed(args.seed)). What an item draws as it is read (a random
    crop, with torch's generator) the loader seeds from (seed, epoch, index), so that a resume is
    exact."""
    if not (args.data_dir and os.path.isdir(os.path.join(args.data_dir, "train"))):
        return common.fashion_mnist(args.data_dir, args.train_samples, args.test_samples)
    size = args.image_size
    resize = [T.Resize(size), T.CenterCrop(size)]
    augment = [T.RandomResizedCrop(size), T.RandomHorizontalFlip()]
    if args.no_augment:
        augment = resize
    return common.image_folders(args.data_dir, augment, resize, args.train_samples,
                                args.test_samples)


# ---------------------------------------------------------------- your model goes here
def make_model(args, shape, classes):
    """The model for `shape` images ([C, H, W]) and `classes` classes: replace this body with your
    own nn.Module (--arch and --zero-init-residual act only here: a body of yours ignores them, and
    a resume still compares them). This page seeds torch before calling it (the same weights on
    every rank), then puts the model on the device and wraps it. What its step draws (dropout,
    stochastic depth) is seeded from (seed, step, micro-batch): a resume is exact. To fine-tune,
    load weights here (a previous run's model.pt; torchvision's weights= are for RGB images and 1000
    classes) and freeze a part: requires_grad_(False), and .eval() on it, which keeps its BatchNorm
    statistics."""
    options = {}
    if args.zero_init_residual:
        options["zero_init_residual"] = True
    return common.classifier(args.arch, classes, shape[0], shape[-1], **options)


# ---------------------------------------------------------------- the optimizer and its schedule
def make_optimizer(raw_model, args, steps_per_epoch):
    """SGD with momentum, its learning rate from --lr, and its schedule: swap the optimizer here,
    and the rule that makes its rate with it. It holds only the parameters that train: a frozen one
    (requires_grad_(False)) gets no update, no weight decay and no momentum. Weight decay on the
    weights only: decaying BatchNorm's parameters and the biases (the 1-D ones) only fights the
    normalisation. The rate: raised linearly over the warm-up (large batches diverge without one),
    then decayed to zero along a cosine, counted in optimizer steps: the loop steps the schedule
    after each one."""
    trained = [p for p in raw_model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim > 1]
    no_decay = [p for p in trained if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # SGD's linear scaling rule (Goyal et al. 2017): --lr is the rate for 256 samples, and a global
    # batch k times larger takes k times the rate. Adam's and AdamW's follow no linear rule (a
    # square root is proposed; most runs tune the rate at their batch, lr = args.lr): change this
    # line with the optimizer, and its flags' values too (AdamW's usual --lr is about 1e-3, its
    # --weight-decay about 0.05; --nesterov is SGD's).
    lr = args.lr * args.batch_size / 256
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=args.nesterov)
    warmup_steps = round(args.warmup_epochs * steps_per_epoch)
    decay_steps = max(1, steps_per_epoch * args.epochs - warmup_steps)
    cosine = CosineAnnealingLR(optimizer, T_max=decay_steps)
    if warmup_steps == 0:
        return optimizer, cosine
    # Step k of the warm-up at (k + 1) / warmup_steps of the rate.
    warmup = LinearLR(optimizer, 1 / warmup_steps, total_iters=warmup_steps - 1)
    return optimizer, SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])


# ---------------------------------------------------------------- one optimizer step
def train_step(model, optimizer, X, y, step, args, sums):
    """Forward and backward in --accum-steps micro-batches, then one optimizer step, the averaged
    gradient clipped first with --clip-grad-norm. The epoch's sums grow on the device: nothing here
    waits for the GPU."""
    optimizer.zero_grad(set_to_none=True)
    rank, world_size = dist.get_rank(), dist.get_world_size()   # DDP: which rank, of how many
    for i in range(args.accum_steps):
        # Micro-batch i: every accum_steps-th sample, as rank i of that many would take them.
        X_micro, y_micro = X[i::args.accum_steps], y[i::args.accum_steps]
        last = i == args.accum_steps - 1
        # Its number among all ranks' micro-batches seeds what it draws.
        common.seed_the_step(args.seed, step, rank + world_size * i)   # DDP: which of them all
        # The model's buffers (BatchNorm's running statistics, and any your model keeps) move
        # with micro-batch 0 alone, as DDP keeps rank 0's: rank 0's micro-batch 0 holds the same
        # images whenever ranks x --accum-steps is the same. They are copied before micro-batch 1
        # and put back after the last (switching BatchNorm's tracking off would make
        # torch.compile compile again).
        if i == 1:
            kept = [buffer.clone() for buffer in model.buffers()]
        # DDP: no allreduce before the last micro-batch, which sums them all at once
        with contextlib.nullcontext() if last else model.no_sync():
            with torch.autocast(X.device.type, torch.bfloat16, enabled=args.amp):
                logits = model(X_micro)
                loss = F.cross_entropy(logits, y_micro, label_smoothing=args.label_smoothing)
            # The mean over the whole rank batch.
            (loss / args.accum_steps).backward()
        sums["loss"] += loss.detach() * len(y_micro)
        sums["correct"] += (logits.argmax(1) == y_micro).sum()
        # A Python number: no copy to the device.
        sums["samples"] += len(y_micro)
    if args.accum_steps > 1:
        for buffer, value in zip(model.buffers(), kept, strict=True):
            buffer.copy_(value)
    if args.clip_grad_norm:
        # The total norm of the gradient DDP averaged, the same on every rank, before clipping.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        common.add_norm(sums, norm)
    optimizer.step()


@torch.no_grad()
def evaluate(eval_model, batches, args, device):
    """The test loss (plain cross-entropy) and accuracy over all ranks, each test image counted
    once, and that count: the bare model (compiled with --compile), in the training's precision
    and memory layout. Every rank evaluates with rank 0's BatchNorm statistics, as DDP hands them
    to every rank before a forward: the last training forward left each rank its own."""
    for buffer in eval_model.buffers():
        dist.broadcast(buffer, src=0)   # DDP: rank 0's BatchNorm statistics
    sums = common.Sums.on(device, loss=0, correct=0, samples=0)
    with common.evaluating(eval_model):
        for X, y in batches:
            X = X.to(device, non_blocking=True).contiguous(memory_format=memory_format(args))
            y = y.to(device, non_blocking=True)
            with torch.autocast(device.type, torch.bfloat16, enabled=args.amp):
                logits = eval_model(X)
            sums["loss"] += F.cross_entropy(logits.float(), y, reduction="sum")
            sums["correct"] += (logits.argmax(1) == y).sum()
            sums["samples"] += len(y)
    tested = sums.total()   # DDP: summed over all ranks
    return {"test_loss": tested["loss"] / tested["samples"],
            "test_acc": tested["correct"] / tested["samples"],
            "test_count": round(tested["samples"])}


# ---------------------------------------------------------------- checkpoints
class Checkpoint:
    """One file, written by rank 0 and read by rank 0 alone (only its node's disk needs it): the
    state of each of `things` (the model, the optimizer, the schedule, and what you add), the run's
    position, the training flags it was written with and the history of its epochs."""
    KEYS = {"position", "flags", "history", "state"}

    def __init__(self, args, things, flags, metrics, steps_per_epoch):
        self.path, self.every, self.things = args.checkpoint, args.checkpoint_every, things
        self.flags, self.metrics, self.steps_per_epoch = flags, metrics, steps_per_epoch
        self.master = dist.get_rank() == 0   # DDP: rank 0 writes it
        # Made now, not at the first save: a folder that cannot be made stops the run at once.
        if self.master:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def due(self, here):
        """Every --checkpoint-every steps inside an epoch: the epoch's last step has its checkpoint
        after the evaluation."""
        inside = here.batch_in_epoch < self.steps_per_epoch
        return self.every is not None and here.step % self.every == 0 and inside

    def save(self, position):
        """On every rank at the same step; rank 0 writes."""
        if self.master:
            state = {"script": os.path.basename(__file__), "position": dataclasses.asdict(position),
                     "flags": self.flags, "history": self.metrics["epochs"],
                     "state": common.states(self.things)}
            common.save_atomically(lambda tmp: torch.save(state, tmp), self.path)
            where = position.where(self.steps_per_epoch)
            print(f"  checkpoint: step {position.step} ({where})", flush=True)
        # DDP: no rank goes on, or leaves at a stop, before it is on disk
        dist.barrier()   # DDP: wait for rank 0's write

    def resume(self, final_step):
        """The position to go on from, and the history back in metrics["epochs"]: from step 0
        without a checkpoint, None when this run has nothing left to train. Rank 0 reads the file
        and sends it to every rank; the training flags are compared before any state is loaded,
        then every rank loads each thing's. An error is said once."""
        state = [None]
        if self.master and not os.path.exists(self.path):
            print(f"no checkpoint at {self.path}: training starts from step 0", flush=True)
        elif self.master:
            try:
                state[0] = torch.load(self.path, map_location="cpu")
                common.check_keys(state[0], self.KEYS, os.path.basename(__file__))
            except Exception as e:
                # A foreign file can raise anything: say which file, and why.
                state[0] = f"error: cannot resume from {self.path}: {common.one_line(e, 400)}"
        dist.broadcast_object_list(state, src=0)   # DDP: rank 0's checkpoint or verdict
        if isinstance(state[0], str):
            raise SystemExit(state[0] if self.master else 1)
        if state[0] is None:
            return common.Position()
        here = common.resume_position(state[0], self.flags, self.path, final_step, self.master)
        if here:
            common.load_states(self.things, state[0]["state"], self.path, self.master)
            self.metrics["epochs"] = state[0]["history"]
            common.say_resumed(state[0], self.flags, self.path, here, self.steps_per_epoch,
                               self.master)
        return here


# ---------------------------------------------------------------- the wrap, and what it sends
def wrap(raw_model, args, device, backend, resumed):
    """DDP: the wrap, after loading: it broadcasts rank 0's weights, then averages the gradients
    in backward. --comm-hook replaces each bucket's allreduce with one of PyTorch's, set before
    the first backward: bf16 and fp16 cast down and back (half the bytes); PowerSGD (Vogels et
    al. 2019) sends each gradient matrix as two rank-R factors, with error feedback and warm start
    kept per bucket. Returns the wrapped model and PowerSGD's state (None without it)."""
    # On gloo, PowerSGD gets one bucket: gloo may run several buckets' factors in other orders
    # on other ranks.
    one_bucket = args.comm_hook == "powersgd" and backend == "gloo"
    device_ids = [device] if device.type == "cuda" else None
    model = DDP(raw_model, device_ids=device_ids, gradient_as_bucket_view=True,   # DDP: the wrap
                bucket_cap_mb=1e6 if one_bucket else None)
    # DDP warns of stride "mismatches" in dimensions of size 1, whose strides mean nothing
    # (pytorch#47163): those warnings alone are silenced.
    warnings.filterwarnings("ignore", message=r"(?s)Grad strides do not match bucket view "
                            r"strides.*grad\.sizes\(\) = \[([^]]*, )?1[],]")
    powersgd = None
    if args.comm_hook in ("bf16", "fp16"):
        hook = getattr(default_hooks, f"{args.comm_hook}_compress_hook")
        model.register_comm_hook(None, hook)   # DDP: the hook
    elif args.comm_hook == "powersgd":
        powersgd = powerSGD_hook.PowerSGDState(process_group=None,
                                               matrix_approximation_rank=args.powersgd_rank,
                                               start_powerSGD_iter=args.powersgd_start)
        model.register_comm_hook(powersgd, powerSGD_hook.powerSGD_hook)   # DDP: the hook
        # Its state is per bucket, and DDP makes its buckets anew in a process's first step: a
        # checkpoint does not keep it.
        if resumed and dist.get_rank() == 0:   # DDP: rank 0 says it
            print(f"note: PowerSGD starts afresh after a resume: plain allreduce for "
                  f"{args.powersgd_start} steps, then empty error feedback (close to, not the "
                  f"same as, one uninterrupted run)", flush=True)
    return model, powersgd


def bytes_sent_per_step(raw_model, args, powersgd, steps, world_size):
    """What each rank hands to allreduce per step: every gradient once (a frozen parameter has
    none), in 16 bits with a 16-bit hook; with PowerSGD, the mean of its plain and its compressed
    steps."""
    if world_size == 1:
        return {}
    sent = common.nbytes(*[p for p in raw_model.parameters() if p.requires_grad])
    if args.comm_hook in ("bf16", "fp16"):
        sent //= 2
    if powersgd:
        plain = min(steps, args.powersgd_start)
        # Its factors are float32.
        sent = (plain * sent + 4 * powersgd.total_numel_after_compression) / steps
    return {f"all_reduce ({world_size} ranks)": sent}


# ---------------------------------------------------------------- the set-up
def join_the_group(args):
    """DDP: this process joins the others. Returns its rank, the world size, its device and the
    backend."""
    # torchrun sets RANK and WORLD_SIZE; main() sets them for a plain `python` run, a group of one.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # NCCL between GPUs, where torch has it; else gloo (CPUs, and GPUs without NCCL).
    nccl = torch.cuda.is_available() and dist.is_nccl_available()   # DDP: GPUs, NCCL
    backend = args.backend or ("nccl" if nccl else "gloo")
    device = common.pick_device(backend)   # DDP: one GPU per process
    dist.init_process_group(backend, store=common.attempt_store(), rank=rank,   # DDP: join
                            world_size=world_size)
    if backend == "nccl":
        common.one_rank_per_gpu(device)   # DDP: before NCCL's first call
    # Every batch has one shape: on GPUs, cuDNN's autotuner picks each convolution's fastest
    # algorithm once, unless the run must repeat its bits.
    torch.backends.cudnn.benchmark = not args.deterministic
    torch.backends.cudnn.deterministic = args.deterministic
    return rank, world_size, device, backend


def load_data(args, rank, world_size, device):
    """The datasets, loaded by each node's first rank first, and this rank's loaders."""
    # DDP: every node reads its own disk
    train_set, test_set, classes = common.load_on_every_rank(lambda: datasets(args), world_size)
    rank_batch = common.check_batch(args.batch_size, world_size, len(train_set), rank,
                                    args.train_samples)
    if rank_batch % args.accum_steps:
        raise SystemExit(f"error: the per-rank batch {rank_batch} does not divide into "
                         f"--accum-steps {args.accum_steps} micro-batches" if rank == 0 else 1)
    # DDP: this rank's 1/W of each global batch
    train_batches, sampler = common.train_loader(train_set, args.batch_size, args.seed, rank,
                                                 world_size, device, args.workers)
    test_batches = common.test_loader(test_set, rank, world_size, device, args.workers)
    return train_set, test_set, classes, train_batches, sampler, test_batches


def place_model(args, shape, classes, device):
    """make_model()'s model, the same on every rank, on the device: the bare model, whose weights
    are saved. With --sync-bn on CUDA its BatchNorm layers normalise over all ranks' batches."""
    # The same seed, the same weights: DDP would broadcast rank 0's anyway.
    torch.manual_seed(args.seed)
    raw_model = make_model(args, shape, classes)
    if args.sync_bn and device.type == "cuda":
        # DDP: BatchNorm's statistics over all ranks' batches
        raw_model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
    elif args.sync_bn and dist.get_rank() == 0:   # DDP: rank 0 says it
        print("note: --sync-bn needs CUDA (torch refuses SyncBatchNorm on CPU): per-rank "
              "BatchNorm", flush=True)
    return raw_model.to(device, memory_format=memory_format(args))


def resume_flags(args, shape, train_set_size, device, world_size):
    """What a resume must match: the training flags, the data, and how each global batch is cut
    into micro-batches. Micro-batch r + W*i (rank r of W, its i-th) holds the same images whenever
    ranks x --accum-steps is the same: BatchNorm normalises them alike, and the step's draws are
    seeded by that number. With --sync-bn (CUDA) BatchNorm normalises micro-batch i of every rank
    together, whose images change with the world size: then the ranks count too."""
    micro_batches = world_size * args.accum_steps
    if args.sync_bn and device.type == "cuda":
        micro_batches = f"{world_size} ranks x {args.accum_steps}"
    return {**common.flags_of(training, args), "image_shape": shape,
            "train_set_size": train_set_size, "micro_batches": micro_batches}


def memory_format(args):
    if args.channels_last:
        return torch.channels_last
    return torch.contiguous_format


# ---------------------------------------------------------------- training
def train_epoch(model, optimizer, scheduler, batches, here, final_step, stop, checkpoint, progress,
                args, device):
    """Epoch `here.epoch`'s steps from its batch `here.batch_in_epoch` on, to the epoch's end, the
    run's last step or a stop; `here` moves with them. Returns the epoch's sums and seconds, and
    the stop's signal (None without one). No step waits for another rank: the stop vote a step
    starts is read a step later, when it has long arrived."""
    sums = common.Sums.on(device, loss=0, correct=0, samples=0, **common.NORM_SUMS)
    # After a restart inside the epoch, rank 0 carries every rank's sums so far.
    if here.batch_in_epoch and dist.get_rank() == 0:   # DDP: rank 0's sums
        sums = common.Sums.on(device, **here.sums)
    timer = common.Timer(device, already=here.seconds)
    progress.new_epoch(here.step)
    signalled = None
    for X, y in batches:
        X = X.to(device, non_blocking=True).contiguous(memory_format=memory_format(args))
        y = y.to(device, non_blocking=True)
        lr = scheduler.get_last_lr()[0]
        train_step(model, optimizer, X, y, here.step, args, sums)
        # The learning rate of the next step.
        scheduler.step()
        here.batch_in_epoch += 1
        here.step += 1
        if here.step == final_step:
            break
        # The last step's vote, which has arrived: a stop, or a progress line, on every rank.
        signalled, line = stop.vote(progress.asks())   # DDP: one answer on every rank
        if signalled:
            break
        if progress.due(here.step, line):
            # Every rank sums its sums with the others' (a collective); rank 0 prints the line,
            # as common.Progress.say writes it.
            trained = sums.total()   # DDP: the sums over all ranks
            progress.say(here, trained, lr)
            # What the line showed since the last one (the gradient norm's) starts again.
            sums.restart("_line")
        if checkpoint.due(here):
            checkpoint.save(dataclasses.replace(here, sums=sums.total(), seconds=timer()))
    seconds = timer()
    if signalled or here.step == final_step:
        # The vote under way is left unread: the run stops, or ends, at this step.
        stop.count()
    else:
        # The epoch's end, where every rank waits for the evaluation anyway: a stop noted in its
        # last steps lands here, before the evaluation.
        signalled = stop.agreed()   # DDP: wait for every rank's vote
    return sums, seconds, signalled


def report_epoch(metrics, epoch, sums, seconds, tested, master):
    """The epoch's line, in metrics["epochs"] and, from rank 0, on the screen, in metrics.json and
    curves.png: a run stopped later keeps them."""
    trained = sums.total()   # DDP: summed over all ranks
    record = common.epoch_record(epoch, trained, seconds, tested)
    metrics["epochs"].append(record)
    if master:
        print(f"epoch {epoch:3d}  loss {record['train_loss']:.4f}  train acc "
              f"{record['train_acc']:.4f}  test loss {record['test_loss']:.4f}  test acc "
              f"{record['test_acc']:.4f}  {record['samples_per_s']:,.0f} samples/s  "
              f"{seconds:.1f} s", flush=True)
        common.write_outputs(metrics)


def say_start(raw_model, shape, optimizer, args, world_size, device, backend):
    """The run's first line, from rank 0: the model, the ranks, the batch, the optimizer."""
    if dist.get_rank() == 0:   # DDP: rank 0 says it
        print(f"ddp_resnet: {type(raw_model).__name__} for {shape} images, {world_size} rank(s) on "
              f"{device} ({backend}), global batch {args.batch_size} = {world_size} x "
              f"{args.batch_size // world_size}, {args.accum_steps} micro-step(s), "
              f"{type(optimizer).__name__} at lr {optimizer.param_groups[0]['initial_lr']:g}",
              flush=True)


def train(args):
    """The set-up, then the epochs, each evaluated and checkpointed. Returns the bare model."""
    rank, world_size, device, backend = join_the_group(args)   # DDP: join the others
    stop = common.StopSignal()   # DDP: one stop for every rank
    master = rank == 0   # DDP: only rank 0 prints, writes
    train_set, test_set, classes, train_batches, sampler, test_batches = load_data(
        args, rank, world_size, device)
    shape = tuple(train_set[0][0].shape)
    raw_model = place_model(args, shape, classes, device)
    steps_per_epoch = len(train_set) // args.batch_size
    final_step = min(args.max_steps or math.inf, steps_per_epoch * args.epochs)
    optimizer, scheduler = make_optimizer(raw_model, args, steps_per_epoch)
    devices = common.every_rank(str(device), world_size)
    metrics = common.new_metrics(__file__, args, devices, backend, world_size, len(test_set))
    flags = resume_flags(args, shape, len(train_set), device, world_size)
    # What a checkpoint keeps and every rank loads at a resume, by name (each has state_dict() and
    # load_state_dict()), and the model evaluated and saved as model.pt: an EMA of the weights
    # goes here (README's "Your own model").
    things = {"model": raw_model, "optimizer": optimizer, "scheduler": scheduler}
    evaluated = raw_model
    checkpoint = Checkpoint(args, things, flags, metrics, steps_per_epoch)
    here = checkpoint.resume(final_step) if args.resume else common.Position()
    if here is None:
        return raw_model
    model, powersgd = wrap(raw_model, args, device, backend, resumed=here.step > 0)   # DDP: wrap
    eval_model = evaluated
    if args.compile:
        model, eval_model = torch.compile(model), torch.compile(evaluated)
    say_start(raw_model, shape, optimizer, args, world_size, device, backend)
    progress = common.Progress(args.print_every, here.step, final_step, args.batch_size, master)
    for epoch in range(here.epoch, args.epochs + 1):
        sampler.set_epoch(epoch, start=here.batch_in_epoch)   # DDP: one order, new each epoch
        sums, seconds, signalled = train_epoch(model, optimizer, scheduler, train_batches, here,
                                               final_step, stop, checkpoint, progress, args, device)
        # A checkpoint inside the epoch: at a stop, or at the run's last step.
        if signalled or here.batch_in_epoch < steps_per_epoch:
            checkpoint.save(dataclasses.replace(here, sums=sums.total(), seconds=seconds))
        if signalled:
            break
        tested = evaluate(eval_model, test_batches, args, device)
        report_epoch(metrics, epoch, sums, seconds, tested, master)
        if here.batch_in_epoch == steps_per_epoch:
            # The epoch's end, evaluated: a checkpoint of the next one's start.
            here = common.Position(epoch + 1, 0, here.step)
            checkpoint.save(here)
        if here.step == final_step:
            break
    # The loaders' workers end with the loop: freed later, in a garbage collection, they would
    # not be told (torch's queues close first), and they ignore SIGTERM.
    del train_batches, test_batches
    if signalled:
        common.say_stopped(signalled, here.step, args.checkpoint, master)
        raise SystemExit(common.PREEMPTED)   # DDP: every rank stops here
    # DDP: every rank's peak GPU memory
    metrics["peak_memory_bytes"] = common.every_rank(common.peak_memory(device), world_size)
    if master and metrics["epochs"]:
        sent = bytes_sent_per_step(raw_model, args, powersgd, here.step - progress.first_step,
                                   world_size)
        common.finish(metrics, here.step, progress.spent(), evaluated.state_dict(), sent)
    return raw_model


# DDP: an error's traceback goes to torchrun's error file, and its summary names the rank.
@record
def main(argv=None):
    args = parse_args(argv)
    # A plain `python ddp_resnet.py`: a group of one.
    common.default_to_one_process()
    with common.leaving_the_group():   # DDP: leave it at the end
        return train(args)


if __name__ == "__main__":
    main()
