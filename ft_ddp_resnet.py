"""ResNet-18 on Fashion-MNIST, data parallel, training that outlives its members: no restart, no lost step.

    python ft_ddp_resnet.py --serve HOST:PORT                     # the coordinator: trains nothing
    python ft_ddp_resnet.py --join HOST:PORT --out runs/m0        # a member; start as many as you like,
    python ft_ddp_resnet.py --join HOST:PORT --out runs/m1        # on any machines, whenever you like
    until python ft_ddp_resnet.py --join HOST:PORT --out runs/m2; do sleep 1; done   # a supervisor's restarts

ddp_resnet.py ends every rank when one dies, and the job restarts from its last checkpoint. Here the
members that remain go on. Before every step the live members agree on who takes part (a quorum,
one generation of membership); when that changes, each builds a new process group for the new
generation over the coordinator's store (a new key prefix), never reusing one a dead member was
in. A member behind the others (a newcomer, a restarted one) receives the weights, optimizer state
and position from the member furthest ahead, over the new group: no file is read.

The training does not depend on who computes it. Step s's global batch (--batch-size) is cut into
micro-batches of --micro-batch, shared among the members, uneven counts allowed; the gradient is
the sum over all micro-batches of each one's mean-loss gradient, divided by their count. BatchNorm
normalises each micro-batch by its own statistics; only micro-batch 0 updates the running
statistics (every other runs with momentum 0), and its holder's buffers are the ones all keep. So
the same steps give the same weights with 1, 2 or 3 members, up to the order of float sums.

A step is applied by all its members or by none: after the allreduce each member votes (it
succeeded, or its collective raised), and the coordinator answers "commit" only if every member of
the generation voted yes. A member that dies, or hangs for --member-timeout seconds, makes the step
fail for all; the next quorum computes it again. The vote also asks for the next step's quorum, so
a step costs one round trip to the coordinator.

No DistributedDataParallel wrapper: it is bound to one process group, and a failed allreduce
leaves its reducer in a state it does not recover from (torchft's own DDP wrapper dies there on
CPU). The gradients are summed in one allreduce after backward, with BatchNorm's buffers and the
step's loss sums in the same message. No overlap with backward: the same overlap by hand (hooks
starting each bucket's allreduce) did not pay on 2 CPU cores; benchmarks/README.md has the figures.
Lines that exist only because members may come and go are tagged `# FT:`.
"""
import argparse, contextlib, datetime, json, math, os, selectors, signal, socket, sys, threading, time, zlib
import torch
import torch.distributed as dist
import torch.nn.functional as F
import common

RUN_FLAGS = ("batch_size", "micro_batch", "seed", "train_samples", "epochs", "max_steps", "lr", "weight_decay",
             "warmup_epochs", "amp")   # what every member must share: the training itself

