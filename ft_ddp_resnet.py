"""ResNet-18 on Fashion-MNIST, data parallel, training that outlives its members: no restart, no lost step.

    export FT_SECRET=...                                        # the same on the coordinator and every member
    python ft_ddp_resnet.py --serve HOST:PORT --run-id r1       # the coordinator: trains nothing
    until python ft_ddp_resnet.py --join HOST:PORT --out runs/m0 --resume; [ $? -le 1 ]; do sleep 1; done

The last line is a member, restarted until it finishes (0) or fails for good (1): start as many as
you like, anywhere, whenever you like. Before every step the live members agree on who takes part
(a quorum, one generation); when that changes, each makes a new process group over the
coordinator's store, and a member behind receives the state of the one furthest ahead. The
gradient is the sum of each micro-batch's mean-loss gradient, divided by their count, summed in
float64: any members, any faults, give the same weights bit for bit. A step is applied by all its
members or by none (each votes after the allreduce; the coordinator commits only if all voted yes).
Lost, the coordinator costs each member a restart from its checkpoint (exit 75; the loop above
brings it back once the coordinator is served again with the same --run-id). No
DistributedDataParallel: a failed allreduce leaves its reducer in a state it does not recover from.
Lines that exist only because members may come and go are tagged `# FT:`.
"""
import argparse, contextlib, datetime, hashlib, hmac, ipaddress, json, math, os, secrets, select, selectors
import signal, socket, sys, threading, time, zlib
import torch
import torch.distributed as dist
import torch.nn.functional as F
import common

RUN_FLAGS = ("batch_size", "micro_batch", "seed", "train_samples", "epochs", "max_steps", "lr", "weight_decay",
             "warmup_epochs", "amp", "sums", "member_timeout", "min_members")   # what every member must share

# ---------------------------------------------------------------- the wire: JSON lines, and only the run's members
MAX_LINE = 1 << 16   # no message of this protocol is longer: a longer line is refused
PROVE_WITHIN = 5.0   # seconds a new connection has to prove it knows FT_SECRET
MAX_UNPROVEN = 64    # connections still to prove it; with more at once (a flood), the oldest is closed
MESSAGES = {"join": {"proof": str, "challenge": str, "flags": dict, "step": int, "run": (str, type(None))},
            "ready": {"step": int}, "vote": {"step": int, "ok": bool, "next": bool, "waited": (int, float),
                                             "error": str}}

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

def the_secret(host):
    """FT_SECRET, proven by an HMAC of a fresh challenge; left out only where no other machine can connect."""
    secret = os.environ.get("FT_SECRET", "")
    with contextlib.suppress(OSError, ValueError):
        if not secret and not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            raise SystemExit(f"error: {host} can be reached from other machines, and FT_SECRET is not set: give the "
                             f"coordinator and every member the same, e.g. export FT_SECRET=$(openssl rand -hex 16)")
    return secret.encode()

def proof(secret, challenge):   # FT: only a holder of the secret computes it
    return hmac.new(secret, challenge.encode(), hashlib.sha256).hexdigest()

