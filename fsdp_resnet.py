"""ResNet-18 with FSDP2: each rank keeps 1/W of the weights, their gradients, the optimizer state.

    python fsdp_resnet.py                         # one process, no launcher needed
    torchrun --standalone --nproc_per_node=2 fsdp_resnet.py
    torchrun --standalone --nproc_per_node=8 fsdp_resnet.py --data-dir DIR --arch resnet50 \\
        --workers 8
    torchrun --nnodes=4 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        fsdp_resnet.py --hsdp

Data, model, optimizer and its schedule, stopping and resuming as in ddp_resnet.py. The same
training as ddp_resnet.py (the same batches, the same weights after every step up to the order of
float sums), with another memory layout (FSDP2's fully_shard). DDP keeps the whole model, its
gradients and its optimizer state on every rank and allreduces the gradients. FSDP keeps a 1/W shard
of each: before a block's forward (and again before its backward) it all-gathers that block's
parameters and frees them after; after backward it reduce-scatters the gradients, so that each rank
receives the summed gradient of its own shard only, and the optimizer updates that shard. About 1.5x
DDP's bytes on the wire, for 1/W of the memory. With --hsdp the shards are spread over one node's
processes only, and the nodes are replicas that all-reduce their shards' gradients: the sharded
traffic stays on the fast links inside a node.

Checkpoints are folders that every rank writes its own shards to (torch.distributed.checkpoint),
read back at any world size. Copy it with common.py. Lines only sharding needs are tagged `# FSDP:`.
"""
import argparse, collections, dataclasses, math, os, re, shutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
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
training.add_argument("--amp", action="store_true",
                      help="bfloat16 mixed precision (BatchNorm in float32)")
training.add_argument("--clip-grad-norm", type=common.positive_float, metavar="MAX",
                      help="scale the averaged gradient down to this total norm, when above it "
                      "(the progress line shows its norm before: the mean and the largest of the "
                      "steps since the line before or the epoch's start; metrics.json the epoch's)")
training.add_argument("--hsdp", action="store_true", help="shard within each node (torchrun's "
                      "--nproc_per_node), replicate across nodes: only an all-reduce crosses them")
parser.add_argument("--data-dir", help="a folder with train/ and val/, one subfolder of images "
                    "per class, or with Fashion-MNIST (FashionMNIST/raw/); default: ./data, "
                    "where Fashion-MNIST is downloaded")
parser.add_argument("--workers", type=common.non_negative_int, default=2,
                    help="DataLoader's (not for data in memory)")
parser.add_argument("--test-samples", type=common.positive_int, help="only N test images")
parser.add_argument("--max-steps", type=common.positive_int,
                    help="stop after this many optimizer steps")
parser.add_argument("--channels-last", action="store_true",
                    help="NHWC memory layout (faster convolutions on GPUs)")
parser.add_argument("--deterministic", action="store_true", help="CUDA: cuDNN's deterministic "
                    "algorithms, not its autotuner's fastest (the same bits again, slower)")
parser.add_argument("--backend", choices=("nccl", "gloo"),
                    help="default: nccl on CUDA, else gloo (CPUs: FSDP2 refuses it with CUDA)")
parser.add_argument("--print-every", type=common.every, default="10s", help="a progress line "
                    "every N steps (100) or N seconds (10s, the default); 0: none")
parser.add_argument("--out", default="runs/fsdp_resnet",
                    help="folder for metrics.json, curves.png and model.pt")
parser.add_argument("--checkpoint", help="a folder, each rank writing its shards into it, after "
                    "every epoch, every --checkpoint-every steps, where the run stops and on "
                    "SIGTERM/SIGUSR1 (default: <out>/checkpoint)")
parser.add_argument("--checkpoint-every", type=common.positive_int,
                    help="also every N steps, inside epochs")
parser.add_argument("--resume", action="store_true", help="go on from the newest checkpoint in "
                    "--checkpoint, mid-epoch too, at any world size with the same training flags; "
                    "without one, start at step 0")


