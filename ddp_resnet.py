"""ResNet-18 on Fashion-MNIST with DistributedDataParallel: the script to copy into real jobs.

    python ddp_resnet.py                          # one process, no launcher needed
    torchrun --nproc_per_node=2 ddp_resnet.py     # one process per GPU (or 2 on CPU, gloo)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 ddp_resnet.py

Lines that exist only because of DDP are tagged `# DDP:`.
"""
import contextlib, os, time, warnings
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import common

ARCH = "fashion_resnet18"

# ---------------------------------------------------------------- checkpoints
def save_checkpoint(path, net, optimizer, epoch, step, history):
    """Everything a restarted job needs to go on exactly where this one was. Temp file, then
    rename: a crash while writing leaves the previous checkpoint usable."""
    state = {"arch": ARCH, "epoch": epoch, "step": step, "history": history, "model": net.state_dict(),
             "optimizer": optimizer.state_dict(), "cpu_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    common.save_atomically(lambda tmp: torch.save(state, tmp), path)

def load_checkpoint(path, net, optimizer, device):
    """Load onto this rank's own device (map_location), or exit saying what is wrong."""
    try:
        state = torch.load(path, map_location=device)
        if not isinstance(state, dict) or state.get("arch") != ARCH:
            raise ValueError(f"it holds no {ARCH} checkpoint"
                             + (f" (it was written for {state['arch']})" if isinstance(state, dict) and "arch" in state else ""))
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except Exception as e:   # a foreign pickle can raise anything; say which file and why
        reason = " ".join(str(e).split())   # e.g. which keys are missing or unexpected
        raise SystemExit(f"error: cannot resume from {path}: {reason[:400]}{'...' if len(reason) > 400 else ''}")
    torch.set_rng_state(state["cpu_rng"].cpu())
    if state["cuda_rng"]:
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
    return state["epoch"], state["step"], state["history"]

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
    first_epoch, step = 1, 0
    if args.resume and os.path.exists(args.checkpoint):
        done_epoch, step, metrics["epochs"] = load_checkpoint(args.checkpoint, net, optimizer, device)
        first_epoch = done_epoch + 1
        if master:
            print(f"resumed from {args.checkpoint}: epoch {done_epoch} done, step {step}", flush=True)
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
    start = time.perf_counter()
    for epoch in range(first_epoch, args.epochs + 1):
        if step == args.max_steps:
            break
        # Global batches from (seed, epoch) alone: a new order each epoch (what set_epoch does
        # for a DistributedSampler), and the same batches as one device at any world size.
        batches = common.epoch_batches(len(y_train), rank_batch * world_size, args.seed, epoch).to(device)
        progress = common.Progress(epoch, len(batches), master)
        timer = common.Timer(device)
        totals = torch.zeros(3, device=device)   # summed loss, hits, samples
        net.train()
        for batch_in_epoch, idx in enumerate(batches, 1):
            idx = idx.view(world_size, rank_batch)[rank]   # DDP: this rank's share
            X = X_train[idx].contiguous(memory_format=memory_format)
            loss_sum, hits = train_step(model, ddp_model, optimizer, X, y_train[idx], args.accum_steps, args.amp)
            totals[:2] += torch.stack([loss_sum, hits.float()])
            totals[2] += len(idx)   # a Python number: no host-to-device copy (a GPU sync) per step
            step += 1
            progress(batch_in_epoch)
            if step == args.max_steps:
                break
        seconds = timer()
        dist.all_reduce(totals)   # DDP: loss, hits and samples over all ranks
        common.broadcast_buffers(net)   # DDP: BatchNorm statistics: rank 0's, those model.pt holds
        net.eval()
        test_acc = common.evaluate(net, X_test, y_test, device, rank, world_size)
        common.record_epoch(metrics, epoch, totals, seconds, test_acc, master)
        if master and step != args.max_steps:
            save_checkpoint(args.checkpoint, net, optimizer, epoch, step, metrics["epochs"])
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
    p.add_argument("--checkpoint", help="checkpoint written by rank 0 after every epoch (default: <out>/checkpoint.pt)")
    p.add_argument("--resume", action="store_true", help="go on from --checkpoint if it exists")
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
