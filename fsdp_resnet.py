"""ResNet-18 on Fashion-MNIST, or your own image folder, with FSDP2 (fully_shard): each rank keeps 1/W of the parameters,
gradients and optimizer state.

    python fsdp_resnet.py                         # one process, no launcher needed
    torchrun --standalone --nproc_per_node=2 fsdp_resnet.py
    torchrun --standalone --nproc_per_node=8 fsdp_resnet.py --data-dir DIR --arch resnet50 --workers 8
    torchrun --nnodes=4 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 fsdp_resnet.py --hsdp

Data, model and learning-rate schedule as in ddp_resnet.py (imagenet_recipe.py); stopping and
resuming too (faults.py). Copy it with common.py, faults.py and imagenet_recipe.py.

The same training as ddp_resnet.py (same batches, same weights after every step), with another
memory layout. DDP keeps the whole model, its gradients and its optimizer state on every rank and
allreduces the gradients. FSDP keeps a 1/W shard of each; before a block's forward (and again
before its backward) it all-gathers that block's parameters and frees them after; after backward
it reduce-scatters the gradients, so each rank receives the summed gradient of its own shard only,
and the optimizer updates that shard. About 1.5x DDP's bytes on the wire, for 1/W of the memory.
With --hsdp the shards are spread over one node's processes only, and the nodes are replicas that
all-reduce their shards' gradients: the sharded traffic stays on the fast links inside a node.
Lines that exist only because of sharding are tagged `# FSDP:`.
"""
import math, os, re, shutil, time
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
import common
import faults
import imagenet_recipe

# ---------------------------------------------------------------- checkpoints: every rank writes its shard
def save_checkpoint(path, arch, model, optimizer, position, history, rank, device):
    """torch.distributed.checkpoint: each rank writes its own shards (on storage every node sees);
    no rank ever holds the whole model. Each checkpoint is a folder of its own, `step-N` inside
    the folder `path`, written as `step-N.tmp` and renamed when complete; the older ones are
    deleted only then. At every moment a complete checkpoint exists: a crash leaves at worst a
    `.tmp` folder (ignored) or two complete ones (the newer is loaded)."""
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
    if rank == 0:   # dcp.save returns once every rank's shards and the metadata are written
        torch.save({"arch": arch, **position, "history": history, **faults.rng_state(device)},
                   os.path.join(done + ".tmp", "progress.pt"))
        faults.sync(os.path.join(done + ".tmp", "progress.pt"))   # DCP syncs its own files
        shutil.rmtree(done, ignore_errors=True)   # the same step, saved by an earlier run
        os.replace(done + ".tmp", done)
        faults.sync(path)   # the rename on disk before the older ones go
        for name in os.listdir(path):
            if re.fullmatch(r"step-\d+(\.tmp)?", name) and name != os.path.basename(done):
                shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    dist.barrier()   # FSDP: nobody goes on (or reads the checkpoint) before it is in place

def newest_checkpoint(path):
    """The complete checkpoint of the highest step in the folder `path`, or None."""
    steps = [name for name in os.listdir(path) if re.fullmatch(r"step-\d+", name)] if os.path.isdir(path) else []
    return os.path.join(path, max(steps, key=lambda name: int(name[5:]))) if steps else None

def load_checkpoint(path, arch, model, optimizer, device, rank, world_size):
    """Rank 0 picks the checkpoint and reads its position; every rank then loads its own shards,
    whatever the world size that wrote them (DCP reshards). Returns the progress (position,
    history), or None when there is none; errors exit, said once."""
    found = [None]
    if rank == 0:
        found[0] = newest_checkpoint(path)
        if found[0] is None:
            print(f"no checkpoint in {path}: training starts from step 0", flush=True)
        else:
            try:
                progress = torch.load(os.path.join(found[0], "progress.pt"), map_location="cpu")
                if not isinstance(progress, dict) or progress.get("arch") != arch:
                    raise ValueError(f"it holds no {arch} checkpoint" + (f" (it was written for {progress['arch']})"
                                     if isinstance(progress, dict) and "arch" in progress else ""))
                found[0] = (found[0], progress)
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
        except Exception as e:
            error = f"{folder}: {' '.join(str(e).split())[:400]} (rank {rank})"
    errors = [None] * world_size
    dist.all_gather_object(errors, error)   # FSDP: any rank's error, said once by rank 0
    if any(errors):
        raise SystemExit(f"error: cannot resume from {next(e for e in errors if e)}" if rank == 0 else 1)
    faults.restore_rng(progress, device)
    return progress

