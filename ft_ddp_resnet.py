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
import argparse, contextlib, copy, datetime, hashlib, hmac, ipaddress, json, math, os, secrets, select, selectors
import signal, socket, sys, threading, time, zlib
import torch
import torch.distributed as dist
import torch.nn.functional as F
import common

RUN_FLAGS = ("batch_size", "micro_batch", "seed", "train_samples", "epochs", "max_steps", "lr", "weight_decay",
             "warmup_epochs", "amp", "sums", "member_timeout", "min_members")   # what every member must share
MAY_DIFFER = ("out", "checkpoint", "checkpoint_every", "resume", "max_steps", "join", "init_timeout", "data_dir",
              "test_samples", "min_members", "member_timeout", "store_port", "run_id")   # a resume's own

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
class Coordinator:
    """The membership: one connection per member (a member that dies closes it), quorums, commits, a beat to
    every member each second. Each turn of serve() reads what came, then decides: who is alive, whether the
    step is committed, who takes part in the next. It ends on SIGTERM, or once the run is over."""

    def __init__(self, args):
        host, port = args.serve
        self.secret, self.run_id = the_secret(host), args.run_id or secrets.token_hex(4)
        self.store = dist.TCPStore(host, args.store_port or port + 1, is_master=True,   # FT: the groups meet here
                                   wait_for_workers=False)
        self.listener = socket.create_server((host, port))
        self.listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.conns = {}   # id: a connection's state ("joined", "want": its pending request, "lost": why it goes)
        self.next_id, self.last_beat = 0, 0.0
        self.run = {"flags": None, "gen": 0, "members": [], "retry": False, "step": 0, "failures": [],
                    "finished": None}
        print(f"coordinator: run {self.run_id}: members join at {host}:{port}, their groups meet at {host}:"
              f"{self.store.port}; to continue it after a restart: --run-id {self.run_id}", flush=True)

    def serve(self):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            for key, _ in self.selector.select(timeout=0.05):
                if key.fileobj is self.listener:
                    self.accept()
                else:
                    self.read(key.data)
            now = time.monotonic()
            timeout = self.run["flags"]["member_timeout"] if self.run["flags"] else 30.0
            self.check_connections(now, timeout)
            live = self.drop_stalled(now, timeout)
            self.commit_or_not(live, now)
            self.form_quorum(live)
            for cid, conn in list(self.conns.items()):
                if "lost" in conn:
                    line = None
                    if conn.get("joined") or conn["lost"].startswith("refused"):
                        line = f"{self.name(conn)} {conn['lost']}"
                    self.close(cid, line)
            if self.over(now, timeout):
                return

    # ---- connections

    def send(self, conn, message):   # never blocks: a connection that cannot take a small message is lost
        data = (json.dumps(message) + "\n").encode()
        try:
            if conn["sock"].send(data) != len(data):
                raise BlockingIOError
        except OSError:
            conn.setdefault("lost", "its connection failed")

    def close(self, cid, line=None):
        conn = self.conns.pop(cid)
        self.selector.unregister(conn["sock"])
        conn["sock"].close()
        if line:
            print(f"coordinator: {line}", flush=True)

    def name(self, conn):
        return f"member {conn['id']}" if conn.get("joined") else f"the connection from {conn['peer']}"

    def accept(self):
        with contextlib.suppress(BlockingIOError):
            sock, peer = self.listener.accept()
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # answers leave at once
            conn = {"id": self.next_id, "sock": sock, "peer": f"{peer[0]}:{peer[1]}", "buffer": b"",
                    "opened": time.monotonic(), "challenge": secrets.token_hex(16)}
            self.conns[self.next_id] = conn
            self.selector.register(sock, selectors.EVENT_READ, self.next_id)
            self.next_id += 1
            unproven = [c for c in self.conns.values() if not c.get("joined") and "lost" not in c]
            if len(unproven) > MAX_UNPROVEN:   # a flood: the oldest goes, so a member still gets in
                unproven[0]["lost"] = f"refused: more than {MAX_UNPROVEN} connections at once have not joined"
            self.send(conn, {"challenge": conn["challenge"]})

    def read(self, cid):
        conn = self.conns[cid]
        try:
            data = conn["sock"].recv(65536)
        except OSError:
            data = b""
        if not data:
            line = None
            if conn.get("joined") and self.run["finished"]:
                line = f"member {cid} finished"
            elif conn.get("joined"):
                line = f"member {cid} is gone (its connection closed)"
            self.close(cid, line)
            return
        conn["buffer"] += data
        try:   # FT: any bytes from anyone end at most their own connection
            while b"\n" in conn["buffer"] and "lost" not in conn:
                line, conn["buffer"] = conn["buffer"].split(b"\n", 1)
                self.handle(conn, parse(line))
            if len(conn["buffer"]) > MAX_LINE:
                raise ValueError(f"a line longer than {MAX_LINE} bytes")
        except ValueError as e:
            conn["lost"] = f"refused: {e}"

    def handle(self, conn, message):
        op = message["op"]
        if not conn.get("joined"):
            if op != "join":
                raise ValueError(f"{op} before proving FT_SECRET")
            self.join(conn, message)
            return
        if op == "join":
            raise ValueError("a second join")
        if not conn.get("dropped"):
            conn.update(want=message, since=time.monotonic())
        elif self.run["finished"] is not None:   # it hung past --member-timeout and woke up: it is told, and let go
            self.send(conn, {"over": f"the run ended while this member hung: its members finished step "
                                     f"{self.run['step']}"})
            conn["lost"] = "was told the run is over"
        else:
            self.send(conn, {"dropped": conn["dropped"]})
            conn["lost"] = "was told it had been dropped"

    def join(self, conn, message):
        """A connection that proves it knows the secret joins, if its flags and its checkpoint's run agree."""
        if not hmac.compare_digest(message["proof"], proof(self.secret, conn["challenge"])):
            raise ValueError("it does not know FT_SECRET")
        flags = message["flags"]
        if not all(isinstance(flags.get(k), (int, float)) for k in ("member_timeout", "min_members", "final_step")):
            raise ValueError("join with unusable flags")
        if not any(c.get("joined") and not c.get("dropped") for c in self.conns.values()):
            self.run["flags"] = flags   # FT: the run's flags are those of its live members (or who comes back)
        differ = [f"{k} {flags.get(k)} here, {v} in the run" for k, v in self.run["flags"].items()
                  if flags.get(k) != v and k != "min_members"]   # (that one counts for the first quorum only)
        answer = {"proof": proof(self.secret, message["challenge"])}   # FT: the coordinator proves it too
        if self.run["finished"] is not None:   # a member after the end (even during the last step): nothing to do
            answer["over"] = f"the run is over: its members finished step {self.run['step']}"
        elif message["run"] not in (None, self.run_id):
            answer["refused"] = (f"error: its checkpoint is of run {message['run']}, and this coordinator serves run "
                                 f"{self.run_id}: start it without --resume, or serve that run (--run-id "
                                 f"{message['run']})")
        elif differ:
            answer["refused"] = (f"error: this member's training flags differ from the run's ({'; '.join(differ)}): "
                                 f"start it with the run's flags")
        else:
            conn.update(joined=True, want=None, since=time.monotonic())
            print(f"coordinator: member {conn['id']} joined from {conn['peer']} at step {message['step']}", flush=True)
            answer.update(id=conn["id"], run=self.run_id)
        self.send(conn, answer)
        if not conn.get("joined"):
            conn["lost"] = "was answered and let go"

    # ---- the decisions of a turn

    def check_connections(self, now, timeout):   # FT: who does not prove itself soon is closed; all hear a beat
        for conn in self.conns.values():
            if not conn.get("joined") and now - conn["opened"] > PROVE_WITHIN:
                conn.setdefault("lost", f"refused: it did not prove it knows FT_SECRET within {PROVE_WITHIN:g} s")
        if now - self.last_beat > min(1.0, timeout / 4):   # the coordinator is alive
            self.last_beat = now
            for conn in self.conns.values():
                if conn.get("joined"):
                    self.send(conn, {"beat": 1})

    def drop_stalled(self, now, timeout):
        """The live members. FT: liveness is progress. Dropped: a member that neither voted nor asked for a quorum
        within --member-timeout of one that waits; one of the generation that has not voted when a peer's
        collective timed out waiting for it (whose collective failed with it votes within 0.25 s)."""
        live = {i: c for i, c in self.conns.items() if c.get("joined") and not c.get("dropped") and "lost" not in c}
        waits = [c["since"] for c in live.values() if c["want"]]
        timed_out = any(c["want"]["op"] == "vote" and not c["want"]["ok"] and c["want"]["waited"] >= 0.9 * timeout
                        and now - c["since"] > 0.25 for c in live.values() if c["want"])
        for i, conn in list(live.items()):
            why = None
            if not conn["want"] and waits and now - max(min(waits), conn["since"]) > timeout:
                why = f"no vote and no request for {timeout:g} s while the others waited"
            elif not conn["want"] and timed_out and i in self.run["members"]:
                why = f"its peers' collective waited {timeout:g} s for it"
            if why:   # FT: alive or not, it holds the others up: they go on without it
                conn.update(dropped=why, want=None)
                print(f"coordinator: {self.name(conn)} dropped: {why}", flush=True)
                del live[i]
        return live

    def commit_or_not(self, live, now):   # FT: all of the generation voted yes, none gone: committed; else no one
        run = self.run
        voters = {i: c for i, c in live.items() if c["want"] and c["want"]["op"] == "vote" and i in run["members"]}
        if not voters or not all(i in voters or i not in live for i in run["members"]):
            return
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
            self.send(conn, {"commit": commit})
        if len(run["failures"]) >= 3:   # FT: said, not retried for ever
            step, members, errors = run["failures"][-1]
            line = (f"error: step {step} failed {len(run['failures'])} times in a row with members {members} "
                    f"({'; '.join(errors) or 'no error given'}): the run ends here; mend that, then --resume")
            print(f"coordinator: {line}", flush=True)
            for conn in live.values():
                self.send(conn, {"failed": line})
            raise SystemExit(1)

    def form_quorum(self, live):   # when every live member asks (at least --min-members for the first)
        run = self.run
        ready = {i: c for i, c in live.items() if c["want"] and c["want"]["op"] == "ready"}
        needed = run["flags"]["min_members"] if run["gen"] == 0 and run["flags"] else 1
        if ready and run["finished"] is not None:   # FT: joined during the last step: told, not trained from 0
            for conn in ready.values():
                self.send(conn, {"over": f"the run is over: its members finished step {run['step']}"})
                conn["lost"] = "was told the run is over"
        if not ready or run["finished"] is not None or len(ready) < max(len(live), needed):
            return
        ids = sorted(ready)
        if ids != run["members"] or run["retry"]:   # a new membership, or the same after a failed step
            run.update(gen=run["gen"] + 1, members=ids, retry=False)
        steps = [ready[i]["want"]["step"] for i in ids]
        behind = min(steps) < max(steps)   # FT: then the member furthest ahead sends its state
        for rank, i in enumerate(ids):   # FT: each member is told what it needs, not the membership
            ready[i]["want"] = None
            self.send(ready[i], {"gen": run["gen"], "rank": rank, "world": len(ids), "step": max(steps),
                                 "src": steps.index(max(steps)) if behind else None})

    def over(self, now, timeout):   # the run finished and its members left (or 10 x --member-timeout passed)
        if any(c.get("joined") and not c.get("dropped") for c in self.conns.values()):
            return False
        if self.run["finished"] is None:
            self.run["flags"] = None   # FT: no member left: no binding flags
            return False
        if self.conns and now - self.run["finished"] <= 10 * timeout:
            return False
        print(f"coordinator: the run is over (step {self.run['step']})", flush=True)
        return True


