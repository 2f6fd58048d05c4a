"""ResNet-18 with DiLoCo: ranks train alone for H steps, then average what they learned.

    python diloco_resnet.py                                   # one process, no launcher needed
    torchrun --standalone --nproc_per_node=2 diloco_resnet.py --local-steps 10
    torchrun --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 diloco_resnet.py --local-steps 50

DDP allreduces the gradients at every step; over a slow link between machines that wait is most of the step. DiLoCo
(Douillard et al., 2023) talks H times less often. Each rank trains its own replica on its share of each global batch
for `--local-steps` H inner steps, with ddp_resnet.py's optimizer (SGD, momentum 0.9, the large-batch recipe), its
momentum kept per rank. Then the ranks average the pseudo-gradient, the shared weights of the last sync minus their own,
and an outer SGD with Nesterov momentum (`--outer-lr` 0.7, `--outer-momentum` 0.9, the paper's) steps the shared weights
with it; every replica starts the next round from them. BatchNorm statistics are rank 0's at each sync, as in
ddp_resnet.py.

With `--local-steps 1 --outer-lr 1 --outer-momentum 0` this is ddp_resnet.py, step for step: the average of the ranks'
SGD updates from the same weights is the update of their averaged gradient (momentum is linear too). That is the
lesson's proof, and a test.

Data, model, recipe, checkpoints and preemption as in ddp_resnet.py. Evaluation and model.pt use the shared weights of
the last sync. A checkpoint holds the shared weights and the outer momentum, and a folder beside it every rank's replica
with its inner optimizer: a run stopped inside a round resumes in it (at the same world size). Copy it with common.py.
Lines that exist only because of distribution are tagged `# DiLoCo:`.
"""
import argparse, collections, functools, math, os, shutil, sys, time
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
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

# ---------------------------------------------------------------- the outer step: what makes this DiLoCo
class Outer:
    """The shared weights (of the last sync) and the outer optimizer that steps them."""
    def __init__(self, net, lr, momentum):
        self.params = [p.detach().clone() for p in net.parameters()]   # where every replica started the round
        self.buffers = [b.detach().clone() for b in net.buffers()]
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    def sync(self, net, world_size, sent):
        """The end of a round: one allreduce of every parameter's pseudo-gradient (the weights of
        the round's start minus this rank's), averaged, an outer step of the shared weights, and
        every replica set to them; rank 0's BatchNorm statistics for all."""
        pseudo = torch.cat([(start - p.detach()).flatten() for start, p in zip(self.params, net.parameters())])
        sent[f"all_reduce ({world_size} ranks)"] += common.nbytes(pseudo)
        dist.all_reduce(pseudo)   # DiLoCo: the round's only exchange of weights, H steps' worth
        pseudo /= world_size
        for start, part in zip(self.params, pseudo.split([p.numel() for p in self.params])):
            start.grad = part.view_as(start)
        self.optimizer.step()   # Nesterov: the shared weights move by the averaged pseudo-gradient, with momentum
        for buffer in net.buffers():
            sent[f"broadcast ({world_size} ranks)"] += common.nbytes(buffer)
            dist.broadcast(buffer, src=0)   # DiLoCo: BatchNorm statistics: rank 0's, as ddp_resnet.py keeps
        with torch.no_grad():
            for p, start in zip(net.parameters(), self.params):
                p.copy_(start)   # every replica starts the next round from the shared weights
            for b, shared in zip(net.buffers(), self.buffers):
                shared.copy_(b)

    def shared_state(self, net):
        """The shared weights as a state dict of `net`'s names (for evaluation and model.pt)."""
        names = [n for n, _ in net.named_parameters()] + [n for n, _ in net.named_buffers()]
        return dict(zip(names, self.params + self.buffers))

    def state_dict(self):
        return {"params": self.params, "buffers": self.buffers, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        with torch.no_grad():
            for mine, saved in zip(self.params + self.buffers, state["params"] + state["buffers"]):
                mine.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])

def evaluate_shared(test_batches, net, outer, device):
    """Test accuracy of the shared weights of the last sync (over all ranks); this rank's replica is put back after."""
    replica = {k: v.clone() for k, v in net.state_dict().items()}
    net.load_state_dict(outer.shared_state(net))
    net.eval()
    tested = common.accuracy(net, test_batches, device, dist.get_world_size())   # DiLoCo: [correct, count] summed
    net.load_state_dict(replica)
    return tested