# ---------------------------------------------------------------- the coordinator: membership, quorums, commits
def serve(args):
    """The membership: one connection per member (a member that dies closes it), quorums, commits, a
    beat to every member each second. Ends on SIGTERM, or once the run is over and its members left."""
    host, port = args.serve
    secret, run_id = the_secret(host), args.run_id or secrets.token_hex(4)
    store = dist.TCPStore(host, args.store_port or port + 1, is_master=True,   # FT: the groups meet here
                          wait_for_workers=False)
    listener = socket.create_server((host, port))
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"coordinator: run {run_id}: members join at {host}:{port}, their groups meet at {host}:{store.port}; "
          f"to continue this run after a restart, serve it with --run-id {run_id}", flush=True)
    conns, next_id, last_beat = {}, 0, 0.0
    run = {"flags": None, "gen": 0, "members": [], "retry": False, "step": 0, "failures": [], "finished": None}

    def send(conn, message):   # never blocks: a connection that cannot take a small message is lost
        data = (json.dumps(message) + "\n").encode()
        try:
            if conn["sock"].send(data) != len(data):
                raise BlockingIOError
        except OSError:
            conn.setdefault("lost", "its connection failed")

    def close(cid, line=None):
        conn = conns.pop(cid)
        selector.unregister(conn["sock"])
        conn["sock"].close()
        if line:
            print(f"coordinator: {line}", flush=True)

    def name(conn):
        return f"member {conn['id']}" if conn.get("joined") else f"the connection from {conn['peer']}"

    def join(conn, message):
        """A connection that proves it knows the secret joins, if its flags and its checkpoint's run agree."""
        if not hmac.compare_digest(message["proof"], proof(secret, conn["challenge"])):
            raise ValueError("it does not know FT_SECRET")
        flags = message["flags"]
        if not all(isinstance(flags.get(k), (int, float)) for k in ("member_timeout", "min_members", "final_step")):
            raise ValueError("join with unusable flags")
        if not any(c.get("joined") and not c.get("dropped") for c in conns.values()):
            run["flags"] = flags   # FT: the run's flags are those of its live members (or who comes back)
        differ = [f"{k} {flags.get(k)} here, {v} in the run" for k, v in run["flags"].items()
                  if flags.get(k) != v and k != "min_members"]   # (that one counts for the first quorum only)
        answer = {"proof": proof(secret, message["challenge"])}   # FT: the coordinator proves it too
        if run["finished"] is not None:   # a member after the end (even during the last step): nothing to train
            answer["over"] = f"the run is over: its members finished step {run['step']}"
        elif message["run"] not in (None, run_id):
            answer["refused"] = (f"error: its checkpoint is of run {message['run']}, and this coordinator serves run "
                                 f"{run_id}: start it without --resume, or serve that run (--run-id {message['run']})")
        elif differ:
            answer["refused"] = (f"error: this member's training flags differ from the run's ({'; '.join(differ)}): "
                                 f"start it with the run's flags")
        else:
            conn.update(joined=True, want=None, since=time.monotonic())
            print(f"coordinator: member {conn['id']} joined from {conn['peer']} at step {message['step']}", flush=True)
            answer.update(id=conn["id"], run=run_id)
        send(conn, answer)
        if not conn.get("joined"):
            conn["lost"] = "was answered and let go"

    def handle(cid, message):
        conn, op = conns[cid], message["op"]
        if not conn.get("joined"):
            if op != "join":
                raise ValueError(f"{op} before proving FT_SECRET")
            return join(conn, message)
        if op == "join":
            raise ValueError("a second join")
        if conn.get("dropped"):   # it hung past --member-timeout and woke up: it is told, and let go
            over = run["finished"] is not None
            send(conn, {"over": f"the run ended while this member hung: its members finished step {run['step']}"}
                 if over else {"dropped": conn["dropped"]})
            conn["lost"] = "was told the run is over" if over else "was told it had been dropped"
        else:
            conn.update(want=message, since=time.monotonic())

    def drop(conn, why):   # FT: alive or not, it holds the others up: they go on without it
        conn.update(dropped=why, want=None)
        print(f"coordinator: {name(conn)} dropped: {why}", flush=True)

    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is listener:
                with contextlib.suppress(BlockingIOError):
                    sock, peer = listener.accept()
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # answers leave at once
                    conns[next_id] = conn = {"id": next_id, "sock": sock, "peer": f"{peer[0]}:{peer[1]}", "buffer": b"",
                                             "opened": time.monotonic(), "challenge": secrets.token_hex(16)}
                    selector.register(sock, selectors.EVENT_READ, next_id)
                    next_id += 1
                    unproven = [c for c in conns.values() if not c.get("joined") and "lost" not in c]
                    if len(unproven) > MAX_UNPROVEN:   # a flood: the oldest goes, so a member still gets in
                        unproven[0]["lost"] = f"refused: more than {MAX_UNPROVEN} connections at once have not joined"
                    send(conn, {"challenge": conn["challenge"]})
                continue
            cid, conn = key.data, conns[key.data]
            try:
                data = conn["sock"].recv(65536)
            except OSError:
                data = b""
            if not data:
                close(cid, None if not conn.get("joined") else f"member {cid} finished" if run["finished"] else
                      f"member {cid} is gone (its connection closed)")
                continue
            conn["buffer"] += data
            try:   # FT: any bytes from anyone end at most their own connection
                while b"\n" in conn["buffer"] and "lost" not in conn:
                    line, conn["buffer"] = conn["buffer"].split(b"\n", 1)
                    handle(cid, parse(line))
                if len(conn["buffer"]) > MAX_LINE:
                    raise ValueError(f"a line longer than {MAX_LINE} bytes")
            except ValueError as e:
                conn["lost"] = f"refused: {e}"
        now = time.monotonic()
        for conn in conns.values():   # FT: a connection that does not prove itself soon is closed
            if not conn.get("joined") and now - conn["opened"] > PROVE_WITHIN:
                conn.setdefault("lost", f"refused: it did not prove it knows FT_SECRET within {PROVE_WITHIN:g} s")
        timeout = run["flags"]["member_timeout"] if run["flags"] else 30.0
        if now - last_beat > min(1.0, timeout / 4):   # FT: each member hears from the coordinator: it is alive
            last_beat = now
            for conn in conns.values():
                if conn.get("joined"):
                    send(conn, {"beat": 1})
        live = {i: c for i, c in conns.items() if c.get("joined") and not c.get("dropped") and "lost" not in c}
        # FT: liveness is progress. A member that neither voted nor asked for a quorum within --member-timeout
        # of a member that waits is dropped; so is a member of the generation that has not voted when a peer's
        # collective timed out waiting for it.
        # (A peer whose collective failed with it votes within milliseconds: 0.25 s keeps it from being dropped.)
        waits = [c["since"] for c in live.values() if c["want"]]
        timed_out = any(c["want"]["op"] == "vote" and not c["want"]["ok"] and c["want"]["waited"] >= 0.9 * timeout
                        and now - c["since"] > 0.25 for c in live.values() if c["want"])
        for i, conn in list(live.items()):
            if not conn["want"] and waits and now - max(min(waits), conn["since"]) > timeout:
                drop(conn, f"no vote and no request for {timeout:g} s while the others waited")
            elif not conn["want"] and timed_out and i in run["members"]:
                drop(conn, f"its peers' collective waited {timeout:g} s for it")
            if conn.get("dropped"):
                del live[i]
        # The commit: every member of the generation voted yes, and none is gone; else no one applies the step.
        voters = {i: c for i, c in live.items() if c["want"] and c["want"]["op"] == "vote" and i in run["members"]}
        if voters and all(i in voters or i not in live for i in run["members"]):
            steps = {c["want"]["step"] for c in voters.values()}
            commit = len(voters) == len(run["members"]) and all(c["want"]["ok"] for c in voters.values())
            commit = commit and len(steps) == 1
            run["retry"] = not commit   # a member whose collective failed has left its group
            errors = [f"member {i}: {c['want']['error']}" for i, c in voters.items() if not c["want"]["ok"]]
            same = run["failures"] and run["failures"][-1][:2] == (min(steps), run["members"])
            run["failures"] = [] if commit else run["failures"] * bool(same) + [(min(steps), run["members"], errors)]
            if commit:
                run["step"] = max(run["step"], min(steps) + 1)
                if run["step"] >= run["flags"]["final_step"]:
                    run["finished"] = now
            for conn in voters.values():   # a vote with "next" also asks for the next step's quorum
                vote = conn["want"]
                conn.update(want={"op": "ready", "step": vote["step"] + commit} if vote["next"] else None, since=now)
                send(conn, {"commit": commit})
        if len(run["failures"]) >= 3:   # FT: the same step failing with the same members: said, not retried for ever
            step, members, errors = run["failures"][-1]
            line = (f"error: step {step} failed {len(run['failures'])} times in a row with members {members} "
                    f"({'; '.join(errors) or 'no error given'}): the run ends here; mend that, then --resume")
            print(f"coordinator: {line}", flush=True)
            for conn in live.values():
                send(conn, {"failed": line})
            raise SystemExit(1)
        # The quorum: every live member asks for one (at least --min-members for the first).
        ready = {i: c for i, c in live.items() if c["want"] and c["want"]["op"] == "ready"}
        needed = run["flags"]["min_members"] if run["gen"] == 0 and run["flags"] else 1
        if ready and run["finished"] is not None:   # FT: joined during the last step: told, not trained from 0
            for conn in ready.values():
                send(conn, {"over": f"the run is over: its members finished step {run['step']}"})
                conn["lost"] = "was told the run is over"
        elif ready and len(ready) == len(live) and len(ready) >= needed:
            ids = sorted(ready)
            if ids != run["members"] or run["retry"]:   # a new membership, or the same after a failed step
                run.update(gen=run["gen"] + 1, members=ids, retry=False)
            steps = [ready[i]["want"]["step"] for i in ids]
            behind = min(steps) < max(steps)   # FT: then the member furthest ahead sends its state
            for rank, i in enumerate(ids):   # FT: each member is told what it needs, not the membership
                ready[i]["want"] = None
                send(ready[i], {"gen": run["gen"], "rank": rank, "world": len(ids), "step": max(steps),
                                "src": steps.index(max(steps)) if behind else None})
        for cid, conn in list(conns.items()):
            if "lost" in conn:
                close(cid, f"{name(conn)} {conn['lost']}" if conn.get("joined") or conn["lost"].startswith("refused")
                      else None)
        if not any(c.get("joined") and not c.get("dropped") for c in conns.values()):
            run["flags"] = None if run["finished"] is None else run["flags"]   # FT: no member left: no binding flags
            if run["finished"] is not None and (not conns or now - run["finished"] > 10 * timeout):
                print(f"coordinator: the run is over (step {run['step']})", flush=True)
                return