def parse_args(argv=None):
    args = parser.parse_args(argv)
    args.checkpoint = args.checkpoint or os.path.join(args.out, "checkpoint")
    # Taken, it would fail at the run's first save, after training.
    if os.path.isfile(args.checkpoint):
        raise SystemExit(f"error: --checkpoint {args.checkpoint} is a file: fsdp_resnet.py "
                         "keeps its checkpoints in a folder")
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
    own nn.Module (--arch acts only here: a body of yours ignores it, and a resume still compares
    it). This page seeds torch before calling it (every rank must make the same weights: each keeps
    its own shard of them), then puts the model on the device and shards it by its blocks (blocks()
    below). What its step draws (dropout, stochastic depth) is seeded from (seed, step, micro-batch:
    a rank's batch): a resume is exact. To fine-tune, load weights here (a previous run's model.pt;
    torchvision's weights= are for RGB images and 1000 classes) and freeze a part:
    requires_grad_(False), and .eval() on it, which keeps its BatchNorm statistics."""
    return common.classifier(args.arch, classes, shape[0], shape[-1])


# ---------------------------------------------------------------- the optimizer and its schedule
def make_optimizer(raw_model, args, steps_per_epoch):
    """SGD with momentum, its learning rate from --lr, and its schedule: swap the optimizer here,
    and the rule that makes its rate with it. It holds only the parameters that train: a frozen one
    (requires_grad_(False)) gets no update, no weight decay and no momentum. Weight decay on the
    weights only: decaying BatchNorm's parameters and the biases (the 1-D ones) only fights the
    normalisation. The rate: raised linearly over the warm-up (large batches diverge without one),
    then decayed to zero along a cosine, counted in optimizer steps: the loop steps the schedule
    after each one. Handed the sharded model, it keeps the momentum of this rank's shards only."""
    trained = [p for p in raw_model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim > 1]
    no_decay = [p for p in trained if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # SGD's linear scaling rule (Goyal et al. 2017): --lr is the rate for 256 samples, and a global
    # batch k times larger takes k times the rate. Adam's and AdamW's follow no linear rule (a
    # square root is proposed; most runs tune the rate at their batch, lr = args.lr): change this
    # line with the optimizer, and its flags' values too (AdamW's usual --lr is about 1e-3, its
    # --weight-decay about 0.05).
    lr = args.lr * args.batch_size / 256
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=0.9)
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
    """Forward, backward and the update of this rank's shards, the gradient clipped first with
    --clip-grad-norm. The epoch's sums grow on the device: nothing here waits for the GPU."""
    optimizer.zero_grad(set_to_none=True)
    # What this rank's batch draws, seeded by its number among the step's batches.
    common.seed_the_step(args.seed, step, dist.get_rank())   # FSDP: which of them all
    logits = model(X)   # FSDP: all-gather each block in turn
    # With --amp the logits are bfloat16: the loss in float32.
    loss = F.cross_entropy(logits.float(), y)
    loss.backward()   # FSDP: gather again, then reduce-scatter
    if args.clip_grad_norm:
        # FSDP: the norms of this rank's shards, combined over the ranks: the whole gradient's (a
        # frozen parameter has none)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads).full_tensor()
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.clip_grad_norm, norm)
        common.add_norm(sums, norm)
    optimizer.step()   # FSDP: each rank updates its shards
    sums["loss"] += loss.detach() * len(y)
    sums["correct"] += (logits.argmax(1) == y).sum()
    # A Python number: no copy to the device.
    sums["samples"] += len(y)


