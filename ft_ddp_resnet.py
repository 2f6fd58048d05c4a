"""ResNet-18 on Fashion-MNIST, data parallel, training that outlives its members: no restart, no
lost step.

    export FT_SECRET=...                                   # the same on the coordinator and members
    python ft_ddp_resnet.py --serve HOST:PORT --run-id r1  # the coordinator: trains nothing
    until python ft_ddp_resnet.py --join HOST:PORT --out runs/m0 --resume; [ $? -le 2 ]; \\
        do sleep 1; done

The last line is a member, restarted until it finishes (0) or fails for good (1; 2: a wrong flag):
start any, anywhere, any time. One that fails leaves with a checkpoint (exit 75) and comes back
through that loop; all do if the coordinator is lost. The optimizer and its schedule are in
make_optimizer(). Then read in the order things happen: the step, the member, the coordinator,
the wire. No DDP wrapper: a failed allreduce leaves its reducer broken. `# FT:` marks what FT costs.

Its sums are exact (--sums float64), so a run ends with the weights of one without faults, bit for
bit, whoever computed which micro-batch and whoever left, joined or resumed. What a micro-batch
draws (dropout, stochastic depth) is seeded from (seed, step, micro-batch), whoever computes it:
a model of yours in make_model() that draws is exact too. BatchNorm2d's running statistics are
micro-batch 0's (each member's step sets the momentum of the others to 0): another kind of
normalisation with running statistics is not claimed.

What a step waits for is the lesson here. The other pages' steps wait for nothing; a member's
committed step waits three times, blocking: for its quorum (asked by its join or its last vote,
sent once every live member has asked), for the allreduce, and for the verdict on its vote, a
round trip to the coordinator.
"""
import argparse, contextlib, dataclasses, functools, hashlib, hmac, ipaddress, itertools, json
import math, os, secrets, select, signal, socket, sys, threading, time, zlib
from datetime import timedelta
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
import common


# ---------------------------------------------------------------- the flags
# FT: every member of a run has these, compared when it joins
SAME_IN_EVERY_MEMBER = ("batch_size", "micro_batch", "seed", "train_samples", "epochs", "max_steps",
                        "lr", "weight_decay", "sums")
# Compared as well, though not flags: a member that differs is told what to match.
NOT_FLAGS = {"torch": "torch version", "threads": "OMP_NUM_THREADS", "data": "data"}
# A --resume must repeat these, which choose the steps; any other flag (paths, logging, limits) may
# change.
RESUME_MUST_MATCH = ("batch_size", "micro_batch", "seed", "train_samples", "epochs", "lr",
                     "weight_decay", "sums", "data")


def address(text):
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(text)
    return host, int(port)


member_parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
member_parser.add_argument("--join", type=address, required=True, metavar="HOST:PORT",
                           help="the coordinator of the run")
member_parser.add_argument("--epochs", type=common.positive_int, default=5,
                           help="passes over the training set")
member_parser.add_argument("--batch-size", type=common.positive_int, default=256,
                           help="global batch, over all members")
member_parser.add_argument("--micro-batch", type=common.positive_int, default=32,
                           help="the size of a global batch's pieces")
member_parser.add_argument("--lr", type=common.positive_float, default=0.05,
                           help="SGD's learning rate for 256 samples, scaled linearly with the "
                           "global batch (make_optimizer(): the rule goes with the optimizer)")
member_parser.add_argument("--weight-decay", type=common.non_negative_float, default=5e-4,
                           help="on weights, not biases or BN")
member_parser.add_argument("--seed", type=int, default=0,
                           help="seeds the weights and the batch order")
member_parser.add_argument("--data-dir", help="a folder holding FashionMNIST/raw/ (default: "
                           "./data, downloaded there)")
member_parser.add_argument("--train-samples", type=common.positive_int,
                           help="use only the first N training images")
member_parser.add_argument("--test-samples", type=common.positive_int,
                           help="use only the first N test images")
member_parser.add_argument("--max-steps", type=common.positive_int,
                           help="stop after this many optimizer steps")
member_parser.add_argument("--sums", choices=("float64", "float32"), default="float64",
                           help="float64: the same bits whoever computes what; float32: half "
                           "the bytes, a faster step")
member_parser.add_argument("--min-members", type=common.positive_int, default=1,
                           help="the first step waits for this many")
member_parser.add_argument("--init-timeout", type=common.positive_float, default=300,
                           help="seconds to wait to join")
member_parser.add_argument("--print-every", type=common.every, default="10s", help="a progress "
                           "line every N steps (100) or N seconds (10s, the default); 0: none")
member_parser.add_argument("--out", default="runs/ft_ddp_resnet",
                           help="folder for metrics.json, curves.png and model.pt")
member_parser.add_argument("--checkpoint", help="this member's (default: <out>/checkpoint.pt), "
                           "written when it leaves")
member_parser.add_argument("--checkpoint-every", type=common.positive_int,
                           help="also write it every N committed steps")
member_parser.add_argument("--resume", action="store_true",
                           help="start from --checkpoint (then from the member ahead)")

coordinator_parser = argparse.ArgumentParser(
    description="The coordinator of a run of ft_ddp_resnet.py: it trains nothing.")
coordinator_parser.add_argument("--serve", type=address, required=True, metavar="HOST:PORT",
                                help="where members join")
coordinator_parser.add_argument("--run-id", help="the run: the one it printed continues that "
                                "run (default: a new one)")
coordinator_parser.add_argument("--store-port", type=common.positive_int,
                                help="where the groups meet (default: PORT + 1)")
coordinator_parser.add_argument("--member-timeout", type=common.positive_float, default=30,
                                help="seconds of no progress, while others wait, that drop a "
                                "member; its collectives and its coordinator's silence, too")


def parse_args(argv=None):
    """A member's flags, or with --serve the coordinator's."""
    if any(a.split("=")[0] == "--serve" for a in (sys.argv[1:] if argv is None else argv)):
        return coordinator_parser.parse_args(argv)
    args = member_parser.parse_args(argv)
    args.checkpoint = args.checkpoint or os.path.join(args.out, "checkpoint.pt")
    return args


# ---------------------------------------------------------------- your model goes here
def make_model(args, shape, classes):
    """The model for `shape` images ([C, H, W]) and `classes` classes: replace this body with your
    own nn.Module. Every member seeds torch before calling it (the same weights everywhere). What
    its step draws is seeded from (seed, step, micro-batch): a run with faults is exact."""
    return common.classifier("resnet18", classes, shape[0], shape[-1])


