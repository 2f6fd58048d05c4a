"""ResNet-18 with DiLoCo: ranks train alone for H steps, then average what they learned.

    python diloco_resnet.py                                   # one process, no launcher needed
    torchrun --standalone --nproc_per_node=2 diloco_resnet.py --local-steps 10
    torchrun --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 diloco_resnet.py \\
        --local-steps 50

DDP allreduces the gradients at every step; over a slow link between machines that wait is most
of the step. DiLoCo (Douillard et al., 2023) talks H times less often. Each rank trains its own
replica on its share of each global batch for `--local-steps` H inner steps, with ddp_resnet.py's
optimizer (SGD, momentum 0.9, the large-batch recipe), its momentum kept per rank. Then the ranks
average the pseudo-gradient, the shared weights of the last sync minus their own, and an outer SGD
with Nesterov momentum (`--outer-lr` 0.7, `--outer-momentum` 0.9, the paper's) steps the shared
weights with it; every replica starts the next round from them. BatchNorm statistics are rank 0's
at each sync, as in ddp_resnet.py.

Streaming DiLoCo (Douillard et al., 2025) hides the sync behind the steps: `--fragments` F cuts
the model's parameters into F consecutive runs of about equal bytes (fragments()), and every H/F
steps one fragment, in turn, is synced, so each is synced every H steps: a sync sends a fragment's
pseudo-gradient, not the model's. It leaves `--sync-delay` TAU steps before its outer step, on a
process group of its own, while the ranks train on; the step of its outer step is the only one
that waits for it. Then each replica takes lerp(shared, its own, `--fragment-alpha` ALPHA) of
the fragment: 0 drops what it learned in those TAU steps. On the parameters this is the
arithmetic of torchft's DiLoCo with model fragments (which leaves buffers alone); here rank 0's
BatchNorm statistics, all of them (38 KB for ResNet-18), come with every sync, blocking. At the
training's last step every fragment is synced (a sync due later is not started).

    torchrun --standalone --nproc_per_node=2 diloco_resnet.py --local-steps 8 --fragments 4 \\
        --sync-delay 1 --fragment-alpha 0.5 --outer-lr 1 --outer-momentum 0

What these flags gave, measured in benchmarks/README.md (ResNet-18, 2 simulated nodes on 2 CPU
cores, 96 steps): 1.3 points under DDP's test accuracy over 3 seeds. In so short a training the
default outer step, the paper's Nesterov one meant for thousands of syncs, overshot (`--local-steps
20 --fragments 4 --sync-delay 4 --fragment-alpha 0.5`: 4.1 points under). A larger H sends less,
each fragment once every H steps, and a larger TAU leaves the link more time: a fragment's bytes
over your link's rate should fit in TAU steps. Over 100 Mbit/s H = 20, TAU = 4 hid the syncs
(1.08x the steps without them; H = 8 1.41x). Over 10 Mbit/s only H = 100, F = 5, TAU = 19 did
(0.96x), and in 96 steps one sync a fragment did not train it (H = 100, TAU = 15: 0.59 test
accuracy).

With `--local-steps 1 --outer-lr 1 --outer-momentum 0` this is ddp_resnet.py, step for step: the
average of the ranks' SGD updates from the same weights is the update of their averaged gradient
(momentum is linear too). That is the lesson's proof, and a test. Not with --clip-grad-norm: each
rank clips its own gradient, where DDP clips their average.

Data, model, optimizer and its schedule, checkpoints and preemption as in ddp_resnet.py.
Evaluation and model.pt use the shared weights of the last sync (each fragment's), a state dict
of the model's: a frozen parameter is neither sent nor stepped, and a buffer kept out of
state_dict stays each rank's own. A checkpoint holds the shared weights, the outer momentum and
a fragment's pseudo-gradient on its way (waited for, summed over the ranks), and a folder beside
it every rank's things (its replica, inner optimizer, schedule, and yours): a run stopped inside
a round resumes in it, bit for bit (at the same world size). Copy it with common.py. Lines that
exist only because of distribution are tagged `# DiLoCo:`.
"""
import argparse, collections, copy, dataclasses, glob, math, os, shutil
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
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
training.add_argument("--amp", action="store_true", help="bfloat16 mixed precision")
training.add_argument("--clip-grad-norm", type=common.positive_float, metavar="MAX",
                      help="scale each rank's own gradient down to this total norm, when above "
                      "it (the progress line shows its norm before: the mean over the ranks and "
                      "the steps since the line before or the epoch's start, and the largest; "
                      "metrics.json the epoch's)")