@torch.no_grad()
def evaluate(model, batches, args, device):
    """The test loss (plain cross-entropy) and accuracy over all ranks, each test image counted
    once, and that count: the sharded model, in the training's precision (its mixed precision
    policy, --amp) and memory layout. BatchNorm's statistics are not sharded, and each rank's own
    batches updated its own: every rank evaluates rank 0's, those model.pt holds."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)   # FSDP: rank 0's BatchNorm statistics
    sums = common.Sums.on(device, loss=0, correct=0, samples=0)
    # FSDP: as many forwards on every rank, each gathering the blocks
    with common.evaluating(model):
        for X, y in batches:
            X = X.to(device, non_blocking=True).contiguous(memory_format=memory_format(args))
            y = y.to(device, non_blocking=True)
            logits = model(X)
            sums["loss"] += F.cross_entropy(logits.float(), y, reduction="sum")
            sums["correct"] += (logits.argmax(1) == y).sum()
            sums["samples"] += len(y)
    tested = sums.total()   # FSDP: summed over all ranks
    return {"test_loss": tested["loss"] / tested["samples"],
            "test_acc": tested["correct"] / tested["samples"],
            "test_count": round(tested["samples"])}


# ---------------------------------------------------------------- checkpoints
class Checkpoint:
    """A folder of checkpoints, each a folder `step-N` that torch.distributed.checkpoint (DCP)
    fills with the state of each of `things` (the model, the optimizer, the schedule, and what you
    add): each rank writes its own shards (on storage every node sees), and no rank ever holds the
    whole model. Beside them rank 0 writes progress.pt: the run's position, the training flags it
    was written with and the history of its epochs. Each is written as
    `step-N.tmp` and renamed when complete; older ones go only then, so that a complete checkpoint
    exists at every moment (a crash leaves at worst a `.tmp` folder, which is ignored)."""
    KEYS = {"position", "flags", "history"}

    def __init__(self, args, things, flags, metrics, steps_per_epoch):
        self.path, self.every, self.things = args.checkpoint, args.checkpoint_every, things
        self.flags, self.metrics, self.steps_per_epoch = flags, metrics, steps_per_epoch
        self.master = dist.get_rank() == 0   # FSDP: rank 0 alone writes progress.pt

    def due(self, here):
        """Every --checkpoint-every steps; at an epoch's end the checkpoint waits for its
        evaluation."""
        inside = here.batch_in_epoch < self.steps_per_epoch
        return self.every is not None and here.step % self.every == 0 and inside

    def save(self, position):
        """On every rank at the same step: each writes its own shards, then rank 0 the progress."""
        # DCP writes an unsharded tensor (BatchNorm's statistics) once, from any one rank: every
        # rank must hold the same ones, rank 0's, those model.pt holds.
        for buffer in self.things["model"].buffers():
            dist.broadcast(buffer, src=0)   # FSDP: rank 0's BatchNorm statistics
        state = self.sharded()
        done = f"{self.path}/step-{position.step:08d}"
        if self.master:
            shutil.rmtree(f"{done}.tmp", ignore_errors=True)
            os.makedirs(self.path, exist_ok=True)
        # FSDP: the folder is clean before anyone writes
        dist.barrier()   # FSDP: wait for rank 0
        dcp.save(state, checkpoint_id=f"{done}.tmp")   # FSDP: each rank its own shards
        # dcp.save returns once every rank's shards and the metadata are written (and synced).
        if self.master:
            progress = {"script": os.path.basename(__file__), "flags": self.flags,
                        "position": dataclasses.asdict(position), "history": self.metrics["epochs"]}
            common.save_atomically(lambda tmp: torch.save(progress, tmp), f"{done}.tmp/progress.pt")
            # The same step, saved before: set aside, not deleted, until the new one is in.
            if os.path.exists(done):
                os.replace(done, f"{done}.old")
            os.replace(f"{done}.tmp", done)
            # The renames on disk before the older checkpoints go.
            common.fsync(self.path)
            for name in os.listdir(self.path):
                if re.fullmatch(r"step-\d+(\.tmp|\.old)?", name) and name != os.path.basename(done):
                    shutil.rmtree(f"{self.path}/{name}", ignore_errors=True)
            where = position.where(self.steps_per_epoch)
            print(f"  checkpoint: step {position.step} ({where})", flush=True)
        # FSDP: nobody goes on, or reads it, before it is in place
        dist.barrier()   # FSDP: wait for rank 0's renames

    def resume(self, final_step):
        """The position to go on from, and the history back in metrics["epochs"]: from step 0
        without a checkpoint, None when this run has nothing left to train. Rank 0 picks the newest
        checkpoint and reads its progress; every rank loads its own shards, whatever the world size
        that wrote them (DCP reshards). An error is said once."""
        found = [None]
        if self.master:
            found[0] = newest_checkpoint(self.path)
        if self.master and found[0] is None:
            print(f"no checkpoint in {self.path}: training starts from step 0", flush=True)
        elif self.master:
            try:
                progress = torch.load(f"{found[0]}/progress.pt", map_location="cpu")
                common.check_keys(progress, self.KEYS, os.path.basename(__file__))
                found[0] = (found[0], progress)
            except Exception as e:
                # A foreign file can raise anything: say which checkpoint, and why.
                found[0] = f"{found[0]}: {common.one_line(e, 400)}"
        dist.broadcast_object_list(found, src=0)   # FSDP: the checkpoint rank 0 chose
        if found[0] is None:
            return common.Position()
        error = found[0]
        if isinstance(found[0], tuple):
            # The flags first: a checkpoint of other ones is refused before its shards are read.
            here = common.resume_position(found[0][1], self.flags, self.path, final_step,
                                          self.master)
            error = None
            if here:
                error = self.load_shards(found[0][0])
        errors = common.every_rank(error, dist.get_world_size())   # FSDP: any rank's error
        if any(errors):
            raise SystemExit(f"error: cannot resume from {next(e for e in errors if e)}"
                             if self.master else 1)
        progress = found[0][1]
        self.metrics["epochs"] = progress["history"]
        if here:
            common.say_resumed(progress, self.flags, self.path, here, self.steps_per_epoch,
                               self.master)
        return here

    def sharded(self):
        """The things as DCP saves and loads them: the model and its optimizer as this rank's
        shards (FSDP's state dicts, of DTensors), the others as they are (DCP calls their
        state_dict() and load_state_dict())."""
        model, optimizer = self.things["model"], self.things["optimizer"]
        # FSDP: sharded state dicts (DTensors)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {**self.things, "model": model_state, "optimizer": optimizer_state}

    def load_shards(self, folder):
        """This rank's shards from `folder`, and the others' state: None, or what went wrong."""
        try:
            state = self.sharded()
            dcp.load(state, checkpoint_id=folder)   # FSDP: resharded to this world size
            set_state_dict(self.things["model"], self.things["optimizer"],
                           model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        except (Exception, dcp.CheckpointException) as e:
            # DCP's exception (not an Exception) holds each rank's own.
            if isinstance(e, dcp.CheckpointException):
                e = next(iter(e.failures.values()))[0]
            rank = dist.get_rank()   # FSDP: which rank failed
            return f"{folder}: {common.one_line(e, 400)} (rank {rank})"
        return None


def newest_checkpoint(path):
    """The complete checkpoint of the highest step in the folder `path`, or None."""
    names = os.listdir(path) if os.path.isdir(path) else []
    # .old: set aside while the same step was saved again.
    steps = [name for name in names if re.fullmatch(r"step-\d+(\.old)?", name)]
    if not steps:
        return None
    return os.path.join(path, max(steps, key=lambda name: (int(name[5:13]), "old" not in name)))


# ---------------------------------------------------------------- the sharding, and what it sends
def device_mesh(device, world_size, processes_here, hsdp):
    """FSDP: the ranks that share a model's shards. Flat: all of them, each holding 1/W. HSDP
    (--hsdp): the processes of one node (torchrun's local world, L of them) hold 1/L each, and the
    nodes are replicas of each other: the all-gathers and reduce-scatters stay inside a node, and
    only an all-reduce of each rank's reduce-scattered gradient (1/L of it) crosses the nodes."""
    if not hsdp:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    if world_size % processes_here:
        raise SystemExit(f"error: --hsdp needs the same number of processes on every node "
                         f"({world_size} ranks, {processes_here} on this node)")
    # Rows are nodes: torchrun numbers a node's ranks in a row.
    shape = (world_size // processes_here, processes_here)
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


# Every kind of BatchNorm, which --amp keeps in float32.
BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d,
               torch.nn.SyncBatchNorm)


def shard(raw_model, mesh, amp):
    """FSDP: shard each block, then the root (the rest: a ResNet's stem and last layer), in place.
    A block's parameters are gathered just before it runs and freed after, so that at most one
    block is ever whole. A 2-D mesh (replicate, shard) makes it HSDP. Returns the sharded model."""
    precision = MixedPrecisionPolicy()
    if amp:
        # bf16 compute, gradients summed in fp32. BatchNorm of every kind stays fp32 (its running
        # statistics are, and CPU kernels refuse a mix), with a bf16 output.
        precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        norm_precision = MixedPrecisionPolicy(param_dtype=torch.float32,
                                              reduce_dtype=torch.float32,
                                              output_dtype=torch.bfloat16)
        for norm in [m for m in raw_model.modules() if isinstance(m, BATCH_NORMS)]:
            fully_shard(norm, mesh=mesh, mp_policy=norm_precision)   # FSDP: each BatchNorm
    for unit in blocks(raw_model):
        # A BatchNorm that --amp made a unit above stays one.
        if not (amp and isinstance(unit, BATCH_NORMS)):
            fully_shard(unit, mesh=mesh, mp_policy=precision)   # FSDP: each block
    return fully_shard(raw_model, mesh=mesh, mp_policy=precision)   # FSDP: the rest


def blocks(model):
    """FSDP: the units to shard. The model's blocks: the outermost modules made of layers whose
    class repeats (ResNet's BasicBlock, EfficientNet's MBConv, a transformer's layer), which
    nn.Sequential, nn.ModuleList and nn.ModuleDict only hold; a block with blocks inside that holds
    more than a quarter of the parameters gives its blocks instead. Then, if what is left to the
    root holds more than a quarter (VGG's layers, a large classifier), each of its layers is a unit
    too. Modules that share a parameter go in one unit (a list of them). For your own model,
    return its units here."""
    repeats = collections.Counter(type(m) for m in model.modules())
    holders = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
    every_block = {m for m in model.modules()
                   if repeats[type(m)] > 1 and list(m.children()) and not isinstance(m, holders)}
    quarter = size(model) / 4
    found = []
    add_blocks(model, every_block, quarter, found)
    # The root's rest, too large: its layers.
    if size(model) - sum(size(unit) for unit in found) > quarter:
        inside = {m for unit in found for m in unit.modules()}
        layers = [m for m in model.modules() if not list(m.children()) and size(m)]
        found += [layer for layer in layers if layer not in inside]
    return shared_in_one_unit(model, found)


def add_blocks(module, every_block, quarter, found):
    """The outermost blocks inside `module` into `found`; one with blocks inside that holds more
    than a quarter of the parameters gives its blocks instead."""
    for child in module.children():
        inner = every_block.intersection(child.modules()) - {child}
        if child in every_block and not (inner and size(child) > quarter):
            found.append(child)
        else:
            add_blocks(child, every_block, quarter, found)


def size(module):
    return sum(p.numel() for p in module.parameters())


def shared_in_one_unit(model, units):
    """`units`, where those that share a parameter become one; a unit that shares one with the
    root's own layers is left to the root."""
    unit_of = {m: unit for unit in units for m in unit.modules()}
    holders = collections.defaultdict(set)
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders[p].add(unit_of.get(m, model))
    groups = [[unit] for unit in units]
    for shared in [h for h in holders.values() if len(h) > 1]:
        joined = [group for group in groups if shared.intersection(group)]
        groups = [group for group in groups if group not in joined]
        if model not in shared:
            groups.append(sum(joined, []))
    return [group[0] if len(group) == 1 else group for group in groups]


def bytes_sent_per_step(model, mesh, amp):
    """What FSDP2 hands to collectives per step, from the sizes of the sharded parameters (its
    collectives run inside FSDP, where no public API counts them; tests/torchrun_checks.py checks
    these sums against what torch.distributed is handed). For every sharded module (a unit), each
    rank hands its shard of the unit's parameters, dim 0 padded to a multiple of the shard group,
    to an all-gather before forward and again before backward (the root's stay gathered between),
    in the dtype `shard` gives it; the unit's whole padded gradient (fp32) to a reduce-scatter;
    and on a 2-D mesh (HSDP) its shard of that sum to an all-reduce across the replicas."""
    shards = mesh.size(mesh.ndim - 1)
    group = f"{shards} ranks"
    if mesh.ndim > 1:
        group = f"shard group of {shards}"
    sent = collections.Counter()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # Each parameter is its innermost unit's: modules() lists a unit before those inside it.
    owner = {p: unit for unit in units for p in unit.parameters()}
    # Frozen units ahead of every parameter that trains run no backward, and are not gathered
    # again; but for the outermost one that holds the last of them, which FSDP prefetches for the
    # backward of the unit after it.
    position = {p: i for i, p in enumerate(model.parameters())}
    first = min([position[p] for p in position if p.requires_grad], default=len(position))
    ahead = [u for u in units if all(position[p] < first for p in u.parameters())]
    prefetched = [u for u in ahead if any(position[p] == first - 1 for p in u.parameters())][:1]
    for p, unit in owner.items():
        # This rank's shard: dim 0 padded to a multiple of the shard group.
        shard = math.ceil(p.shape[0] / shards) * math.prod(p.shape[1:])
        gathers = 2
        if unit is model or (unit in ahead and unit not in prefetched):
            gathers = 1
        # Gathered in bf16 with --amp, BatchNorm's in fp32.
        itemsize = 4
        if amp and not isinstance(unit, BATCH_NORMS):
            itemsize = 2
        sent[f"all_gather ({group})"] += gathers * shard * itemsize
        # A frozen parameter has no gradient to reduce.
        if p.requires_grad:
            sent[f"reduce_scatter ({group})"] += shards * shard * 4
        if p.requires_grad and mesh.ndim > 1:
            sent[f"all_reduce (replicate group of {mesh.size(0)})"] += shard * 4
    return sent


def bytes_held(model, optimizer):
    """What this rank really holds: its local shards of parameters, gradients, optimizer state."""
    # The root keeps its parameters gathered after a forward: back to shards.
    model.reshard()
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    # The sharded state: a step count, say, is not.
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, DTensor)]
    held = {"params": params, "grads": grads, "optimizer_state": state}
    # Every parameter and gradient is a DTensor, of which this rank holds its local part.
    return {kind: common.nbytes(*[t.to_local() for t in tensors]) for kind, tensors in held.items()}


