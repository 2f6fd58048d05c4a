"""ResNet-18 with FSDP2 (fully_shard): each rank keeps 1/W of the parameters, gradients and optimizer state.

    python fsdp_resnet.py                         # one process, no launcher needed
    torchrun --standalone --nproc_per_node=2 fsdp_resnet.py
    torchrun --standalone --nproc_per_node=8 fsdp_resnet.py --data-dir DIR --arch resnet50 --workers 8
    torchrun --nnodes=4 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 fsdp_resnet.py --hsdp

Data, model, learning-rate schedule, stopping and resuming as in ddp_resnet.py. Copy it with common.py.

The same training as ddp_resnet.py (same batches, same weights after every step), with another memory layout. DDP keeps
the whole model, its gradients and its optimizer state on every rank and allreduces the gradients. FSDP keeps a 1/W
shard of each; before a block's forward (and again before its backward) it all-gathers that block's parameters and frees
them after; after backward it reduce-scatters the gradients, so each rank receives the summed gradient of its own shard
only, and the optimizer updates that shard. About 1.5x DDP's bytes on the wire, for 1/W of the memory. With --hsdp the
shards are spread over one node's processes only, and the nodes are replicas that all-reduce their shards' gradients:
the sharded traffic stays on the fast links inside a node. Lines that exist only because of sharding are tagged
`# FSDP:`.
"""
import argparse, functools, math, os, re, shutil, sys, time
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import Subset
from torchvision import transforms as T
from torchvision.datasets import ImageFolder
import common

