"""ResNet-18 on Fashion-MNIST, data parallel, training that outlives its members: no restart, no lost step.

    export FT_SECRET=...                                        # the same on the coordinator and every member
    python ft_ddp_resnet.py --serve HOST:PORT --run-id r1       # the coordinator: trains nothing
    until python ft_ddp_resnet.py --join HOST:PORT --out runs/m0 --resume; [ $? -le 2 ]; do sleep 1; done

The last line is a member, restarted until it finishes (0) or fails for good (1; 2: a wrong flag): start any,
anywhere, any time. One that fails leaves with a checkpoint (exit 75) and comes back through that loop (rejoining in
place saved little); all do if the coordinator is lost. Read in the order things happen: the step, the member, the
coordinator, the wire. No DDP wrapper: a failed allreduce leaves its reducer broken. `# FT:` marks what FT costs.
"""
import argparse, contextlib, dataclasses, functools, hashlib, hmac, ipaddress, itertools, json, math, os
import secrets, select, signal, socket, sys, threading, time, zlib
from datetime import timedelta
import torch
import torch.distributed as dist
import torch.nn.functional as F
import common

SAME_IN_EVERY_MEMBER = ("batch_size", "micro_batch", "seed", "train_samples", "epochs", "max_steps", "lr",
                        "weight_decay", "sums")   # FT: compared when a member joins
NOT_FLAGS = {"torch": "torch version", "threads": "OMP_NUM_THREADS", "data": "data"}   # compared too: to match
MAY_CHANGE_ON_RESUME = ("out", "checkpoint", "checkpoint_every", "resume", "max_steps", "join", "init_timeout",
                        "data_dir", "test_samples", "min_members")

# ---------------------------------------------------------------- 1. the step: the same sums whoever computes them
def statistics_of(net):   # BatchNorm's running statistics (its step counters are set after each committed step)
    return {name: b for name, b in net.named_buffers() if not name.endswith("num_batches_tracked")}

def gradients_of(net):   # one flat float32 tensor that every .grad is a view into (backward adds into it)
    sizes = [p.numel() for p in net.parameters()]
    flat = torch.zeros(sum(sizes))
    for p, piece in zip(net.parameters(), flat.split(sizes)):
        p.grad = piece.view_as(p)
    return flat

def compute(net, grads, flat_sums, X, y, micro_batch, mine):
    """This member's micro-batches of (X, y), each one's mean-loss gradient added into flat_sums: float64 holds
    the exact sum of float32 values (unless their magnitudes differ by more than ~2^25; the float32 result then still
    agrees but for a ~2^-29 chance), whoever computes which, in any order. Returns [loss sum, hits, samples]."""
    totals = torch.zeros(3, dtype=flat_sums.dtype)
    norms = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    momentum = [norm.momentum for norm in norms]
    flat_sums[len(grads) if mine else 0:].zero_()   # what no micro-batch overwrites (with none, all: zeros are sent)
    for i in mine:
        for norm, usual in zip(norms, momentum):
            norm.momentum = usual if i == 0 else 0.0   # FT: running statistics from micro-batch 0 only
        X_micro, y_micro = X[i * micro_batch:(i + 1) * micro_batch], y[i * micro_batch:(i + 1) * micro_batch]
        grads.zero_()
        logits = net(X_micro)
        loss = F.cross_entropy(logits, y_micro)
        loss.backward()
        if i == mine[0]:   # FT: each micro-batch's gradient on its own, added exactly (the first copied: float32
            flat_sums[:len(grads)].copy_(grads)   # added into float64 takes 7x a copy's time)
        else:
            flat_sums[:len(grads)] += grads
        hits = (logits.argmax(1) == y_micro).sum().double()
        totals += torch.stack([loss.detach().double() * len(y_micro), hits, torch.ones_like(hits) * len(y_micro)])
    for norm, usual in zip(norms, momentum):   # as they were, for whoever uses the net next
        norm.momentum = usual
    return totals

def failure(error, started):   # what a vote says of a collective that failed, and how long it waited
    return {"error": " ".join(str(error).split()).split("] ", 1)[-1][:160], "waited": time.monotonic() - started}

def exchange(net, grads, flat_sums, totals, holds_first, count):
    """One allreduce: gradients, micro-batch 0's running statistics (others send zeros), loss sums; then .grad is
    the mean over all `count` micro-batches, rounded once to float32. ([loss, hits, samples] or None, the failure)"""
    stats = list(statistics_of(net).values())
    tail = flat_sums[len(grads):].split([b.numel() for b in stats] + [3])
    if holds_first:
        for piece, b in zip(tail, stats):
            piece.copy_(b.flatten())
    tail[-1].copy_(totals)
    started = time.monotonic()
    try:   # one allreduce after backward: buckets overlapped by hand took 0.34 s a step on 2 cores, this 0.33
        dist.all_reduce(flat_sums)   # FT: on this generation's group
    except (RuntimeError, dist.DistError) as e:   # its group goes: a peer still in it fails now, not at the timeout
        dist.destroy_process_group()   # FT: (in gloo's ring a death fails only its neighbours at once)
        return None, failure(e, started)
    for piece, b in zip(tail, stats):
        b.copy_(piece.view_as(b))
    grads.copy_(flat_sums[:len(grads)].div_(count))   # (in place: no 90 MB temporary)
    return tail[-1].clone(), None