# ---------------------------------------------------------------- the set-up
def join_the_group(args):
    """FSDP: this process joins the others. Returns its rank, the world size, its device and the
    backend."""
    # torchrun sets RANK and WORLD_SIZE; main() sets them for a plain `python` run, a group of one.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # NCCL between GPUs, where torch has it; else gloo (CPUs, and GPUs without NCCL).
    nccl = torch.cuda.is_available() and dist.is_nccl_available()   # FSDP: GPUs, NCCL
    backend = args.backend or ("nccl" if nccl else "gloo")
    device = common.pick_device(backend)   # FSDP: one GPU per process
    if backend == "gloo" and device.type == "cuda":
        raise SystemExit(f"rank {rank}: error: FSDP2 over gloo crashes with CUDA tensors "
                         f"(SIGSEGV): use --backend nccl (one process per GPU), or the CPU: "
                         f"CUDA_VISIBLE_DEVICES=")
    dist.init_process_group(backend, store=common.attempt_store(), rank=rank,   # FSDP: join
                            world_size=world_size)
    if backend == "nccl":
        common.one_rank_per_gpu(device)   # FSDP: before NCCL's first call
    # Every batch has one shape: on GPUs, cuDNN's autotuner picks each convolution's fastest
    # algorithm once, unless the run must repeat its bits.
    torch.backends.cudnn.benchmark = not args.deterministic
    torch.backends.cudnn.deterministic = args.deterministic
    return rank, world_size, device, backend


