"""ResNet-18 on Fashion-MNIST or your own data with DistributedDataParallel: the script to copy into real jobs.

    python ddp_resnet.py                          # one process, no launcher needed
    torchrun --nproc_per_node=2 ddp_resnet.py     # one process per GPU (or 2 on CPU, gloo)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 ddp_resnet.py
    torchrun --nproc_per_node=8 ddp_resnet.py --data-dir DIR --workers 8 --batch-size 1024 --warmup-epochs 2

Your data goes in datasets() below. DIR holds train/ and val/, one subfolder of images per class (torchvision's
ImageFolder, read by DataLoader workers); Fashion-MNIST is held in memory instead. Either way DistributedSampler gives
each rank its share of the same global batches at any world size. The learning rate is given for 256 samples, scaled
with the global batch, warmed up, then decayed (Goyal et al. 2017). SIGTERM or SIGUSR1 stops every rank at the same step
with a checkpoint; --resume goes on from it exactly when BatchNorm sees the same batches (the same ranks x
--accum-steps), else close to it, said. Copy it with common.py. Lines only DDP needs are tagged `# DDP:`.
"""
import argparse, contextlib, functools, math, os, sys, time, warnings
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset
from torchvision import transforms as T
from torchvision.datasets import ImageFolder
import common

# ---------------------------------------------------------------- your data goes here
def datasets(args):
    """(training set, test set, number of classes): replace this body with your own Datasets. Any whose items
    are (image tensor [C, H, W], label) will do: the model is made for their images' shape, and the loader
    draws their random numbers (torch's) from (seed, epoch, index), so a resume is exact."""
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

# ---------------------------------------------------------------- checkpoints
def save_checkpoint(path, net, optimizer, scheduler, flags, history, **position):
    state = {**position, "flags": flags, "history": history, "model": net.state_dict(),
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    common.save_atomically(lambda tmp: torch.save(state, tmp), path)

def load_checkpoint(path, net, optimizer, scheduler, master):
    """Rank 0 reads the file and sends it to every rank (only rank 0's node needs it on its disk), but for the
    weights: the DDP wrap broadcasts rank 0's anyway. The checkpoint, or None; an error is said once."""
    state = [None]
    if master and not os.path.exists(path):
        print(f"no checkpoint at {path}: training starts from step 0", flush=True)
    elif master:
        try:
            state[0] = torch.load(path, map_location="cpu")
            net.load_state_dict(state[0].pop("model"))
            missing = {"flags", "optimizer", "scheduler", "epoch", "batch_in_epoch", "step", "totals", "seconds",
                       "history"} - state[0].keys()
            if missing:
                raise ValueError(f"it lacks {', '.join(sorted(missing))}")
        except Exception as e:   # a foreign file can raise anything: say which file and why
            state[0] = f"error: cannot resume from {path}: {' '.join(str(e).split())[:400]}"
    dist.broadcast_object_list(state, src=0)   # DDP: rank 0's checkpoint but its weights, or its verdict
    if isinstance(state[0], str):
        raise SystemExit(state[0] if master else 1)
    if state[0]:
        optimizer.load_state_dict(state[0]["optimizer"])
        scheduler.load_state_dict(state[0]["scheduler"])
    return state[0]

# ---------------------------------------------------------------- the wrap, and compressing what it sends
def wrap(net, args, device, backend, resumed, master):
    """DDP: the wrap, after loading: it broadcasts rank 0's weights, then averages the gradients in backward.
    --comm-hook replaces each bucket's allreduce with one of PyTorch's (set before the first backward): bf16/fp16
    cast down and back (half the bytes); PowerSGD (Vogels et al. 2019) sends each gradient matrix as two rank-R
    factors, with error feedback and warm start, kept per bucket (on gloo one bucket: gloo may run several
    buckets' factors in other orders on other ranks)."""
    one_bucket = args.comm_hook == "powersgd" and backend == "gloo"
    ddp_model = DDP(net, device_ids=[device] if device.type == "cuda" else None,   # DDP: the wrap
                    gradient_as_bucket_view=True, bucket_cap_mb=1e6 if one_bucket else None)
    # DDP warns of stride "mismatches" of size-1 dims on GPUs (pytorch#47163)
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    powersgd = None
    if args.comm_hook in ("bf16", "fp16"):   # DDP: the hook
        ddp_model.register_comm_hook(None, getattr(default_hooks, f"{args.comm_hook}_compress_hook"))
    elif args.comm_hook == "powersgd":   # DDP: the hook. Its state is per bucket, and DDP makes its buckets anew in a
        # process's first step: a checkpoint does not keep it, and a resume starts it afresh
        powersgd = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                               start_powerSGD_iter=args.powersgd_start)
        ddp_model.register_comm_hook(powersgd, powerSGD_hook.powerSGD_hook)
        if resumed and master:
            print(f"note: PowerSGD starts afresh after a resume: plain allreduce for {args.powersgd_start} steps, "
                  f"then empty error feedback (close to, not the same as, one uninterrupted run)", flush=True)
    return ddp_model, torch.compile(ddp_model) if args.compile else ddp_model, powersgd