# ---------------------------------------------------------------- a member's line to the coordinator
class CoordinatorLost(Exception):
    pass

class Stopped(Exception):   # a SIGTERM came while this member waited for the coordinator
    pass

class Coordinator:
    """A member's connection to the coordinator, which beats each second: silent for --member-timeout, it is lost."""
    def __init__(self, address, secret, hello, timeout, init_timeout, stop):
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
        # Small messages leave at once (Nagle's algorithm would wait for an acknowledgement, up to 40 ms).
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer, self.timeout, self.stop = b"", timeout, stop
        mine = secrets.token_hex(16)
        try:
            challenge = self.receive().get("challenge")
            answer = self.ask({**hello, "op": "join", "proof": proof(secret, str(challenge)), "challenge": mine})
        except (CoordinatorLost, ValueError, AttributeError):   # closed on a member that does not prove the secret
            answer = {}
        if not hmac.compare_digest(str(answer.get("proof")), proof(secret, mine)):   # FT: a coordinator of this run
            raise SystemExit(f"error: {host}:{port} refused this member or does not know FT_SECRET: give the "
                             f"coordinator and every member the same FT_SECRET")
        if "refused" in answer:
            raise SystemExit(answer["refused"])
        if "over" in answer:
            print(answer["over"], flush=True)
            raise SystemExit(0)
        self.id, self.run = answer["id"], answer["run"]

    def tell(self, message):
        try:
            self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError as e:
            raise CoordinatorLost(str(e)) from None

    def ask(self, message):
        self.tell(message)
        return self.receive()

    def receive(self):
        """The next message (beats aside). CoordinatorLost after --member-timeout without a word from
        it; Stopped half a second after a SIGTERM (an answer on its way is still read)."""
        heard = time.monotonic()
        while True:
            if b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                message = json.loads(line)   # a coordinator that proved it knows FT_SECRET
                if "beat" not in message:
                    return message
                heard = time.monotonic()
                continue
            if select.select([self.sock], [], [], 0.1)[0]:
                try:
                    data = self.sock.recv(65536)
                except OSError as e:
                    raise CoordinatorLost(str(e)) from None
                if not data:
                    raise CoordinatorLost("its connection closed")
                self.buffer += data
                continue
            if self.stop["signal"] and time.monotonic() - self.stop["at"] > 0.5:
                raise Stopped()
            if time.monotonic() - heard > self.timeout:
                raise CoordinatorLost(f"not a word from it for {self.timeout:g} s: it hangs or cannot be reached")