# ---------------------------------------------------------------- checkpoints: the shared weights and every replica
def on_cpu(state):
    """The tensors in nested dicts and lists, copied to the CPU: a GPU tensor sent to rank 0
    would be unpickled there onto the GPU of the sender's number."""
    if torch.is_tensor(state):
        return state.cpu()
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    return type(state)(on_cpu(v) for v in state) if isinstance(state, (list, tuple)) else state

def replica_files(path, step):
    """The folder of the replicas that the checkpoint `path` of step `step` goes with."""
    return f"{path}.replicas-step{step}"

def save_checkpoint(path, net, optimizer, scheduler, outer, position, flags, history, rank, world_size):
    """Rank 0 writes each rank's replica, inner optimizer and random state (inside a round they differ) to a folder of
    their own, one file per rank, receiving them one at a time (its memory does not grow with the world size); then the
    checkpoint file itself: the position, the shared weights and outer momentum, and which folder goes with it. Older
    folders are deleted only once the new file is in place, so a crash leaves the last complete checkpoint."""
    replica = on_cpu({"model": net.state_dict(), "optimizer": optimizer.state_dict()})
    folder = replica_files(path, position["step"])
    for sender in range(world_size):
        if rank == 0:
            if sender:
                received = [None]
                dist.recv_object_list(received, src=sender)   # DiLoCo: rank `sender`'s replica, alone
                replica = received[0]
            os.makedirs(folder, exist_ok=True)
            common.save_atomically(lambda tmp: torch.save(replica, tmp), os.path.join(folder, f"rank{sender}.pt"))
        elif rank == sender:
            dist.send_object_list([replica], dst=0)   # DiLoCo: this rank's replica to rank 0
    if rank == 0:
        state = {"world_size": world_size, **position, "flags": flags, "history": history, "outer": outer.state_dict(),
                 "scheduler": scheduler.state_dict(), "replicas": os.path.basename(folder)}
        common.save_atomically(lambda tmp: torch.save(state, tmp), path)
        prefix = os.path.basename(path) + ".replicas-step"
        for name in os.listdir(os.path.dirname(os.path.abspath(path))):
            if name.startswith(prefix) and name != os.path.basename(folder):
                shutil.rmtree(os.path.join(os.path.dirname(os.path.abspath(path)), name), ignore_errors=True)
    dist.barrier()   # DiLoCo: no rank goes on (or leaves, at a stop) before the checkpoint is on disk

def load_checkpoint(path, net, optimizer, scheduler, outer, rank, world_size):
    """Rank 0 reads and checks the file, sends all ranks the position and shared weights, then each rank its replica,
    one at a time. Returns the checkpoint, or None when there is none; errors exit, said once."""
    state = [None]
    if rank == 0 and not os.path.exists(path):
        print(f"no checkpoint at {path}: training starts from step 0", flush=True)
    elif rank == 0:
        try:
            state[0] = torch.load(path, map_location="cpu")
            if not isinstance(state[0], dict) or "outer" not in state[0]:
                raise ValueError("it holds no diloco_resnet.py checkpoint")
            if state[0]["world_size"] != world_size:
                raise ValueError(f"it was written by {state[0]['world_size']} ranks, each with its own replica; "
                                 f"resume with {state[0]['world_size']}")
            folder = os.path.join(os.path.dirname(os.path.abspath(path)), state[0]["replicas"])
            mine = torch.load(os.path.join(folder, "rank0.pt"), map_location="cpu")
            net.load_state_dict(mine["model"])   # checked here, once
        except Exception as e:
            state[0] = f"error: cannot resume from {path}: {' '.join(str(e).split())[:400]}"
    dist.broadcast_object_list(state, src=0)   # DiLoCo: the position and shared weights, or the verdict
    if isinstance(state[0], str):
        raise SystemExit(state[0] if rank == 0 else 1)
    if state[0]:
        for receiver in range(1, world_size):
            if rank == 0:   # each rank its replica, one in rank 0's memory at a time
                theirs = torch.load(os.path.join(folder, f"rank{receiver}.pt"), map_location="cpu")
                dist.send_object_list([theirs], dst=receiver)   # DiLoCo: rank `receiver`'s replica
            elif rank == receiver:
                received = [None]
                dist.recv_object_list(received, src=0)   # DiLoCo: this rank's replica
                mine = received[0]
        net.load_state_dict(mine["model"])
        optimizer.load_state_dict(mine["optimizer"])
        scheduler.load_state_dict(state[0]["scheduler"])
        outer.load_state_dict(state[0]["outer"])
    return state[0]