training.add_argument("--local-steps", type=common.positive_int, default=10, help="H: inner steps "
                      "each rank takes alone between two syncs (1: every step, as DDP)")
training.add_argument("--outer-lr", type=common.positive_float, default=0.7,
                      help="the outer SGD's learning rate, on the averaged pseudo-gradient")
training.add_argument("--outer-momentum", type=common.non_negative_float, default=0.9,
                      help="the outer SGD's Nesterov momentum (0: none)")
training.add_argument("--fragments", type=common.positive_int, default=1, help="F: the model cut "
                      "into F fragments of about equal bytes (fragments()), one synced every H/F "
                      "steps in turn, each once every H (Streaming DiLoCo; 1: all at once)")
training.add_argument("--sync-delay", type=common.non_negative_int, default=0, help="TAU: a "
                      "fragment's pseudo-gradient is sent TAU steps before its outer step, while "
                      "the ranks train on (under H/F)")
training.add_argument("--fragment-alpha", type=float, default=0.0, help="ALPHA, from 0 to 1: "
                      "after a fragment's outer step each replica takes lerp(shared, its own, "
                      "ALPHA) of it (0: the shared weights)")
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
                    help="default: nccl on CUDA, else gloo (can share a GPU)")
parser.add_argument("--print-every", type=common.every, default="10s", help="a progress line "
                    "every N steps (100) or N seconds (10s, the default); 0: none")
parser.add_argument("--out", default="runs/diloco_resnet",
                    help="folder for metrics.json, curves.png and model.pt")
parser.add_argument("--checkpoint", help="written by rank 0 after every epoch, every "
                    "--checkpoint-every steps, where the run stops and on SIGTERM/SIGUSR1, with "
                    "every rank's replica in a folder beside it (default: <out>/checkpoint.pt)")
parser.add_argument("--checkpoint-every", type=common.positive_int,
                    help="also every N steps, inside epochs and rounds")
parser.add_argument("--resume", action="store_true", help="go on from --checkpoint (as rank 0 "
                    "sees it), mid-round too, at the same world size and training flags; without "
                    "one, start at step 0")


def parse_args(argv=None):
    args = parser.parse_args(argv)
    args.checkpoint = args.checkpoint or os.path.join(args.out, "checkpoint.pt")
    # Taken, it would fail at the run's first save, after training.
    if os.path.isdir(args.checkpoint) or args.checkpoint.endswith(("/", os.sep)):
        raise SystemExit(f"error: --checkpoint {args.checkpoint} is a folder: diloco_resnet.py "
                         "keeps its checkpoint in a file (name one: DIR/checkpoint.pt)")
    # Each fragment syncs once every H steps, and its sync ends before the next one starts.
    every = args.local_steps // args.fragments
    if args.local_steps % args.fragments:
        raise SystemExit(f"error: --fragments {args.fragments} does not divide --local-steps "
                         f"{args.local_steps}: one fragment syncs every H/F steps")
    if args.sync_delay >= every:
        raise SystemExit(f"error: --sync-delay {args.sync_delay} is not under --local-steps / "
                         f"--fragments = {every}: a fragment's sync would start before the last "
                         "one ends")
    if not 0 <= args.fragment_alpha <= 1:
        raise SystemExit(f"error: --fragment-alpha {args.fragment_alpha} is not from 0 to 1")
    return args


# ---------------------------------------------------------------- your data goes here
def datasets(args):
    """(training set, test set, number of classes): replace this body with your own Datasets. Any
    whose items are (image tensor [C, H, W], label) will do: the model is made for their images'
    shape, and the loader draws their random numbers (torch's) from (seed, epoch, index), so that
    a resume is exact."""
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
    it). This page seeds torch before calling it (every replica starts from the same weights), then
    puts the model on the device. What its step draws (dropout, stochastic depth) is seeded from
    (seed, step, micro-batch: a rank's batch): a resume is exact. To fine-tune, load weights here (a
    previous run's model.pt; torchvision's weights= are for RGB images and 1000 classes) and freeze
    a part: requires_grad_(False), and .eval() on it, which keeps its BatchNorm statistics."""
    return common.classifier(args.arch, classes, shape[0], shape[-1])


# ---------------------------------------------------------------- the optimizer and its schedule
def make_optimizer(raw_model, args, steps_per_epoch):
    """SGD with momentum, its learning rate from --lr, and its schedule: swap the optimizer here,
    and the rule that makes its rate with it. It holds only the parameters that train: a frozen one
    (requires_grad_(False)) gets no update, no weight decay and no momentum. Weight decay on the
    weights only: decaying BatchNorm's parameters and the biases (the 1-D ones) only fights the
    normalisation. The rate: raised linearly over the warm-up (large batches diverge without one),
    then decayed to zero along a cosine, counted in optimizer steps: the loop steps the schedule
    after each one. Here the inner optimizer, each rank's own, that steps its replica."""
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