# ---------------------------------------------------------------- the coordinator: membership, quorums, commits
def serve(args):
    """The membership. Holds the store the process groups meet in, and one connection per member:
    a member that dies closes it (seen at once), one that hangs stops its heartbeat (dropped after
    --member-timeout). Forms a quorum when every live member asks for one, and decides commits.
    Ends on SIGTERM, or once a member has finished and none is left."""
    host, port = args.serve
    store_port = common.free_port()
    store = dist.TCPStore(host, store_port, is_master=True, wait_for_workers=False)   # FT: the groups meet here
    print(f"coordinator: members join at {host}:{port}; the groups' store is at {host}:{store.port}", flush=True)
    listener = socket.create_server((host, port), reuse_port=False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    members, run, state = {}, None, {"gen": 0, "gen_members": [], "next_id": 0, "finished": False, "failed": False}

    def send(member, message):
        try:
            member["sock"].sendall((json.dumps(message) + "\n").encode())
        except OSError:
            pass

    def gone(member_id, why):
        member = members.pop(member_id)
        selector.unregister(member["sock"])
        member["sock"].close()
        print(f"coordinator: member {member_id} {why}", flush=True)

    def handle(member_id, message):
        nonlocal run
        member, op = members[member_id], message["op"]
        if op == "beat" or member.get("dropped"):
            if op in ("ready", "vote"):   # it hung past --member-timeout and woke up: it is told, and leaves
                send(member, {"dropped": f"no answer for {run['member_timeout']:g} s"})
                gone(member_id, "was told it had been dropped")
            elif not member.get("dropped"):
                member["beat"] = time.monotonic()
            return
        member["beat"] = time.monotonic()
        if op == "join":
            if state["finished"]:   # a member came after the end: nothing is left to train
                send(member, {"over": "the run is over: its members have finished"})
                return
            if run is None:
                run = message["flags"]
            differ = [f"--{k.replace('_', '-')} {message['flags'].get(k)} here, {v} in the run"
                      for k, v in run.items() if k in RUN_FLAGS and message["flags"].get(k) != v]
            if differ:
                send(member, {"refused": f"error: this member's training flags differ from the run's "
                                         f"({'; '.join(differ)}): start it with the run's flags"})
                return
            member.update(joined=True, flags=message["flags"])
            send(member, {"id": member_id, "store_port": store_port, "run": run})
        elif op in ("ready", "vote"):
            member["want"] = message
        elif op == "done":
            member["done"] = state["finished"] = True

    while True:
        for key, _ in selector.select(timeout=0.01):
            if key.fileobj is listener:
                sock, _ = listener.accept()
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # answers leave at once (see Coordinator)
                member_id, state["next_id"] = state["next_id"], state["next_id"] + 1
                members[member_id] = {"sock": sock, "buffer": b"", "beat": time.monotonic(), "want": None}
                selector.register(sock, selectors.EVENT_READ, member_id)
                continue
            member_id = key.data
            try:
                data = key.fileobj.recv(65536)
            except OSError:
                data = b""
            if not data:
                gone(member_id, "finished" if members[member_id].get("done") else "is gone (its connection closed)")
                continue
            members[member_id]["buffer"] += data
            while member_id in members and b"\n" in members[member_id]["buffer"]:
                line, members[member_id]["buffer"] = members[member_id]["buffer"].split(b"\n", 1)
                handle(member_id, json.loads(line))
        now, timeout = time.monotonic(), run["member_timeout"] if run else math.inf
        for member_id, member in members.items():   # FT: a member that hangs (alive, silent) is dropped
            if member.get("joined") and not member.get("dropped") and now - member["beat"] > timeout:
                member["dropped"] = True
                print(f"coordinator: member {member_id} dropped: no answer for {timeout:g} s", flush=True)
                if member["want"]:   # it waits for a quorum it asked for with its vote: the answer waits for it
                    member["want"] = None
                    send(member, {"dropped": f"no answer for {timeout:g} s"})
                    print(f"coordinator: member {member_id} will read that it has been dropped", flush=True)
        live = {i: m for i, m in members.items() if m.get("joined") and not m.get("dropped")}
        # The commit: every member of the generation voted yes, and none is gone; else no one applies the step.
        voters = {i: m for i, m in live.items() if m["want"] and m["want"]["op"] == "vote"}
        if voters and all(i in voters or i not in live for i in state["gen_members"]):
            commit = (all(i in voters for i in state["gen_members"]) and all(m["want"]["ok"] for m in voters.values())
                      and len({m["want"]["step"] for m in voters.values()}) == 1)
            state["failed"] = state["failed"] or not commit   # a member whose collective failed has left its group
            for member in voters.values():   # a vote with "next" also asks for the next step's quorum
                vote = member["want"]
                member["want"] = {"op": "ready", "step": vote["step"] + commit} if vote.get("next") else None
                send(member, {"commit": commit})
        # The quorum: every live member asks for one (at least --min-members for the first).
        ready = {i: m for i, m in live.items() if m["want"] and m["want"]["op"] == "ready"}
        needed = run["min_members"] if run and state["gen"] == 0 else 1
        if ready and len(ready) == len(live) and len(ready) >= needed:
            ids = sorted(ready)
            if ids != state["gen_members"] or state["failed"]:   # a new membership, or the same after a failed step
                state["gen"], state["gen_members"], state["failed"] = state["gen"] + 1, ids, False
            steps = [ready[i]["want"]["step"] for i in ids]
            for rank, i in enumerate(ids):
                ready[i]["want"] = None
                send(ready[i], {"gen": state["gen"], "rank": rank, "members": ids, "steps": steps})
        if state["finished"] and not members:
            print("coordinator: the run is over", flush=True)
            return


# ---------------------------------------------------------------- a member's line to the coordinator
class CoordinatorLost(Exception):
    pass

class Coordinator:
    """A member's connection to the coordinator: requests answered in turn, and a heartbeat from a
    thread of its own (a hung process stops it: the coordinator drops it)."""
    def __init__(self, address, flags, init_timeout):
        host, port = address
        deadline = time.monotonic() + init_timeout
        while True:
            try:
                self.sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise SystemExit(f"error: no coordinator at {host}:{port} within {init_timeout:g} s "
                                     f"({e.strerror or e}); start one with: python ft_ddp_resnet.py --serve "
                                     f"{host}:{port}") from None
                time.sleep(0.2)
        self.sock.settimeout(None)
        # Small messages leave at once: with Nagle's algorithm a request sent just after a heartbeat
        # would wait for the coordinator's delayed acknowledgement of it (up to 40 ms on Linux).
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lock, self.buffer, self.address = threading.Lock(), b"", f"{host}:{port}"
        answer = self.ask({"op": "join", "flags": flags})
        if "refused" in answer:
            raise SystemExit(answer["refused"])
        if "over" in answer:
            print(answer["over"], flush=True)
            raise SystemExit(0)
        self.id, self.store_port, self.run = answer["id"], answer["store_port"], answer["run"]
        self.beating = True
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self):
        while self.beating:
            time.sleep(min(0.5, self.run["member_timeout"] / 5))
            with self.lock, contextlib.suppress(OSError):
                self.sock.sendall(b'{"op": "beat"}\n')

    def tell(self, message):
        with self.lock:
            try:
                self.sock.sendall((json.dumps(message) + "\n").encode())
            except OSError as e:
                raise CoordinatorLost(str(e)) from None

    def ask(self, message):
        self.tell(message)
        return self.receive()

    def receive(self):
        while b"\n" not in self.buffer:
            try:
                data = self.sock.recv(65536)
            except OSError as e:
                raise CoordinatorLost(str(e)) from None
            if not data:
                raise CoordinatorLost("its connection closed")
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self):
        self.beating = False
        with self.lock:
            self.sock.close()