# ---------------------------------------------------------------- one inner step
def train_step(net, optimizer, X, y, amp, totals):
    """This rank's step on its replica, alone: nothing is sent. Adds the summed loss, the hits and the samples
    to `totals` (on the device: no sync with the GPU)."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(X.device.type, torch.bfloat16, enabled=amp):
        logits = net(X)
        loss = F.cross_entropy(logits, y)
    loss.backward()   # this rank's gradient only
    optimizer.step()   # the inner step, of this rank's replica
    totals[0] += loss.detach() * len(y)
    totals[1] += (logits.argmax(1) == y).sum()
    totals[2] += len(y)   # a Python number: no copy to the device

# ---------------------------------------------------------------- training
def train(args):
    # DiLoCo: join the process group. torchrun sets these variables (a plain `python` run: a group of one).
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nccl = torch.cuda.is_available() and dist.is_nccl_available()   # DiLoCo: NCCL between GPUs, where torch has it
    backend = args.backend or ("nccl" if nccl else "gloo")   # else gloo (CPUs; GPUs where torch has no NCCL)
    device = common.pick_device(backend)   # DiLoCo: one GPU per process
    dist.init_process_group(backend, store=common.attempt_store(), rank=rank,   # DiLoCo: all ranks
                            world_size=world_size, device_id=device if backend == "nccl" else None)
    stop = common.StopSignal()   # DiLoCo: SIGTERM/SIGUSR1 stop every rank at the same step, from now on
    master = rank == 0   # DiLoCo: rank 0 alone prints and writes
    if master:
        os.makedirs(args.out, exist_ok=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)   # now, not at the first save
    train_set, test_set, classes = common.load_on_every_rank(lambda: datasets(args), world_size)   # DiLoCo: per node
    shape = tuple(train_set[0][0].shape)   # (channels, height, width): the model is made for it
    rank_batch = common.check_batch(args.batch_size, world_size, len(train_set), rank, args.train_samples)
    train_batches, sampler = common.train_loader(train_set, args.batch_size, args.seed, rank, world_size, device,
                                                 args.workers)   # DiLoCo: this rank's 1/W of each global batch
    test_batches = common.test_loader(test_set, rank, world_size, device, args.workers)
    steps_per_epoch = len(train_set) // args.batch_size
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format

    net = common.resnet(args.arch, classes, args.seed, channels=shape[0], image_size=shape[-1])
    net = net.to(device, memory_format=memory_format)
    lr = args.lr * args.batch_size / 256   # --lr is for 256 samples of the global batch
    optimizer, scheduler = common.sgd_recipe(net, lr, args.weight_decay, round(args.warmup_epochs * steps_per_epoch),
                                             steps_per_epoch * args.epochs)   # inner, per rank
    outer = Outer(net, args.outer_lr, args.outer_momentum)   # the same seed: the same start on every rank
    devices = common.every_rank(str(device), world_size)   # each rank's own
    metrics = common.new_metrics(__file__, args, devices, backend, world_size, len(test_set))
    flags = {**vars(args), "image shape": shape, "training samples": len(train_set)}   # a resume must match them
    position = {"epoch": 1, "batch_in_epoch": 0, "step": 0, "totals": [0.0] * 3, "seconds": 0.0}
    state = None
    if args.resume:
        state = load_checkpoint(args.checkpoint, net, optimizer, scheduler, outer, rank, world_size)
    last_step = steps_per_epoch * args.epochs   # a round ends every H steps, and here
    final_step = min(args.max_steps or math.inf, last_step)
    if state:
        position = common.resume_position(state, flags, args.checkpoint, steps_per_epoch, final_step, master)
        if position is None:   # nothing left to train
            return outer.shared_state(net)
        metrics["epochs"] = state["history"]
    def save(step, epoch, batch_in_epoch, totals, seconds):   # DiLoCo: every rank sends its replica; rank 0 writes
        partial = totals.clone()
        dist.all_reduce(partial)   # DiLoCo: every rank's sums so far in this epoch
        here = {"epoch": epoch, "batch_in_epoch": batch_in_epoch, "step": step, "totals": partial.tolist(),
                "seconds": seconds}
        save_checkpoint(args.checkpoint, net, optimizer, scheduler, outer, here, flags, metrics["epochs"], rank,
                        world_size)
        if master:
            where = common.position_text(epoch, batch_in_epoch, steps_per_epoch)   # "epoch 3 done" at its end
            print(f"  checkpoint: step {step} ({where})", flush=True)
    sent = collections.Counter()   # the bytes this rank hands to collectives in this run's steps (metrics.json)
    if master:
        print(f"diloco_resnet: {args.arch} for {shape} images, {world_size} rank(s) on {device} ({backend}), global "
              f"batch {args.batch_size} = "
              f"{world_size} x {rank_batch}, lr {lr:g} ({args.lr:g} x {args.batch_size}/256), cosine after "
              f"{args.warmup_epochs:g} warm-up epochs; a sync every {args.local_steps} step(s): outer SGD lr "
              f"{args.outer_lr:g}, Nesterov momentum {args.outer_momentum:g}", flush=True)
    step, start = position["step"], time.perf_counter()
    for epoch in range(position["epoch"], args.epochs + 1):
        done = position["batch_in_epoch"] if epoch == position["epoch"] else 0   # before a restart
        sampler.set_epoch(epoch, start=done)   # a new order each epoch, the same on every rank
        timer = common.Timer(device, already=position["seconds"] if done else 0.0)
        totals = torch.tensor(position["totals"] if done and master else [0] * 3, device=device, dtype=torch.float64)
        batch_in_epoch = done
        for batch_in_epoch, (X, y) in enumerate(train_batches, done + 1):
            X = X.to(device, non_blocking=True).contiguous(memory_format=memory_format)
            train_step(net, optimizer, X, y.to(device, non_blocking=True), args.amp, totals)
            scheduler.step()
            step += 1
            if step % args.local_steps == 0 or step == last_step:
                outer.sync(net, world_size, sent)   # DiLoCo: the end of a round
            signalled = stop.agreed() if step < final_step else None   # DiLoCo: one answer on all ranks
            epoch_end = batch_in_epoch == steps_per_epoch   # then the checkpoint waits for the evaluation
            every = args.checkpoint_every is not None and step % args.checkpoint_every == 0
            if signalled or (not epoch_end and (every or step == final_step)):
                save(step, epoch, batch_in_epoch, totals, timer())
            if signalled:   # DiLoCo: every rank stops after this same step, the replicas written
                if master:
                    print(f"stopped by {signalled} at step {step}, checkpoint written; exit status 75 (not finished, "
                          f"nothing failed): run again with --resume to go on from {args.checkpoint}", flush=True)
                raise SystemExit(common.PREEMPTED)
            if step == final_step:
                break
        seconds = timer()
        dist.all_reduce(totals)   # DiLoCo: loss, hits and samples over all ranks
        tested = evaluate_shared(test_batches, net, outer, device)
        common.record_epoch(metrics, epoch, totals, seconds, tested, master)
        if batch_in_epoch == steps_per_epoch:   # the epoch's end, evaluated: a checkpoint of the next one's start
            save(step, epoch + 1, 0, torch.zeros(3, device=device, dtype=torch.float64), 0.0)
        if step == final_step:
            break
    if master and metrics["epochs"]:
        if step % args.local_steps and step != last_step:
            print(f"note: stopped inside a round: model.pt holds the shared weights of the last sync "
                  f"(step {step - step % args.local_steps}); --resume goes on in the round", flush=True)
        common.finish(metrics, step, time.perf_counter() - start, outer.shared_state(net),
                      {k: v / max(1, step - position["step"]) for k, v in sent.items()})   # per step of this run
    return outer.shared_state(net)

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
    p.add_argument("--local-steps", type=common.positive_int, default=10,
                   help="H: inner steps each rank takes alone between two syncs (1: every step, as DDP)")
    p.add_argument("--outer-lr", type=common.positive_float, default=0.7,
                   help="the outer SGD's learning rate, on the averaged pseudo-gradient")
    p.add_argument("--outer-momentum", type=common.non_negative_float, default=0.9,
                   help="the outer SGD's Nesterov momentum (0: none)")
    p.add_argument("--checkpoint", help="checkpoint written by rank 0 after every epoch, every --checkpoint-every "
                                        "steps, where the run stops and on SIGTERM/SIGUSR1 "
                                        "(default: <out>/checkpoint.pt)")
    p.add_argument("--checkpoint-every", type=common.positive_int, help="also every N steps, inside epochs and rounds")
    p.add_argument("--resume", action="store_true",
                   help="go on from --checkpoint (as rank 0 sees it), mid-round too; without one, start at step 0")
    p.add_argument("--out", default="runs/diloco_resnet", help="folder for metrics.json, curves.png and model.pt")
    args = p.parse_args(argv)
    args.checkpoint = args.checkpoint or os.path.join(args.out, "checkpoint.pt")
    return args

@record   # DiLoCo: an error's traceback goes to torchrun's error file, and its summary names the rank
def main(argv=None):
    args = parse_args(argv)
    common.default_to_one_process()   # plain `python diloco_resnet.py`: a group of one
    with common.leaving_the_group():   # DiLoCo: after the run, a stop or an error
        return train(args)

if __name__ == "__main__":
    main()