# ---------------------------------------------------------------- one step, the same whoever computes it
def buffers_of(net):   # BatchNorm's running statistics (its step counters are set after each committed step)
    return [b for name, b in net.named_buffers() if not name.endswith("num_batches_tracked")]

def gradients_of(net):   # one flat float32 tensor that every .grad is a view into (backward adds into it)
    params, sizes = list(net.parameters()), [p.numel() for p in net.parameters()]
    flat = torch.zeros(sum(sizes))
    for p, piece in zip(params, flat.split(sizes)):
        p.grad = piece.view_as(p)
    return flat

def message_buffer(net, dtype):   # what a step's allreduce sends: the gradients, running statistics, loss sums
    return torch.zeros(sum(p.numel() for p in net.parameters()) + sum(b.numel() for b in buffers_of(net)) + 3,
                       dtype=dtype)

def compute(net, grads, message, X, y, micro_batch, mine, amp):
    """This member's micro-batches of the global batch (X, y), each one's mean-loss gradient added into the
    message. float64 holds the exact sum of float32 values unless their magnitudes differ by more than ~2^25
    (then the float32 result still agrees but for a ~2^-29 chance), so it depends neither on who computed which
    micro-batch nor on gloo's order. Micro-batch 0 alone moves BatchNorm's running statistics. Returns
    [summed loss, hits, samples] of this member's micro-batches."""
    totals = torch.zeros(3, dtype=message.dtype)
    norms = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    message[len(grads) if mine else 0:].zero_()   # what no micro-batch overwrites (with none, all: zeros are sent)
    for i in mine:
        for norm in norms:
            norm.momentum = 0.1 if i == 0 else 0.0   # FT: running statistics from micro-batch 0 only (0.1: torch's)
        X_micro, y_micro = X[i * micro_batch:(i + 1) * micro_batch], y[i * micro_batch:(i + 1) * micro_batch]
        grads.zero_()
        with torch.autocast(X.device.type, torch.bfloat16, enabled=amp):
            logits = net(X_micro)
            loss = F.cross_entropy(logits, y_micro)
        loss.backward()
        if i == mine[0]:   # FT: each micro-batch's gradient on its own, added exactly (the first copied: float32
            message[:len(grads)].copy_(grads)   # added into float64 takes 7x a copy's time)
        else:
            message[:len(grads)] += grads
        totals += torch.stack([loss.detach().double() * len(y_micro), (logits.argmax(1) == y_micro).sum().double(),
                               torch.tensor(float(len(y_micro)), dtype=torch.float64)])
    return totals

