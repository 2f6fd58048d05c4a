"""ResNet-18 on Fashion-MNIST, or your own image folder, with DistributedDataParallel: the script to copy into real jobs.

    python ddp_resnet.py                          # one process, no launcher needed
    torchrun --nproc_per_node=2 ddp_resnet.py     # one process per GPU (or 2 on CPU, gloo)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 ddp_resnet.py
    torchrun --nproc_per_node=8 ddp_resnet.py --data-dir DIR --workers 8 --batch-size 1024 --warmup-epochs 2

DIR holds train/ and val/, one subfolder of images per class: DataLoader workers decode and augment
them; the Fashion-MNIST IDX files are held in memory instead. The learning rate is given for 256
samples and scaled with the global batch, warmed up, then decayed (imagenet_recipe.py). SIGTERM or
SIGUSR1 stops every rank at the same step with a checkpoint (faults.py); --resume goes on from it.

Copy it with common.py, faults.py and imagenet_recipe.py. Lines that exist only because of DDP are
tagged `# DDP:`.

One warning is silenced, in backward only: DDP compares each gradient's strides with its bucket's,
those of size-1 dimensions too, which do not change the layout. On GPUs the 1x1 shortcut
convolutions and the one-channel stem get gradients with such nominal differences, and DDP warns
once of a mismatch that is not there (pytorch#47163).
"""
import contextlib, math, os, time, warnings
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
import common
import faults
import imagenet_recipe

# ---------------------------------------------------------------- checkpoints
def save_checkpoint(path, arch, net, optimizer, position, history, device):
    """Everything a restarted job needs to go on exactly where this one was (`position`: see
    faults.Checkpointing). Temp file, then rename: a crash while writing leaves the previous
    checkpoint usable."""
    state = {"arch": arch, **position, "history": history, "model": net.state_dict(),
             "optimizer": optimizer.state_dict(), **faults.rng_state(device)}
    faults.save_atomically(lambda tmp: torch.save(state, tmp), path)

def load_checkpoint(path, arch, net, optimizer, device, master):
    """Rank 0 alone decides: it reads the file and checks it by loading it, then sends the rest of
    it to every rank, so that ranks on nodes that do not see the file (node-local disks) go on
    from the same step. The weights are not sent here: the DDP wrap, after this, broadcasts rank
    0's weights and buffers to every rank anyway. Returns the checkpoint, or None when there is
    none; errors exit, said once."""
    state = [None]
    if master and not os.path.exists(path):
        print(f"no checkpoint at {path}: training starts from step 0", flush=True)
    elif master:
        try:
            state[0] = torch.load(path, map_location="cpu")
            if not isinstance(state[0], dict) or state[0].get("arch") != arch:
                raise ValueError(f"it holds no {arch} checkpoint" + (f" (it was written for {state[0]['arch']})"
                                 if isinstance(state[0], dict) and "arch" in state[0] else ""))
            net.load_state_dict(state[0]["model"])
            optimizer.load_state_dict(state[0]["optimizer"])
            missing = {"epoch", "batch_in_epoch", "step", "totals", "seconds", "drawn_from"} - state[0].keys()
            if missing:
                raise ValueError(f"it lacks the run's position ({', '.join(sorted(missing))})")
            del state[0]["model"]   # in net now; the wrap sends it on
        except Exception as e:   # a foreign pickle can raise anything; say which file and why
            reason = " ".join(str(e).split())   # e.g. which keys are missing or unexpected
            state[0] = f"error: cannot resume from {path}: {reason[:400]}{'...' if len(reason) > 400 else ''}"
    dist.broadcast_object_list(state, src=0)   # DDP: rank 0's checkpoint but its weights, or its verdict, to all
    if isinstance(state[0], str):
        raise SystemExit(state[0] if master else 1)
    if state[0] and not master:
        optimizer.load_state_dict(state[0]["optimizer"])
    if state[0]:
        faults.restore_rng(state[0], device)
    return state[0]