# ---------------------------------------------------------------- what one sync sends
def fragments(raw_model, count):
    """The model's parameters that train, in its order, cut into `count` consecutive runs of about
    equal bytes: each goes where its middle byte falls (a tensor of a fifth of the model makes a
    run of its own; more runs than such tensors leave one empty, refused). Streaming DiLoCo syncs
    the runs in this order, one at a time. Cut them your way here, by name if you like
    (raw_model.named_parameters()): `count` runs that hold each parameter that trains once."""
    params = trained_params(raw_model)
    total, before = common.nbytes(*params), 0
    runs = [[] for _ in range(count)]
    for p in params:
        runs[min(count - 1, int((before + common.nbytes(p) / 2) / total * count))].append(p)
        before += common.nbytes(p)
    return runs


def checked_fragments(raw_model, args, master):
    """fragments()'s runs, refused in one line unless they are --fragments runs, none empty,
    holding each parameter that trains once."""
    runs = fragments(raw_model, args.fragments)
    held = sorted(id(p) for run in runs for p in run)
    if len(runs) != args.fragments or not all(runs) or held != sorted(map(id, trained_params(
            raw_model))):
        raise SystemExit(f"error: fragments() must cut the parameters that train into --fragments "
                         f"{args.fragments} runs, none empty, each parameter in one: fewer "
                         "fragments, or cut them your way there" if master else 1)
    return runs


# ---------------------------------------------------------------- one inner step
def train_step(model, optimizer, X, y, step, args, sums):
    """This rank's step on its replica, alone: nothing is sent. With --clip-grad-norm this rank's
    own gradient is clipped (DDP clips the averaged one: with clipping, --local-steps 1 is no
    longer DDP's step). The epoch's sums grow on the device: nothing here waits for the GPU."""
    optimizer.zero_grad(set_to_none=True)
    # What this rank's batch draws, seeded by its number among the step's batches.
    common.seed_the_step(args.seed, step, dist.get_rank())   # DiLoCo: which of them all
    with torch.autocast(X.device.type, torch.bfloat16, enabled=args.amp):
        logits = model(X)
        loss = F.cross_entropy(logits, y)
    # This rank's gradient only.
    loss.backward()
    if args.clip_grad_norm:
        # The total norm of this replica's gradient, before clipping.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        common.add_norm(sums, norm)
    # The inner step, of this rank's replica.
    optimizer.step()
    sums["loss"] += loss.detach() * len(y)
    sums["correct"] += (logits.argmax(1) == y).sum()
    # A Python number: no copy to the device.
    sums["samples"] += len(y)


@torch.no_grad()
def evaluate(raw_model, outer, batches, args, device):
    """The test loss (plain cross-entropy) and accuracy of the shared weights (each fragment's last
    sync's) over all ranks, each test image counted once, and that count, in the training's
    precision and memory layout. This rank's replica is put back after, each module in its mode."""
    replica = copy.deepcopy(raw_model.state_dict())
    raw_model.load_state_dict(outer.shared)
    sums = common.Sums.on(device, loss=0, correct=0, samples=0)
    with common.evaluating(raw_model):
        for X, y in batches:
            X = X.to(device, non_blocking=True).contiguous(memory_format=memory_format(args))
            y = y.to(device, non_blocking=True)
            with torch.autocast(device.type, torch.bfloat16, enabled=args.amp):
                logits = raw_model(X)
            sums["loss"] += F.cross_entropy(logits.float(), y, reduction="sum")
            sums["correct"] += (logits.argmax(1) == y).sum()
            sums["samples"] += len(y)
    raw_model.load_state_dict(replica)
    tested = sums.total()   # DiLoCo: summed over all ranks
    return {"test_loss": tested["loss"] / tested["samples"],
            "test_acc": tested["correct"] / tested["samples"],
            "test_count": round(tested["samples"])}