def leave_group():   # a collective failed: its connections close, so a peer still in it fails now, not at the
    dist.destroy_process_group()   # FT: timeout (in gloo's ring a death fails only its neighbours at once)

def failure(error, started):   # what a vote says of a collective that failed, and how long it waited
    return {"error": " ".join(str(error).split()).split("] ", 1)[-1][:160], "waited": time.monotonic() - started}

def exchange(net, grads, message, totals, holds_first, count):
    """One allreduce of the message: gradients, micro-batch 0's holder's running statistics (the others send
    zeros), loss sums; then .grad is their sum over `count` micro-batches, rounded once to float32. Returns
    (the step's [loss, hits, samples], None), or (None, the failure) when the collective failed."""
    stats = buffers_of(net)
    tail = message[len(grads):].split([b.numel() for b in stats] + [3])
    if holds_first:
        for piece, b in zip(tail, stats):
            piece.copy_(b.flatten())
    tail[-1].copy_(totals)
    started = time.monotonic()
    try:
        dist.all_reduce(message)   # FT: on this generation's group
    except (RuntimeError, dist.DistError) as e:
        leave_group()
        return None, failure(e, started)
    for piece, b in zip(tail, stats):
        b.copy_(piece.view_as(b))
    grads.copy_(message[:len(grads)].div_(count))   # (in place: no 90 MB temporary)
    return tail[-1].clone(), None

def state_tensors(net, optimizer):   # what a recovering member receives: weights, running statistics, momentum
    return ([p.data for p in net.parameters()] + buffers_of(net) +
            [optimizer.state[p]["momentum_buffer"] for p in net.parameters()])

EPOCH_KEYS = ("epoch", "train_loss", "train_acc", "test_acc", "samples", "samples_per_s", "seconds")

def progress_tensor(progress, epochs):
    """A position and its history as float64 numbers: members send tensors only, nothing to unpickle."""
    rows = [float(e[k]) for e in progress["history"] for k in EPOCH_KEYS]
    head = [progress["step"], progress["seconds"], *progress["totals"], len(progress["history"])]
    return torch.tensor(head + rows + [0.0] * (len(EPOCH_KEYS) * epochs - len(rows)), dtype=torch.float64)