def bytes_sent_per_step(net, args, powersgd, steps, world_size):
    """What each rank hands to allreduce per step: every gradient once; PowerSGD counts its compressed steps'."""
    sent = common.nbytes(*net.parameters())
    if args.comm_hook in ("bf16", "fp16"):
        sent //= 2
    if powersgd:
        plain = min(steps, args.powersgd_start)
        sent = (plain * sent + 4 * powersgd.total_numel_after_compression) / steps   # fp32 gradients
    return {f"all_reduce ({world_size} ranks)": sent} if world_size > 1 else {}

# ---------------------------------------------------------------- one optimizer step
def train_step(model, ddp_model, optimizer, X, y, args, totals):
    """Forward and backward in --accum-steps micro-batches, one optimizer step; sums kept on the device (no sync)."""
    optimizer.zero_grad(set_to_none=True)
    for i in range(args.accum_steps):   # micro-batch i: every accum_steps-th sample, as rank i of that many would
        X_micro, y_micro = X[i::args.accum_steps], y[i::args.accum_steps]
        # DDP: no gradient allreduce but on the last micro-step; it sums them all at once
        with contextlib.nullcontext() if i == args.accum_steps - 1 else ddp_model.no_sync():
            with torch.autocast(X.device.type, torch.bfloat16, enabled=args.amp):
                logits = model(X_micro)
                loss = F.cross_entropy(logits, y_micro, label_smoothing=args.label_smoothing)
            (loss / args.accum_steps).backward()   # the mean over the whole rank batch
        totals[0] += loss.detach() * len(y_micro)
        totals[1] += (logits.argmax(1) == y_micro).sum()
        totals[2] += len(y_micro)   # a Python number: no copy to the device
    optimizer.step()

def end_of_epoch(net, totals, test_batches, device, world_size):
    """Rank 0's BatchNorm statistics on all ranks, as DDP sends them before a forward (the last updated each rank's)."""
    dist.all_reduce(totals)   # DDP: loss, hits and samples over all ranks
    for buffer in net.buffers():
        dist.broadcast(buffer, src=0)   # DDP: rank 0's BatchNorm statistics
    net.eval()
    tested = common.accuracy(net, test_batches, device, world_size)   # DDP: [correct, count] summed
    net.train()
    return tested