# ---------------------------------------------------------------- your data goes here
def datasets(args):
    """(training set, test set, number of classes), as in ddp_resnet.py: replace this body with your own
    Datasets of (image tensor [C, H, W], label). Here: Fashion-MNIST, or your images when --data-dir holds train/
    and val/, one subfolder per class (torchvision's ImageFolder)."""
    if not (args.data_dir and os.path.isdir(os.path.join(args.data_dir, "train"))):
        return common.fashion_mnist(args.data_dir, args.train_samples, args.test_samples)
    folders = []
    for split in ("train", "val"):
        try:
            folders.append(ImageFolder(os.path.join(args.data_dir, split)))
        except OSError as e:   # no class folders, or a class without images: torchvision's message names it
            sys.exit(f"error: {os.path.join(args.data_dir, split)}: {e}")
    train, val = folders
    if train.classes != val.classes:
        sys.exit(f"error: {args.data_dir}/train and {args.data_dir}/val have other class folders "
                 f"({' '.join(sorted(set(train.classes) ^ set(val.classes)))} in one only)")
    mode = common.read_image(train.samples[0][0]).mode   # "L" or "RGB": every image is read as the first one is
    normalize = T.Normalize((common.MEAN,), (common.STD,))   # Fashion-MNIST's for gray images, ImageNet's for colour
    if mode == "RGB":
        normalize = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    resize = [T.Resize(args.image_size), T.CenterCrop(args.image_size)]
    augment = [T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip()]
    parts = []
    for folder, first, n in ((train, resize if args.no_augment else augment, args.train_samples),
                             (val, resize, args.test_samples)):
        folder.loader = functools.partial(common.read_image, mode=mode)
        folder.transform = T.Compose(first + [T.ToTensor(), normalize])
        if n and n < len(folder):   # N images spread over the classes (a folder's images are sorted by class)
            folder = Subset(folder, [i * len(folder) // n for i in range(n)])
        parts.append(folder)
    return parts[0], parts[1], len(train.classes)

# ---------------------------------------------------------------- checkpoints: every rank writes its shard
def save_checkpoint(path, model, optimizer, scheduler, position, flags, history, rank):
    """torch.distributed.checkpoint: each rank writes its own shards (on storage every node sees); no
    rank ever holds the whole model. Each checkpoint is a folder, `step-N` in the folder `path`,
    written as `step-N.tmp` and renamed when complete; older ones go only then, so a complete
    checkpoint exists at every moment (a crash leaves at worst a `.tmp` folder, ignored)."""
    # BatchNorm statistics are not sharded: DCP writes each such tensor once, from any one rank,
    # so every rank must hold the same ones: rank 0's, those model.pt holds.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)   # FSDP: rank 0's BatchNorm statistics on every rank
    model_state, optimizer_state = get_state_dict(model, optimizer)   # FSDP: sharded (DTensors)
    done = os.path.join(path, f"step-{position['step']:08d}")
    if rank == 0:
        shutil.rmtree(done + ".tmp", ignore_errors=True)
        os.makedirs(path, exist_ok=True)
    dist.barrier()   # FSDP: the folder is clean before anyone writes
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=done + ".tmp")   # FSDP: own shards
    if rank == 0:   # dcp.save returns once every rank's shards and the metadata are written (and synced)
        progress = {**position, "flags": flags, "history": history, "scheduler": scheduler.state_dict()}
        common.save_atomically(lambda tmp: torch.save(progress, tmp), os.path.join(done + ".tmp", "progress.pt"))
        if os.path.exists(done):   # the same step, saved before: set aside, not deleted, until the new one is in
            os.replace(done, done + ".old")
        os.replace(done + ".tmp", done)
        common.sync(path)   # the renames on disk before the older checkpoints go
        for name in os.listdir(path):
            if re.fullmatch(r"step-\d+(\.tmp|\.old)?", name) and name != os.path.basename(done):
                shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    dist.barrier()   # FSDP: nobody goes on (or reads the checkpoint) before it is in place

def newest_checkpoint(path):
    """The complete checkpoint of the highest step in the folder `path`, or None."""
    names = os.listdir(path) if os.path.isdir(path) else []
    steps = [name for name in names if re.fullmatch(r"step-\d+(\.old)?", name)]   # .old: set aside mid-save
    return os.path.join(path, max(steps, key=lambda name: (int(name[5:13]), "old" not in name))) if steps else None

def load_checkpoint(path, model, optimizer, scheduler, rank, world_size):
    """Rank 0 picks the newest checkpoint and reads its progress; every rank loads its own shards,
    whatever the world size that wrote them (DCP reshards). The progress, or None; errors said once."""
    found = [None]
    if rank == 0:
        found[0] = newest_checkpoint(path)
        if found[0] is None:
            print(f"no checkpoint in {path}: training starts from step 0", flush=True)
        else:
            try:
                found[0] = (found[0], torch.load(os.path.join(found[0], "progress.pt"), map_location="cpu"))
            except Exception as e:
                found[0] = f"{found[0]}: {' '.join(str(e).split())[:400]}"
    dist.broadcast_object_list(found, src=0)   # FSDP: every rank loads the checkpoint rank 0 chose
    if found[0] is None:
        return None
    error = found[0] if isinstance(found[0], str) else None
    if not error:
        folder, progress = found[0]
        try:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            dcp.load(state, checkpoint_id=folder)   # FSDP: own shards, resharded to this world size
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            scheduler.load_state_dict(progress["scheduler"])
        except Exception as e:
            error = f"{folder}: {' '.join(str(e).split())[:400]} (rank {rank})"
    errors = common.every_rank(error, world_size)   # FSDP: any rank's error, said once by rank 0
    if any(errors):
        raise SystemExit(f"error: cannot resume from {next(e for e in errors if e)}" if rank == 0 else 1)
    return progress

def bytes_held(model, optimizer):
    """What this rank really holds: its local shards of parameters, gradients, optimizer state. On every rank."""
    model.reshard()   # the root keeps its parameters gathered after a forward; back to shards
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t
    size = lambda tensors: sum(local(t).numel() * local(t).element_size() for t in tensors)
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"params": size(params), "grads": size(p.grad for p in params if p.grad is not None),
            "optimizer_state": size(state)}