def load_data(args, rank, world_size, device):
    """The datasets, loaded by each node's first rank first, and this rank's loaders."""
    # FSDP: every node reads its own disk
    train_set, test_set, classes = common.load_on_every_rank(lambda: datasets(args), world_size)
    common.check_batch(args.batch_size, world_size, len(train_set), rank, args.train_samples)
    # FSDP: this rank's 1/W of each global batch
    train_batches, sampler = common.train_loader(train_set, args.batch_size, args.seed, rank,
                                                 world_size, device, args.workers)
    test_batches = common.test_loader(test_set, rank, world_size, device, args.workers)
    return train_set, test_set, classes, train_batches, sampler, test_batches


def sharded_model(args, shape, classes, device, world_size):
    """make_model()'s model on the device, its parameters sharded in place: what the loop calls and
    whose state is saved, one handle. Returns it and the mesh it is sharded over."""
    # FSDP: the same weights on every rank, each keeping its own shard of them
    torch.manual_seed(args.seed)
    # FSDP: the weights stay contiguous (fully_shard refuses others); channels-last inputs make
    # the convolutions NHWC.
    raw_model = make_model(args, shape, classes).to(device)
    processes_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    mesh = device_mesh(device, world_size, processes_here, args.hsdp)
    return shard(raw_model, mesh, args.amp), mesh