# ---------------------------------------------------------------- training
def train(args):
    # DDP: join the process group. torchrun sets these variables (a plain `python` run: a group of one).
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nccl = torch.cuda.is_available() and dist.is_nccl_available()   # DDP: NCCL between GPUs, where torch has it
    backend = args.backend or ("nccl" if nccl else "gloo")   # else gloo (CPUs; GPUs where torch has no NCCL)
    device = common.pick_device(backend)   # DDP: one GPU per process
    dist.init_process_group(backend, store=common.attempt_store(), rank=rank, world_size=world_size,   # DDP: all ranks
                            device_id=device if backend == "nccl" else None)
    stop = common.StopSignal()   # DDP: SIGTERM/SIGUSR1 stop every rank at the same step, from now on
    master = rank == 0   # DDP: rank 0 alone prints and writes
    if master:
        os.makedirs(args.out, exist_ok=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)   # now, not at the first save
    train_set, test_set, classes = common.load_on_every_rank(lambda: datasets(args), world_size)   # DDP: per node
    shape = tuple(train_set[0][0].shape)   # (channels, height, width): the model is made for it
    rank_batch = common.check_batch(args.batch_size, world_size, len(train_set), rank, args.train_samples)
    if rank_batch % args.accum_steps:
        raise SystemExit(f"error: the per-rank batch {rank_batch} does not divide into --accum-steps "
                         f"{args.accum_steps} micro-batches" if master else 1)
    train_batches, sampler = common.train_loader(train_set, args.batch_size, args.seed, rank, world_size, device,
                                                 args.workers)   # DDP: this rank's 1/W of each global batch
    test_batches = common.test_loader(test_set, rank, world_size, device, args.workers)
    steps_per_epoch = len(train_set) // args.batch_size
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format

    net = common.resnet(args.arch, classes, args.seed, channels=shape[0], image_size=shape[-1],
                        zero_init_residual=args.zero_init_residual)   # each block's last BatchNorm from 0
    if args.sync_bn and device.type == "cuda":
        net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)   # DDP: batch statistics over all ranks
    elif args.sync_bn and master:
        print("note: --sync-bn needs CUDA (torch refuses SyncBatchNorm on CPU): per-rank BatchNorm", flush=True)
    net = net.to(device, memory_format=memory_format)
    lr = args.lr * args.batch_size / 256   # --lr is for 256 samples (the linear scaling rule)
    optimizer, scheduler = common.sgd_recipe(net, lr, args.weight_decay, round(args.warmup_epochs * steps_per_epoch),
                                             steps_per_epoch * args.epochs, args.nesterov)
    devices = common.every_rank(str(device), world_size)   # each rank's own
    metrics = common.new_metrics(__file__, args, devices, backend, world_size, len(test_set))
    # a resume must match them; BatchNorm normalises each micro-batch (of all ranks' with --sync-bn on CUDA)
    bn_batch = (args.batch_size if args.sync_bn and device.type == "cuda" else rank_batch) // args.accum_steps
    flags = {**vars(args), "image shape": shape, "training samples": len(train_set), "BatchNorm's batch": bn_batch}
    position = {"epoch": 1, "batch_in_epoch": 0, "step": 0, "totals": [0.0] * 3, "seconds": 0.0}
    state = load_checkpoint(args.checkpoint, net, optimizer, scheduler, master) if args.resume else None
    final_step = min(args.max_steps or math.inf, steps_per_epoch * args.epochs)
    if state:
        position = common.resume_position(state, flags, args.checkpoint, steps_per_epoch, final_step, master)
        if position is None:   # nothing left to train
            return net
        metrics["epochs"] = state["history"]
    def save(step, epoch, batch_in_epoch, totals, seconds):   # DDP: on every rank, at the same step; rank 0 writes
        partial = totals.clone()
        dist.all_reduce(partial)   # DDP: every rank's sums so far in this epoch
        if master:
            save_checkpoint(args.checkpoint, net, optimizer, scheduler, flags, metrics["epochs"], epoch=epoch,
                            batch_in_epoch=batch_in_epoch, step=step, totals=partial.tolist(), seconds=seconds)
            where = common.position_text(epoch, batch_in_epoch, steps_per_epoch)   # "epoch 3 done" at its end
            print(f"  checkpoint: step {step} ({where})", flush=True)
        dist.barrier()   # DDP: no rank goes on (or leaves, at a stop) before the checkpoint is on disk
    ddp_model, model, powersgd = wrap(net, args, device, backend, state is not None, master)   # DDP: the wrap
    if master:
        print(f"ddp_resnet: {args.arch} for {shape} images, {world_size} rank(s) on {device} ({backend}), global "
              f"batch {args.batch_size} = {world_size} x {rank_batch}, {args.accum_steps} micro-step(s), lr {lr:g} "
              f"({args.lr:g} x {args.batch_size}/256), cosine after {args.warmup_epochs:g} warm-up epochs", flush=True)
    step, start = position["step"], time.perf_counter()
    for epoch in range(position["epoch"], args.epochs + 1):
        done = position["batch_in_epoch"] if epoch == position["epoch"] else 0   # before a restart
        sampler.set_epoch(epoch, start=done)   # DDP: a new order each epoch, the same on every rank
        timer = common.Timer(device, already=position["seconds"] if done else 0.0)
        # summed loss, hits, samples; after a restart mid-epoch rank 0 carries all ranks' sums so far
        totals = torch.tensor(position["totals"] if done and master else [0] * 3, device=device, dtype=torch.float64)
        batch_in_epoch = done
        for batch_in_epoch, (X, y) in enumerate(train_batches, done + 1):
            X = X.to(device, non_blocking=True).contiguous(memory_format=memory_format)
            train_step(model, ddp_model, optimizer, X, y.to(device, non_blocking=True), args, totals)
            scheduler.step()   # the learning rate of the next step
            step += 1
            signalled = stop.agreed() if step < final_step else None   # DDP: one answer on all ranks
            epoch_end = batch_in_epoch == steps_per_epoch   # then the checkpoint waits for the evaluation
            every = args.checkpoint_every is not None and step % args.checkpoint_every == 0
            if signalled or (not epoch_end and (every or step == final_step)):
                save(step, epoch, batch_in_epoch, totals, timer())
            if signalled:   # DDP: every rank stops after this same step, the checkpoint written
                if master:
                    print(f"stopped by {signalled} at step {step}, checkpoint written; exit status 75 (not finished, "
                          f"nothing failed): run again with --resume to go on from {args.checkpoint}", flush=True)
                raise SystemExit(common.PREEMPTED)
            if step == final_step:
                break
        seconds = timer()
        tested = end_of_epoch(net, totals, test_batches, device, world_size)
        common.record_epoch(metrics, epoch, totals, seconds, tested, master)
        if batch_in_epoch == steps_per_epoch:   # the epoch's end, evaluated: a checkpoint of the next one's start
            save(step, epoch + 1, 0, torch.zeros(3, device=device, dtype=torch.float64), 0.0)
        if step == final_step:
            break
    if master and metrics["epochs"]:
        sent = bytes_sent_per_step(net, args, powersgd, step - position["step"], world_size)
        common.finish(metrics, step, time.perf_counter() - start, net.state_dict(), sent)
    return net