# ---------------------------------------------------------------- the model, sharded
def device_mesh(device, world_size, processes_here, hsdp):
    """FSDP: the ranks that share a model's shards. Flat: all of them, each holding 1/W. HSDP
    (--hsdp): the processes of one node (torchrun's local world, L of them) hold 1/L each, and the
    nodes are replicas of each other: the all-gathers and reduce-scatters stay inside a node, and
    only an all-reduce of each rank's reduce-scattered gradient (1/L of it) crosses the nodes."""
    if not hsdp:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    if world_size % processes_here:
        raise SystemExit(f"error: --hsdp needs the same number of processes on every node ({world_size} ranks, "
                         f"{processes_here} on this node)")
    return init_device_mesh(device.type, (world_size // processes_here, processes_here),   # rows: nodes (torchrun
                            mesh_dim_names=("replicate", "shard"))   # (torchrun numbers a node's ranks in a row)

def parameter_dtype(unit, amp):
    """The dtype `shard` gathers a unit's parameters in: bf16 with --amp, but BatchNorm's fp32."""
    return torch.bfloat16 if amp and not isinstance(unit, torch.nn.BatchNorm2d) else torch.float32

def bytes_sent_per_step(model, mesh, amp):
    """What FSDP2 hands to collectives per step, from the sizes of the sharded parameters (its collectives run inside
    FSDP, where no public API counts them; tests/torchrun_checks.py checks these sums against what torch.distributed is
    handed). For every sharded module (a unit), each rank hands its shard of the unit's parameters, dim 0 padded to a
    multiple of the shard group, to an all-gather before forward and again before backward (the root's stay gathered
    between), in parameter_dtype; the unit's whole padded gradient (fp32) to a reduce-scatter; and on a 2-D mesh (HSDP)
    its shard of that sum to an all-reduce across the replicas."""
    shards, sent = mesh.size(mesh.ndim - 1), {}
    names = mesh.mesh_dim_names
    group = lambda dim: f"{dim} group of {mesh.size(names.index(dim))}" if mesh.ndim > 1 else f"{shards} ranks"
    def add(collective, dim, nbytes):
        sent[f"{collective} ({group(dim)})"] = sent.get(f"{collective} ({group(dim)})", 0) + nbytes
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        below = {id(p) for other in units if other is not unit and any(other is m for m in unit.modules())
                 for p in other.parameters()}   # those of the units inside this one
        shard = sum(math.ceil(p.shape[0] / shards) * math.prod(p.shape[1:])
                    for p in unit.parameters() if id(p) not in below)   # elements, padded
        add("all_gather", "shard", (1 if unit is model else 2) * shard * parameter_dtype(unit, amp).itemsize)
        add("reduce_scatter", "shard", shards * shard * 4)
        if mesh.ndim > 1:
            add("all_reduce", "replicate", shard * 4)
    return sent

def shard(net, mesh, amp):
    """FSDP: shard each residual stage, then the root (stem and last layer). A stage's parameters are gathered just
    before it runs and freed after, so at most one stage is ever whole. A model without ResNet's four stages (another
    --arch) is sharded by its top-level blocks. A 2-D mesh (replicate, shard) makes it HSDP."""
    precision = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if amp
                 else MixedPrecisionPolicy())   # --amp: bf16 compute, gradients summed in fp32
    if amp:   # BatchNorm stays fp32 (its running statistics are; CPU kernels refuse a mix), bf16 out
        for norm in [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]:
            fully_shard(norm, mesh=mesh, mp_policy=MixedPrecisionPolicy(   # FSDP: each BatchNorm
                param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.bfloat16))
    stages = ([net.layer1, net.layer2, net.layer3, net.layer4] if hasattr(net, "layer4") else
              [m for m in net.children() if any(True for _ in m.parameters())])
    for stage in stages:
        fully_shard(stage, mesh=mesh, mp_policy=precision)   # FSDP: each stage
    return fully_shard(net, mesh=mesh, mp_policy=precision)   # FSDP: the rest (stem, last layer)