def progress_of(numbers):
    rows = numbers[6:6 + len(EPOCH_KEYS) * int(numbers[5])].view(-1, len(EPOCH_KEYS)).tolist()
    return {"step": int(numbers[0]), "seconds": numbers[1].item(), "totals": numbers[2:5].tolist(),
            "history": [{**dict(zip(EPOCH_KEYS, row)), "epoch": int(row[0])} for row in rows]}

def recover(net, optimizer, progress, src, epochs):
    """Live recovery: every member of the new group takes member `src`'s weights, running
    statistics, momentum and position (it is furthest ahead). Returns (the position, None), or
    (None, the failure) when the collective failed."""
    tensors = state_tensors(net, optimizer)
    flat = torch.cat([t.float().flatten() for t in tensors])
    position = progress_tensor(progress, epochs)
    started = time.monotonic()
    try:
        dist.broadcast(flat, src=src)   # FT: the state, from the member furthest ahead
        dist.broadcast(position, src=src)   # FT: its position and history
    except (RuntimeError, dist.DistError) as e:
        leave_group()
        return None, failure(e, started)
    with torch.no_grad():
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(piece.view_as(t))
    return progress_of(position), None

# ---------------------------------------------------------------- checkpoints, for the whole-job restarts that remain
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
    secret = the_secret(host)
    device = common.pick_device("gloo", cuda=False)   # FT: gloo between CPUs; see the README on GPUs
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
    steps_per_epoch, count = len(y_train) // args.batch_size, args.batch_size // args.micro_batch
    optimizer, scheduler = common.sgd_recipe(net, lr, args.weight_decay, round(args.warmup_epochs * steps_per_epoch),
                                             steps_per_epoch * args.epochs)
    for p in net.parameters():   # a momentum of zeros steps as none does; every member then holds the same tensors
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    grads, message = gradients_of(net), message_buffer(net, getattr(torch, args.sums))
    final_step = min(args.max_steps or math.inf, steps_per_epoch * args.epochs)
    metrics = common.new_metrics(__file__, args, [device], "gloo, members that come and go", 1, len(test_set))
    progress = {"step": 0, "totals": [0.0] * 3, "history": [], "seconds": 0.0}
    # FT: all that makes the training, compared at join, the first step's weights too; the same torch and threads
    # give the same sums
    flags = {**{k: getattr(args, k) for k in RUN_FLAGS}, "final_step": final_step, "torch": torch.__version__,
             "threads": torch.get_num_threads(), "data": f"labels crc {zlib.crc32(y_train.numpy().tobytes())}",
             "weights": f"crc {zlib.crc32(torch.cat([p.detach().flatten() for p in net.parameters()]).numpy())}"}
    state = load_checkpoint(args.checkpoint, net, optimizer, scheduler) if args.resume else None
    if state:   # a resume as the other scripts do it: the same training flags, or refused in one line
        common.resume_check(state["flags"], {**vars(args), "data": flags["data"]}, args.checkpoint, True,
                            may_differ=("out", "checkpoint", "checkpoint_every", "resume", "max_steps", "join",
                                        "init_timeout", "data_dir", "test_samples", "min_members", "member_timeout",
                                        "store_port", "run_id"))
        progress = {k: state[k] for k in progress}
        print(f"resumed from {args.checkpoint} (run {state['run']}): step {progress['step']}", flush=True)
        if progress["step"] >= final_step:
            print(f"nothing to train: {args.checkpoint} is at step {progress['step']}", flush=True)
            return net
    common.check_out_dir(args.out)
    stop, kept = {"signal": None, "at": 0.0}, []   # kept: the running statistics as committed, during a step
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal="SIGTERM", at=time.monotonic()))

    def uncommitted():   # FT: the step is not applied: BatchNorm's running statistics go back to the committed ones
        for b, committed in zip(buffers_of(net), kept):
            b.copy_(committed)
        kept.clear()

    def checkpoint():   # this member's own, for restarts of the whole job: where it is, of which run, with which flags
        uncommitted()
        saved = {**progress, "run": coordinator.run, "flags": {**vars(args), "data": flags["data"]},
                 "model": net.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        common.save_atomically(lambda tmp: torch.save(saved, tmp), args.checkpoint)

    def join():   # FT: join the run; the coordinator gives this member its id and the store
        hello = {"flags": flags, "step": progress["step"], "run": state["run"] if state else None}
        joined = Coordinator((host, port), secret, hello, args.member_timeout, args.init_timeout, stop)
        store = dist.TCPStore(host, args.store_port or port + 1, is_master=False,   # FT: where this run's groups meet
                              timeout=datetime.timedelta(seconds=args.member_timeout))
        print(f"member {joined.id}: joined run {joined.run} at {host}:{port}, at step {progress['step']}", flush=True)
        return joined, store

    def leave(line, status, end=sys.exit):   # FT: this member stops; the others go on without it
        checkpoint()
        print(f"member {coordinator.id}: {line}; checkpoint of step {progress['step']} written to {args.checkpoint}; "
              f"exit status {status}", file=sys.stderr if status != common.PREEMPTED else sys.stdout, flush=True)
        end(status)

    def watchdog():   # FT: making a group waits on the coordinator's store, without a bound if it hangs (SIGSTOP);
        while True:   # a peer stopped mid-handshake holds gloo's connect ~5x the timeout, then fails: it is voted out
            time.sleep(0.25)
            if making["since"] and time.monotonic() - making["since"] > 6 * args.member_timeout:
                leave(f"lost the coordinator at {host}:{port} (its store did not answer for "
                      f"{6 * args.member_timeout:g} s); once it is back, --resume goes on", common.PREEMPTED, os._exit)

    def talk(message=None):   # FT: a word with the coordinator: losing it, or a SIGTERM, ends this member here
        try:
            return coordinator.ask(message) if message else coordinator.receive()
        except Stopped:
            leave(f"stopped by {stop['signal']} at step {progress['step']} (the other members go on)", common.PREEMPTED)
        except CoordinatorLost as e:
            leave(f"lost the coordinator at {host}:{port} ({e}); once it is back, --resume goes on", common.PREEMPTED)

    def answered(reply):   # FT: True if the step may go on; else this member rejoins, or ends
        nonlocal coordinator, store, gen
        if "over" in reply:   # it hung until the run ended, or joined during its last step
            print(f"member {coordinator.id}: {reply['over']}; nothing is left to train", flush=True)
            raise SystemExit(0)
        if "failed" in reply:
            leave(reply["failed"], 1)
        if "dropped" in reply:   # it hung past --member-timeout; the others went on without it
            print(f"member {coordinator.id}: dropped by the coordinator ({reply['dropped']}); rejoining", flush=True)
            checkpoint()   # its statistics as committed (and a file as current as it can be)
            coordinator.sock.close()
            if dist.is_initialized():   # FT: its old group, which the others have left
                dist.destroy_process_group()   # FT: (a new one comes with its next generation)
            coordinator, store = join()
            gen = None
        return "dropped" not in reply

    coordinator, store = join()
    making = {"since": None}   # FT: when this member began making its group, while it does
    threading.Thread(target=watchdog, daemon=True).start()
    gen, generations, steps_here, counted = None, 0, 0, False
    timer = common.Timer(device, already=progress["seconds"])
    while progress["step"] < final_step:
        step = progress["step"]
        if stop["signal"]:
            leave(f"stopped by {stop['signal']} at step {step} (the other members go on)", common.PREEMPTED)
        # FT: who takes part in this step (after a vote that asked for it too, it comes unasked)
        quorum = talk() if counted else talk({"op": "ready", "step": step})
        counted = False
        if not answered(quorum):
            continue
        rank, world_size, problem = quorum["rank"], quorum["world"], None
        if quorum["gen"] != gen:   # FT: a new membership: a new group, over a new prefix of the store
            gen, generations, started = quorum["gen"], generations + 1, time.monotonic()
            print(f"member {coordinator.id}: generation {gen}: {world_size} member(s), from step {quorum['step']}",
                  flush=True)
            if dist.is_initialized():   # FT: the last generation's group goes
                dist.destroy_process_group()   # FT: before this one's is made
            making["since"] = started
            try:
                dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{gen}", store), rank=rank,   # FT: its own
                                        world_size=world_size, timeout=datetime.timedelta(seconds=args.member_timeout))
            except (RuntimeError, dist.DistError) as e:
                gen, problem = None, failure(e, started)
            making["since"] = None
        if not problem and quorum["src"] is not None:   # FT: someone is behind: the member furthest ahead sends
            recovered, problem = recover(net, optimizer, progress, quorum["src"], args.epochs)
            if recovered and recovered["step"] != step:
                progress, step = recovered, recovered["step"]
                schedule_at(scheduler, step)
                timer = common.Timer(device, already=progress["seconds"])
                print(f"member {coordinator.id}: recovered live at step {step}", flush=True)
        kept[:] = [b.clone() for b in buffers_of(net)]
        if not problem:
            epoch, batch_in_epoch = step // steps_per_epoch + 1, step % steps_per_epoch
            idx = global_batch(len(y_train), args.batch_size, args.seed, epoch, batch_in_epoch)
            mine = range(count * rank // world_size, count * (rank + 1) // world_size)   # FT: this member's share
            net.train()
            totals = compute(net, grads, message, X_train[idx], y_train[idx], args.micro_batch, mine, args.amp)
            step_totals, problem = exchange(net, grads, message, totals, 0 in mine, count)   # FT: sums, statistics
        # FT: all apply the step, or none; "next": this member is ready for the next step's quorum too
        # (one message to the coordinator per step; not at the last step, nor when it was told to stop)
        counted = step + 1 < final_step and not stop["signal"]
        commit = talk({"op": "vote", "step": step, "ok": problem is None, "next": counted,
                       **(problem or {"error": "", "waited": 0.0})})
        if not answered(commit):
            counted = False
            continue
        if not commit["commit"]:   # FT: no member applies it; the next quorum computes this step again
            uncommitted()
            continue
        kept.clear()
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
    coordinator.sock.close()
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
    p.add_argument("--warmup-epochs", type=common.non_negative_float, default=0.0, help="a linear warm-up this long")
    p.add_argument("--weight-decay", type=common.non_negative_float, default=5e-4,
                   help="on convolution and linear weights (none on BatchNorm and biases)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the batch order")
    p.add_argument("--data-dir", default="data", help="where Fashion-MNIST is (or will be put)")
    p.add_argument("--train-samples", type=common.positive_int, help="use only the first N training images")
    p.add_argument("--test-samples", type=common.positive_int, help="use only the first N test images")
    p.add_argument("--max-steps", type=common.positive_int, help="stop after this many optimizer steps")
    p.add_argument("--amp", action="store_true", help="bfloat16 mixed precision")
    p.add_argument("--out", default="runs/ft_ddp_resnet", help="folder for metrics.json, curves.png and model.pt")
    p.add_argument("--init-timeout", type=common.positive_float, default=300, help="seconds to wait to join")
    role = p.add_mutually_exclusive_group(required=True)
    role.add_argument("--serve", type=address, metavar="HOST:PORT", help="run the coordinator there (trains nothing)")
    role.add_argument("--join", type=address, metavar="HOST:PORT", help="train as a member of the run served there")
    p.add_argument("--micro-batch", type=common.positive_int, default=32, help="the size of a global batch's pieces")
    p.add_argument("--min-members", type=common.positive_int, default=1, help="the first step waits for this many")
    p.add_argument("--member-timeout", type=common.positive_float, default=30,
                   help="seconds of no progress, while others wait, that drop a member; as long unheard, a coordinator")
    p.add_argument("--store-port", type=common.positive_int, help="where the groups meet (default: PORT + 1)")
    p.add_argument("--sums", choices=("float64", "float32"), default="float64",
                   help="float64: the same bits whoever computes what; float32: half the bytes, a faster step")
    p.add_argument("--run-id", help="the coordinator's run: the one it printed continues that run (default: a new one)")
    p.add_argument("--checkpoint", help="this member's checkpoint (default: <out>/checkpoint.pt), written on SIGTERM, "
                                        "every --checkpoint-every steps and when the coordinator is lost")
    p.add_argument("--checkpoint-every", type=common.positive_int, help="also write it every N committed steps")
    p.add_argument("--resume", action="store_true", help="start from --checkpoint (then from the member ahead)")
    args = p.parse_args(argv)
    args.checkpoint = args.checkpoint or os.path.join(args.out, "checkpoint.pt")
    return args

def main(argv=None):
    args = parse_args(argv)
    return serve(args) if args.serve else train(args)

if __name__ == "__main__":
    main()