# ---------------------------------------------------------------- the optimizer and its schedule
def make_optimizer(model, args, steps_per_epoch):
    """SGD with momentum, its learning rate from --lr, and its schedule: swap the optimizer here,
    and the rule that makes its rate with it. It holds only the parameters that train (a frozen
    one gets no update). No weight decay on BatchNorm and the biases (the 1-D parameters: decaying
    them only fights the normalisation). The rate: --lr per 256 samples, scaled to the global batch
    (SGD's linear scaling rule), then decayed to zero along a cosine over the run's epochs. A
    LambdaLR: a member that recovers live makes it again at the step it recovered."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    optimizer = torch.optim.SGD(groups, lr=args.lr * args.batch_size / 256, momentum=0.9)
    # FT: a momentum of zeros steps as none does: every member holds the same tensors
    for p in params:
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    steps = steps_per_epoch * args.epochs
    return optimizer, LambdaLR(optimizer, lambda step: cosine(step, steps))


def cosine(step, steps):
    """The learning rate's factor at optimizer step `step`, counted from 0: half a cosine from 1
    down to 0 at the run's last step, `steps`, and 0 after it."""
    return 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps)))


# ---------------------------------------------------------------- 1. the step: exact sums
# A step's sums over its micro-batches, by name: the last three numbers of its allreduce.
SUMS = ("loss", "correct", "samples")


def statistics_of(model):
    """BatchNorm's running statistics. Their step counters are set after each committed step."""
    return {n: b for n, b in model.named_buffers() if not n.endswith("num_batches_tracked")}


def gradients_of(model):
    """One flat float32 tensor that every .grad is a view into (a frozen parameter has none):
    backward adds into it."""
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [p.numel() for p in params]
    flat = torch.zeros(sum(sizes))
    for p, piece in zip(params, flat.split(sizes)):
        p.grad = piece.view_as(p)
    return flat