# ---------------------------------------------------------------- one optimizer step
def train_step(model, optimizer, X, y, totals):
    """Forward, backward and the update of this rank's shard; adds the summed loss, the hits and the samples
    to `totals` (on the device: no sync with the GPU)."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(X)                        # FSDP: all-gather each stage's parameters in turn
    loss = F.cross_entropy(logits.float(), y)
    loss.backward()                          # FSDP: gather again, then reduce-scatter the gradients
    optimizer.step()                         # FSDP: each rank updates its own shard
    totals[0] += loss.detach() * len(y)
    totals[1] += (logits.argmax(1) == y).sum()
    totals[2] += len(y)   # a Python number: no copy to the device

def end_of_epoch(model, totals, test_batches, device, world_size):
    """The epoch's sums over all ranks; rank 0's BatchNorm statistics on all (they are not sharded, and each
    rank's own batches updated its own; model.pt holds rank 0's); the test accuracy over all ranks."""
    dist.all_reduce(totals)   # FSDP: loss, hits and samples over all ranks
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)   # FSDP: rank 0's BatchNorm statistics
    model.eval()
    tested = common.accuracy(model, test_batches, device, world_size)   # FSDP: as many forwards on every rank
    model.train()
    return tested

# ---------------------------------------------------------------- training
def train(args):
    # FSDP: join the process group. torchrun sets these variables (a plain `python` run: a group of one).
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nccl = torch.cuda.is_available() and dist.is_nccl_available()   # FSDP: NCCL between GPUs, where torch has it
    backend = args.backend or ("nccl" if nccl else "gloo")   # else gloo (CPUs; GPUs where torch has no NCCL)
    device = common.pick_device(backend)   # FSDP: one GPU per process
    if backend == "gloo" and device.type == "cuda":
        sys.exit(f"rank {rank}: error: FSDP2 over gloo crashes with CUDA tensors (SIGSEGV): use --backend nccl "
                 f"(one process per GPU), or the CPU: CUDA_VISIBLE_DEVICES=")
    dist.init_process_group(backend, store=common.attempt_store(), rank=rank, world_size=world_size,   # FSDP: all ranks
                            device_id=device if backend == "nccl" else None)
    stop = common.StopSignal()   # FSDP: SIGTERM/SIGUSR1 stop every rank at the same step, from now on
    master = rank == 0   # FSDP: rank 0 alone prints and writes
    if master:
        os.makedirs(args.out, exist_ok=True)
    train_set, test_set, classes = common.load_on_every_rank(lambda: datasets(args), world_size)   # FSDP: per node
    shape = tuple(train_set[0][0].shape)   # (channels, height, width): the model is made for it
    rank_batch = common.check_batch(args.batch_size, world_size, len(train_set), rank, args.train_samples)
    train_batches, sampler = common.train_loader(train_set, args.batch_size, args.seed, rank, world_size, device,
                                                 args.workers)   # FSDP: this rank's 1/W of each global batch
    test_batches = common.test_loader(test_set, rank, world_size, device, args.workers)
    steps_per_epoch = len(train_set) // args.batch_size
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format

    # FSDP: the weights stay contiguous (fully_shard refuses others); channels_last inputs make the convolutions NHWC
    net = common.resnet(args.arch, classes, args.seed, channels=shape[0], image_size=shape[-1]).to(device)
    mesh = device_mesh(device, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), args.hsdp)
    model = shard(net, mesh, args.amp)
    lr = args.lr * args.batch_size / 256   # --lr is for 256 samples
    optimizer, scheduler = common.sgd_recipe(model, lr, args.weight_decay, round(args.warmup_epochs * steps_per_epoch),
                                             steps_per_epoch * args.epochs)
    devices = common.every_rank(str(device), world_size)   # each rank's own
    metrics = common.new_metrics(__file__, args, devices, backend, world_size, len(test_set))
    # a resume must match them; BatchNorm normalises each rank's batch
    flags = {**vars(args), "image shape": shape, "training samples": len(train_set), "BatchNorm's batch": rank_batch}
    position = {"epoch": 1, "batch_in_epoch": 0, "step": 0, "totals": [0.0] * 3, "seconds": 0.0}
    saved = load_checkpoint(args.checkpoint, model, optimizer, scheduler, rank, world_size) if args.resume else None
    final_step = min(args.max_steps or math.inf, steps_per_epoch * args.epochs)
    if saved:
        position = common.resume_position(saved, flags, args.checkpoint, steps_per_epoch, final_step, master)
        if position is None:   # nothing left to train
            return None
        metrics["epochs"] = saved["history"]
    def save(step, epoch, batch_in_epoch, totals, seconds):   # FSDP: every rank writes its own shards
        partial = totals.clone()
        dist.all_reduce(partial)   # FSDP: every rank's sums so far in this epoch
        here = dict(epoch=epoch, batch_in_epoch=batch_in_epoch, step=step, totals=partial.tolist(), seconds=seconds)
        save_checkpoint(args.checkpoint, model, optimizer, scheduler, here, flags, metrics["epochs"], rank)
        if master:
            where = common.position_text(epoch, batch_in_epoch, steps_per_epoch)   # "epoch 3 done" at its end
            print(f"  checkpoint: step {step} ({where})", flush=True)
    if master:
        replicas = f" in each of {mesh.size(0)} replicas (HSDP)" if args.hsdp else ""
        print(f"fsdp_resnet: {args.arch} for {shape} images, {world_size} rank(s) on {device} ({backend}), global "
              f"batch {args.batch_size} = {world_size} x {rank_batch}, parameters sharded {mesh.size(mesh.ndim - 1)} "
              f"ways{replicas}, lr {lr:g} ({args.lr:g} x {args.batch_size}/256), cosine after {args.warmup_epochs:g} "
              f"warm-up epochs", flush=True)
    step, start = position["step"], time.perf_counter()
    for epoch in range(position["epoch"], args.epochs + 1):
        done = position["batch_in_epoch"] if epoch == position["epoch"] else 0   # before a restart
        sampler.set_epoch(epoch, start=done)   # FSDP: a new order each epoch, the same on every rank
        timer = common.Timer(device, already=position["seconds"] if done else 0.0)
        # summed loss, hits, samples; after a restart mid-epoch rank 0 carries all ranks' sums so far
        totals = torch.tensor(position["totals"] if done and master else [0] * 3, device=device, dtype=torch.float64)
        batch_in_epoch = done
        for batch_in_epoch, (X, y) in enumerate(train_batches, done + 1):
            X = X.to(device, non_blocking=True).contiguous(memory_format=memory_format)
            train_step(model, optimizer, X, y.to(device, non_blocking=True), totals)
            scheduler.step()
            step += 1
            signalled = stop.agreed() if step < final_step else None   # FSDP: one answer on all ranks
            epoch_end = batch_in_epoch == steps_per_epoch   # then the checkpoint waits for the evaluation
            every = args.checkpoint_every is not None and step % args.checkpoint_every == 0
            if signalled or (not epoch_end and (every or step == final_step)):
                save(step, epoch, batch_in_epoch, totals, timer())
            if signalled:   # FSDP: every rank stops after this same step, its shards written
                if master:
                    print(f"stopped by {signalled} at step {step}, checkpoint written; exit status 75 (not finished, "
                          f"nothing failed): run again with --resume to go on from {args.checkpoint}", flush=True)
                raise SystemExit(common.PREEMPTED)
            if step == final_step:
                break
        seconds = timer()
        tested = end_of_epoch(model, totals, test_batches, device, world_size)
        common.record_epoch(metrics, epoch, totals, seconds, tested, master)
        if batch_in_epoch == steps_per_epoch:   # the epoch's end, evaluated: a checkpoint of the next one's start
            save(step, epoch + 1, 0, torch.zeros(3, device=device, dtype=torch.float64), 0.0)
        if step == final_step:
            break
    held = common.every_rank(bytes_held(model, optimizer), world_size)   # FSDP: what each rank holds
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)   # FSDP: the shards gathered, on rank 0's CPU
    state = get_model_state_dict(model, options=whole)   # FSDP: the whole model for model.pt (empty on other ranks)
    if master and metrics["epochs"]:
        metrics["bytes_per_rank"] = held
        print(f"per rank: {held[0]['params'] / 1e6:.1f} MB parameters, {held[0]['grads'] / 1e6:.1f} MB gradients, "
              f"{held[0]['optimizer_state'] / 1e6:.1f} MB optimizer state (of "
              f"{sum(h['params'] for h in held[:mesh.size(mesh.ndim - 1)]) / 1e6:.1f} MB each, all of which DDP "
              f"keeps on every rank)", flush=True)
        common.finish(metrics, step, time.perf_counter() - start, state, bytes_sent_per_step(model, mesh, args.amp))
    return state

# ---------------------------------------------------------------- command line
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=common.positive_int, default=5, help="passes over the training set")
    p.add_argument("--batch-size", type=common.positive_int, default=256, help="global batch, over all ranks")
    p.add_argument("--lr", type=common.positive_float, default=0.05, help="for 256 samples, scaled to --batch-size")
    p.add_argument("--warmup-epochs", type=common.non_negative_float, default=0.0,
                   help="raise the learning rate linearly from ~0 over these epochs")
    p.add_argument("--weight-decay", type=common.non_negative_float, default=5e-4, help="on weights, not biases or BN")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights, the batch order and the augmentation")
    p.add_argument("--data-dir", help="a folder with train/ and val/, one subfolder of images per class, or with "
                   "Fashion-MNIST (FashionMNIST/raw/); default: ./data, where Fashion-MNIST is downloaded")
    p.add_argument("--arch", default="resnet18", help="a torchvision ResNet (resnet18, resnet50, ...)")
    p.add_argument("--image-size", type=common.positive_int, default=224, help="image folders: resized, cropped to it")
    p.add_argument("--workers", type=common.non_negative_int, default=2, help="DataLoader's (not for data in memory)")
    p.add_argument("--no-augment", action="store_true", help="image folders: no random crop and flip")
    p.add_argument("--train-samples", type=common.positive_int, help="only N training images")
    p.add_argument("--test-samples", type=common.positive_int, help="only N test images")
    p.add_argument("--max-steps", type=common.positive_int, help="stop after this many optimizer steps")
    p.add_argument("--amp", action="store_true", help="bfloat16 mixed precision (BatchNorm in float32)")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory layout (faster convolutions on GPUs)")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl on CUDA (one process per GPU), "
                   "else gloo; gloo on GPUs lets several ranks share one")
    p.add_argument("--hsdp", action="store_true", help="shard within each node (torchrun's --nproc_per_node), "
                   "replicate across nodes: only an all-reduce crosses them")
    p.add_argument("--out", default="runs/fsdp_resnet", help="folder for metrics.json, curves.png and model.pt")
    p.add_argument("--checkpoint", help="checkpoint folder (each rank writes its shards), written after every "
                   "epoch, every --checkpoint-every steps, where the run stops and on SIGTERM/SIGUSR1 "
                   "(default: <out>/checkpoint)")
    p.add_argument("--checkpoint-every", type=common.positive_int, help="also every N steps, inside epochs")
    p.add_argument("--resume", action="store_true", help="go on from the newest checkpoint in --checkpoint, "
                   "mid-epoch too, at any world size with the same flags; without one, start at step 0")
    args = p.parse_args(argv)
    args.checkpoint = args.checkpoint or os.path.join(args.out, "checkpoint")
    return args

@record   # FSDP: an error's traceback goes to torchrun's error file, and its summary names the rank
def main(argv=None):
    args = parse_args(argv)
    common.default_to_one_process()   # plain `python fsdp_resnet.py`: a group of one
    with common.leaving_the_group():   # FSDP: after the run, a stop or an error
        return train(args)

if __name__ == "__main__":
    main()