# ---------------------------------------------------------------- command line
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=common.positive_int, default=5, help="passes over the training set")
    p.add_argument("--batch-size", type=common.positive_int, default=256, help="global batch, over all ranks")
    p.add_argument("--lr", type=common.positive_float, default=0.05, help="for 256 samples, scaled to --batch-size")
    p.add_argument("--warmup-epochs", type=common.non_negative_float, default=0.0, help="the lr's linear ramp-up")
    p.add_argument("--nesterov", action="store_true", help="Nesterov momentum")
    p.add_argument("--label-smoothing", type=common.non_negative_float, default=0.0, help="of the loss, 0 to 1")
    p.add_argument("--zero-init-residual", action="store_true", help="each residual block starts as the identity")
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
    p.add_argument("--accum-steps", type=common.positive_int, default=1, help="gradient accumulation's micro-batches")
    p.add_argument("--amp", action="store_true", help="bfloat16 mixed precision")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory layout (faster convolutions on GPUs)")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over all ranks (CUDA only)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl on CUDA, else gloo (can share a GPU)")
    p.add_argument("--comm-hook", choices=("bf16", "fp16", "powersgd"), help="compress the gradients DDP sends")
    p.add_argument("--powersgd-rank", type=common.positive_int, default=4, help="PowerSGD: the rank of the factors")
    p.add_argument("--powersgd-start", type=int, default=10, help="PowerSGD: plain allreduce for this many steps "
                   "first (at least 2; PyTorch suggests ~10%% of the training)")
    p.add_argument("--out", default="runs/ddp_resnet", help="folder for metrics.json, curves.png and model.pt")
    p.add_argument("--checkpoint", help="written by rank 0 after every epoch, every --checkpoint-every steps, where "
                   "the run stops and on SIGTERM/SIGUSR1 (default: <out>/checkpoint.pt)")
    p.add_argument("--checkpoint-every", type=common.positive_int, help="also every N steps, inside epochs")
    p.add_argument("--resume", action="store_true", help="go on from --checkpoint (as rank 0 sees it), mid-epoch "
                   "too, at any world size with the same flags; without one, start at step 0")
    args = p.parse_args(argv)
    if args.powersgd_start < 2:
        p.error(f"argument --powersgd-start: must be 2 or more (DDP rebuckets after step 1), got {args.powersgd_start}")
    if args.label_smoothing > 1:
        p.error(f"argument --label-smoothing: must be at most 1, got {args.label_smoothing:g}")
    args.checkpoint = args.checkpoint or os.path.join(args.out, "checkpoint.pt")
    return args

@record   # DDP: an error's traceback goes to torchrun's error file, and its summary names the rank
def main(argv=None):
    args = parse_args(argv)
    common.default_to_one_process()   # plain `python ddp_resnet.py`: a group of one
    with common.leaving_the_group():   # DDP: after the run, a stop or an error
        return train(args)

if __name__ == "__main__":
    main()