def resume_flags(args, shape, train_set_size, world_size):
    """What a resume must match: the training flags, the data, and how each global batch is cut
    among the ranks: rank r's share holds the same images, which BatchNorm normalises alike and
    whose draws are seeded by r, at the same world size."""
    return {**common.flags_of(training, args), "image_shape": shape,
            "train_set_size": train_set_size, "micro_batches": world_size}


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
    if here.batch_in_epoch and dist.get_rank() == 0:   # FSDP: rank 0's sums
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
        signalled, line = stop.vote(progress.asks())   # FSDP: one answer on every rank
        if signalled:
            break
        if progress.due(here.step, line):
            # Every rank sums its sums with the others' (a collective); rank 0 prints the line,
            # as common.Progress.say writes it.
            trained = sums.total()   # FSDP: the sums over all ranks
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
        signalled = stop.agreed()   # FSDP: wait for every rank's vote
    return sums, seconds, signalled


def report_epoch(metrics, epoch, sums, seconds, tested, master):
    """The epoch's line, in metrics["epochs"] and, from rank 0, on the screen, in metrics.json and
    curves.png: a run stopped later keeps them."""
    trained = sums.total()   # FSDP: summed over all ranks
    record = common.epoch_record(epoch, trained, seconds, tested)
    metrics["epochs"].append(record)
    if master:
        print(f"epoch {epoch:3d}  loss {record['train_loss']:.4f}  train acc "
              f"{record['train_acc']:.4f}  test loss {record['test_loss']:.4f}  test acc "
              f"{record['test_acc']:.4f}  {record['samples_per_s']:,.0f} samples/s  "
              f"{seconds:.1f} s", flush=True)
        common.write_outputs(metrics)