def compute(model, grads, flat_sums, X, y, micro_batch, mine, seed, step):
    """This member's micro-batches `mine` of (X, y), step `step`'s: each one's mean-loss gradient
    added into flat_sums, and its loss, right answers and samples into the last three numbers
    there; what micro-batch i draws is seeded from (seed, step, i), whoever computes it. float64
    holds the exact sum of float32 values (unless their magnitudes differ by more than ~2^25; the
    float32 result then still agrees but for a ~2^-29 chance), whoever computes which, in any
    order."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    momentum = [norm.momentum for norm in norms]
    # What no micro-batch overwrites; with none, all of it: this member then sends zeros.
    flat_sums[len(grads) if mine else 0:].zero_()
    # Views of the last three numbers: += adds into flat_sums.
    loss_sum, correct, samples = flat_sums[-3:]
    for i in mine:
        # FT: running statistics from micro-batch 0 only
        for norm, usual in zip(norms, momentum):
            norm.momentum = usual if i == 0 else 0.0
        rows = slice(i * micro_batch, (i + 1) * micro_batch)
        X_micro, y_micro = X[rows], y[rows]
        common.seed_the_step(seed, step, i)
        grads.zero_()
        logits = model(X_micro)
        loss = F.cross_entropy(logits, y_micro)
        loss.backward()
        # FT: each micro-batch's gradient added exactly
        if i == mine[0]:
            # Copied: float32 added into float64 takes 7 times a copy's time.
            flat_sums[:len(grads)].copy_(grads)
        else:
            flat_sums[:len(grads)] += grads
        loss_sum += loss.detach().double() * len(y_micro)
        correct += (logits.argmax(1) == y_micro).sum()
        samples += len(y_micro)
    # As they were, for whoever uses the model next.
    for norm, usual in zip(norms, momentum):
        norm.momentum = usual


def failure(error, started):
    """What a vote says of a collective that failed, and how long it waited."""
    # gloo's messages begin with where in its source they were raised: the reason follows.
    why = " ".join(str(error).split()).split("] ", 1)[-1]
    return {"error": why[:160], "waited": time.monotonic() - started}


def exchange(model, grads, flat_sums, holds_first, count):
    """One allreduce of flat_sums: the gradients, micro-batch 0's running statistics (the others
    send zeros) and the step's SUMS. Then .grad is the mean over all `count` micro-batches, rounded
    once to float32. Returns ({name: its sum over all members}, None), or (None, the failure)."""
    stats = list(statistics_of(model).values())
    pieces = flat_sums[len(grads):-3].split([b.numel() for b in stats])
    if holds_first:
        for piece, b in zip(pieces, stats):
            piece.copy_(b.flatten())
    started = time.monotonic()
    # One allreduce after backward: buckets overlapped with it by hand were no faster on CPUs.
    try:
        dist.all_reduce(flat_sums)   # FT: on this generation's group
    except (RuntimeError, dist.DistError) as e:
        # Its group goes: a peer still in it fails now, not at the timeout (in gloo's ring a death
        # fails only its neighbours at once).
        dist.destroy_process_group()   # FT: the failed group goes
        return None, failure(e, started)
    for piece, b in zip(pieces, stats):
        b.copy_(piece.view_as(b))
    # In place: no temporary the size of the gradients.
    grads.copy_(flat_sums[:len(grads)].div_(count))
    return dict(zip(SUMS, flat_sums[-3:].tolist())), None


@torch.no_grad()
def evaluate(model, batches, device):
    """The test loss (plain cross-entropy), the test accuracy and the number of test images. Every
    member evaluates the whole test set alike, alone: a collective here could fail with a member."""
    sums = common.Sums.on(device, loss=0, correct=0, samples=0)
    with common.evaluating(model):
        for X, y in batches:
            logits = model(X)
            sums["loss"] += F.cross_entropy(logits, y, reduction="sum")
            sums["correct"] += (logits.argmax(1) == y).sum()
            sums["samples"] += len(y)
    # This member's own sums, not their total() over the group.
    loss, correct, samples = [value.item() for value in sums.values()]
    return {"test_loss": loss / samples, "test_acc": correct / samples,
            "test_count": round(samples)}


# An epoch's record in metrics.json, as recover() sends it: a row of numbers.
EPOCH_KEYS = ("epoch", "train_loss", "train_acc", "test_loss", "test_acc", "test_count",
              "samples", "samples_per_s", "seconds")


@dataclasses.dataclass
class Progress:
    """Where a member is, as of its last committed step: the steps done, the epoch's SUMS and
    seconds so far, and the records of the epochs done. A checkpoint keeps one."""
    step: int = 0
    sums: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(SUMS, 0.0))
    seconds: float = 0.0
    history: list = dataclasses.field(default_factory=list)


def recover(model, optimizer, progress, src, epochs):
    """Live recovery: every member of the new group takes the weights, running statistics,
    momentum and progress of member `src`, which is furthest ahead, as tensors (nothing to
    unpickle). Returns (the progress received, None), or (None, the failure)."""
    tensors = [p.data for p in model.parameters()] + list(statistics_of(model).values())
    tensors += [optimizer.state[p]["momentum_buffer"] for group in optimizer.param_groups
                for p in group["params"]]
    flat = torch.cat([t.float().flatten() for t in tensors])
    # The history as rows of EPOCH_KEYS, as many as the run has epochs: the same size everywhere.
    rows = [float(e[k]) for e in progress.history for k in EPOCH_KEYS]
    rows += [0.0] * (len(EPOCH_KEYS) * epochs - len(rows))
    head = [progress.step, progress.seconds, *progress.sums.values(), len(progress.history)]
    numbers = torch.tensor(head + rows, dtype=torch.float64)
    started = time.monotonic()
    try:
        dist.broadcast(flat, src=src)   # FT: the state of member src
        dist.broadcast(numbers, src=src)   # FT: its progress and history
    except (RuntimeError, dist.DistError) as e:
        dist.destroy_process_group()   # FT: as in exchange
        return None, failure(e, started)
    with torch.no_grad():
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(piece.view_as(t))
    step, seconds, *sums, epochs_done = numbers[:len(head)].tolist()
    table = numbers[len(head):].view(-1, len(EPOCH_KEYS))[:int(epochs_done)].tolist()
    history = [{**dict(zip(EPOCH_KEYS, row)), "epoch": int(row[0])} for row in table]
    return Progress(int(step), dict(zip(SUMS, sums)), seconds, history), None


# Drawn once an epoch, not at every step.
@functools.lru_cache(maxsize=1)
def epoch_order(num_samples, seed, epoch):
    """DistributedSampler's order: the global batches the other scripts draw."""
    sampler = torch.utils.data.DistributedSampler(range(num_samples), num_replicas=1, rank=0,
                                                  seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    return torch.tensor(list(sampler))


# ---------------------------------------------------------------- 2. a member: quorum, group, vote
class Member:
    """Each step: its quorum, its group, its share of the step, its vote. Stopped, dropped or
    without its coordinator, it leaves with a checkpoint and exit 75."""
    CHECKPOINT_KEYS = {"progress", "run", "model", "flags", "optimizer", "scheduler"}

    def __init__(self, args):
        self.args = args
        self.secret = the_secret(args.join[0])
        self.device = common.pick_device("gloo", cuda=False)   # FT: gloo between CPUs
        train_set, test_set, _ = common.fashion_mnist(args.data_dir, args.train_samples,
                                                      args.test_samples)
        self.X_train, self.y_train = train_set.tensors
        if args.batch_size % args.micro_batch:
            raise SystemExit(f"error: --micro-batch {args.micro_batch} does not divide "
                             f"--batch-size {args.batch_size}")
        if len(self.y_train) < args.batch_size:
            raise SystemExit(f"error: {len(self.y_train)} training images, fewer than "
                             f"--batch-size {args.batch_size}")
        # The same seed, the same weights on every member.
        torch.manual_seed(args.seed)
        self.model = make_model(args, tuple(self.X_train[0].shape), 10).to(self.device)
        self.steps_per_epoch = len(self.y_train) // args.batch_size
        self.final_step = min(args.max_steps or math.inf, self.steps_per_epoch * args.epochs)
        # Micro-batches in a global batch.
        self.count = args.batch_size // args.micro_batch
        self.optimizer, self.scheduler = make_optimizer(self.model, args, self.steps_per_epoch)
        self.grads = gradients_of(self.model)
        # What a step's allreduce sends: the gradients, BatchNorm's statistics and the SUMS.
        statistics = sum(b.numel() for b in statistics_of(self.model).values())
        size = len(self.grads) + statistics + len(SUMS)
        self.flat_sums = torch.zeros(size, dtype=getattr(torch, args.sums))
        self.test_batches = common.test_loader(test_set, 0, 1, self.device)
        self.metrics = common.new_metrics(__file__, args, [self.device],
                                          "gloo, members that come and go", 1, len(test_set))
        self.progress = Progress()
        self.flags = {k: getattr(args, k) for k in SAME_IN_EVERY_MEMBER}
        self.flags.update(final_step=self.final_step, min_members=args.min_members,
                          torch=torch.__version__, threads=torch.get_num_threads(),
                          data=f"labels crc {zlib.crc32(self.y_train.numpy().tobytes())}")
        # Those a checkpoint is written with: every flag, and the data.
        self.checkpoint_flags = {**vars(args), "data": self.flags["data"]}
        # FT: BatchNorm's statistics as committed, while a step is open
        self.committed_statistics = {}
        self.stop = {"signal": None, "at": 0.0}
        # "member N" once the coordinator has given it its id.
        self.name = "this member"
        # The generation whose group this member is in.
        self.gen = None
        self.generations = 0
        # The run's, once this member joined it or resumed its checkpoint.
        self.run_id = None
        if args.resume:
            self.resume()

    def train(self):
        """Joins the run, then takes part in its steps to the last. Returns the model."""
        if self.progress.step >= self.final_step:
            print(f"nothing to train: {self.args.checkpoint} is at step {self.progress.step}, and "
                  f"this run ends at step {self.final_step}", flush=True)
            return self.model
        os.makedirs(self.args.out, exist_ok=True)
        signal.signal(signal.SIGTERM, lambda signum, frame: self.stop.update(
            signal="SIGTERM", at=time.monotonic()))
        self.join()
        self.start_clocks()
        while self.progress.step < self.final_step and not self.stop["signal"]:
            self.attempt_step()
        if self.progress.step < self.final_step:
            self.leave(f"stopped by {self.stop['signal']} (the other members go on)",
                       common.PREEMPTED)
        sent = {}
        if self.generations:
            sent = {"all_reduce (the members)": common.nbytes(self.flat_sums)}
        # The last step wrote the epochs, its own too.
        seconds = sum(e["seconds"] for e in self.metrics["epochs"])
        common.finish(self.metrics, self.progress.step, seconds, self.model.state_dict(), sent)
        if dist.is_initialized():   # FT: leave the last group
            dist.destroy_process_group()   # FT: cleanly
        return self.model

    def attempt_step(self):
        """One try at the next step: its quorum, the state of the member ahead if this one is
        behind, this member's share, the allreduce and the vote. Then every member applies the
        step, or none does."""
        # FT: who takes part (the join or the vote asked)
        quorum = self.ask_coordinator()
        problem = self.new_group(quorum) if quorum["gen"] != self.gen else None
        if not problem and quorum["src"] is not None:
            problem = self.recover_from(quorum["src"])
        self.committed_statistics = {n: b.clone() for n, b in statistics_of(self.model).items()}
        step = self.progress.step
        step_sums = None
        if not problem:
            # This member's micro-batches of the global batch, then their sums over all members.
            order = epoch_order(len(self.y_train), self.args.seed, step // self.steps_per_epoch + 1)
            idx = order[step % self.steps_per_epoch * self.args.batch_size:][:self.args.batch_size]
            # FT: this member's share of the micro-batches
            mine = range(self.count * quorum["rank"] // quorum["world"],
                         self.count * (quorum["rank"] + 1) // quorum["world"])
            compute(self.model, self.grads, self.flat_sums, self.X_train[idx], self.y_train[idx],
                    self.args.micro_batch, mine, self.args.seed, step)
            step_sums, problem = exchange(self.model, self.grads, self.flat_sums, 0 in mine,
                                          self.count)
        # FT: all apply the step, or none. "next": this member asks for the next step's quorum too.
        verdict = self.ask_coordinator({"op": "vote", "step": step, "ok": problem is None,
                                        "next": not self.stop["signal"],
                                        **(problem or {"error": "", "waited": 0})})
        if verdict["commit"]:
            self.apply(step, step_sums)
        else:
            # FT: none applies it; the next quorum computes it again
            for name, b in statistics_of(self.model).items():
                b.copy_(self.committed_statistics[name])

    def recover_from(self, src):
        """The state of member `src`, when it is ahead of this one. Returns None, or the failure."""
        recovered, problem = recover(self.model, self.optimizer, self.progress, src,
                                     self.args.epochs)
        if recovered and recovered.step != self.progress.step:
            self.progress = recovered
            # FT: the learning rate of that step
            self.scheduler = LambdaLR(self.optimizer, self.scheduler.lr_lambdas,
                                      last_epoch=recovered.step - 1)
            self.start_clocks()
            print(f"{self.name}: recovered live at step {recovered.step}", flush=True)
        return problem

    def start_clocks(self):
        """The epoch's timer, and the progress line's clock, which counts from this step."""
        self.timer = common.Timer(self.device, already=self.progress.seconds)
        # Each member prints its own line, from its own clock (master: asks() reads this one's).
        self.progress_line = common.Progress(self.args.print_every, self.progress.step,
                                             self.final_step, self.args.batch_size, master=True)

    def new_group(self, quorum):
        """FT: a new membership, a new group (none is repaired), on keys of its own. It is made in a
        thread: a hung store waits for ever, and a peer stopped mid-handshake holds gloo about 5
        times the timeout; past 6 times, this member leaves. Returns None, or the failure."""
        self.gen = quorum["gen"]
        self.generations += 1
        print(f"{self.name}: generation {self.gen}: {quorum['world']} member(s) from step "
              f"{quorum['step']}", flush=True)
        if dist.is_initialized():   # FT: the last generation's group goes
            dist.destroy_process_group()   # FT: before this one's is made
        made = {"failure": "its store did not answer"}
        maker = threading.Thread(target=self.make_group, args=(quorum, made), daemon=True)
        maker.start()
        # Waited on the store: a time this process was stopped (SIGSTOP) is not the store's.
        waited = 0.0
        while maker.is_alive() and waited < 6 * self.timeout:
            before = time.monotonic()
            maker.join(0.25)
            waited += min(time.monotonic() - before, 0.5)
        if maker.is_alive():
            why = self.link.lost(f"its store did not answer for {6 * self.timeout:g} s")
            self.leave(why, common.PREEMPTED, end=os._exit)
        if made["failure"]:
            self.gen = None
        return made["failure"]

    def make_group(self, quorum, made):
        """new_group's thread: made["failure"] becomes None once the group is made, else why not."""
        started = time.monotonic()
        timeout = timedelta(seconds=self.timeout)
        # A client of the coordinator's store: connecting to a store that hangs waits for ever too.
        try:
            client = dist.TCPStore(*self.store_at, timeout=timeout)   # FT: the coordinator's store
            prefix = generation_prefix(self.secret, self.run_id, self.gen)
            store = SignedStore(client, self.secret, prefix)
            dist.init_process_group("gloo", store=store, rank=quorum["rank"],   # FT: its own group
                                    world_size=quorum["world"], timeout=timeout)
            made["failure"] = None
        except (RuntimeError, dist.DistError) as e:
            made["failure"] = failure(e, started)

    def apply(self, step, step_sums):
        """The committed step: the update, the progress and, when due, the progress line; at an
        epoch's end, or the run's last step, its evaluation, the same on every member, its line,
        metrics.json and curves.png; then the checkpoint, when it is due."""
        self.committed_statistics = {}
        self.optimizer.step()
        self.scheduler.step()
        # FT: the same on every member, whoever held micro-batch 0
        for name, b in self.model.named_buffers():
            if name.endswith("num_batches_tracked"):
                b.fill_(step + 1)
        progress = self.progress
        progress.step = step + 1
        progress.sums = {k: progress.sums[k] + step_sums[k] for k in SUMS}
        progress.seconds = self.timer()
        epoch = step // self.steps_per_epoch + 1
        line = self.progress_line
        # The step's allreduce brought every member's sums: the line waits for no one.
        if progress.step < self.final_step and line.due(progress.step, line.asks()):
            line.say(common.Position(epoch, step=progress.step), progress.sums,
                     self.scheduler.get_last_lr()[0])
        epoch_ends = progress.step % self.steps_per_epoch == 0
        if epoch_ends or progress.step == self.final_step:
            tested = evaluate(self.model, self.test_batches, self.device)
            record = common.epoch_record(epoch, progress.sums, progress.seconds, tested)
            print(f"epoch {epoch:3d}  loss {record['train_loss']:.4f}  train acc "
                  f"{record['train_acc']:.4f}  test loss {record['test_loss']:.4f}  test acc "
                  f"{record['test_acc']:.4f}  {record['samples_per_s']:,.0f} samples/s  "
                  f"{progress.seconds:.1f} s", flush=True)
            # Written now: a member that stops, or is killed, later keeps its history.
            self.metrics.update(generations=self.generations, epochs=progress.history + [record])
            common.write_outputs(self.metrics)
        # A run that ends inside an epoch keeps its sums, not its record: resumed with a larger
        # --max-steps, it goes on summing that epoch and records it once, over all its steps.
        if epoch_ends:
            # The next epoch's sums and seconds start from zero.
            self.progress = Progress(progress.step, history=progress.history + [record])
            self.timer = common.Timer(self.device)
            self.progress_line.new_epoch(progress.step)
        # After the epoch's evaluation: the checkpoint holds its record.
        if self.args.checkpoint_every and progress.step % self.args.checkpoint_every == 0:
            self.checkpoint()

    def resume(self):
        """From this member's own checkpoint, if there is one, written with the same training
        flags."""
        path = self.args.checkpoint
        if not os.path.exists(path):
            print(f"no checkpoint at {path}: this member starts from step 0 (or from its peers)",
                  flush=True)
            return
        here = {k: self.checkpoint_flags[k] for k in RESUME_MUST_MATCH}
        # A foreign file can raise anything, a KeyError too: said in one line, which file and why.
        try:
            saved = torch.load(path, map_location="cpu")
            common.check_keys(saved, self.CHECKPOINT_KEYS, os.path.basename(__file__))
            common.resume_check(saved["flags"], here, path, True)
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
            self.progress = Progress(**saved["progress"])
            self.run_id = saved["run"]
        except Exception as e:
            raise SystemExit(f"error: cannot resume from {path}: "
                             f"{common.one_line(e, 300)}") from None
        print(f"resumed from {path} (run {self.run_id}): step {self.progress.step}", flush=True)

    def join(self):
        """FT: both prove FT_SECRET; admitted, this member learns its id, the run's, the timeout and
        the store's port."""
        host, port = self.args.join
        mine = secrets.token_hex(16)
        try:
            self.link = CoordinatorLink(self.args.join, self.args.init_timeout, self.stop)
            challenge = str(self.link.receive().get("challenge"))
            answer = self.link.ask({"op": "join", "proof": proof(self.secret, challenge),
                                    "challenge": mine, "flags": self.flags,
                                    "step": self.progress.step, "run": self.run_id})
        except MustLeave as e:
            # A SIGTERM, or the connection lost: not a wrong secret.
            self.leave(str(e), common.PREEMPTED)
        except (ValueError, TypeError, AttributeError):
            # Not JSON, or not an object: no coordinator of this run.
            answer = {}
        expected = proof(self.secret, mine).encode()
        if not hmac.compare_digest(str(answer.get("proof")).encode(), expected):
            raise SystemExit(f"error: {host}:{port} refused this member or does not know "
                             f"FT_SECRET: give the coordinator and every member the same FT_SECRET")
        self.heed(answer)
        self.name = f"member {answer['id']}"
        self.run_id = answer["run"]
        self.timeout = self.link.timeout = answer["timeout"]   # FT: the run's, for every wait
        # FT: its groups meet on the coordinator's host
        self.store_at = (host, answer["store"])
        print(f"{self.name}: joined run {self.run_id} at {host}:{port}, at step "
              f"{self.progress.step}", flush=True)

    def ask_coordinator(self, message=None):
        """FT: `message` sent (if any), the coordinator's next word, unless it, a SIGTERM or silence
        ends this member."""
        try:
            reply = self.link.ask(message) if message else self.link.receive()
            return self.heed(reply)
        except MustLeave as e:
            self.leave(str(e), common.PREEMPTED)

    def heed(self, reply):
        """FT: a word that ends this member: refused or failed (1), the run over (0), dropped
        (75)."""
        if "refused" in reply:
            raise SystemExit(reply["refused"])
        # It hung until the run ended, or came during its last step.
        if "over" in reply:
            print(f"{self.name}: {reply['over']}; nothing is left to train", flush=True)
            raise SystemExit(0)
        if "failed" in reply:
            self.leave(reply["failed"], 1)
        # It hung past --member-timeout; the others went on without it.
        if "dropped" in reply:
            self.leave(f"dropped by the coordinator ({reply['dropped']})", common.PREEMPTED)
        return reply

    def leave(self, why, status, end=sys.exit):
        """FT: this member stops, with its checkpoint; the others go on without it."""
        step = self.checkpoint()
        out = sys.stdout if status == common.PREEMPTED else sys.stderr
        print(f"{self.name} at step {step}: {why}; its checkpoint is in {self.args.checkpoint}; "
              f"exit status {status}", file=out, flush=True)
        end(status)

    def checkpoint(self):
        """All a restart of the whole job needs, as of the last committed step, which it returns."""
        # FT: not the statistics of an open step
        weights = {**self.model.state_dict(), **self.committed_statistics}
        state = {"script": os.path.basename(__file__), "run": self.run_id,
                 "progress": dataclasses.asdict(self.progress),
                 "model": weights, "flags": self.checkpoint_flags,
                 "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        common.save_atomically(lambda tmp: torch.save(state, tmp), self.args.checkpoint)
        return self.progress.step


# ---------------------------------------------------------------- 3. the coordinator: its decisions
# Its state in two records; each decision a pure function of them, which says why (as torchft's
# lighthouse does).
@dataclasses.dataclass
class Connection:
    """One connection to the coordinator."""
    id: int
    # host:port, for its lines.
    peer: str
    # When it connected (it has PROVE_WITHIN s to prove FT_SECRET); a member: when it last
    # progressed.
    since: float
    # What it must sign to prove it.
    challenge: str
    sock: socket.socket = None
    # What came of a line not yet ended.
    buffer: bytes = b""
    # It proved FT_SECRET and was let in: a member.
    joined: bool = False
    # What it waits for: "ready", a quorum (its join or its vote's "next" asked), or a "vote".
    request: dict = None
    # Why it was dropped: it is told when it next speaks.
    dropped: str = None
    # Why it is closed at the end of this turn.
    lost: str = None


@dataclasses.dataclass
class Run:
    """The run, as the coordinator knows it."""
    # Its members' flags: those of the first to join while none is live.
    flags: dict = None
    # Its generation: one more for each new quorum.
    gen: int = 0
    # The generation's members, by rank ([]: a step failed).
    members: list = dataclasses.field(default_factory=list)
    # The steps committed.
    step: int = 0
    # (step, members, why) of the failed tries in a row.
    failures: list = dataclasses.field(default_factory=list)
    # When its last step was committed.
    finished: float = None
    # When a member last left mid-run (dropped, killed, stopped): its loop may bring it back.
    left: float = -math.inf


def stalled(now, live, run, timeout):
    """Who holds the others up: {id: why}. Liveness is progress: one that neither voted nor asked
    within `timeout` of one that waits; or, of the generation, one that has not voted 0.25 s after
    a peer's collective gave up."""
    waiting = [c.since for c in live.values() if c.request]
    gave_up = any(c.request["op"] == "vote" and not c.request["ok"]
                  and c.request["waited"] >= 0.9 * timeout and now - c.since > 0.25
                  for c in live.values() if c.request)
    why = {}
    for i, c in live.items():
        if not c.request and waiting and now - max(min(waiting), c.since) > timeout:
            why[i] = f"no vote and no request for {timeout:g} s while the others waited"
        elif not c.request and gave_up and i in run.members:
            why[i] = f"its peers' collective waited {timeout:g} s for it"
    return why


def commit_or_not(live, run):
    """The verdict on the generation's step: (None, why) while a live member of it has not voted;
    (True, why) if all its members voted yes for one step; else (False, why): no member applies
    it."""
    votes = {i: c.request for i, c in live.items()
             if c.request and c.request["op"] == "vote" and i in run.members}
    missing = [i for i in run.members if i in live and i not in votes]
    if not votes or missing:
        return None, f"waiting for the votes of members {missing}"
    steps = sorted({v["step"] for v in votes.values()})
    against = [f"member {i}: {v['error']}" for i, v in votes.items() if not v["ok"]]
    against += [f"member {i} is gone" for i in run.members if i not in live]
    if len(steps) > 1:
        against.append(f"votes for steps {steps}")
    if against:
        return False, "; ".join(against)
    return True, f"members {run.members} voted yes for step {steps[0]}"


def next_quorum(live, run):
    """Who takes part in the next step: ({gen, members, step, src}, why) once every live member
    asked (the first quorum: at least --min-members); a new generation if they changed or a step
    failed; src: the rank ahead, if any."""
    asking = sorted(i for i, c in live.items() if c.request and c.request["op"] == "ready")
    needed = run.flags["min_members"] if run.gen == 0 and run.flags else 1
    if not asking:
        return None, "no member asks"
    if run.finished is not None:
        return None, "the run is over"
    if len(asking) < max(len(live), needed):
        return None, f"members {asking} asked; waiting for all {max(len(live), needed)}"
    steps = [live[i].request["step"] for i in asking]
    src = steps.index(max(steps)) if min(steps) < max(steps) else None
    gen = run.gen + 1 if asking != run.members else run.gen
    quorum = {"gen": gen, "members": asking, "step": max(steps), "src": src}
    return quorum, f"generation {gen}: members {asking}"


def admit(run, run_id, flags, checkpoint_run):
    """Whether a member that proved FT_SECRET joins: ("joined", None), or ("over" or "refused",
    what it is told)."""
    # Even after the end: it is not this run that is over.
    if checkpoint_run not in (None, run_id):
        return "refused", (f"error: its checkpoint is of run {checkpoint_run}, and this "
                           f"coordinator serves run {run_id}: start it without --resume, or "
                           f"serve that run (--run-id {checkpoint_run})")
    # A member after the end, even during the last step: nothing to do.
    if run.finished is not None:
        return "over", f"the run is over: its members finished step {run.step}"
    # No flags yet: it is the first live member. min_members counts for the first quorum only.
    differ = [k for k, v in (run.flags or {}).items() if flags.get(k) != v and k != "min_members"]
    if differ:
        said = "; ".join(f"{k} {flags.get(k)} here, {run.flags[k]} in the run" for k in differ)
        remedy = " and ".join(sorted({NOT_FLAGS.get(k, "training flags") for k in differ}))
        return "refused", (f"error: this member differs from the run ({said}): start it with "
                           f"the run's {remedy}")
    return "joined", None


def run_over(now, run, connections, timeout):
    """(True, why) once the run finished and its members left, and none may still wake or come
    back (10 x timeout)."""
    if run.finished is None or any(c.joined and not c.dropped for c in connections):
        return False, "the run goes on"
    if (connections and now - run.finished <= 10 * timeout) or now - run.left <= 10 * timeout:
        return False, "a member may still wake or come back"
    return True, f"the run is over (step {run.step})"


class Coordinator:
    """Each turn: what came, then the decisions carried out. It ends on SIGTERM or with the run."""

    def __init__(self, args):
        host, port = args.serve
        self.secret = the_secret(host)
        self.run_id = args.run_id or secrets.token_hex(4)
        self.timeout = args.member_timeout
        self.listener = listen(host, port, "--serve")
        # FT: the store listens where members join, not on *
        store_socket = listen(host, args.store_port or port + 1, "--store-port")
        self.store_port = store_socket.getsockname()[1]
        self.store = dist.TCPStore(host, self.store_port, is_master=True,   # FT: where groups meet
                                   wait_for_workers=False, master_listen_fd=store_socket.detach())
        # {id: Connection}, and the next connection's id.
        self.connections = {}
        self.ids = itertools.count()
        self.last_beat = 0.0
        self.run = Run()
        print(f"coordinator: run {self.run_id}: members join at {host}:{port}, their groups meet "
              f"at {host}:{self.store_port}; to continue it after a restart: --run-id "
              f"{self.run_id}", flush=True)

    def serve(self):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            # Joins, requests for a quorum and votes (see handle); strangers' bytes refused.
            self.receive()
            now = time.monotonic()
            # Those given up on are closed, and said, before a commit.
            for c in [c for c in self.connections.values() if c.lost]:
                self.connections.pop(c.id).sock.close()
                # FT: it may come back through its loop: run_over waits
                if c.joined and self.run.finished is None:
                    self.run.left = now
                who = f"member {c.id}" if c.joined else f"the connection from {c.peer}"
                if c.joined or c.lost.startswith("refused"):
                    print(f"coordinator: {who} {c.lost}", flush=True)
            self.decide(now)
            over, why = run_over(now, self.run, self.connections.values(), self.timeout)
            if over:
                print(f"coordinator: {why}", flush=True)
                return

    def decide(self, now):
        """A turn's decisions, carried out: who is dropped, the verdict, the next quorum."""
        run = self.run
        live = {c.id: c for c in self.connections.values()
                if c.joined and not c.dropped and not c.lost}
        # FT: alive or not, the others go on without it
        for i, why in stalled(now, live, run, self.timeout).items():
            live.pop(i).dropped = why
            print(f"coordinator: member {i} dropped: {why}", flush=True)
        commit, why = commit_or_not(live, run)
        if commit is not None:
            self.give_verdict(commit, why, live, now)
        quorum, why = next_quorum(live, run)
        if quorum:
            run.gen, run.members = quorum["gen"], quorum["members"]
            # FT: each is told what it needs, not the membership
            for rank, i in enumerate(run.members):
                live[i].request = None
                self.send(live[i], {"gen": run.gen, "rank": rank, "world": len(run.members),
                                    "step": quorum["step"], "src": quorum["src"]})
        elif why == "the run is over":
            # FT: those that joined during the last step are told
            for c in live.values():
                self.send(c, {"over": f"the run is over: its members finished step {run.step}"})
                c.lost = "was told the run is over"

    def give_verdict(self, commit, why, live, now):
        """The verdict on the step: counted, and told to its voters. The same step failing 3 times
        in a row with the same members ends the run."""
        run = self.run
        voters = [live[i] for i in run.members if i in live]
        step = min(c.request["step"] for c in voters)
        if commit:
            run.failures = []
            run.step = max(run.step, step + 1)
            run.finished = now if run.step >= run.flags["final_step"] else None
        elif run.failures and run.failures[-1][:2] == (step, run.members):
            run.failures.append((step, run.members, why))
        else:
            run.failures = [(step, run.members, why)]
        for c in voters:
            # A vote with "next" also asks for the next step's quorum.
            asks = c.request["next"] and run.finished is None
            c.request = {"op": "ready", "step": c.request["step"] + commit} if asks else None
            c.since = now
            self.send(c, {"commit": commit})
        # FT: said, not retried
        if len(run.failures) >= 3:
            line = (f"error: step {step} failed {len(run.failures)} times in a row with members "
                    f"{run.members} ({why}): the run ends here; mend that, then --resume")
            print(f"coordinator: {line}", flush=True)
            for c in live.values():
                self.send(c, {"failed": line})
            raise SystemExit(1)
        # Its members left their group: the next quorum is a new generation, whoever is in it.
        if not commit:
            run.members = []

    def handle(self, c, message):
        """A message of this protocol from connection c."""
        if not c.joined:
            self.join(c, message)
        elif self.run.finished is not None:
            # One that hung past --member-timeout, say, and woke up.
            self.send(c, {"over": f"the run is over: its members finished step {self.run.step}"})
            c.lost = "was told the run is over"
        elif c.dropped:
            self.send(c, {"dropped": c.dropped})
            c.lost = "was told it had been dropped"
        else:
            c.request = message
            c.since = time.monotonic()

    def join(self, c, message):
        """A connection that proves it knows FT_SECRET joins, if admitted."""
        if message["op"] != "join":
            raise ValueError(f"{message['op']} before proving FT_SECRET")
        # Any text: compared as bytes.
        if not hmac.compare_digest(message["proof"].encode(),
                                   proof(self.secret, c.challenge).encode()):
            # Said: the member does not take it for a lost link.
            self.send(c, {"refused": "FT_SECRET"})
            raise ValueError("it does not know FT_SECRET")
        flags = message["flags"]
        if not all(isinstance(flags.get(k), (int, float)) for k in ("min_members", "final_step")):
            raise ValueError("join with unusable flags")
        # FT: the run's flags are its live members'; with none, the next admitted's
        if not any(c.joined and not c.dropped and not c.lost for c in self.connections.values()):
            self.run.flags = None
        verdict, why = admit(self.run, self.run_id, flags, message["run"])
        # FT: the coordinator proves it too
        answer = {"proof": proof(self.secret, message["challenge"]), verdict: why}
        if verdict == "joined":
            # It asks for its first quorum at once.
            c.joined = True
            c.since = time.monotonic()
            c.request = {"op": "ready", "step": message["step"]}
            self.run.flags = self.run.flags or flags
            print(f"coordinator: member {c.id} joined from {c.peer} at step {message['step']}",
                  flush=True)
            answer.update(id=c.id, run=self.run_id, store=self.store_port, timeout=self.timeout)
        else:
            c.lost = "was answered and let go"
        self.send(c, answer)

    # ---- its sockets: none ever blocks it, and what anyone sends ends at most their own connection

    def receive(self):
        """What came within 50 ms; who did not prove itself in time is refused; members get a
        beat."""
        socks = {c.sock: c for c in self.connections.values()}
        for sock in select.select([self.listener, *socks], [], [], 0.05)[0]:
            if sock is not self.listener:
                self.read(socks[sock])
                continue
            sock, peer = self.listener.accept()
            sock.setblocking(False)
            # Answers leave at once.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = Connection(next(self.ids), f"{peer[0]}:{peer[1]}", time.monotonic(),
                           secrets.token_hex(16), sock)
            self.connections[c.id] = c
            self.send(c, {"challenge": c.challenge})
            unproven = [u for u in self.connections.values() if not u.joined and not u.lost]
            # A flood: the oldest goes, so that a member still gets in.
            if len(unproven) > MAX_UNPROVEN:
                unproven[0].lost = (f"refused: more than {MAX_UNPROVEN} connections at once have "
                                    f"not joined")
        now = time.monotonic()
        for c in self.connections.values():
            if not c.joined and now - c.since > PROVE_WITHIN:
                c.lost = c.lost or (f"refused: it did not prove it knows FT_SECRET within "
                                    f"{PROVE_WITHIN:g} s")
        # FT: the coordinator is alive
        if now - self.last_beat > min(1.0, self.timeout / 4):
            self.last_beat = now
            for c in [c for c in self.connections.values() if c.joined]:
                self.send(c, {"beat": 1})

    def read(self, c):
        try:
            data = c.sock.recv(65536)
        except OSError:
            data = b""
        c.buffer += data
        try:
            while b"\n" in c.buffer and not c.lost:
                line, c.buffer = c.buffer.split(b"\n", 1)
                self.handle(c, parse(line))
            if len(c.buffer) > MAX_LINE:
                raise ValueError(f"a line longer than {MAX_LINE} bytes")
        except ValueError as e:
            c.lost = f"refused: {e}"
        if not data:
            c.lost = c.lost or "left (its connection closed)"

    def send(self, c, message):
        """A connection that cannot take a small message at once is lost."""
        data = (json.dumps(message) + "\n").encode()
        try:
            if c.sock.send(data) != len(data):
                raise BlockingIOError
        except OSError:
            c.lost = c.lost or "its connection failed"


# ---------------------------------------------------------------- 4. the wire: its members only
# No message of this protocol is longer: a longer line is refused.
MAX_LINE = 1 << 16
# Seconds a new connection has to prove it knows FT_SECRET.
PROVE_WITHIN = 5.0
# Connections still to prove it; with more at once (a flood), the oldest is closed.
MAX_UNPROVEN = 64
# What a member sends: each op's fields and their types.
MESSAGES = {"join": {"proof": str, "challenge": str, "flags": dict, "step": int,
                     "run": (str, type(None))},
            "vote": {"step": int, "ok": bool, "next": bool, "waited": (int, float), "error": str}}


def parse(line):
    """A message of this protocol (a JSON object of a known op, its fields of the right types),
    else ValueError."""
    # JSON nested past Python's limit ("[[[[...") raises RecursionError.
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        raise ValueError("not a line of JSON") from None
    # str(): a list is neither an op nor a key.
    op = str(message.get("op")) if isinstance(message, dict) else None
    if op not in MESSAGES:
        raise ValueError("not a message of this protocol")
    wrong = [k for k, kind in MESSAGES[op].items() if not isinstance(message.get(k), kind)]
    if wrong:
        raise ValueError(f"{op} without a proper {', '.join(wrong)}")
    return message


def the_secret(host):
    """FT_SECRET: it may be left out only where no other machine can connect."""
    secret = os.environ.get("FT_SECRET", "")
    # A name that does not resolve passes here: connecting says so.
    with contextlib.suppress(OSError, ValueError):
        if not secret and not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            raise SystemExit(f"error: {host} can be reached from other machines, and FT_SECRET is "
                             f"not set: give the coordinator and every member the same, e.g. "
                             f"export FT_SECRET=$(openssl rand -hex 16)")
    return secret.encode()


def proof(secret, challenge):
    """FT: only a holder of the secret computes it."""
    return hmac.new(secret, challenge.encode(), hashlib.sha256).hexdigest()


def generation_prefix(secret, run_id, gen):
    """FT: where a generation's keys are in the store: no guess finds them."""
    return hmac.new(secret, f"run {run_id} generation {gen}".encode(),
                    hashlib.sha256).hexdigest()[:32] + "/"


class SignedStore(dist.Store):
    """FT: anyone who reaches a TCPStore lists and writes its keys, so its values are signed."""

    def __init__(self, store, secret, prefix):
        super().__init__()
        self.store, self.secret, self.prefix = store, secret, prefix

    def signature(self, key, value):
        return hmac.new(self.secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key, value):
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.store.set(self.prefix + key, self.signature(self.prefix + key, value) + value)

    def get(self, key):
        signed = self.store.get(self.prefix + key)
        if not hmac.compare_digest(signed[:32], self.signature(self.prefix + key, signed[32:])):
            raise RuntimeError(f"the store's {key} is not signed with FT_SECRET: someone else "
                               f"wrote it")
        return signed[32:]

    def wait(self, keys, *timeout):
        self.store.wait([self.prefix + k for k in keys], *timeout)


def listen(host, port, flag):
    """A listening socket, or one line that says why there is none."""
    try:
        return socket.create_server((host, port))
    except OSError as e:
        raise SystemExit(f"error: cannot listen at {host}:{port} ({flag}): "
                         f"{e.strerror or e}") from None


class MustLeave(Exception):
    """A SIGTERM while this member waited for the coordinator, or the coordinator lost."""


class CoordinatorLink:
    """A member's line to the coordinator, which beats each second: silent for `timeout`, it is
    lost."""

    def __init__(self, address, init_timeout, stop):
        self.address, self.timeout, self.stop, self.buffer = address, init_timeout, stop, b""
        deadline = time.monotonic() + init_timeout
        while True:
            try:
                self.sock = socket.create_connection(address, timeout=5)
                break
            except OSError as e:
                if stop["signal"]:
                    raise MustLeave(f"stopped by {stop['signal']} while it waited for "
                                    f"{address[0]}:{address[1]}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"error: no coordinator at {address[0]}:{address[1]} within "
                                     f"{init_timeout:g} s ({e.strerror or e}): start one with "
                                     f"--serve {address[0]}:{address[1]}") from None
                time.sleep(0.2)
        # Small messages leave at once (no Nagle).
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def ask(self, message):
        try:
            self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError as e:
            raise MustLeave(self.lost(e)) from None
        return self.receive()

    def lost(self, why):
        return (f"lost the coordinator at {self.address[0]}:{self.address[1]} ({why}); once it is "
                f"back, --resume goes on")

    def receive(self):
        """The next message but beats; MustLeave after `timeout` of silence, or 0.5 s after a
        SIGTERM."""
        heard = time.monotonic()
        while True:
            if b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                message = json.loads(line)
                if "beat" not in message:
                    return message
            elif select.select([self.sock], [], [], 0.1)[0]:
                try:
                    data = self.sock.recv(65536)
                except OSError as e:
                    raise MustLeave(self.lost(e)) from None
                if not data:
                    raise MustLeave(self.lost("its connection closed"))
                self.buffer += data
                heard = time.monotonic()
            elif self.stop["signal"] and time.monotonic() - self.stop["at"] > 0.5:
                raise MustLeave(f"stopped by {self.stop['signal']} (the other members go on)")
            elif time.monotonic() - heard > self.timeout:
                raise MustLeave(self.lost(f"not a word from it for {self.timeout:g} s: it hangs "
                                          f"or cannot be reached"))


# ---------------------------------------------------------------- the start
def main(argv=None):
    args = parse_args(argv)
    if "serve" in args:
        return Coordinator(args).serve()
    return Member(args).train()


if __name__ == "__main__":
    main()