EPOCH_KEYS = ("epoch", "train_loss", "train_acc", "test_acc", "test_count", "samples", "samples_per_s", "seconds")

def recover(net, optimizer, progress, src, epochs):
    """Live recovery: every member of the new group takes the weights, running statistics, momentum, position and
    history of member `src`, which is furthest ahead (as tensors: nothing to unpickle). (position or None, failure)"""
    tensors = ([p.data for p in net.parameters()] + list(statistics_of(net).values()) +
               [optimizer.state[p]["momentum_buffer"] for p in net.parameters()])
    flat = torch.cat([t.float().flatten() for t in tensors])
    rows = [float(e[k]) for e in progress["history"] for k in EPOCH_KEYS]
    head = [progress["step"], progress["seconds"], *progress["totals"], len(progress["history"])]
    position = torch.tensor(head + rows + [0.0] * (len(EPOCH_KEYS) * epochs - len(rows)), dtype=torch.float64)
    started = time.monotonic()
    try:
        dist.broadcast(flat, src=src)   # FT: the state, from the member furthest ahead
        dist.broadcast(position, src=src)   # FT: its position and history
    except (RuntimeError, dist.DistError) as e:
        dist.destroy_process_group()   # FT: as in exchange
        return None, failure(e, started)
    with torch.no_grad():
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(piece.view_as(t))
    rows = position[6:6 + len(EPOCH_KEYS) * int(position[5])].view(-1, len(EPOCH_KEYS)).tolist()
    return {"step": int(position[0]), "seconds": position[1].item(), "totals": position[2:5].tolist(),
            "history": [{**dict(zip(EPOCH_KEYS, row)), "epoch": int(row[0])} for row in rows]}, None