# ---------------------------------------------------------------- a member's line to the coordinator
class CoordinatorLost(Exception):
    pass

class Stopped(Exception):   # a SIGTERM came while this member waited for the coordinator
    pass

class CoordinatorLink:
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
class Member:
    """A member: it joins; for each step it asks for the quorum, makes the generation's group when the membership
    changed, computes its share, votes, applies what is committed. Stopped, or without its coordinator, it
    leaves with a checkpoint of the last committed step (exit 75)."""

    def __init__(self, args):
        self.args, self.address = args, args.join
        self.secret = the_secret(args.join[0])
        self.device = common.pick_device("gloo", cuda=False)   # FT: gloo between CPUs; see the README on GPUs
        if os.path.isdir(os.path.join(args.data_dir, "train")):
            raise SystemExit("error: ft_ddp_resnet.py trains on Fashion-MNIST; for an image folder, use ddp_resnet.py")
        train_set, self.test_set, _ = common.fashion_mnist(args.data_dir, args.train_samples, args.test_samples)
        self.X_train, self.y_train = train_set.tensors
        if args.batch_size % args.micro_batch:
            raise SystemExit(f"error: --micro-batch {args.micro_batch} does not divide --batch-size {args.batch_size}")
        if len(self.y_train) < args.batch_size:
            raise SystemExit(f"error: {len(self.y_train)} training images are fewer than one global batch of "
                             f"{args.batch_size}")
        self.net = common.resnet("resnet18", 10, args.seed, channels=1, image_size=28).to(self.device)
        lr = args.lr * args.batch_size / 256   # --lr is for 256 samples
        self.steps_per_epoch = len(self.y_train) // args.batch_size
        self.count = args.batch_size // args.micro_batch   # micro-batches in a global batch
        warmup, steps = round(args.warmup_epochs * self.steps_per_epoch), self.steps_per_epoch * args.epochs
        self.optimizer, self.scheduler = common.sgd_recipe(self.net, lr, args.weight_decay, warmup, steps)
        for p in self.net.parameters():   # a momentum of zeros steps as none does: every member holds the same tensors
            self.optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
        self.grads, self.message = gradients_of(self.net), message_buffer(self.net, getattr(torch, args.sums))
        self.final_step = min(args.max_steps or math.inf, self.steps_per_epoch * args.epochs)
        self.metrics = common.new_metrics(__file__, args, [self.device], "gloo, members that come and go", 1,
                                          len(self.test_set))
        self.progress = {"step": 0, "totals": [0.0] * 3, "history": [], "seconds": 0.0}
        # FT: all that makes the training, compared at join, the first step's weights too; the same torch and
        # threads give the same sums
        weights = torch.cat([p.detach().flatten() for p in self.net.parameters()])
        self.flags = {**{k: getattr(args, k) for k in RUN_FLAGS}, "final_step": self.final_step,
                      "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "data": f"labels crc {zlib.crc32(self.y_train.numpy().tobytes())}",
                      "weights": f"crc {zlib.crc32(weights.numpy())}"}
        self.kept = []   # the running statistics as committed, during a step
        self.stop = {"signal": None, "at": 0.0}
        self.making_since = None   # FT: when this member began making its group, while it does
        self.gen, self.generations, self.steps_here = None, 0, 0
        self.saved = load_checkpoint(args.checkpoint, self.net, self.optimizer, self.scheduler) if args.resume else None

    def resume(self):   # as the other scripts do it: the same training flags, or refused; False: nothing to train
        path = self.args.checkpoint
        common.resume_check(self.saved["flags"], {**vars(self.args), "data": self.flags["data"]}, path, True,
                            may_differ=MAY_DIFFER)
        self.progress = {k: self.saved[k] for k in self.progress}
        print(f"resumed from {path} (run {self.saved['run']}): step {self.progress['step']}", flush=True)
        if self.progress["step"] >= self.final_step:
            print(f"nothing to train: {path} is at step {self.progress['step']}", flush=True)
        return self.progress["step"] < self.final_step

    # ---- the coordinator, and leaving

    def join(self):   # FT: join the run; the coordinator gives this member its id, and the store its groups use
        host, port = self.address
        hello = {"flags": self.flags, "step": self.progress["step"], "run": self.saved["run"] if self.saved else None}
        self.link = CoordinatorLink(self.address, self.secret, hello, self.args.member_timeout, self.args.init_timeout,
                                    self.stop)
        self.store = dist.TCPStore(host, self.args.store_port or port + 1, is_master=False,   # FT: the groups meet here
                                   timeout=datetime.timedelta(seconds=self.args.member_timeout))
        print(f"member {self.link.id}: joined run {self.link.run} at {host}:{port}, at step {self.progress['step']}",
              flush=True)

    def uncommitted(self):   # FT: the step is not applied: BatchNorm's running statistics back to the committed ones
        for b, committed in zip(buffers_of(self.net), self.kept):
            b.copy_(committed)
        self.kept.clear()

    def state(self):   # a copy of all a restart of the whole job needs: where it is, of which run, with which flags
        self.uncommitted()
        return copy.deepcopy({**self.progress, "run": self.link.run, "model": self.net.state_dict(),
                              "flags": {**vars(self.args), "data": self.flags["data"]},
                              "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()})

    def checkpoint(self, state=None):   # this member's own, of the last committed step
        saved = state or self.state()
        common.save_atomically(lambda tmp: torch.save(saved, tmp), self.args.checkpoint)

    def leave(self, line, status, state=None, end=sys.exit):   # FT: this member stops; the others go on without it
        self.checkpoint(state)
        print(f"member {self.link.id}: {line}; checkpoint of step {self.progress['step']} written to "
              f"{self.args.checkpoint}; exit status {status}", file=sys.stdout if status == common.PREEMPTED else
              sys.stderr, flush=True)
        end(status)

    def watchdog(self):
        """FT: making a group waits on the store, unbounded if the coordinator hangs (SIGSTOP); a peer stopped
        mid-handshake holds gloo's connect ~5x the timeout. Past 6x this member ends, with the state copied
        before the group was begun: this thread never touches the model."""
        while True:
            time.sleep(0.25)
            since = self.making_since
            if since and time.monotonic() - since > 6 * self.args.member_timeout:
                self.leave(f"lost the coordinator at {self.address[0]}:{self.address[1]} (its store did not answer "
                           f"for {6 * self.args.member_timeout:g} s); once it is back, --resume goes on",
                           common.PREEMPTED, self.before_group, os._exit)

    def talk(self, message=None):   # FT: a word with the coordinator: losing it, or a SIGTERM, ends this member
        try:
            return self.link.ask(message) if message else self.link.receive()
        except Stopped:
            self.leave(f"stopped by {self.stop['signal']} at step {self.progress['step']} (the other members go on)",
                       common.PREEMPTED)
        except CoordinatorLost as e:
            self.leave(f"lost the coordinator at {self.address[0]}:{self.address[1]} ({e}); once it is back, "
                       f"--resume goes on", common.PREEMPTED)

    def answered(self, reply):   # FT: True if the step may go on; else this member rejoins, or ends
        if "over" in reply:   # it hung until the run ended, or joined during its last step
            print(f"member {self.link.id}: {reply['over']}; nothing is left to train", flush=True)
            raise SystemExit(0)
        if "failed" in reply:
            self.leave(reply["failed"], 1)
        if "dropped" not in reply:
            return True
        # it hung past --member-timeout; the others went on without it
        print(f"member {self.link.id}: dropped by the coordinator ({reply['dropped']}); rejoining", flush=True)
        self.checkpoint()   # its statistics as committed (and a file as current as it can be)
        self.link.sock.close()
        if dist.is_initialized():   # FT: its old group, which the others have left
            dist.destroy_process_group()   # FT: (a new one comes with its next generation)
        self.join()
        self.gen = None
        return False

    # ---- one step

    def new_group(self, quorum):   # FT: a new membership: a new group, on a new prefix of the store; the failure
        self.gen, self.generations = quorum["gen"], self.generations + 1
        print(f"member {self.link.id}: generation {self.gen}: {quorum['world']} member(s), from step "
              f"{quorum['step']}", flush=True)
        if dist.is_initialized():   # FT: the last generation's group goes
            dist.destroy_process_group()   # FT: before this one's is made
        self.before_group = self.state()   # what the watchdog writes, should the store hang
        started = time.monotonic()
        self.making_since = started
        problem = None
        try:
            dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{self.gen}", self.store),   # FT: its own
                                    rank=quorum["rank"], world_size=quorum["world"],
                                    timeout=datetime.timedelta(seconds=self.args.member_timeout))
        except (RuntimeError, dist.DistError) as e:
            self.gen, problem = None, failure(e, started)
        self.making_since = None
        return problem

    def take_part(self, quorum, step):
        """The step: a recovery if someone is behind, this member's micro-batches, the allreduce. Returns (the
        step, recovered or not, its sums, the failure or None)."""
        problem = None
        if quorum["gen"] != self.gen:
            problem = self.new_group(quorum)
        if not problem and quorum["src"] is not None:   # FT: someone is behind: the member furthest ahead sends
            recovered, problem = recover(self.net, self.optimizer, self.progress, quorum["src"], self.args.epochs)
            if recovered and recovered["step"] != step:
                self.progress, step = recovered, recovered["step"]
                schedule_at(self.scheduler, step)
                self.timer = common.Timer(self.device, already=self.progress["seconds"])
                print(f"member {self.link.id}: recovered live at step {step}", flush=True)
        self.kept[:] = [b.clone() for b in buffers_of(self.net)]
        if problem:
            return step, None, problem
        rank, world_size = quorum["rank"], quorum["world"]
        idx = global_batch(len(self.y_train), self.args.batch_size, self.args.seed, step // self.steps_per_epoch + 1,
                           step % self.steps_per_epoch)
        mine = range(self.count * rank // world_size, self.count * (rank + 1) // world_size)   # FT: this member's share
        self.net.train()
        totals = compute(self.net, self.grads, self.message, self.X_train[idx], self.y_train[idx],
                         self.args.micro_batch, mine, self.args.amp)
        step_totals, problem = exchange(self.net, self.grads, self.message, totals, 0 in mine, self.count)   # FT: sums
        return step, step_totals, problem

    def apply(self, step, step_totals):   # committed: the update, the position, an epoch's evaluation, a checkpoint
        self.kept.clear()
        self.optimizer.step()
        self.scheduler.step()
        for name, b in self.net.named_buffers():
            if name.endswith("num_batches_tracked"):
                b.fill_(step + 1)   # FT: the same on every member, whoever held micro-batch 0
        self.steps_here += 1
        totals = [a + b for a, b in zip(self.progress["totals"], step_totals.tolist())]
        self.progress = {"step": step + 1, "totals": totals, "history": self.progress["history"],
                         "seconds": self.timer()}
        if self.progress["step"] % self.steps_per_epoch == 0 or self.progress["step"] == self.final_step:
            self.net.eval()   # an epoch's end: every member evaluates alike
            test_acc = common.accuracy(self.net, common.test_loader(self.test_set, 0, 1, self.device), self.device, 1)
            self.metrics["epochs"] = self.progress["history"]
            common.record_epoch(self.metrics, step // self.steps_per_epoch + 1, torch.tensor(self.progress["totals"]),
                                self.progress["seconds"], test_acc, True)
            self.progress = {"step": self.progress["step"], "totals": [0.0] * 3, "history": self.metrics["epochs"],
                             "seconds": 0.0}
            self.timer = common.Timer(self.device)
        if self.args.checkpoint_every and self.progress["step"] % self.args.checkpoint_every == 0:
            self.checkpoint()   # after an epoch's evaluation

    def train(self):
        if self.saved and not self.resume():
            return self.net
        os.makedirs(self.args.out, exist_ok=True)
        signal.signal(signal.SIGTERM, lambda signum, frame: self.stop.update(signal="SIGTERM", at=time.monotonic()))
        self.join()
        threading.Thread(target=self.watchdog, daemon=True).start()
        self.timer = common.Timer(self.device, already=self.progress["seconds"])
        counted = False   # the last vote also asked for this step's quorum
        while self.progress["step"] < self.final_step:
            step = self.progress["step"]
            if self.stop["signal"]:
                self.leave(f"stopped by {self.stop['signal']} at step {step} (the other members go on)",
                           common.PREEMPTED)
            # FT: who takes part in this step (after a vote that asked for it too, it comes unasked)
            quorum = self.talk() if counted else self.talk({"op": "ready", "step": step})
            counted = False
            if not self.answered(quorum):
                continue
            step, step_totals, problem = self.take_part(quorum, step)
            # FT: all apply the step, or none; "next": this member is ready for the next step's quorum too
            # (one message to the coordinator per step; not at the last step, nor when it was told to stop)
            counted = step + 1 < self.final_step and not self.stop["signal"]
            commit = self.talk({"op": "vote", "step": step, "ok": problem is None, "next": counted,
                                **(problem or {"error": "", "waited": 0.0})})
            if not self.answered(commit):
                counted = False
            elif not commit["commit"]:   # FT: no member applies it; the next quorum computes this step again
                self.uncommitted()
            else:
                self.apply(step, step_totals)
        self.link.sock.close()
        self.metrics.update(generations=self.generations, epochs=self.progress["history"])
        sent = {"all_reduce (the members)": common.nbytes(self.message)} if self.steps_here else {}
        common.finish(self.metrics, self.progress["step"], sum(e["seconds"] for e in self.metrics["epochs"]),
                      self.net.state_dict(), sent)
        if dist.is_initialized():   # FT: leave the last group
            dist.destroy_process_group()   # FT: cleanly
        return self.net

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
    if args.serve:
        return Coordinator(args).serve()
    return Member(args).train()

if __name__ == "__main__":
    main()