# ---------------------------------------------------------------- compressing what is sent
def comm_hook(args, resumed, master):
    """DDP: PyTorch's own communication hooks, which replace the allreduce of each bucket of
    gradients. bf16/fp16: the bucket is cast down before the allreduce and back after (half the
    bytes). PowerSGD (Vogels et al., 2019): each gradient matrix goes as two rank-R factors; what
    that leaves out is added to the next step's gradient (error feedback, per rank), and the
    factors start from the last step's (warm start). Returns (state, hook).

    PowerSGD's memory is kept per DDP bucket, and DDP lays its buckets out anew after the first
    step of every process (hence its plain allreduce for the first steps): memory saved by one
    process would land in other buckets in the next. So a resume starts it afresh, and says so."""
    if args.comm_hook in ("bf16", "fp16"):
        return None, getattr(default_hooks, f"{args.comm_hook}_compress_hook")
    if resumed and master:
        print(f"note: PowerSGD starts afresh after a resume: plain allreduce for {args.powersgd_start} steps, "
              f"then compression with empty error feedback (close to, not the same as, one uninterrupted run)",
              flush=True)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                        start_powerSGD_iter=args.powersgd_start)   # error feedback, warm start: on
    return state, powerSGD_hook.powerSGD_hook

def counting(hook, sent, world_size):
    """`hook`, with the bytes it hands to allreduce added up in `sent` (none in a group of one).
    A 16-bit hook sends its bucket at 2 bytes an element. PowerSGD counts the elements it sends,
    its factors and the tensors it leaves uncompressed, in `total_numel_after_compression`; in its
    plain steps that count stays, and it sends the bucket as it is."""
    key = f"all_reduce ({world_size} ranks)"
    def hook_and_count(state, bucket):
        before = state.total_numel_after_compression if state else 0
        future = hook(state, bucket)
        if world_size > 1:
            elements = (state.total_numel_after_compression - before if state else 0) or bucket.buffer().numel()
            sent[key] = sent.get(key, 0) + elements * (bucket.buffer().element_size() if state else 2)
        return future
    return hook_and_count

# ---------------------------------------------------------------- one optimizer step
def train_step(model, ddp_model, optimizer, X, y, accum_steps, amp):
    """Forward and backward in accum_steps micro-batches, then one optimizer step. Returns the
    summed loss and hits. `model` may be the compiled `ddp_model`."""
    optimizer.zero_grad(set_to_none=True)
    loss_sum, hits = 0.0, 0
    for i, (X_micro, y_micro) in enumerate(zip(X.chunk(accum_steps), y.chunk(accum_steps))):
        last = i == accum_steps - 1
        # DDP: skip the gradient allreduce on all but the last micro-step; it sums them all at once
        with contextlib.nullcontext() if last else ddp_model.no_sync():
            with torch.autocast(X.device.type, torch.bfloat16, enabled=amp):
                logits = model(X_micro)
                loss = F.cross_entropy(logits, y_micro)
            with warnings.catch_warnings():   # see the top: a stride warning for a mismatch that is not there
                warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
                (loss / accum_steps).backward()   # the mean over the whole rank batch
        loss_sum = loss_sum + loss.detach().float() * len(y_micro)
        hits = hits + (logits.argmax(1) == y_micro).sum()
    optimizer.step()
    return loss_sum, hits