def report_memory(metrics, model, optimizer, mesh, device, world_size, master):
    """What each rank holds, and its peak GPU memory, in metrics.json and, from rank 0, on the
    screen."""
    # FSDP: every rank's peak GPU memory
    metrics["peak_memory_bytes"] = common.every_rank(common.peak_memory(device), world_size)
    held = common.every_rank(bytes_held(model, optimizer), world_size)   # FSDP: what each holds
    if master and metrics["epochs"]:
        metrics["bytes_per_rank"] = held
        whole = sum(h["params"] for h in held[:mesh.size(mesh.ndim - 1)])
        print(f"per rank: {held[0]['params'] / 1e6:.1f} MB parameters, "
              f"{held[0]['grads'] / 1e6:.1f} MB gradients, "
              f"{held[0]['optimizer_state'] / 1e6:.1f} MB optimizer state (of {whole / 1e6:.1f} MB "
              f"each, all of which DDP keeps on every rank)", flush=True)


def say_start(model, shape, optimizer, mesh, args, world_size, device, backend):
    """The run's first line, from rank 0: the model, the ranks, the batch, the shards, the
    optimizer."""
    if dist.get_rank() == 0:   # FSDP: rank 0 says it
        replicas = f" in each of {mesh.size(0)} replicas (HSDP)" if args.hsdp else ""
        print(f"fsdp_resnet: {type(model).__name__} for {shape} images, {world_size} rank(s) on "
              f"{device} ({backend}), global batch {args.batch_size} = {world_size} x "
              f"{args.batch_size // world_size}, parameters sharded {mesh.size(mesh.ndim - 1)} "
              f"ways{replicas}, {type(optimizer).__name__} at lr "
              f"{optimizer.param_groups[0]['initial_lr']:g}", flush=True)


