"""ResNet-18 on Fashion-MNIST with DistributedDataParallel: the script to copy into real jobs.

    python ddp_resnet.py                          # one process, no launcher needed
    torchrun --nproc_per_node=2 ddp_resnet.py     # one process per GPU (or 2 on CPU, gloo)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 ddp_resnet.py

Lines that exist only because of DDP are tagged `# DDP:`.
"""
import contextlib, os, signal, time, warnings
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import common

ARCH = "fashion_resnet18"

# ---------------------------------------------------------------- checkpoints
def save_checkpoint(path, net, optimizer, position, history):
    """Everything a restarted job needs to go on exactly where this one was. `position`: the
    epoch under way, how many of its batches are done, the global step, the epoch's partial
    totals and seconds, and what its batches were drawn from. Temp file, then rename: a crash
    while writing leaves the previous checkpoint usable."""
    state = {"arch": ARCH, **position, "history": history, "model": net.state_dict(),
             "optimizer": optimizer.state_dict(), "cpu_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    common.save_atomically(lambda tmp: torch.save(state, tmp), path)

def load_checkpoint(path, net, optimizer, device, drawn_from):
    """Load onto this rank's own device (map_location), or exit saying what is wrong. A checkpoint
    taken inside an epoch is refused unless this run draws the same batches: its position would
    point at other batches (another world size at the same global batch draws the same ones)."""
    try:
        state = torch.load(path, map_location=device)
        if not isinstance(state, dict) or state.get("arch") != ARCH:
            raise ValueError(f"it holds no {ARCH} checkpoint"
                             + (f" (it was written for {state['arch']})" if isinstance(state, dict) and "arch" in state else ""))
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        missing = {"epoch", "batch_in_epoch", "step", "totals", "seconds", "drawn_from"} - state.keys()
        if missing:
            raise ValueError(f"it lacks the run's position ({', '.join(sorted(missing))})")
    except Exception as e:   # a foreign pickle can raise anything; say which file and why
        reason = " ".join(str(e).split())   # e.g. which keys are missing or unexpected
        raise SystemExit(f"error: cannot resume from {path}: {reason[:400]}{'...' if len(reason) > 400 else ''}")
    if state["batch_in_epoch"] and state["drawn_from"] != drawn_from:
        differ = ", ".join(f"{k} {state['drawn_from'][k]} there, {v} here"
                           for k, v in drawn_from.items() if state["drawn_from"][k] != v)
        raise SystemExit(f"error: cannot resume from {path}: it stopped inside epoch {state['epoch']}, and this "
                         f"run draws other batches ({differ}); use the same --batch-size, --seed and "
                         f"--train-samples, or start without --resume")
    torch.set_rng_state(state["cpu_rng"].cpu())
    if state["cuda_rng"]:
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
    return state

# ---------------------------------------------------------------- preemption: SIGTERM, SIGUSR1
PREEMPTED = 75   # EX_TEMPFAIL, "try again later": not 0, which a scheduler or a pipeline would take
                 # for a finished training, and not 1, which says something broke

class StopRequest:
    """SIGTERM (preemption, requeue, torchrun shutting down) and SIGUSR1 (sbatch --signal, ahead
    of the time limit) only note the signal. At every step boundary the ranks decide together,
    with an allreduce of the noted signal: a rank that stopped alone would leave the others
    waiting in the next gradient allreduce for ever. The flag goes over gloo on the CPU, so on
    GPUs this per-step check does not wait for the GPU."""
    def __init__(self):
        self.signal = 0
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        for name in ("SIGTERM", "SIGUSR1"):
            if hasattr(signal, name):   # Windows has no SIGUSR1
                signal.signal(getattr(signal, name), self._note)

    def _note(self, signum, frame):
        self.signal = signum

    def agreed(self):
        """The signal any rank has received (the same answer on every rank), or None."""
        flag = torch.tensor([float(self.signal)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return signal.Signals(int(flag.item())).name if flag.item() else None

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
            (loss / accum_steps).backward()   # the mean over the whole rank batch
        loss_sum = loss_sum + loss.detach().float() * len(y_micro)
        hits = hits + (logits.argmax(1) == y_micro).sum()
    optimizer.step()
    return loss_sum, hits

# ---------------------------------------------------------------- training
def train(args):
    rank, world_size, device = common.init_distributed(args.init_timeout)   # DDP: join the group
    master = rank == 0   # DDP: rank 0 alone prints and writes
    if master:
        common.check_out_dir(args.out)
    data = common.load_fashion_mnist(args.data_dir, args.train_samples, args.test_samples, rank, world_size)
    (X_train, y_train), (X_test, y_test) = data["train"], data["test"]
    rank_batch = common.rank_batch_size(args.batch_size, world_size, len(y_train), master)
    if rank_batch % args.accum_steps:
        raise SystemExit(f"error: the per-rank batch {rank_batch} does not divide into "
                         f"--accum-steps {args.accum_steps} micro-batches" if master else 1)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    X_train, X_test = X_train.to(device), X_test.to(device)   # small enough to live on the device
    y_train, y_test = y_train.to(device), y_test.to(device)

    net = common.fashion_resnet18(args.seed)   # the same seed gives every rank the same weights
    if args.sync_bn and device.type == "cuda":
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)   # DDP: batch statistics over all ranks
    elif args.sync_bn and master:
        print("note: --sync-bn needs CUDA (torch refuses SyncBatchNorm on CPU); "
              "going on with per-rank BatchNorm", flush=True)
    net = net.to(device, memory_format=memory_format)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    metrics = common.new_metrics(__file__, args, [device] * world_size, dist.get_backend(),
                                 world_size, len(y_test))
    drawn_from = {"global batch": rank_batch * world_size, "seed": args.seed, "training samples": len(y_train)}
    steps_per_epoch = len(y_train) // (rank_batch * world_size)
    # Where the run is: epoch under way, batches of it done, global step, partial totals and seconds.
    position = {"epoch": 1, "batch_in_epoch": 0, "step": 0, "totals": [0.0] * 3, "seconds": 0.0}
    if args.resume and os.path.exists(args.checkpoint):
        state = load_checkpoint(args.checkpoint, net, optimizer, device, drawn_from)
        position, metrics["epochs"] = {k: state[k] for k in position}, state["history"]
        if master:
            where = (f"epoch {position['epoch'] - 1} done" if not position["batch_in_epoch"] else
                     f"epoch {position['epoch']} at batch {position['batch_in_epoch']}/{steps_per_epoch}")
            print(f"resumed from {args.checkpoint}: {where}, step {position['step']}", flush=True)
    stop = StopRequest()   # DDP: every rank stops at the same step boundary
    # DDP compares each gradient's strides with its bucket's, those of size-1 dimensions too,
    # which do not change the layout. On GPUs the 1x1 shortcut convolutions and the one-channel
    # stem get gradients with such nominal differences, and DDP warns once of a mismatch that is
    # not there (pytorch#47163). That message alone is silenced.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    # DDP: wrap after loading; DDP broadcasts rank 0's weights and averages gradients in backward
    ddp_model = DDP(net, device_ids=[device] if device.type == "cuda" else None)
    model = torch.compile(ddp_model) if args.compile else ddp_model

    if master:
        print(f"ddp_resnet: {world_size} rank(s) on {device} ({dist.get_backend()}), global batch "
              f"{rank_batch * world_size} = {world_size} x {rank_batch}, {args.accum_steps} micro-step(s)",
              flush=True)
    step, start = position["step"], time.perf_counter()
    for epoch in range(position["epoch"], args.epochs + 1):
        if step == args.max_steps:
            break
        # Global batches from (seed, epoch) alone: a new order each epoch (what set_epoch does
        # for a DistributedSampler), and the same batches as one device at any world size.
        batches = common.epoch_batches(len(y_train), rank_batch * world_size, args.seed, epoch).to(device)
        progress = common.Progress(epoch, len(batches), master)
        timer = common.Timer(device)
        done = position["batch_in_epoch"] if epoch == position["epoch"] else 0   # before a restart
        # Summed loss, hits, samples; after a mid-epoch restart rank 0 carries all ranks' sums so far.
        totals = torch.tensor(position["totals"] if done and master else [0.0] * 3, device=device)
        net.train()
        for batch_in_epoch, idx in enumerate(batches[done:], done + 1):
            idx = idx.view(world_size, rank_batch)[rank]   # DDP: this rank's share
            X = X_train[idx].contiguous(memory_format=memory_format)
            loss_sum, hits = train_step(model, ddp_model, optimizer, X, y_train[idx], args.accum_steps, args.amp)
            totals[:2] += torch.stack([loss_sum, hits.float()])
            totals[2] += len(idx)   # a Python number: no host-to-device copy (a GPU sync) per step
            step += 1
            progress(batch_in_epoch)
            if step == args.max_steps:
                break
            signalled = stop.agreed()
            if signalled or (args.checkpoint_every and step % args.checkpoint_every == 0
                             and batch_in_epoch < len(batches)):
                partial = totals.clone()
                dist.all_reduce(partial)   # DDP: every rank's sums so far, kept by rank 0
                here = {"epoch": epoch, "batch_in_epoch": batch_in_epoch, "step": step, "totals": partial.tolist(),
                        "seconds": (position["seconds"] if done else 0.0) + timer(), "drawn_from": drawn_from}
                if master:
                    save_checkpoint(args.checkpoint, net, optimizer, here, metrics["epochs"])
                    print(f"  checkpoint: step {step} (epoch {epoch}, batch {batch_in_epoch}/{len(batches)})", flush=True)
            if signalled:
                dist.barrier(group=stop.group)   # DDP: nobody leaves before rank 0 has saved
                if master:
                    print(f"stopped by {signalled} at step {step}; exit status {PREEMPTED} (not finished): "
                          f"run again with --resume to go on from {args.checkpoint}", flush=True)
                dist.destroy_process_group()
                raise SystemExit(PREEMPTED)
        seconds = (position["seconds"] if done else 0.0) + timer()
        dist.all_reduce(totals)   # DDP: loss, hits and samples over all ranks
        common.broadcast_buffers(net)   # DDP: BatchNorm statistics: rank 0's, those model.pt holds
        net.eval()
        test_acc = common.evaluate(net, X_test, y_test, device, rank, world_size)
        common.record_epoch(metrics, epoch, totals, seconds, test_acc, master)
        if master and step != args.max_steps:
            next_epoch = {"epoch": epoch + 1, "batch_in_epoch": 0, "step": step, "totals": [0.0] * 3,
                          "seconds": 0.0, "drawn_from": drawn_from}
            save_checkpoint(args.checkpoint, net, optimizer, next_epoch, metrics["epochs"])
    if master and metrics["epochs"]:
        common.finish(metrics, step, time.perf_counter() - start, net.state_dict())
    dist.destroy_process_group()   # DDP: leave cleanly
    return net

# ---------------------------------------------------------------- command line
def parse_args(argv=None):
    p = common.base_parser(__file__, __doc__.splitlines()[0], epochs=5, batch_size=256, lr=0.05)
    p.add_argument("--accum-steps", type=common.positive_int, default=1,
                   help="split each rank's batch into this many micro-batches (gradient accumulation)")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over all ranks (CUDA only)")
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory layout (faster convolutions on GPUs)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--checkpoint", help="checkpoint written by rank 0 after every epoch, every "
                                        "--checkpoint-every steps and on SIGTERM/SIGUSR1 (default: <out>/checkpoint.pt)")
    p.add_argument("--checkpoint-every", type=common.positive_int,
                   help="also write the checkpoint every N optimizer steps, inside epochs")
    p.add_argument("--resume", action="store_true", help="go on from --checkpoint if it exists, mid-epoch too")
    p.add_argument("--init-timeout", type=common.positive_float, default=300,
                   help="seconds to wait for every rank to join before giving up")
    args = p.parse_args(argv)
    args.checkpoint = args.checkpoint or os.path.join(args.out, "checkpoint.pt")
    return args

def main(argv=None):
    args = parse_args(argv)
    common.default_to_one_process()   # plain `python ddp_resnet.py`: a group of one
    return train(args)

if __name__ == "__main__":
    main()