# ---------------------------------------------------------------- one step, the same whoever computes it
def my_micro_batches(count, rank, world_size):
    """This member's share of the step's `count` micro-batches: a contiguous run, uneven counts allowed."""
    return range(count * rank // world_size, count * (rank + 1) // world_size)

def buffers_of(net):   # BatchNorm's running statistics (its step counters are set after each committed step)
    return [b for name, b in net.named_buffers() if not name.endswith("num_batches_tracked")]

def message_buffer(net):
    """The one tensor each step's allreduce sends: every gradient, then BatchNorm's running
    statistics, then the step's loss sums. Each parameter's .grad is a view into it, so backward
    accumulates there and nothing is copied in or out (ResNet-18's gradients are 45 MB)."""
    params, sizes = list(net.parameters()), [p.numel() for p in net.parameters()]
    flat = torch.zeros(sum(sizes) + sum(b.numel() for b in buffers_of(net)) + 3)
    for p, piece in zip(params, flat[:sum(sizes)].split(sizes)):
        p.grad = piece.view_as(p)   # backward adds into it in place (it never sets .grad to a new tensor)
    return flat

def compute(net, message, X, y, micro_batch, mine, amp):
    """Forward and backward of this member's micro-batches of the global batch (X, y): each one's
    mean-loss gradient divided by the number of micro-batches, summed in .grad. BatchNorm: each
    micro-batch normalised by its own statistics; micro-batch 0 alone moves the running ones.
    Returns [summed loss, hits, samples] of this member's micro-batches."""
    count, totals = len(y) // micro_batch, torch.zeros(3, device=X.device)
    norms = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    message.zero_()   # every member sends a gradient, also one with no micro-batch
    for i in mine:
        for norm in norms:
            norm.momentum = 0.1 if i == 0 else 0.0   # FT: running statistics from micro-batch 0 only (0.1: torch's)
        X_micro, y_micro = X[i * micro_batch:(i + 1) * micro_batch], y[i * micro_batch:(i + 1) * micro_batch]
        with torch.autocast(X.device.type, torch.bfloat16, enabled=amp):
            logits = net(X_micro)
            loss = F.cross_entropy(logits, y_micro)
        (loss / count).backward()
        totals[:2] += torch.stack([loss.detach().float() * len(y_micro), (logits.argmax(1) == y_micro).sum().float()])
        totals[2] += len(y_micro)   # a Python number: no host sync per micro-batch
    return totals

def leave_group():
    """A collective failed: leave its group at once. Its connections close, so a member still waiting
    inside the collective for this one fails now, not at the group's timeout (a member that died
    fails only its neighbours in gloo's ring: the others wait on a survivor)."""
    dist.destroy_process_group()   # FT: the next generation makes a new one

def exchange(net, message, totals, holds_first):
    """One allreduce of the message buffer: the gradients (summed in place), the running statistics
    of micro-batch 0's holder (every other member sends zeros) and the step's loss sums. Returns
    the step's [loss, hits, samples], or None when the collective failed (a member died or hung)."""
    stats = buffers_of(net)
    tail = message[sum(p.numel() for p in net.parameters()):].split([b.numel() for b in stats] + [3])
    if holds_first:
        for piece, b in zip(tail, stats):
            piece.copy_(b.flatten())
    tail[-1].copy_(totals)
    try:
        dist.all_reduce(message)   # FT: on this generation's group
    except (RuntimeError, dist.DistError):
        leave_group()
        return None
    for piece, b in zip(tail, stats):
        b.copy_(piece.view_as(b))
    return tail[-1].clone()

def state_tensors(net, optimizer):
    """What a recovering member receives: weights, running statistics, momentum."""
    return ([p.data for p in net.parameters()] + buffers_of(net) +
            [optimizer.state[p]["momentum_buffer"] for p in net.parameters()])

def recover(net, optimizer, progress, src):
    """Live recovery: every member of the new group takes member `src`'s weights, running
    statistics, momentum and position (it is furthest ahead). Returns the position, or None when
    the collective failed."""
    tensors = state_tensors(net, optimizer)
    flat = torch.cat([t.float().flatten() for t in tensors])
    box = [progress]
    try:
        dist.broadcast(flat, src=src)   # FT: the state, from the member furthest ahead
        dist.broadcast_object_list(box, src=src)   # FT: its position and history
    except (RuntimeError, dist.DistError):
        leave_group()
        return None
    with torch.no_grad():
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(piece.view_as(t))
    return box[0]

# ---------------------------------------------------------------- checkpoints, for the whole-job restarts that remain
def save_checkpoint(path, net, optimizer, scheduler, position):
    state = {**position, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict()}
    common.save_atomically(lambda tmp: torch.save(state, tmp), path)

def load_checkpoint(path, net, optimizer, scheduler):
    """This member's own checkpoint, or None; a file it cannot use ends it with one line."""
    if not os.path.exists(path):
        print(f"no checkpoint at {path}: this member starts from step 0 (or from its peers)", flush=True)
        return None
    try:
        state = torch.load(path, map_location="cpu")
        missing = {"step", "totals", "history", "seconds", "flags", "scheduler"} - state.keys()
        if missing:
            raise ValueError(f"it lacks {', '.join(sorted(missing))}")
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        return state
    except Exception as e:   # a foreign pickle can raise anything: say which file and why
        raise SystemExit(f"error: cannot resume from {path}: {' '.join(str(e).split())[:300]}") from None

def global_batch(num_samples, batch_size, seed, epoch, batch_in_epoch):
    """The samples of one global batch, in DistributedSampler's order: the batches the other scripts draw."""
    sampler = torch.utils.data.DistributedSampler(range(num_samples), num_replicas=1, rank=0, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    return torch.tensor(list(sampler)[batch_in_epoch * batch_size:(batch_in_epoch + 1) * batch_size])

def schedule_at(scheduler, step):   # FT: the learning rate of `step`, for a member that took a peer's state
    scheduler.last_epoch = step - 1
    scheduler.step()

# ---------------------------------------------------------------- a member
def train(args):
    host, port = args.join
    device = common.pick_device("gloo")   # FT: gloo between CPUs; see the README on GPUs
    if os.path.isdir(os.path.join(args.data_dir, "train")):
        raise SystemExit("error: ft_ddp_resnet.py trains on Fashion-MNIST held in memory; for an image folder, use "
                         "ddp_resnet.py")
    train_set, test_set = common.fashion_mnist(args.data_dir, args.train_samples, args.test_samples)
    X_train, y_train = train_set.tensors
    if args.batch_size % args.micro_batch:
        raise SystemExit(f"error: --micro-batch {args.micro_batch} does not divide --batch-size {args.batch_size}")
    if len(y_train) < args.batch_size:
        raise SystemExit(f"error: {len(y_train)} training images are fewer than one global batch of {args.batch_size}")
    net = common.resnet("fashion_resnet18", 10, args.seed).to(device)
    lr = args.lr * args.batch_size / 256   # --lr is for 256 samples
    steps_per_epoch = len(y_train) // args.batch_size
    optimizer, scheduler = common.sgd_recipe(net, lr, args.weight_decay, round(args.warmup_epochs * steps_per_epoch),
                                             steps_per_epoch * args.epochs)
    for p in net.parameters():   # a momentum of zeros steps as none does; every member then holds the same tensors
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    message = message_buffer(net)
    final_step = min(args.max_steps or math.inf, steps_per_epoch * args.epochs)
    metrics = common.new_metrics(__file__, args, [device], "gloo, members that come and go", 1, len(test_set))
    progress = {"step": 0, "totals": [0.0] * 3, "history": [], "seconds": 0.0}
    labels = zlib.crc32(y_train.numpy().tobytes())
    flags = {**{k: getattr(args, k) for k in RUN_FLAGS}, "data": f"labels crc {labels}",
             "member_timeout": args.member_timeout, "min_members": args.min_members}
    state = load_checkpoint(args.checkpoint, net, optimizer, scheduler) if args.resume else None
    if state:   # a resume as the other scripts do it: the same training flags, or refused in one line
        common.resume_check(state["flags"], {**vars(args), "data": flags["data"]}, args.checkpoint, True,
                            may_differ=("out", "checkpoint", "checkpoint_every", "resume", "max_steps", "join",
                                        "init_timeout", "data_dir", "test_samples", "min_members", "member_timeout"))
        progress = {k: state[k] for k in progress}
        print(f"resumed from {args.checkpoint}: step {progress['step']}", flush=True)
        if progress["step"] >= final_step:
            print(f"nothing to train: {args.checkpoint} is at step {progress['step']}", flush=True)
            return net

    def checkpoint():   # this member's own, for restarts of the whole job: where it is, with which flags
        save_checkpoint(args.checkpoint, net, optimizer, scheduler,
                        {**progress, "flags": {**vars(args), "data": flags["data"]}})
    common.check_out_dir(args.out)
    stop = {"signal": None}
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal="SIGTERM"))

    def join():   # FT: join the run; the coordinator gives this member its id and the store
        coordinator = Coordinator((host, port), flags, args.init_timeout)
        store = dist.TCPStore(host, coordinator.store_port, is_master=False,   # FT: where this run's groups meet
                              timeout=datetime.timedelta(seconds=args.member_timeout))
        print(f"member {coordinator.id}: joined the run at {host}:{port}, at step {progress['step']}", flush=True)
        return coordinator, store

    def leave(line, status):   # FT: this member stops; the others go on without it
        checkpoint()
        print(f"member {coordinator.id}: {line}; checkpoint of step {progress['step']} written to {args.checkpoint}; "
              f"exit status {status}", file=sys.stderr if status != common.PREEMPTED else sys.stdout, flush=True)
        raise SystemExit(status)

    def rejoin(why):   # FT: told it had been dropped: it joins again, as a newcomer
        print(f"member {coordinator.id}: dropped by the coordinator ({why}); rejoining as a newcomer", flush=True)
        coordinator.close()
        if dist.is_initialized():   # FT: its old group, which the others have left
            dist.destroy_process_group()   # FT: (its peers are gone from it)
        return (*join(), None)

    coordinator, store = join()
    gen, generations, steps_here, counted = None, 0, 0, False
    timer = common.Timer(device, already=progress["seconds"])
    while progress["step"] < final_step:
        step = progress["step"]
        if stop["signal"] and not counted:   # (counted in this step's quorum: the others wait for it; it goes after)
            coordinator.close()
            leave(f"stopped by {stop['signal']} at step {step} (the other members go on)", common.PREEMPTED)
        try:   # FT: who takes part in this step (after a vote that asked for it too, it comes unasked)
            quorum = coordinator.receive() if counted else coordinator.ask({"op": "ready", "step": step})
        except CoordinatorLost as e:
            leave(f"the coordinator at {host}:{port} is gone ({e}): run the job again with --resume", common.PREEMPTED)
        if "dropped" in quorum:   # FT: it hung past --member-timeout; the others went on without it
            coordinator, store, gen = rejoin(quorum["dropped"])
            counted = False
            continue
        rank, world_size, steps = quorum["rank"], len(quorum["members"]), quorum["steps"]
        ok = True
        if quorum["gen"] != gen:   # FT: a new membership: a new group, over a new prefix of the store
            gen, generations = quorum["gen"], generations + 1
            print(f"member {coordinator.id}: generation {gen}: members {quorum['members']} ({world_size}), "
                  f"from step {max(steps)}", flush=True)
            if dist.is_initialized():   # FT: the last generation's group goes
                dist.destroy_process_group()   # FT: before this one's is made
            try:
                dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{gen}", store), rank=rank,   # FT: its own
                                        world_size=world_size, timeout=datetime.timedelta(seconds=args.member_timeout))
            except (RuntimeError, dist.DistError):
                ok, gen = False, None
        if ok and min(steps) < max(steps):   # FT: someone is behind: the member furthest ahead sends its state
            src = steps.index(max(steps))
            recovered = recover(net, optimizer, progress, src)
            ok = recovered is not None
            if ok and steps[rank] < max(steps):
                progress = recovered
                schedule_at(scheduler, progress["step"])
                timer = common.Timer(device, already=progress["seconds"])
                print(f"member {coordinator.id}: recovered live from member {quorum['members'][src]} at step "
                      f"{progress['step']}", flush=True)
                step = progress["step"]
        kept = [b.clone() for b in buffers_of(net)]   # FT: running statistics as committed, should the step fail
        if ok:
            epoch, batch_in_epoch = step // steps_per_epoch + 1, step % steps_per_epoch
            idx = global_batch(len(y_train), args.batch_size, args.seed, epoch, batch_in_epoch)
            mine = my_micro_batches(args.batch_size // args.micro_batch, rank, world_size)   # FT: this member's share
            net.train()
            totals = compute(net, message, X_train[idx], y_train[idx], args.micro_batch, mine, args.amp)
            step_totals = exchange(net, message, totals, holds_first=0 in mine)   # FT: gradients, statistics, sums
            ok = step_totals is not None
        # FT: all apply the step, or none; "next": this member is ready for the next step's quorum too
        # (one message to the coordinator per step; not at the last step, nor when it was told to stop)
        counted = step + 1 < final_step and not stop["signal"]
        try:
            commit = coordinator.ask({"op": "vote", "step": step, "ok": ok, "next": counted})
        except CoordinatorLost as e:
            leave(f"the coordinator at {host}:{port} is gone ({e}): run the job again with --resume", common.PREEMPTED)
        if "dropped" in commit:
            for b, committed in zip(buffers_of(net), kept):
                b.copy_(committed)
            coordinator, store, gen = rejoin(commit["dropped"])
            counted = False
            continue
        if not commit["commit"]:   # FT: no member applies it; the next quorum computes this step again
            for b, committed in zip(buffers_of(net), kept):
                b.copy_(committed)
            continue
        optimizer.step()
        scheduler.step()
        for name, b in net.named_buffers():
            if name.endswith("num_batches_tracked"):
                b.fill_(step + 1)   # FT: the same on every member, whoever held micro-batch 0
        steps_here += 1
        progress = {"step": step + 1, "totals": [a + b for a, b in zip(progress["totals"], step_totals.tolist())],
                    "history": progress["history"], "seconds": timer()}
        if progress["step"] % steps_per_epoch == 0 or progress["step"] == final_step:   # an epoch's end: evaluate here
            net.eval()
            test_acc = common.accuracy(net, common.test_loader(test_set, 0, 1, device), device, 1)   # all alike
            metrics["epochs"] = progress["history"]
            common.record_epoch(metrics, epoch, torch.tensor(progress["totals"]), progress["seconds"], test_acc, True)
            progress = {"step": progress["step"], "totals": [0.0] * 3, "history": metrics["epochs"], "seconds": 0.0}
            timer = common.Timer(device)
        if args.checkpoint_every and progress["step"] % args.checkpoint_every == 0:   # after an epoch's evaluation
            checkpoint()
    coordinator.tell({"op": "done"})
    coordinator.close()
    metrics.update(generations=generations, epochs=progress["history"])
    common.finish(metrics, progress["step"], sum(e["seconds"] for e in metrics["epochs"]), net.state_dict(),
                  {"all_reduce (the members)": message.numel() * message.element_size()} if steps_here else {})
    if dist.is_initialized():   # FT: leave the last group
        dist.destroy_process_group()   # FT: cleanly
    return net

# ---------------------------------------------------------------- command line
def address(text):
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(text)
    return host, int(port)

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=common.positive_int, default=5, help="passes over the training set")
    p.add_argument("--batch-size", type=common.positive_int, default=256, help="global batch, over all members")
    p.add_argument("--lr", type=common.positive_float, default=0.05,
                   help="learning rate for 256 samples, scaled linearly with the global batch")
    p.add_argument("--warmup-epochs", type=common.non_negative_float, default=0.0,
                   help="raise the learning rate linearly from ~0 over these epochs")
    p.add_argument("--weight-decay", type=common.non_negative_float, default=5e-4,
                   help="on convolution and linear weights (none on BatchNorm and biases)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the batch order")
    p.add_argument("--data-dir", default="data", help="where Fashion-MNIST is (or will be put)")
    p.add_argument("--train-samples", type=common.positive_int, help="use only the first N training images")
    p.add_argument("--test-samples", type=common.positive_int, help="use only the first N test images")
    p.add_argument("--max-steps", type=common.positive_int, help="stop after this many optimizer steps")
    p.add_argument("--amp", action="store_true", help="bfloat16 mixed precision")
    p.add_argument("--out", default="runs/ft_ddp_resnet", help="folder for metrics.json, curves.png and model.pt")
    p.add_argument("--init-timeout", type=common.positive_float, default=300,
                   help="seconds to wait for the coordinator")
    role = p.add_mutually_exclusive_group(required=True)
    role.add_argument("--serve", type=address, metavar="HOST:PORT", help="run the coordinator there (trains nothing)")
    role.add_argument("--join", type=address, metavar="HOST:PORT", help="train as a member of the run served there")
    p.add_argument("--micro-batch", type=common.positive_int, default=32,
                   help="the fixed size of the micro-batches each global batch is cut into and shared out")
    p.add_argument("--min-members", type=common.positive_int, default=1, help="the first step waits for this many")
    p.add_argument("--member-timeout", type=common.positive_float, default=30,
                   help="seconds without an answer after which a member is dropped (and collectives give up)")
    p.add_argument("--checkpoint", help="this member's checkpoint, for restarts of the whole job (default: "
                                        "<out>/checkpoint.pt), written on SIGTERM, every --checkpoint-every steps "
                                        "and when the coordinator is lost")
    p.add_argument("--checkpoint-every", type=common.positive_int, help="also write it every N committed steps")
    p.add_argument("--resume", action="store_true", help="start from --checkpoint (then from the member ahead)")
    args = p.parse_args(argv)
    args.checkpoint = args.checkpoint or os.path.join(args.out, "checkpoint.pt")
    return args

def main(argv=None):
    args = parse_args(argv)
    if args.serve:
        return serve(args)
    return train(args)

if __name__ == "__main__":
    main()