def train(args):
    """The set-up, then the epochs, each evaluated and checkpointed. Returns the whole model's
    state dict on rank 0 (empty on the others)."""
    rank, world_size, device, backend = join_the_group(args)   # FSDP: join the others
    stop = common.StopSignal()   # FSDP: one stop for every rank
    master = rank == 0   # FSDP: only rank 0 prints, writes
    train_set, test_set, classes, train_batches, sampler, test_batches = load_data(
        args, rank, world_size, device)
    shape = tuple(train_set[0][0].shape)
    model, mesh = sharded_model(args, shape, classes, device, world_size)   # FSDP: sharded
    steps_per_epoch = len(train_set) // args.batch_size
    final_step = min(args.max_steps or math.inf, steps_per_epoch * args.epochs)
    optimizer, scheduler = make_optimizer(model, args, steps_per_epoch)
    devices = common.every_rank(str(device), world_size)
    metrics = common.new_metrics(__file__, args, devices, backend, world_size, len(test_set))
    flags = resume_flags(args, shape, len(train_set), world_size)
    # What a checkpoint keeps and every rank loads at a resume, by name (each has state_dict() and
    # load_state_dict()): yours go here.
    things = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    checkpoint = Checkpoint(args, things, flags, metrics, steps_per_epoch)
    here = checkpoint.resume(final_step) if args.resume else common.Position()
    if here is None:
        return None
    say_start(model, shape, optimizer, mesh, args, world_size, device, backend)
    progress = common.Progress(args.print_every, here.step, final_step, args.batch_size, master)
    for epoch in range(here.epoch, args.epochs + 1):
        sampler.set_epoch(epoch, start=here.batch_in_epoch)   # FSDP: one order, new each epoch
        sums, seconds, signalled = train_epoch(model, optimizer, scheduler, train_batches, here,
                                               final_step, stop, checkpoint, progress, args, device)
        # A checkpoint inside the epoch: at a stop, or at the run's last step.
        if signalled or here.batch_in_epoch < steps_per_epoch:
            checkpoint.save(dataclasses.replace(here, sums=sums.total(), seconds=seconds))
        if signalled:
            break
        tested = evaluate(model, test_batches, args, device)
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
        raise SystemExit(common.PREEMPTED)   # FSDP: every rank stops here
    report_memory(metrics, model, optimizer, mesh, device, world_size, master)
    # FSDP: the shards gathered into the whole model, on rank 0's CPU
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=whole)
    if master and metrics["epochs"]:
        sent = bytes_sent_per_step(model, mesh, args.amp)
        common.finish(metrics, here.step, progress.spent(), state, sent)
    return state


# FSDP: an error's traceback goes to torchrun's error file, and its summary names the rank.
@record
def main(argv=None):
    args = parse_args(argv)
    # A plain `python fsdp_resnet.py`: a group of one.
    common.default_to_one_process()
    with common.leaving_the_group():   # FSDP: leave it at the end
        return train(args)


if __name__ == "__main__":
    main()