@functools.lru_cache(maxsize=1)   # drawn once an epoch, not at every step
def epoch_order(num_samples, seed, epoch):   # DistributedSampler's: the global batches the other scripts draw
    sampler = torch.utils.data.DistributedSampler(range(num_samples), num_replicas=1, rank=0, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    return torch.tensor(list(sampler))

# ---------------------------------------------------------------- 2. a member: quorum, group, step, vote
class Member:   # quorum, group, step, vote; stopped, dropped or without its coordinator: a checkpoint, exit 75

    def __init__(self, args):
        self.args = args
        self.secret = the_secret(args.join[0])
        self.device = common.pick_device("gloo", cuda=False)   # FT: gloo between CPUs: this script trains on CPUs
        train_set, self.test_set, _ = common.fashion_mnist(args.data_dir, args.train_samples, args.test_samples)
        self.X_train, self.y_train = train_set.tensors
        if args.batch_size % args.micro_batch:
            raise SystemExit(f"error: --micro-batch {args.micro_batch} does not divide --batch-size {args.batch_size}")
        if len(self.y_train) < args.batch_size:
            raise SystemExit(f"error: {len(self.y_train)} training images, fewer than --batch-size {args.batch_size}")
        self.net = common.resnet("resnet18", 10, args.seed, channels=1, image_size=28).to(self.device)
        self.steps_per_epoch = len(self.y_train) // args.batch_size
        self.final_step = min(args.max_steps or math.inf, self.steps_per_epoch * args.epochs)
        self.count = args.batch_size // args.micro_batch   # micro-batches in a global batch
        lr = args.lr * args.batch_size / 256   # --lr is for 256 samples; no warm-up
        steps = self.steps_per_epoch * args.epochs
        self.optimizer, self.scheduler = common.sgd_recipe(self.net, lr, args.weight_decay, 0, steps)
        for p in self.net.parameters():   # a momentum of zeros steps as none does: every member holds the same tensors
            self.optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
        self.grads = gradients_of(self.net)
        size = len(self.grads) + sum(b.numel() for b in statistics_of(self.net).values()) + 3   # and 3 loss sums
        self.flat_sums = torch.zeros(size, dtype=getattr(torch, args.sums))   # what a step's allreduce sends
        self.metrics = common.new_metrics(__file__, args, [self.device], "gloo, members that come and go", 1,
                                          len(self.test_set))
        self.progress = {"step": 0, "totals": [0.0] * 3, "history": [], "seconds": 0.0}   # totals, seconds: the epoch's
        self.flags = {**{k: getattr(args, k) for k in SAME_IN_EVERY_MEMBER}, "final_step": self.final_step,
                      "min_members": args.min_members, "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "data": f"labels crc {zlib.crc32(self.y_train.numpy().tobytes())}"}
        self.committed_statistics = {}   # FT: BatchNorm's running statistics as committed, while a step is open
        self.stop = {"signal": None, "at": 0.0}
        self.name = "this member"   # "member N" once the coordinator has given it its id
        self.gen = None   # the generation whose group this member is in
        self.generations = 0
        self.run_id = None   # the run's, once this member joined it or resumed its checkpoint
        if args.resume:
            self.resume()

    def train(self):
        os.makedirs(self.args.out, exist_ok=True)
        signal.signal(signal.SIGTERM, lambda signum, frame: self.stop.update(signal="SIGTERM", at=time.monotonic()))
        self.join()
        self.timer = common.Timer(self.device, already=self.progress["seconds"])
        while self.progress["step"] < self.final_step:
            if self.stop["signal"]:
                self.leave(f"stopped by {self.stop['signal']} (the other members go on)", common.PREEMPTED)
            quorum = self.ask_coordinator()   # FT: who takes part in this step (asked for by the join, or the vote)
            problem = self.new_group(quorum) if quorum["gen"] != self.gen else None
            if not problem and quorum["src"] is not None:   # FT: someone is behind: the member furthest ahead sends
                recovered, problem = recover(self.net, self.optimizer, self.progress, quorum["src"], self.args.epochs)
                if recovered and recovered["step"] != self.progress["step"]:   # this member was behind
                    self.progress = recovered
                    self.scheduler = torch.optim.lr_scheduler.LambdaLR(   # FT: the learning rate of that step
                        self.optimizer, self.scheduler.lr_lambdas, last_epoch=recovered["step"] - 1)
                    self.timer = common.Timer(self.device, already=recovered["seconds"])
                    print(f"{self.name}: recovered live at step {recovered['step']}", flush=True)
            self.committed_statistics = {name: b.clone() for name, b in statistics_of(self.net).items()}
            step = self.progress["step"]
            if not problem:   # this member's micro-batches of the global batch, then their sums over all members
                order = epoch_order(len(self.y_train), self.args.seed, step // self.steps_per_epoch + 1)
                idx = order[step % self.steps_per_epoch * self.args.batch_size:][:self.args.batch_size]
                mine = range(self.count * quorum["rank"] // quorum["world"],   # FT: this member's share
                             self.count * (quorum["rank"] + 1) // quorum["world"])
                self.net.train()
                totals = compute(self.net, self.grads, self.flat_sums, self.X_train[idx], self.y_train[idx],
                                 self.args.micro_batch, mine)
                step_totals, problem = exchange(self.net, self.grads, self.flat_sums, totals, 0 in mine, self.count)
            # FT: all apply the step, or none; "next": this member asks for the next step's quorum too
            verdict = self.ask_coordinator({"op": "vote", "step": step, "ok": problem is None,
                                            "next": not self.stop["signal"], **(problem or {"error": "", "waited": 0})})
            if verdict["commit"]:
                self.apply(step, step_totals)
            else:   # FT: no member applies it (BatchNorm's statistics go back too); the next quorum computes it again
                for name, b in statistics_of(self.net).items():
                    b.copy_(self.committed_statistics[name])
        self.metrics.update(generations=self.generations, epochs=self.progress["history"])
        sent = {"all_reduce (the members)": common.nbytes(self.flat_sums)} if self.generations else {}
        common.finish(self.metrics, self.progress["step"], sum(e["seconds"] for e in self.metrics["epochs"]),
                      self.net.state_dict(), sent)
        if dist.is_initialized():   # FT: leave the last group
            dist.destroy_process_group()   # FT: cleanly
        return self.net

    def new_group(self, quorum):
        """FT: a new membership, a new group (none is repaired), on keys of its own; made in a thread: a hung store
        waits for ever, a peer stopped mid-handshake holds gloo ~5x the timeout; past 6x this member leaves."""
        self.gen = quorum["gen"]
        self.generations += 1
        print(f"{self.name}: generation {self.gen}: {quorum['world']} member(s) from step {quorum['step']}", flush=True)
        if dist.is_initialized():   # FT: the last generation's group goes
            dist.destroy_process_group()   # FT: before this one's is made
        made = {"failure": "its store did not answer"}

        def make():   # FT: made["failure"]: None once made, or why it failed
            started = time.monotonic()
            try:   # a client of the coordinator's store: connecting to it when it hangs waits for ever too
                client = dist.TCPStore(*self.store_at, timeout=timedelta(seconds=self.timeout))   # FT: the store
                store = SignedStore(client, self.secret, generation_prefix(self.secret, self.run_id, self.gen))
                dist.init_process_group("gloo", store=store, rank=quorum["rank"],   # FT: its own group
                                        world_size=quorum["world"], timeout=timedelta(seconds=self.timeout))
                made["failure"] = None
            except (RuntimeError, dist.DistError) as e:
                made["failure"] = failure(e, started)
        maker = threading.Thread(target=make, daemon=True)
        maker.start()
        waited = 0.0   # on the store: a time this process was stopped (SIGSTOP) is not the store's
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

    def apply(self, step, step_totals):   # committed: the update, the position, an epoch's evaluation, a checkpoint
        self.committed_statistics = {}
        self.optimizer.step()
        self.scheduler.step()
        for name, b in self.net.named_buffers():
            if name.endswith("num_batches_tracked"):
                b.fill_(step + 1)   # FT: the same on every member, whoever held micro-batch 0
        totals = [a + b for a, b in zip(self.progress["totals"], step_totals.tolist())]
        self.progress = {**self.progress, "step": step + 1, "totals": totals, "seconds": self.timer()}
        if self.progress["step"] % self.steps_per_epoch == 0 or self.progress["step"] == self.final_step:
            self.net.eval()   # an epoch's end: every member evaluates alike
            tested = common.accuracy(self.net, common.test_loader(self.test_set, 0, 1, self.device), self.device, 1)
            self.metrics["epochs"] = self.progress["history"]
            common.record_epoch(self.metrics, step // self.steps_per_epoch + 1, torch.tensor(self.progress["totals"]),
                                self.progress["seconds"], tested, True)
            self.progress = {"step": step + 1, "totals": [0.0] * 3, "history": self.metrics["epochs"], "seconds": 0.0}
            self.timer = common.Timer(self.device)
        if self.args.checkpoint_every and self.progress["step"] % self.args.checkpoint_every == 0:
            self.checkpoint()   # after an epoch's evaluation

    def resume(self):   # from its own checkpoint, if there is one, with the same training flags as the other scripts
        path = self.args.checkpoint
        if not os.path.exists(path):
            print(f"no checkpoint at {path}: this member starts from step 0 (or from its peers)", flush=True)
            return
        try:   # a foreign pickle can raise anything (a KeyError too): said in one line, which file and why
            saved = torch.load(path, map_location="cpu")
            common.resume_check(saved["flags"], {**vars(self.args), "data": self.flags["data"]}, path, True,
                                may_differ=MAY_CHANGE_ON_RESUME)
            self.net.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
            self.progress = {k: saved[k] for k in self.progress}
            self.run_id = saved["run"]
        except Exception as e:
            raise SystemExit(f"error: cannot resume from {path}: {' '.join(str(e).split())[:300]}") from None
        print(f"resumed from {path} (run {self.run_id}): step {self.progress['step']}", flush=True)

    def join(self):
        """FT: both prove FT_SECRET; admitted, this member learns its id, the run's, the timeout, the store's port."""
        host, port = self.args.join
        mine = secrets.token_hex(16)
        try:
            self.link = CoordinatorLink(self.args.join, self.args.init_timeout, self.stop)
            challenge = str(self.link.receive().get("challenge"))
            answer = self.link.ask({"op": "join", "proof": proof(self.secret, challenge), "challenge": mine,
                                    "flags": self.flags, "step": self.progress["step"], "run": self.run_id})
        except MustLeave as e:   # a SIGTERM, or the connection lost: not a wrong secret
            self.leave(str(e), common.PREEMPTED)
        except (ValueError, TypeError, AttributeError):   # not JSON, or not an object: no coordinator of this run
            answer = {}
        if not hmac.compare_digest(str(answer.get("proof")).encode(), proof(self.secret, mine).encode()):
            raise SystemExit(f"error: {host}:{port} refused this member or does not know FT_SECRET: give the "
                             f"coordinator and every member the same FT_SECRET")
        self.heed(answer)
        self.name = f"member {answer['id']}"
        self.run_id = answer["run"]
        self.timeout = self.link.timeout = answer["timeout"]   # FT: the run's, for every wait
        self.store_at = (host, answer["store"])   # FT: where its groups meet, on the coordinator's host
        print(f"{self.name}: joined run {self.run_id} at {host}:{port}, at step {self.progress['step']}", flush=True)

    def ask_coordinator(self, message=None):
        """FT: `message` sent (if any), the coordinator's next word, unless it, a SIGTERM or silence ends it."""
        try:
            return self.heed(self.link.ask(message) if message else self.link.receive())
        except MustLeave as e:
            self.leave(str(e), common.PREEMPTED)

    def heed(self, reply):   # FT: a word that ends this member: refused or failed (1), the run over (0), dropped (75)
        if "refused" in reply:
            raise SystemExit(reply["refused"])
        if "over" in reply:   # it hung until the run ended, or came during its last step
            print(f"{self.name}: {reply['over']}; nothing is left to train", flush=True)
            raise SystemExit(0)
        if "failed" in reply:
            self.leave(reply["failed"], 1)
        if "dropped" in reply:   # it hung past --member-timeout; the others went on without it
            self.leave(f"dropped by the coordinator ({reply['dropped']})", common.PREEMPTED)
        return reply

    def leave(self, why, status, end=sys.exit):   # FT: this member stops; the others go on without it
        step = self.checkpoint()
        print(f"{self.name} at step {step}: {why}; its checkpoint is in {self.args.checkpoint}; exit status {status}",
              file=sys.stdout if status == common.PREEMPTED else sys.stderr, flush=True)
        end(status)

    def checkpoint(self):   # all a restart of the whole job needs, as of the last committed step (returned)
        model = {**self.net.state_dict(), **self.committed_statistics}   # FT: not the statistics of an open step
        flags = {**vars(self.args), "data": self.flags["data"]}
        state = {**self.progress, "run": self.run_id, "model": model, "flags": flags,
                 "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        common.save_atomically(lambda tmp: torch.save(state, tmp), self.args.checkpoint)
        return state["step"]

# ---------------------------------------------------------------- 3. the coordinator: its decisions, carried out
# Its state in two records; each decision a pure function of them, which says why (as torchft's lighthouse does).
@dataclasses.dataclass
class Connection:   # one connection to the coordinator
    id: int
    peer: str   # host:port, for its lines
    since: float   # when it connected (it has PROVE_WITHIN s to prove FT_SECRET); a member: when it last progressed
    challenge: str   # what it must sign to prove it
    sock: socket.socket = None
    buffer: bytes = b""   # what came of a line not yet ended
    joined: bool = False   # it proved FT_SECRET and was let in: a member
    request: dict = None   # what it waits for: "ready", a quorum (its join or vote's "next" asked), or a "vote"
    dropped: str = None   # why it was dropped: it is told when it next speaks
    lost: str = None   # why it is closed at the end of this turn

@dataclasses.dataclass
class Run:   # the run, as the coordinator knows it
    flags: dict = None   # its members' flags: those of the first to join while none is live
    gen: int = 0   # its generation: one more for each new quorum
    members: list = dataclasses.field(default_factory=list)   # the generation's members, by rank ([]: a step failed)
    step: int = 0   # the steps committed
    failures: list = dataclasses.field(default_factory=list)   # (step, members, why) of the failed tries in a row
    finished: float = None   # when its last step was committed
    left: float = -math.inf   # when a member last left mid-run (dropped, killed, stopped): its loop may bring it back

def stalled(now, live, run, timeout):
    """Who holds the others up: {id: why}. Liveness is progress: one that neither voted nor asked within `timeout`
    of one that waits; or, of the generation, one that has not voted 0.25 s after a peer's collective gave up."""
    waiting = [c.since for c in live.values() if c.request]
    gave_up = any(c.request["op"] == "vote" and not c.request["ok"] and c.request["waited"] >= 0.9 * timeout
                  and now - c.since > 0.25 for c in live.values() if c.request)
    why = {}
    for i, c in live.items():
        if not c.request and waiting and now - max(min(waiting), c.since) > timeout:
            why[i] = f"no vote and no request for {timeout:g} s while the others waited"
        elif not c.request and gave_up and i in run.members:
            why[i] = f"its peers' collective waited {timeout:g} s for it"
    return why

def commit_or_not(live, run):
    """The verdict on the generation's step: (None, why) while a live member of it has not voted; (True, why)
    if all its members voted yes for one step; else (False, why): no member applies it."""
    votes = {i: c.request for i, c in live.items() if c.request and c.request["op"] == "vote" and i in run.members}
    missing = [i for i in run.members if i in live and i not in votes]
    if not votes or missing:
        return None, f"waiting for the votes of members {missing}"
    steps = sorted({v["step"] for v in votes.values()})
    against = [f"member {i}: {v['error']}" for i, v in votes.items() if not v["ok"]]
    against += [f"member {i} is gone" for i in run.members if i not in live]
    against += [f"votes for steps {steps}"] if len(steps) > 1 else []
    if against:
        return False, "; ".join(against)
    return True, f"members {run.members} voted yes for step {steps[0]}"

def next_quorum(live, run):
    """Who takes part in the next step: ({gen, members, step, src}, why) once every live member asked (the first:
    at least --min-members); a new generation if they changed or a step failed; src: the rank ahead, if any."""
    asking = sorted(i for i, c in live.items() if c.request and c.request["op"] == "ready")
    needed = run.flags["min_members"] if run.gen == 0 and run.flags else 1
    if run.finished is not None or not asking:
        return None, "the run is over" if asking else "no member asks"
    if len(asking) < max(len(live), needed):
        return None, f"members {asking} asked; waiting for all {max(len(live), needed)}"
    steps = [live[i].request["step"] for i in asking]
    src = steps.index(max(steps)) if min(steps) < max(steps) else None
    gen = run.gen + 1 if asking != run.members else run.gen
    return {"gen": gen, "members": asking, "step": max(steps), "src": src}, f"generation {gen}: members {asking}"

def admit(run, run_id, flags, checkpoint_run):
    """Whether a member that proved FT_SECRET joins: ("joined", None), or ("over" or "refused", what it is told)."""
    if checkpoint_run not in (None, run_id):   # (even after the end: it is not this run that is over)
        return "refused", (f"error: its checkpoint is of run {checkpoint_run}, and this coordinator serves run "
                           f"{run_id}: start it without --resume, or serve that run (--run-id {checkpoint_run})")
    if run.finished is not None:   # a member after the end (even during the last step): nothing to do
        return "over", f"the run is over: its members finished step {run.step}"
    differ = [k for k, v in (run.flags or {}).items()   # (none: it is the first live member)
              if flags.get(k) != v and k != "min_members"]   # (min_members: only the first quorum's)
    if differ:
        said = "; ".join(f"{k} {flags.get(k)} here, {run.flags[k]} in the run" for k in differ)
        remedy = " and ".join(sorted({NOT_FLAGS.get(k, "training flags") for k in differ}))
        return "refused", f"error: this member differs from the run ({said}): start it with the run's {remedy}"
    return "joined", None

def run_over(now, run, connections, timeout):
    """(True, why) once the run finished and its members left, and none may still wake or come back (10 x timeout)."""
    if run.finished is None or any(c.joined and not c.dropped for c in connections):
        return False, "the run goes on"
    if (connections and now - run.finished <= 10 * timeout) or now - run.left <= 10 * timeout:
        return False, "a member may still wake or come back"
    return True, f"the run is over (step {run.step})"

class Coordinator:   # each turn: what came, then the decisions carried out; it ends on SIGTERM or with the run

    def __init__(self, args):
        host, port = args.serve
        self.secret = the_secret(host)
        self.run_id = args.run_id or secrets.token_hex(4)
        self.timeout = args.member_timeout
        self.listener = listen(host, port, "--serve")
        store_socket = listen(host, args.store_port or port + 1, "--store-port")   # FT: where members join, not *
        self.store_port = store_socket.getsockname()[1]
        self.store = dist.TCPStore(host, self.store_port, is_master=True, wait_for_workers=False,   # FT: groups
                                   master_listen_fd=store_socket.detach())
        self.connections = {}   # id: Connection
        self.ids = itertools.count()   # each new connection's id
        self.last_beat = 0.0
        self.run = Run()
        print(f"coordinator: run {self.run_id}: members join at {host}:{port}, their groups meet at {host}:"
              f"{self.store_port}; to continue it after a restart: --run-id {self.run_id}", flush=True)

    def serve(self):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            self.receive()   # joins, requests for a quorum and votes (self.handle); strangers' bytes refused
            now = time.monotonic()
            for c in [c for c in self.connections.values() if c.lost]:   # given up: closed and said, before a commit
                self.connections.pop(c.id).sock.close()
                if c.joined and self.run.finished is None:   # FT: it may come back through its loop: run_over waits
                    self.run.left = now
                if c.joined or c.lost.startswith("refused"):
                    print(f"coordinator: {f'member {c.id}' if c.joined else f'the connection from {c.peer}'} "
                          f"{c.lost}", flush=True)
            self.decide(now)
            over, why = run_over(now, self.run, self.connections.values(), self.timeout)
            if over:
                print(f"coordinator: {why}", flush=True)
                return

    def decide(self, now):   # a turn's decisions, carried out
        run = self.run
        live = {c.id: c for c in self.connections.values() if c.joined and not c.dropped and not c.lost}
        for i, why in stalled(now, live, run, self.timeout).items():   # FT: alive or not, the others go on without it
            live.pop(i).dropped = why
            print(f"coordinator: member {i} dropped: {why}", flush=True)
        commit, why = commit_or_not(live, run)
        if commit is not None:   # the verdict on the step: counted, and told to its voters
            voters = [live[i] for i in run.members if i in live]
            step = min(c.request["step"] for c in voters)
            same = run.failures and run.failures[-1][:2] == (step, run.members)
            run.failures = [] if commit else (run.failures if same else []) + [(step, run.members, why)]
            if commit:
                run.step = max(run.step, step + 1)
                run.finished = now if run.step >= run.flags["final_step"] else None
            for c in voters:   # a vote with "next" also asks for the next step's quorum
                asks = c.request["next"] and run.finished is None
                c.request = {"op": "ready", "step": c.request["step"] + commit} if asks else None
                c.since = now
                self.send(c, {"commit": commit})
            if len(run.failures) >= 3:   # FT: the same step failed 3 times with the same members: said, not retried
                line = (f"error: step {step} failed {len(run.failures)} times in a row with members {run.members} "
                        f"({why}): the run ends here; mend that, then --resume")
                print(f"coordinator: {line}", flush=True)
                for c in live.values():
                    self.send(c, {"failed": line})
                raise SystemExit(1)
            if not commit:   # its members left their group: the next quorum is a new generation, whoever is in it
                run.members = []
        quorum, why = next_quorum(live, run)
        if quorum:
            run.gen, run.members = quorum["gen"], quorum["members"]
            for rank, i in enumerate(run.members):   # FT: each member is told what it needs, not the membership
                live[i].request = None
                self.send(live[i], {"gen": run.gen, "rank": rank, "world": len(run.members), "step": quorum["step"],
                                    "src": quorum["src"]})
        elif why == "the run is over":   # FT: those that joined during the last step are told, not trained from 0
            for c in live.values():
                self.send(c, {"over": f"the run is over: its members finished step {run.step}"})
                c.lost = "was told the run is over"

    def handle(self, c, message):   # a message of this protocol from connection c
        if not c.joined:
            self.join(c, message)
        elif self.run.finished is not None:   # e.g. one that hung past --member-timeout, and woke up
            self.send(c, {"over": f"the run is over: its members finished step {self.run.step}"})
            c.lost = "was told the run is over"
        elif c.dropped:
            self.send(c, {"dropped": c.dropped})
            c.lost = "was told it had been dropped"
        else:
            c.request = message
            c.since = time.monotonic()

    def join(self, c, message):   # a connection that proves it knows FT_SECRET joins, if admitted
        if message["op"] != "join":
            raise ValueError(f"{message['op']} before proving FT_SECRET")
        if not hmac.compare_digest(message["proof"].encode(), proof(self.secret, c.challenge).encode()):   # any text
            self.send(c, {"refused": "FT_SECRET"})   # (said: the member does not take it for a lost link)
            raise ValueError("it does not know FT_SECRET")
        flags = message["flags"]
        if not all(isinstance(flags.get(k), (int, float)) for k in ("min_members", "final_step")):
            raise ValueError("join with unusable flags")
        if not any(c.joined and not c.dropped and not c.lost for c in self.connections.values()):
            self.run.flags = None   # FT: the run's flags are its live members'; with none, the next admitted's
        verdict, why = admit(self.run, self.run_id, flags, message["run"])
        answer = {"proof": proof(self.secret, message["challenge"]), verdict: why}   # FT: it proves it too
        if verdict == "joined":   # it asks for its first quorum at once
            c.joined = True
            c.since = time.monotonic()
            c.request = {"op": "ready", "step": message["step"]}
            self.run.flags = self.run.flags or flags
            print(f"coordinator: member {c.id} joined from {c.peer} at step {message['step']}", flush=True)
            answer.update(id=c.id, run=self.run_id, store=self.store_port, timeout=self.timeout)
        else:
            c.lost = "was answered and let go"
        self.send(c, answer)

    # ---- its sockets: none ever blocks it, and what anyone sends ends at most their own connection

    def receive(self):   # what came within 50 ms; who did not prove itself in time, refused; a beat to members
        socks = {c.sock: c for c in self.connections.values()}
        for sock in select.select([self.listener, *socks], [], [], 0.05)[0]:
            if sock is not self.listener:
                self.read(socks[sock])
                continue
            sock, peer = self.listener.accept()
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # answers leave at once
            c = Connection(next(self.ids), f"{peer[0]}:{peer[1]}", time.monotonic(), secrets.token_hex(16), sock)
            self.connections[c.id] = c
            self.send(c, {"challenge": c.challenge})
            unproven = [u for u in self.connections.values() if not u.joined and not u.lost]
            if len(unproven) > MAX_UNPROVEN:   # a flood: the oldest goes, so a member still gets in
                unproven[0].lost = f"refused: more than {MAX_UNPROVEN} connections at once have not joined"
        now = time.monotonic()
        for c in [c for c in self.connections.values() if not c.joined and now - c.since > PROVE_WITHIN]:
            c.lost = c.lost or f"refused: it did not prove it knows FT_SECRET within {PROVE_WITHIN:g} s"
        if now - self.last_beat > min(1.0, self.timeout / 4):   # FT: the coordinator is alive
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

    def send(self, c, message):   # a connection that cannot take a small message at once is lost
        data = (json.dumps(message) + "\n").encode()
        try:
            if c.sock.send(data) != len(data):
                raise BlockingIOError
        except OSError:
            c.lost = c.lost or "its connection failed"

# ---------------------------------------------------------------- 4. the wire: JSON lines, only the run's members
MAX_LINE = 1 << 16   # no message of this protocol is longer: a longer line is refused
PROVE_WITHIN = 5.0   # seconds a new connection has to prove it knows FT_SECRET
MAX_UNPROVEN = 64    # connections still to prove it; with more at once (a flood), the oldest is closed
MESSAGES = {"join": {"proof": str, "challenge": str, "flags": dict, "step": int, "run": (str, type(None))},
            "vote": {"step": int, "ok": bool, "next": bool, "waited": (int, float), "error": str}}

def parse(line):
    """A message of this protocol (a JSON object of a known op, its fields of the right types), else ValueError."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):   # RecursionError: "[[[[..." nested past Python's limit
        raise ValueError("not a line of JSON") from None
    op = str(message.get("op")) if isinstance(message, dict) else None   # (str: a list is no op, nor a key)
    if op not in MESSAGES:
        raise ValueError("not a message of this protocol")
    wrong = [k for k, kind in MESSAGES[op].items() if not isinstance(message.get(k), kind)]
    if wrong:
        raise ValueError(f"{op} without a proper {', '.join(wrong)}")
    return message

def the_secret(host):   # FT_SECRET; left out only where no other machine can connect
    secret = os.environ.get("FT_SECRET", "")
    with contextlib.suppress(OSError, ValueError):   # (a name that does not resolve: connecting says so)
        if not secret and not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            raise SystemExit(f"error: {host} can be reached from other machines, and FT_SECRET is not set: give the "
                             f"coordinator and every member the same, e.g. export FT_SECRET=$(openssl rand -hex 16)")
    return secret.encode()

def proof(secret, challenge):   # FT: only a holder of the secret computes it
    return hmac.new(secret, challenge.encode(), hashlib.sha256).hexdigest()

def generation_prefix(secret, run_id, gen):   # FT: where a generation's keys are: no guess finds them
    return hmac.new(secret, f"run {run_id} generation {gen}".encode(), hashlib.sha256).hexdigest()[:32] + "/"

class SignedStore(dist.Store):   # FT: anyone who reaches a TCPStore lists and writes its keys: values are signed

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
            raise RuntimeError(f"the store's {key} is not signed with FT_SECRET: someone else wrote it")
        return signed[32:]

    def wait(self, keys, *timeout):
        self.store.wait([self.prefix + k for k in keys], *timeout)

def listen(host, port, flag):   # a listening socket, or one line that says why there is none
    try:
        return socket.create_server((host, port))
    except OSError as e:
        raise SystemExit(f"error: cannot listen at {host}:{port} ({flag}): {e.strerror or e}") from None

class MustLeave(Exception):   # a SIGTERM while this member waited for the coordinator, or the coordinator lost
    pass

class CoordinatorLink:   # a member's line to the coordinator, which beats each second: silent for `timeout`, lost

    def __init__(self, address, init_timeout, stop):
        self.address, self.timeout, self.stop, self.buffer = address, init_timeout, stop, b""
        deadline = time.monotonic() + init_timeout
        while True:
            try:
                self.sock = socket.create_connection(address, timeout=5)
                break
            except OSError as e:
                if stop["signal"]:
                    raise MustLeave(f"stopped by {stop['signal']} while it waited for {address[0]}:{address[1]}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"error: no coordinator at {address[0]}:{address[1]} within {init_timeout:g} s "
                                 f"({e.strerror or e}): start one with --serve {address[0]}:{address[1]}") from None
                time.sleep(0.2)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # small messages leave at once (no Nagle)

    def ask(self, message):
        try:
            self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError as e:
            raise MustLeave(self.lost(e)) from None
        return self.receive()

    def lost(self, why):
        return f"lost the coordinator at {self.address[0]}:{self.address[1]} ({why}); once it is back, --resume goes on"

    def receive(self):
        """The next message but beats; MustLeave after `timeout` of silence, or 0.5 s after a SIGTERM."""
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
                raise MustLeave(self.lost(f"not a word from it for {self.timeout:g} s: it hangs or cannot be reached"))

# ---------------------------------------------------------------- command line
def address(text):
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(text)
    return host, int(port)

def parse_args(argv=None):   # a member's flags, or with --serve the coordinator's
    if any(a.split("=")[0] == "--serve" for a in (sys.argv[1:] if argv is None else argv)):
        p = argparse.ArgumentParser(description="The coordinator of a run of ft_ddp_resnet.py: it trains nothing.")
        p.add_argument("--serve", type=address, required=True, metavar="HOST:PORT", help="where members join")
        p.add_argument("--run-id", help="the run: the one it printed continues that run (default: a new one)")
        p.add_argument("--store-port", type=common.positive_int, help="where the groups meet (default: PORT + 1)")
        p.add_argument("--member-timeout", type=common.positive_float, default=30, help="seconds of no progress, "
                       "while others wait, that drop a member; its collectives and its coordinator's silence, too")
        return p.parse_args(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--join", type=address, required=True, metavar="HOST:PORT", help="the coordinator of the run")
    p.add_argument("--epochs", type=common.positive_int, default=5, help="passes over the training set")
    p.add_argument("--batch-size", type=common.positive_int, default=256, help="global batch, over all members")
    p.add_argument("--micro-batch", type=common.positive_int, default=32, help="the size of a global batch's pieces")
    p.add_argument("--lr", type=common.positive_float, default=0.05, help="learning rate for 256 samples, scaled")
    p.add_argument("--weight-decay", type=common.non_negative_float, default=5e-4, help="on weights, not biases or BN")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the batch order")
    p.add_argument("--data-dir", help="a folder holding FashionMNIST/raw/ (default: ./data, downloaded there)")
    p.add_argument("--train-samples", type=common.positive_int, help="use only the first N training images")
    p.add_argument("--test-samples", type=common.positive_int, help="use only the first N test images")
    p.add_argument("--max-steps", type=common.positive_int, help="stop after this many optimizer steps")
    p.add_argument("--sums", choices=("float64", "float32"), default="float64",
                   help="float64: the same bits whoever computes what; float32: half the bytes, a faster step")
    p.add_argument("--min-members", type=common.positive_int, default=1, help="the first step waits for this many")
    p.add_argument("--init-timeout", type=common.positive_float, default=300, help="seconds to wait to join")
    p.add_argument("--out", default="runs/ft_ddp_resnet", help="folder for metrics.json, curves.png and model.pt")
    p.add_argument("--checkpoint", help="this member's (default: <out>/checkpoint.pt), written when it leaves")
    p.add_argument("--checkpoint-every", type=common.positive_int, help="also write it every N committed steps")
    p.add_argument("--resume", action="store_true", help="start from --checkpoint (then from the member ahead)")
    args = p.parse_args(argv)
    args.checkpoint = args.checkpoint or os.path.join(args.out, "checkpoint.pt")
    return args

def main(argv=None):
    args = parse_args(argv)
    if "serve" in args:
        return Coordinator(args).serve()
    return Member(args).train()

if __name__ == "__main__":
    main()