# ---------------------------------------------------------------- training
def train(args):
    # DDP: join the process group. torchrun sets these variables (a plain `python` run: a group of one).
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, processes_here = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    backend = common.pick_backend()   # DDP: NCCL between GPUs (on Linux), gloo between CPUs
    if backend == "nccl":
        common.check_gpu_count(processes_here, rank=rank)   # DDP: one GPU per process
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        common.share_cores(processes_here)
    # DDP: join the group the way torchrun documents it, with one change: the wait for every rank has a
    # bound of its own (--init-timeout), as init_process_group's `timeout` bounds every collective too (there, 2 s
    # ended an allreduce whose peer came 4 s late: gloo, 2026-11-24), and ranks wait on each other mid-run.
    dist.init_process_group(backend, store=common.rendezvous_store(args.init_timeout),   # DDP: wait for all ranks
                            rank=rank, world_size=world_size, device_id=device if backend == "nccl" else None)
    master = rank == 0   # DDP: rank 0 alone prints and writes
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    # Fashion-MNIST held on the device, or an image folder read by DataLoader workers; either way
    # the same global batches at any world size, drawn from (seed, epoch).
    data = imagenet_recipe.load_data(args, rank, world_size, device, memory_format, master)
    global_batch = data.train.global_batch
    rank_batch = global_batch // world_size
    if rank_batch % args.accum_steps:
        raise SystemExit(f"error: the per-rank batch {rank_batch} does not divide into "
                         f"--accum-steps {args.accum_steps} micro-batches" if master else 1)

    net = imagenet_recipe.make_model(data.arch, data.classes, args.seed)   # the same seed gives every rank the same weights
    if args.sync_bn and device.type == "cuda":
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)   # DDP: batch statistics over all ranks
    elif args.sync_bn and master:
        print("note: --sync-bn needs CUDA (torch refuses SyncBatchNorm on CPU); "
              "going on with per-rank BatchNorm", flush=True)
    net = net.to(device, memory_format=memory_format)
    lr = imagenet_recipe.scaled_lr(args.lr, global_batch)   # --lr is for 256 samples
    optimizer = torch.optim.SGD(imagenet_recipe.param_groups(net, args.weight_decay), lr=lr, momentum=0.9)
    steps_per_epoch = len(data.train)
    scheduler = imagenet_recipe.lr_schedule(optimizer, round(args.warmup_epochs * steps_per_epoch),
                                            steps_per_epoch * args.epochs, args.schedule)
    metrics = common.new_metrics(__file__, args, [device] * world_size, dist.get_backend(),
                                 world_size, data.test_samples)
    drawn_from = {"global batch": global_batch, "seed": args.seed, "training samples": data.train.num_samples}
    recipe = imagenet_recipe.recipe_of(args)   # the flags a resume may change (said, applied from there)
    # Where the run is: epoch under way, batches of it done, global step, partial totals and seconds.
    position = {"epoch": 1, "batch_in_epoch": 0, "step": 0, "totals": [0.0] * 3, "seconds": 0.0}
    state = load_checkpoint(args.checkpoint, data.arch, net, optimizer, device, master) if args.resume else None
    if state:
        position = faults.resume_position(state, drawn_from, recipe, args, steps_per_epoch, master)
        metrics["epochs"] = state["history"]
        if position is None:   # nothing left to train
            dist.destroy_process_group()   # DDP: leave cleanly
            return net
        imagenet_recipe.continue_schedule(optimizer, scheduler, lr, args.weight_decay, position["step"])
    final_step = min(args.max_steps or math.inf, steps_per_epoch * args.epochs)
    def save(here):   # DDP: every rank holds the same weights; rank 0 writes them
        if master:
            save_checkpoint(args.checkpoint, data.arch, net, optimizer, here, metrics["epochs"], device)
    checkpoints = faults.Checkpointing(save, args.checkpoint, args.checkpoint_every, drawn_from, final_step, master,
                                       recipe)   # DDP: all ranks stop at the same step
    # DDP: wrap after loading; DDP broadcasts rank 0's weights and averages gradients in backward
    # DDP: the wrap. PowerSGD on gloo takes one bucket: it sends its factors from callbacks, and
    # gloo runs several buckets' in different orders on different ranks (a size-mismatch abort).
    one_bucket = args.comm_hook == "powersgd" and backend == "gloo"
    ddp_model = DDP(net, device_ids=[device] if device.type == "cuda" else None,   # DDP: the wrap
                    bucket_cap_mb=1e6 if one_bucket else None)
    sent = {}   # the bytes this rank hands to allreduce in this run's steps (metrics.json)
    if args.comm_hook:   # DDP: compression replaces each bucket's allreduce; set before the first backward
        hook_state, hook = comm_hook(args, state is not None, master)
        ddp_model.register_comm_hook(hook_state, counting(hook, sent, world_size))   # DDP: the hook, counted
    elif world_size > 1:   # DDP allreduces every gradient once a step, in its own buckets: their bytes
        sent_each_step = common.nbytes(*(p for p in net.parameters() if p.requires_grad))
    model = torch.compile(ddp_model) if args.compile else ddp_model

    if master:
        print(f"ddp_resnet: {data.arch}, {world_size} rank(s) on {device} ({dist.get_backend()}), global batch "
              f"{global_batch} = {world_size} x {rank_batch}, {args.accum_steps} micro-step(s), lr {lr:g} "
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
        net.train()
        # DDP: this rank's share of each global batch: a new order each epoch (what set_epoch does for a
        # DistributedSampler), from batch `done` on (a resumed epoch skips the batches it had)
        for batch_in_epoch, (X, y) in enumerate(data.train.epoch(epoch, done, last), done + 1):
            loss_sum, hits = train_step(model, ddp_model, optimizer, X, y, args.accum_steps, args.amp)
            scheduler.step()   # the learning rate of the next step
            totals[:2] += torch.stack([loss_sum, hits.float()])
            totals[2] += len(y)   # a Python number: no host-to-device copy (a GPU sync) per step
            step += 1
            progress(batch_in_epoch)
            if checkpoints.after_step(epoch, batch_in_epoch, batches, step, totals, timer):   # DDP: a stop, agreed
                dist.destroy_process_group()   # DDP: every rank stops after this same step, the checkpoint written
                raise SystemExit(faults.PREEMPTED)   # 75: not finished, nothing failed; --resume goes on
        seconds = timer()
        if last < batches:   # stopped by --max-steps inside the epoch: a checkpoint of here
            checkpoints.save(epoch, last, step, totals, seconds, batches)
        dist.all_reduce(totals)   # DDP: loss, hits and samples over all ranks
        for buffer in net.buffers():   # BatchNorm statistics: rank 0's, those model.pt holds
            dist.broadcast(buffer, src=0)   # DDP: each rank's own batches updated its own
        net.eval()
        test_acc = data.evaluate(net)   # DDP: each rank scores its slice; [correct, count] summed
        common.record_epoch(metrics, epoch, totals, seconds, test_acc, master)
        if last < batches:
            break
        checkpoints.epoch_done(epoch, step)
    checkpoints.close()
    if master and metrics["epochs"]:
        steps_here = step - position["step"]
        sent_per_step = ({k: v / steps_here for k, v in sent.items()} if args.comm_hook else
                         {f"all_reduce ({world_size} ranks)": sent_each_step} if world_size > 1 else {})
        common.finish(metrics, step, time.perf_counter() - start, net.state_dict(), sent_per_step)
    dist.destroy_process_group()   # DDP: leave cleanly
    return net

# ---------------------------------------------------------------- command line
def parse_args(argv=None):
    p = imagenet_recipe.add_recipe_flags(common.base_parser(__file__, __doc__.splitlines()[0], epochs=5, batch_size=256,
                                                            lr=0.05, resnet=True, distributed=True, folders=True))
    p.add_argument("--accum-steps", type=common.positive_int, default=1,
                   help="split each rank's batch into this many micro-batches (gradient accumulation)")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over all ranks (CUDA only)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--comm-hook", choices=("bf16", "fp16", "powersgd"),
                   help="compress the gradients DDP sends: to 16 bits, or PowerSGD's low-rank factors")
    p.add_argument("--powersgd-rank", type=common.positive_int, default=4,
                   help="PowerSGD: the rank of each gradient matrix's approximation")
    p.add_argument("--powersgd-start", type=int, default=10,
                   help="PowerSGD: plain allreduce for this many steps first (at least 2; PyTorch suggests "
                        "~10%% of the training)")
    p.add_argument("--checkpoint", help="checkpoint written by rank 0 after every epoch, every --checkpoint-every "
                                        "steps, where the run stops and on SIGTERM/SIGUSR1 "
                                        "(default: <out>/checkpoint.pt)")
    p.add_argument("--checkpoint-every", type=common.positive_int,
                   help="also write the checkpoint every N optimizer steps, inside epochs")
    p.add_argument("--resume", action="store_true",
                   help="go on from --checkpoint (as rank 0 sees it), mid-epoch too; without one, start at step 0")
    args = p.parse_args(argv)
    if args.powersgd_start < 2:
        p.error(f"argument --powersgd-start: must be 2 or more (DDP re-buckets after step 1), got {args.powersgd_start}")
    args.checkpoint = args.checkpoint or os.path.join(args.out, "checkpoint.pt")
    return args

def main(argv=None):
    args = parse_args(argv)
    common.default_to_one_process()   # plain `python ddp_resnet.py`: a group of one
    with faults.one_line_per_rank(args.checkpoint):   # a failed rank, or a lost peer: one line each
        return train(args)

if __name__ == "__main__":
    main()