# ---------------------------------------------------------------- checkpoints
class Checkpoint:
    """The checkpoint file, written by rank 0 and read by rank 0 alone: the position, the training
    flags, the history of the epochs, the shared weights and the outer momentum, and the name of
    its replica folder. That folder, beside the file, holds every rank's own `things` (its replica,
    its inner optimizer, the schedule, and what you add: between syncs the replicas differ), one
    file per rank, moved through rank 0 one at a time: its memory does not grow with the world
    size. A resume needs the same world size."""
    KEYS = {"position", "flags", "history", "outer", "world_size", "replicas"}

    def __init__(self, args, things, outer, flags, metrics, steps_per_epoch):
        self.path, self.every, self.things = args.checkpoint, args.checkpoint_every, things
        self.outer, self.flags, self.metrics = outer, flags, metrics
        self.steps_per_epoch = steps_per_epoch
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()   # DiLoCo: of how many
        self.master = self.rank == 0
        # Made now, not at the first save: a folder that cannot be made stops the run at once.
        if self.master:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def due(self, here):
        """Every --checkpoint-every steps; at an epoch's end the checkpoint waits for its
        evaluation."""
        inside = here.batch_in_epoch < self.steps_per_epoch
        return self.every is not None and here.step % self.every == 0 and inside

    def save(self, position):
        """On every rank at the same step: every rank's replica to rank 0, then rank 0 writes the
        file. Older replica folders are deleted only once the new file is in place, so that a
        crash leaves the last complete checkpoint."""
        folder = f"{self.path}.replicas-step{position.step}"
        # A sync on its way has arrived on every rank: none leaves it behind at a stop.
        self.outer.arrived()   # DiLoCo: wait for it
        self.save_replicas(folder)
        if self.master:
            state = {"script": os.path.basename(__file__), "position": dataclasses.asdict(position),
                     "flags": self.flags, "history": self.metrics["epochs"],
                     "outer": self.outer.state_dict(), "world_size": self.world_size,
                     "replicas": os.path.basename(folder)}
            common.save_atomically(lambda tmp: torch.save(state, tmp), self.path)
            for older in glob.glob(f"{glob.escape(self.path)}.replicas-step*"):
                if older != folder:
                    shutil.rmtree(older, ignore_errors=True)
            where = position.where(self.steps_per_epoch)
            print(f"  checkpoint: step {position.step} ({where})", flush=True)
        # DiLoCo: no rank goes on, or leaves at a stop, before it is on disk
        dist.barrier()   # DiLoCo: wait for rank 0's write

    def save_replicas(self, folder):
        """Each rank's things into `folder`, a file per rank, written by rank 0 as it receives
        them, one at a time."""
        replica = on_cpu(common.states(self.things))
        for sender in range(self.world_size):
            if self.master and sender:
                received = [None]
                dist.recv_object_list(received, src=sender)   # DiLoCo: rank `sender`'s replica
                replica = received[0]
            if self.master:
                os.makedirs(folder, exist_ok=True)
                common.save_atomically(lambda tmp: torch.save(replica, tmp),
                                       os.path.join(folder, f"rank{sender}.pt"))
            elif self.rank == sender:
                dist.send_object_list([replica], dst=0)   # DiLoCo: to rank 0

    def resume(self, final_step):
        """The position to go on from, and the history back in metrics["epochs"]: from step 0
        without a checkpoint, None when this run has nothing left to train. Rank 0 reads and checks
        the file, sends every rank the position and the shared weights; the training flags are
        compared before any state is loaded; then rank 0 sends each rank its things, one at a time.
        An error is said once."""
        found = [None]
        if self.master and not os.path.exists(self.path):
            print(f"no checkpoint at {self.path}: training starts from step 0", flush=True)
        elif self.master:
            try:
                found[0] = torch.load(self.path, map_location="cpu")
                common.check_keys(found[0], self.KEYS, os.path.basename(__file__))
                written_by = found[0]["world_size"]
                if written_by != self.world_size:
                    raise ValueError(f"it was written by {written_by} ranks, each with its own "
                                     f"replica; resume with {written_by}")
            except Exception as e:
                # A foreign file can raise anything: say which file, and why.
                found[0] = f"error: cannot resume from {self.path}: {common.one_line(e, 400)}"
        dist.broadcast_object_list(found, src=0)   # DiLoCo: the position and shared weights
        state = found[0]
        if isinstance(state, str):
            raise SystemExit(state if self.master else 1)
        if state is None:
            return common.Position()
        here = common.resume_position(state, self.flags, self.path, final_step, self.master)
        if here is None:
            return None
        mine = [self.replica(state, 0) if self.master else None]
        for receiver in range(1, self.world_size):
            # Each rank its things, one in rank 0's memory at a time.
            if self.master:
                theirs = self.replica(state, receiver)
                dist.send_object_list([theirs], dst=receiver)   # DiLoCo: rank `receiver`'s replica
            elif self.rank == receiver:
                dist.recv_object_list(mine, src=0)   # DiLoCo: this rank's replica
        common.load_states(self.things, mine[0], self.path, self.master)
        self.outer.load_state_dict(state["outer"])
        self.metrics["epochs"] = state["history"]
        common.say_resumed(state, self.flags, self.path, here, self.steps_per_epoch, self.master)
        return here

    def replica(self, state, rank):
        """Rank `rank`'s things, from the folder of the checkpoint `state`."""
        path = os.path.join(os.path.dirname(self.path), state["replicas"], f"rank{rank}.pt")
        return torch.load(path, map_location="cpu")