def full_state_dict(model):
    """The whole model as one state dict of CPU tensors on rank 0 (empty elsewhere), as the other
    scripts write model.pt. Every rank must call it: the shards are gathered."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

def bytes_held(model, optimizer):
    """What this rank really holds: its local shards of parameters, gradients, optimizer state."""
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
                            mesh_dim_names=("replicate", "shard"))                       # numbers a node's ranks in a row)

def parameter_dtype(unit, amp):
    """The dtype `shard` gathers a unit's parameters in: bf16 with --amp, but BatchNorm's fp32."""
    return torch.bfloat16 if amp and not isinstance(unit, torch.nn.BatchNorm2d) else torch.float32

def bytes_sent_per_step(model, mesh, amp):
    """What FSDP2 hands to collectives per step, from the sizes of the sharded parameters (its
    collectives run inside FSDP, where no public API counts them; tests/torchrun_checks.py checks
    these sums against what torch.distributed is handed). For every sharded module (a unit), each
    rank hands its shard of the unit's parameters, dim 0 padded to a multiple of the shard group,
    to an all-gather before forward and again before backward (the root's stay gathered between),
    in parameter_dtype; the unit's whole padded gradient (fp32) to a reduce-scatter; and on a 2-D
    mesh (HSDP) its shard of that sum to an all-reduce across the replicas."""
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
    """FSDP: shard each residual stage, then the root (stem and last layer). A stage's parameters
    are gathered just before it runs and freed after, so at most one stage is ever whole. A model
    without ResNet's four stages (another --arch) is sharded by its top-level blocks. A 2-D mesh
    (replicate, shard) makes it HSDP."""
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

# ---------------------------------------------------------------- training
def train(args):
    # FSDP: join the process group. torchrun sets these variables (a plain `python` run: a group of one).
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, processes_here = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    backend = common.pick_backend()   # FSDP: NCCL between GPUs (on Linux), gloo between CPUs
    if backend == "nccl":
        common.check_gpu_count(processes_here, rank=rank)   # FSDP: one GPU per process
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        common.share_cores(processes_here)
    # FSDP: join the group the way torchrun documents it, with one change: the wait for every rank has a
    # bound of its own (--init-timeout), as init_process_group's `timeout` bounds every collective too (there, 2 s
    # ended an allreduce whose peer came 4 s late: gloo, 2026-11-24), and ranks wait on each other mid-run.
    dist.init_process_group(backend, store=common.rendezvous_store(args.init_timeout),   # FSDP: wait for all ranks
                            rank=rank, world_size=world_size, device_id=device if backend == "nccl" else None)
    master = rank == 0   # FSDP: rank 0 alone prints and writes
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    data = imagenet_recipe.load_data(args, rank, world_size, device, memory_format, master)   # as ddp_resnet.py
    global_batch = data.train.global_batch
    rank_batch = global_batch // world_size

    net = imagenet_recipe.make_model(data.arch, data.classes, args.seed).to(device, memory_format=memory_format)
    mesh = device_mesh(device, world_size, processes_here, args.hsdp)
    model = shard(net, mesh, args.amp)
    lr = imagenet_recipe.scaled_lr(args.lr, global_batch)   # --lr is for 256 samples
    optimizer = torch.optim.SGD(imagenet_recipe.param_groups(model, args.weight_decay), lr=lr, momentum=0.9)
    steps_per_epoch = len(data.train)
    scheduler = imagenet_recipe.lr_schedule(optimizer, round(args.warmup_epochs * steps_per_epoch),
                                            steps_per_epoch * args.epochs, args.schedule)
    metrics = common.new_metrics(__file__, args, [device] * world_size, dist.get_backend(), world_size,
                                 data.test_samples)
    drawn_from = {"global batch": global_batch, "seed": args.seed, "training samples": data.train.num_samples}
    recipe = imagenet_recipe.recipe_of(args)   # the flags a resume may change (said, applied from there)
    position = {"epoch": 1, "batch_in_epoch": 0, "step": 0, "totals": [0.0] * 3, "seconds": 0.0}
    saved = load_checkpoint(args.checkpoint, data.arch, model, optimizer, device, rank, world_size) if args.resume else None
    if saved:
        position = faults.resume_position(saved, drawn_from, recipe, args, steps_per_epoch, master)
        metrics["epochs"] = saved["history"]
        if position is None:   # nothing left to train
            dist.destroy_process_group()   # FSDP: leave cleanly
            return None
        imagenet_recipe.continue_schedule(optimizer, scheduler, lr, args.weight_decay, position["step"])
    final_step = min(args.max_steps or math.inf, steps_per_epoch * args.epochs)
    def save(here):   # FSDP: every rank writes its own shards
        save_checkpoint(args.checkpoint, data.arch, model, optimizer, here, metrics["epochs"], rank, device)
    checkpoints = faults.Checkpointing(save, args.checkpoint, args.checkpoint_every, drawn_from, final_step, master,
                                       recipe)   # FSDP: all ranks stop at the same step
    if master:
        print(f"fsdp_resnet: {data.arch}, {world_size} rank(s) on {device} ({dist.get_backend()}), global batch "
              f"{global_batch} = {world_size} x {rank_batch}, parameters sharded {mesh.size(mesh.ndim - 1)} ways"
              f"{f' in each of {mesh.size(0)} replicas (HSDP)' if args.hsdp else ''}, lr {lr:g} "
              f"({args.lr:g} x {global_batch}/256), {args.schedule} after {args.warmup_epochs:g} warm-up epochs",
              flush=True)
    step, start = position["step"], time.perf_counter()
    for epoch in range(position["epoch"], args.epochs + 1):
        if step >= final_step:   # --max-steps reached at the end of the last epoch
            break
        batches = len(data.train)
        done = position["batch_in_epoch"] if epoch == position["epoch"] else 0   # before a restart
        last = min(batches, done + final_step - step)   # where --max-steps may stop this epoch
        progress = common.Progress(epoch, batches, master, first=done, last=last)
        timer = common.Timer(device, already=position["seconds"] if done else 0.0)
        # Summed loss, hits, samples; after a mid-epoch restart rank 0 carries all ranks' sums so far.
        totals = torch.tensor(position["totals"] if done and master else [0.0] * 3, device=device)
        model.train()
        for batch_in_epoch, (X, y) in enumerate(data.train.epoch(epoch, done, last), done + 1):   # this rank's share
            optimizer.zero_grad(set_to_none=True)
            logits = model(X)                        # FSDP: all-gather each stage's parameters in turn
            loss = F.cross_entropy(logits.float(), y)
            loss.backward()                          # FSDP: gather again, then reduce-scatter the gradients
            optimizer.step()                         # FSDP: each rank updates its own shard
            scheduler.step()
            totals[:2] += torch.stack([loss.detach() * len(y), (logits.argmax(1) == y).sum().float()])
            totals[2] += len(y)
            step += 1
            progress(batch_in_epoch)
            if checkpoints.after_step(epoch, batch_in_epoch, batches, step, totals, timer):   # FSDP: a stop, agreed
                dist.destroy_process_group()   # FSDP: every rank stops after this same step, its shards written
                raise SystemExit(faults.PREEMPTED)   # 75: not finished, nothing failed; --resume goes on
        seconds = timer()
        if last < batches:   # stopped by --max-steps inside the epoch: a checkpoint of here
            checkpoints.save(epoch, last, step, totals, seconds, batches)
        dist.all_reduce(totals)   # FSDP: loss, hits and samples over all ranks
        for buffer in model.buffers():   # BatchNorm statistics: rank 0's, those model.pt holds
            dist.broadcast(buffer, src=0)   # FSDP: BatchNorm buffers are not sharded; each rank updated its own
        model.eval()
        test_acc = data.evaluate(model)   # FSDP: every rank the same number of forwards (each gathers weights)
        common.record_epoch(metrics, epoch, totals, seconds, test_acc, master)
        if last < batches:
            break
        checkpoints.epoch_done(epoch, step)
    checkpoints.close()
    held = [None] * world_size
    dist.all_gather_object(held, bytes_held(model, optimizer))   # FSDP: what each rank holds
    state = full_state_dict(model)
    if master and metrics["epochs"]:
        metrics["bytes_per_rank"] = held
        mb = lambda key: f"{held[0][key] / 1e6:.1f}"
        print(f"per rank: {mb('params')} MB parameters, {mb('grads')} MB gradients, {mb('optimizer_state')} MB "
              f"optimizer state (of {sum(h['params'] for h in held[:mesh.size(mesh.ndim - 1)]) / 1e6:.1f} MB each, all of which "
              f"DDP keeps on every rank)", flush=True)
        common.finish(metrics, step, time.perf_counter() - start, state, bytes_sent_per_step(model, mesh, args.amp))
    dist.destroy_process_group()   # FSDP: leave cleanly
    return state

# ---------------------------------------------------------------- command line
def parse_args(argv=None):
    p = imagenet_recipe.add_recipe_flags(common.base_parser(__file__, __doc__.splitlines()[0], epochs=5, batch_size=256,
                                                            lr=0.05, resnet=True, distributed=True, folders=True))
    p.add_argument("--hsdp", action="store_true", help="shard within each node (torchrun's --nproc_per_node), "
                                                       "replicate across nodes: only an all-reduce crosses them")
    p.add_argument("--checkpoint", help="checkpoint folder (one file per rank in it), written after every epoch, every "
                                        "--checkpoint-every steps, where the run stops and on SIGTERM/SIGUSR1 "
                                        "(default: <out>/checkpoint)")
    p.add_argument("--checkpoint-every", type=common.positive_int,
                   help="also write the checkpoint every N optimizer steps, inside epochs")
    p.add_argument("--resume", action="store_true",
                   help="go on from the newest checkpoint in --checkpoint, mid-epoch too, at any world size; "
                        "without one, start at step 0")
    args = p.parse_args(argv)
    args.checkpoint = args.checkpoint or os.path.join(args.out, "checkpoint")
    return args

def main(argv=None):
    args = parse_args(argv)
    common.default_to_one_process()   # plain `python fsdp_resnet.py`: a group of one
    with faults.one_line_per_rank(args.checkpoint):   # a failed rank, or a lost peer: one line each
        return train(args)

if __name__ == "__main__":
    main()