def on_cpu(state):
    """The tensors in nested dicts and lists, copied to the CPU: a GPU tensor sent to rank 0
    would be unpickled there onto the GPU of the sender's number."""
    if torch.is_tensor(state):
        return state.cpu()
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(on_cpu(v) for v in state)
    return state


# ---------------------------------------------------------------- the outer step, and what it sends
class Outer:
    """The shared weights (of each fragment's last sync) and the outer optimizer that steps them.
    `shared` is a state dict of the model's (its names; a weight tied in two modules is one tensor
    under both): the outer step moves the parameters that train, and a sync brings rank 0's
    buffers (BatchNorm's statistics), all of them at each; a frozen parameter never changes, and a
    buffer kept out of state_dict stays each rank's own. The k-th sync (k = 1, 2, ...), after
    inner step k*H/F, is of fragment (k - 1) mod F: its pseudo-gradient (the shared weights minus
    this rank's) is sent `delay` steps before, without waiting, and at step k*H/F averaged over
    the ranks, stepped by the outer optimizer (its momentum is each parameter's, so each
    fragment's) and merged: each replica takes lerp(shared, its own, alpha). A sync whose step
    would come after the training's last step is not started; at that step every fragment not
    synced there is synced at once. `sent` counts the bytes this rank hands to collectives."""
    def __init__(self, raw_model, lr, momentum, local_steps=1, last_step=math.inf, runs=None,
                 delay=0, alpha=0.0):
        # Where every replica started, by name; each tensor cloned once.
        clones = {}
        for t in raw_model.state_dict(keep_vars=True).values():
            if t not in clones:
                clones[t] = t.detach().clone()
        self.shared = {name: clones[t] for name, t in raw_model.state_dict(keep_vars=True).items()}
        self.params = [clones[p] for p in trained_params(raw_model)]
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum,
                                         nesterov=momentum > 0)
        # Each fragment: (this replica's parameter, its shared weights) pairs.
        runs = runs or [trained_params(raw_model)]
        self.fragments = [[(p, clones[p]) for p in run] for run in runs]
        self.largest = max(common.nbytes(*run) for run in runs)
        self.every, self.last_step = local_steps // len(runs), last_step
        self.delay, self.alpha = delay, alpha
        # The syncs' allreduce travels on a group of its own while the steps go on: on NCCL, the
        # default group's collectives would queue behind it.
        self.group = dist.new_group()   # DiLoCo: the syncs' own
        self.ranks = dist.get_world_size()   # DiLoCo: how many
        # The sync under way: (its fragments, its pseudo-gradient, summed over the ranks once the
        # allreduce `work` has arrived).
        self.in_flight = self.work = None
        self.sent = collections.Counter()

    def after_step(self, raw_model, step):
        """After inner step `step` (the run's, from 1): a sync starts, ends, or both. Returns the
        bytes sent and the syncs ended."""
        sent, syncs, ended = sum(self.sent.values()), 0, []
        ahead = step + self.delay
        if ahead % self.every == 0 and ahead <= self.last_step:
            self.start([(ahead // self.every - 1) % len(self.fragments)])
        if step % self.every == 0:
            ended, syncs = self.end(raw_model), 1
        rest = [i for i in range(len(self.fragments)) if i not in ended]
        if step == self.last_step and rest:
            # The last step: the evaluation and model.pt hold every rank's training.
            self.start(rest)
            self.end(raw_model)
            syncs += 1
        return sum(self.sent.values()) - sent, syncs

    def shown(self, trained, window=""):
        """From sums over all ranks: the syncs ended, the bytes each rank sent, since the last
        progress line (window "_line") or in the epoch; and the largest fragment's bytes."""
        return {"syncs": round(trained["syncs" + window] / self.ranks),
                "sent_bytes": trained["sent" + window] / self.ranks,
                "largest_fragment_bytes": self.largest}

    def start(self, which):
        """The pseudo-gradient of fragments `which`, sent to be summed over the ranks, without
        waiting."""
        pairs = [pair for i in which for pair in self.fragments[i]]
        pseudo = torch.cat([(shared - p.detach()).flatten() for p, shared in pairs])
        self.sent[f"all_reduce ({self.ranks} ranks)"] += common.nbytes(pseudo)
        self.in_flight = (which, pseudo)
        # DiLoCo: one fragment's H steps' worth, sent while the ranks train on
        self.work = dist.all_reduce(pseudo, group=self.group, async_op=True)   # DiLoCo: summed

    def arrived(self):
        """The sync under way, its sum over the ranks waited for: the only wait of a step."""
        if self.work:
            self.work.wait()   # DiLoCo: all ranks' sum, arrived
            self.work = None
        return self.in_flight

    def end(self, raw_model):
        """The sync under way, ended: the averaged pseudo-gradient steps the fragments' shared
        weights, each replica merges them, and all take rank 0's buffers. Returns the fragments."""
        which, pseudo = self.arrived()
        self.in_flight = None
        pairs = [pair for i in which for pair in self.fragments[i]]
        average = pseudo / self.ranks
        for (p, shared), part in zip(pairs, average.split([p.numel() for p, _ in pairs])):
            shared.grad = part.view_as(shared)
        # Nesterov: the shared weights move by the averaged pseudo-gradient, with momentum; the
        # other fragments have no gradient, and do not move.
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        buffers = {name: b for name, b in raw_model.state_dict(keep_vars=True).items()
                   if not isinstance(b, torch.nn.Parameter)}
        for buffer in buffers.values():
            self.sent[f"broadcast ({self.ranks} ranks)"] += common.nbytes(buffer)
            dist.broadcast(buffer, src=0)   # DiLoCo: rank 0's BatchNorm statistics
        with torch.no_grad():
            # Every replica goes on from the shared weights (alpha 0), or towards its own.
            for p, shared in pairs:
                p.copy_(shared.lerp(p, self.alpha))
            for name, buffer in buffers.items():
                self.shared[name].copy_(buffer)
        return which

    def state_dict(self):
        """The shared weights, the outer momentum and a sync under way, its sum arrived."""
        return {"shared": self.shared, "optimizer": self.optimizer.state_dict(),
                "in_flight": self.arrived()}

    def load_state_dict(self, state):
        with torch.no_grad():
            for name, t in self.shared.items():
                t.copy_(state["shared"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        if state["in_flight"]:
            which, pseudo = state["in_flight"]
            self.in_flight = (which, pseudo.to(self.params[0].device))


def trained_params(raw_model):
    """The parameters that train, each once: a frozen one is not synced."""
    return [p for p in raw_model.parameters() if p.requires_grad]


def bytes_sent_per_step(sent, steps):
    """What this rank handed to collectives, per step of this run: `sent` counts its syncs'."""
    return {collective: nbytes / max(1, steps) for collective, nbytes in sent.items()}


# ---------------------------------------------------------------- the set-up
def join_the_group(args):
    """DiLoCo: this process joins the others. Returns its rank, the world size, its device and the
    backend."""
    # torchrun sets RANK and WORLD_SIZE; main() sets them for a plain `python` run, a group of one.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # NCCL between GPUs, where torch has it; else gloo (CPUs, and GPUs without NCCL).
    nccl = torch.cuda.is_available() and dist.is_nccl_available()   # DiLoCo: GPUs, NCCL
    backend = args.backend or ("nccl" if nccl else "gloo")
    device = common.pick_device(backend)   # DiLoCo: one GPU per process
    dist.init_process_group(backend, store=common.attempt_store(), rank=rank,   # DiLoCo: join
                            world_size=world_size)
    if backend == "nccl":
        common.one_rank_per_gpu(device)   # DiLoCo: before NCCL's first call
    # Every batch has one shape: on GPUs, cuDNN's autotuner picks each convolution's fastest
    # algorithm once, unless the run must repeat its bits.
    torch.backends.cudnn.benchmark = not args.deterministic
    torch.backends.cudnn.deterministic = args.deterministic
    return rank, world_size, device, backend


def load_data(args, rank, world_size, device):
    """The datasets, loaded by each node's first rank first, and this rank's loaders."""
    # DiLoCo: every node reads its own disk
    train_set, test_set, classes = common.load_on_every_rank(lambda: datasets(args), world_size)
    common.check_batch(args.batch_size, world_size, len(train_set), rank, args.train_samples)
    # DiLoCo: this rank's 1/W of each global batch
    train_batches, sampler = common.train_loader(train_set, args.batch_size, args.seed, rank,
                                                 world_size, device, args.workers)
    test_batches = common.test_loader(test_set, rank, world_size, device, args.workers)
    return train_set, test_set, classes, train_batches, sampler, test_batches


def place_model(args, shape, classes, device):
    """make_model()'s model on the device: this rank's replica, what the loop calls and whose state
    is saved."""
    # DiLoCo: every replica starts from the same weights
    torch.manual_seed(args.seed)
    return make_model(args, shape, classes).to(device, memory_format=memory_format(args))


def resume_flags(args, shape, train_set_size):
    """What a resume must match: the training flags and the data."""
    return {**common.flags_of(training, args), "image_shape": shape,
            "train_set_size": train_set_size}


def memory_format(args):
    if args.channels_last:
        return torch.channels_last
    return torch.contiguous_format


# ---------------------------------------------------------------- training
def train_epoch(raw_model, optimizer, scheduler, outer, batches, here, final_step, stop,
                checkpoint, progress, args, device):
    """Epoch `here.epoch`'s steps from its batch `here.batch_in_epoch` on, to the epoch's end, the
    run's last step or a stop; `here` moves with them. Returns the epoch's sums and seconds, and
    the stop's signal (None without one). A sync's end waits for every rank; no other step
    does: the stop vote a step starts is read a step later, when it has long arrived."""
    sums = common.Sums.on(device, loss=0, correct=0, samples=0, **common.NORM_SUMS, sent=0,
                          syncs=0, sent_line=0, syncs_line=0)
    # After a restart inside the epoch, rank 0 carries every rank's sums so far.
    if here.batch_in_epoch and dist.get_rank() == 0:   # DiLoCo: rank 0's sums
        sums = common.Sums.on(device, **here.sums)
    timer = common.Timer(device, already=here.seconds)
    progress.new_epoch(here.step)
    signalled = None
    for X, y in batches:
        X = X.to(device, non_blocking=True).contiguous(memory_format=memory_format(args))
        y = y.to(device, non_blocking=True)
        lr = scheduler.get_last_lr()[0]
        train_step(raw_model, optimizer, X, y, here.step, args, sums)
        # The learning rate of the next step.
        scheduler.step()
        here.batch_in_epoch += 1
        here.step += 1
        # DiLoCo: a fragment's sync starts, or ends (the only step that waits)
        sent, syncs = outer.after_step(raw_model, here.step)
        for window in ("", "_line"):
            sums["sent" + window] += sent
            sums["syncs" + window] += syncs
        if here.step == final_step:
            break
        # The last step's vote, which has arrived: a stop, or a progress line, on every rank.
        signalled, line = stop.vote(progress.asks())   # DiLoCo: one answer on every rank
        if signalled:
            break
        if progress.due(here.step, line):
            # Every rank sums its sums with the others' (a collective); rank 0 prints the line,
            # as common.Progress.say writes it.
            trained = sums.total()   # DiLoCo: the sums over all ranks
            synced = outer.shown(trained, "_line")
            progress.say(here, trained, lr, syncs_done=synced["syncs"],
                         sent_MB=synced["sent_bytes"] / 1e6,
                         largest_fragment_MB=synced["largest_fragment_bytes"] / 1e6)
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
        signalled = stop.agreed()   # DiLoCo: wait for every rank's vote
    return sums, seconds, signalled


def report_epoch(metrics, epoch, sums, seconds, tested, master, outer):
    """The epoch's line, in metrics["epochs"] and, from rank 0, on the screen, in metrics.json and
    curves.png: a run stopped later keeps them. The record has the epoch's syncs."""
    trained = sums.total()   # DiLoCo: summed over all ranks
    record = {**common.epoch_record(epoch, trained, seconds, tested), **outer.shown(trained)}
    metrics["epochs"].append(record)
    if master:
        print(f"epoch {epoch:3d}  loss {record['train_loss']:.4f}  train acc "
              f"{record['train_acc']:.4f}  test loss {record['test_loss']:.4f}  test acc "
              f"{record['test_acc']:.4f}  {record['samples_per_s']:,.0f} samples/s  "
              f"{seconds:.1f} s", flush=True)
        common.write_outputs(metrics)


def say_start(raw_model, shape, optimizer, args, world_size, device, backend):
    """The run's first line, from rank 0: the model, the ranks, the batch, both optimizers."""
    if dist.get_rank() == 0:   # DiLoCo: rank 0 says it
        print(f"diloco_resnet: {type(raw_model).__name__} for {shape} images, {world_size} rank(s) "
              f"on {device} ({backend}), global batch {args.batch_size} = {world_size} x "
              f"{args.batch_size // world_size}, {type(optimizer).__name__} at lr "
              f"{optimizer.param_groups[0]['initial_lr']:g}; {args.fragments} fragment(s), one "
              f"synced every {args.local_steps // args.fragments} step(s), sent {args.sync_delay} "
              f"step(s) ahead (alpha {args.fragment_alpha:g}): outer SGD lr {args.outer_lr:g}, "
              f"Nesterov momentum {args.outer_momentum:g}", flush=True)


def train(args):
    """The set-up, then the epochs, each evaluated and checkpointed. Returns the shared weights."""
    rank, world_size, device, backend = join_the_group(args)   # DiLoCo: join the others
    stop = common.StopSignal()   # DiLoCo: one stop for every rank
    master = rank == 0   # DiLoCo: only rank 0 prints, writes
    train_set, test_set, classes, train_batches, sampler, test_batches = load_data(
        args, rank, world_size, device)
    shape = tuple(train_set[0][0].shape)
    raw_model = place_model(args, shape, classes, device)
    steps_per_epoch = len(train_set) // args.batch_size
    last_step = steps_per_epoch * args.epochs
    final_step = min(args.max_steps or math.inf, last_step)
    optimizer, scheduler = make_optimizer(raw_model, args, steps_per_epoch)
    outer = Outer(raw_model, args.outer_lr, args.outer_momentum, args.local_steps, last_step,
                  checked_fragments(raw_model, args, master), args.sync_delay, args.fragment_alpha)
    devices = common.every_rank(str(device), world_size)
    metrics = common.new_metrics(__file__, args, devices, backend, world_size, len(test_set))
    # What a checkpoint keeps of each rank and every rank loads at a resume, by name (each has
    # state_dict() and load_state_dict()): yours go here.
    things = {"model": raw_model, "optimizer": optimizer, "scheduler": scheduler}
    checkpoint = Checkpoint(args, things, outer, resume_flags(args, shape, len(train_set)), metrics,
                            steps_per_epoch)
    here = checkpoint.resume(final_step) if args.resume else common.Position()
    if here is None:
        return outer.shared
    say_start(raw_model, shape, optimizer, args, world_size, device, backend)
    progress = common.Progress(args.print_every, here.step, final_step, args.batch_size, master)
    for epoch in range(here.epoch, args.epochs + 1):
        sampler.set_epoch(epoch, start=here.batch_in_epoch)   # DiLoCo: one order, new each epoch
        sums, seconds, signalled = train_epoch(raw_model, optimizer, scheduler, outer,
                                               train_batches, here, final_step, stop, checkpoint,
                                               progress, args, device)
        # A checkpoint inside the epoch: at a stop, or at the run's last step.
        if signalled or here.batch_in_epoch < steps_per_epoch:
            checkpoint.save(dataclasses.replace(here, sums=sums.total(), seconds=seconds))
        if signalled:
            break
        tested = evaluate(raw_model, outer, test_batches, args, device)
        report_epoch(metrics, epoch, sums, seconds, tested, master, outer)
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
        raise SystemExit(common.PREEMPTED)   # DiLoCo: every rank stops here
    # DiLoCo: every rank's peak GPU memory
    metrics["peak_memory_bytes"] = common.every_rank(common.peak_memory(device), world_size)
    if master and metrics["epochs"]:
        say_inside_round(here.step, last_step, args)
        sent = bytes_sent_per_step(outer.sent, here.step - progress.first_step)
        common.finish(metrics, here.step, progress.spent(), outer.shared, sent)
    return outer.shared


def say_inside_round(step, last_step, args):
    """A note when the run ends inside a round: model.pt holds the shared weights of the last
    sync, of each fragment's."""
    every = args.local_steps // args.fragments
    if step != last_step and (step % args.local_steps or args.fragments > 1):
        which = "the shared weights" if args.fragments == 1 else "each fragment's shared weights"
        print(f"note: stopped inside a round: model.pt holds {which} of the last sync "
              f"(step {step - step % every}); --resume goes on in the round", flush=True)


# DiLoCo: an error's traceback goes to torchrun's error file, and its summary names the rank.
@record
def main(argv=None):
    args = parse_args(argv)
    # A plain `python diloco_resnet.py`: a group of one.
    common.default_to_one_process()
    with common.leaving_the_group():   # DiLoCo: leave it at the end
        return train(args)


if __name__ == "__main__":
    main()
