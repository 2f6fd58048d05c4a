"""What a run of many processes does when something goes wrong, so that a user can act on it.

- A rank fails: every rank ends with one line, never a traceback (one_line_per_rank); a problem
  one node has before training (its data) ends every rank at once, said once (check_together); a
  global batch the ranks cannot share is refused (rank_batch_size).
- A preemption signal (SIGTERM, SIGUSR1): the ranks agree at a step boundary and write a
  checkpoint (StopRequest, Checkpointing); the script stops there, with exit status PREEMPTED.
  Checkpoints are written durably (save_atomically).
- A restart: where the checkpoint goes on from, said in one line, and the random state
  (resume_position, rng_state).

Used by scratch_ring.py and ddp_toy.py (the first part), and by ddp_resnet.py, fsdp_resnet.py and
diloco_resnet.py (all of it)."""
import contextlib, json, os, signal, socket, sys, threading, time, zlib
import torch
import torch.distributed as dist
import common

# ---------------------------------------------------------------- a rank fails: one line from every rank
def tell_the_launcher(line):
    """torchrun's summary names the first failed worker's error file as the "Root Cause"; a line we
    exit with (a SystemExit, which torch's `record` does not write) goes there, in its JSON form."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)

def where_to_resume(checkpoint):
    if not checkpoint:
        return "nothing was saved to resume from"
    if os.path.exists(checkpoint):
        return f"run again with --resume to go on from the last checkpoint, {checkpoint}"
    return f"no checkpoint at {checkpoint} on this node"

@contextlib.contextmanager
def one_line_per_rank(checkpoint=None):
    """Every rank ends with one line, never a traceback. A rank's own error (a SystemExit with its
    line) is said and handed to torchrun. A rank whose collective breaks because a peer failed or
    left (c10d's error types, gloo's or NCCL's words) says so and where the last checkpoint is, a
    second later, so that the launcher names the failed rank first (it orders by whole seconds)."""
    try:
        yield
    except SystemExit as e:
        if isinstance(e.code, str):
            tell_the_launcher(e.code)
        raise
    except RuntimeError as e:
        if not dist.is_initialized() or not (isinstance(e, dist.DistError) or any(
                word in str(e) for word in ("gloo", "NCCL", "Connection closed", "Connection reset"))):
            raise   # a bug of this rank: its traceback
        reason = " ".join(str(e).split()).split("] ", 1)[-1].split(". ")[0][:160]   # gloo: "[file:line] Conn..."
        rank = dist.get_rank()
        time.sleep(1.0)
        print(f"rank {rank}: stopping: another rank failed or left ({reason}); {where_to_resume(checkpoint)}",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None

def problem_of(check, *args):
    """(check(*args), None), or (None, the line it exits with): for check_together."""
    try:
        return check(*args), None
    except SystemExit as e:
        return None, e.code if isinstance(e.code, str) else f"error: exit status {e.code}"

def check_together(problem, rank, world_size, same=None):
    """Every rank hears each rank's problem (a line, or None) and what must be equal on all (`same`:
    its data) in one collective: one node's problem ends all at once, said by the first rank that
    has it (named if others do not); the others say which rank stopped the run."""
    told = [(problem, same)]
    if world_size > 1:
        told = [None] * world_size
        dist.all_gather_object(told, (problem, same))
    problems = [p for p, _ in told]
    if not any(problems) and any(s != told[0][1] for _, s in told):
        other = next(r for r, (_, s) in enumerate(told) if s != told[0][1])
        problems = [f"error: rank {other} sees other data than rank 0 ({told[other][1]}; rank 0: {told[0][1]}): "
                    f"every node's --data-dir must hold the same"] * world_size
    mine = problems[rank]
    if not any(problems) or (mine and problems.index(mine) != rank):   # nothing, or said by an earlier rank
        if any(problems):
            raise SystemExit(1)
        return
    if mine is None:
        first = next(r for r, p in enumerate(problems) if p)
        print(f"rank {rank}: stopping: rank {first} cannot go on (its line says why)", file=sys.stderr, flush=True)
        raise SystemExit(1)
    raise SystemExit(mine if all(p == mine for p in problems) else f"rank {rank} ({socket.gethostname()}): {mine}")

def rank_batch_size(batch_size, world_size, train_samples, master, what="training samples"):
    """The global batch divided by the world size (one command line, the same training at any size); a
    batch the ranks cannot share, or fewer samples than one, refused in one line by rank 0."""
    rank_batch = batch_size // world_size
    if rank_batch == 0 or train_samples < rank_batch * world_size:
        sys.exit((f"error: --batch-size {batch_size} is smaller than the world size {world_size}" if rank_batch == 0 else
                  f"error: {train_samples} {what} are fewer than one global batch of {rank_batch * world_size}; use "
                  f"more samples, a smaller batch or fewer ranks") if master else 1)
    if rank_batch * world_size != batch_size and master:
        print(f"note: --batch-size {batch_size} does not divide by {world_size} ranks: each takes "
              f"{rank_batch}, a global batch of {rank_batch * world_size}", flush=True)
    return rank_batch

def fashion_mnist_on_every_node(data_dir, train_samples, test_samples, rank, world_size):
    """common.load_fashion_mnist in a group: each node's first process prepares the files on its own
    disk (nodes need not share one), every rank reads its own copy, and all check they hold the same."""
    first_here = int(os.environ.get("LOCAL_RANK", rank)) == 0
    check_together(common.prepare_fashion_mnist(data_dir) if first_here else None, rank, world_size)
    out, problem = problem_of(common.load_fashion_mnist, data_dir, train_samples, test_samples)
    check_together(problem, rank, world_size, same=out and ", ".join(
        f"{len(y)} {split} images, labels crc {zlib.crc32(y.numpy().tobytes())}" for split, (_, y) in out.items()))
    return out

# ---------------------------------------------------------------- preemption: stop together, checkpoint
PREEMPTED = 75   # EX_TEMPFAIL, "try again later": not 0, which a scheduler or a pipeline would take
                 # for a finished training, and not 1, which says something broke

class StopRequest:
    """SIGTERM (preemption, requeue, torchrun shutting down) and SIGUSR1 (sbatch --signal, ahead
    of the time limit) only note the signal; the ranks decide together, at a step boundary: a
    rank that stopped alone would leave the others waiting in the next collective for ever.

    The decision costs no waiting. At each boundary a rank reads the allreduce (MAX) of the flags
    that it started at the previous boundary, long finished since, and starts the next one, on a
    gloo group of its own over CPU tensors (no GPU sync, never queued behind the gradients). All
    ranks read the same answer after the same step, one step after a signal is first noted.

    A SIGTERM can also mean that the launcher is ending the job because another rank failed
    (torchrun does so). A rank blocked in a collective with the failed one never returns to
    Python, where the handler runs (NCCL waits out its timeout): a thread that the signal wakes
    at once ends the rank with its line when the ranks have not agreed to stop within a grace of
    10 s plus three of the longest steps so far."""
    def __init__(self, checkpoint=None):
        self.signal, self.pending, self.answer, self.watching, self.wake = 0, None, None, True, None
        self.longest_step, self.boundary, self.rank = 0.0, time.monotonic(), dist.get_rank()
        self.group = dist.new_group(backend="gloo")
        for name in ("SIGTERM", "SIGUSR1"):
            if hasattr(signal, name):   # Windows has no SIGUSR1
                signal.signal(getattr(signal, name), self._note)
        if hasattr(signal, "SIGTERM") and os.name == "posix":
            wake_read, self.wake = os.pipe()   # the C-level handler writes the signal's number here
            os.set_blocking(self.wake, False)
            signal.set_wakeup_fd(self.wake)
            threading.Thread(target=self._watch, args=(wake_read, checkpoint), daemon=True).start()

    def _note(self, signum, frame):
        self.signal = signum

    def _watch(self, wake_read, checkpoint):
        while (byte := os.read(wake_read, 1)) and byte[0] != signal.SIGTERM:
            pass
        if not byte:   # the write end closed: the run is over
            os.close(wake_read)
            return
        grace = 10.0 + 3 * self.longest_step
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.answer or not self.watching:
                return
            time.sleep(0.1)
        print(f"rank {self.rank}: stopping: SIGTERM came and the ranks did not agree to stop within "
              f"{grace:.0f} s (another rank failed, left or hangs); {where_to_resume(checkpoint)}",
              file=sys.stderr, flush=True)
        os._exit(1)

    def agreed(self):
        """The signal any rank had noted one step ago (the same answer on every rank), or None."""
        now, answer = time.monotonic(), None
        self.longest_step, self.boundary = max(self.longest_step, now - self.boundary), now
        if self.pending:
            work, flag = self.pending
            work.wait()
            answer = signal.Signals(int(flag.item())).name if flag.item() else None
        self.pending = None
        if not answer:
            flag = torch.tensor([float(self.signal)])
            self.pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        self.answer = answer
        return answer

    def close(self):
        """Wait for the flag's last allreduce (nothing may be in flight when the groups go) and
        let go of the group: the signal handlers keep this object alive, and a group object still
        referenced keeps gloo's threads running past destroy_process_group."""
        self.watching = False
        if self.wake is not None:
            signal.set_wakeup_fd(-1)
            os.close(self.wake)   # ends the watching thread
            self.wake = None
        if self.pending:
            self.pending[0].wait()
        self.pending = self.group = None

class Checkpointing:
    """Where the run is, saved: every `every` steps inside an epoch, at each epoch's end, where
    --max-steps stops it, and when a signal is agreed on (after_step says so; the script stops).
    `save(position)` is the script's own writer, called on every rank. A position: the epoch under
    way, its batches done, the global step, the epoch's partial totals (summed over ranks) and
    seconds, and what the batches are drawn from."""
    def __init__(self, save, path, every, drawn_from, final_step, master, recipe):
        self.save_fn, self.path, self.every, self.drawn_from, self.recipe = save, path, every, drawn_from, recipe
        self.final_step, self.master, self.stop = final_step, master, StopRequest(path)
        if master:
            remove_leftovers(os.path.dirname(os.path.abspath(path)))

    def save(self, epoch, batch_in_epoch, step, totals, seconds, batches):
        partial = totals.clone()
        dist.all_reduce(partial)   # every rank's sums so far
        self.save_fn({"epoch": epoch, "batch_in_epoch": batch_in_epoch, "step": step,
                      "totals": partial.tolist(), "seconds": seconds, "drawn_from": self.drawn_from,
                      "recipe": self.recipe})
        if self.master:
            print(f"  checkpoint: step {step} (epoch {epoch}, batch {batch_in_epoch}/{batches})", flush=True)

    def after_step(self, epoch, batch_in_epoch, batches, step, totals, timer):
        """Save every `every` steps. On a signal the ranks agreed on: save, say so (here and to
        torchrun, which counts exit status 75 as a failure and shows this line), and return the
        signal's name: the script stops. The run's last step goes on to its outputs regardless."""
        if step == self.final_step:
            return
        signalled = self.stop.agreed()
        if signalled or (self.every and step % self.every == 0 and batch_in_epoch < batches):
            self.save(epoch, batch_in_epoch, step, totals, timer(), batches)
        if signalled:
            line = (f"stopped by {signalled} at step {step}, checkpoint written; exit status {PREEMPTED} (not finished, "
                    f"nothing failed): run again with --resume to go on from {self.path}")
            if self.master:
                print(line, flush=True)
            tell_the_launcher(line)
        return signalled

    def epoch_done(self, epoch, step):
        self.save_fn({"epoch": epoch + 1, "batch_in_epoch": 0, "step": step, "totals": [0.0] * 3,
                      "seconds": 0.0, "drawn_from": self.drawn_from,
                      "recipe": self.recipe})

    def close(self):   # at the end of the run, before the group goes
        self.stop.close()

# ---------------------------------------------------------------- checkpoints written durably
def sync(path):
    """A file's or folder's contents from the page cache to the disk (a rename is durable only
    once its folder is synced). Where folders cannot be opened (Windows), nothing."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

def save_atomically(write, path):
    """write(tmp), sync, rename, sync the folder: after a crash or a power loss the file is the
    old one or the new one, never a part of one."""
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    sync(tmp)
    os.replace(tmp, path)
    sync(os.path.dirname(os.path.abspath(path)))

def remove_leftovers(folder):
    """Delete the `NAME.tmp<pid>` files of writers killed mid-write (save_atomically's), unless that
    process still runs."""
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        pid = name.rpartition(".tmp")[2]
        if ".tmp" in name and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))

# ---------------------------------------------------------------- resuming
def resume_position(saved, drawn_from, recipe, args, steps_per_epoch, master):
    """The position a loaded checkpoint goes on from, said in one line; None when nothing is
    left to train (the caller leaves the group and returns). Exits, saying why, when the
    checkpoint stopped inside an epoch and this run would draw other batches. At an epoch's end
    other batches are fine: the run goes on from the next epoch, its steps counted in this run's
    batches. Other `recipe` flags (--lr, ...) than the checkpoint's are said, and apply from here."""
    position = {k: saved[k] for k in ("epoch", "batch_in_epoch", "step", "totals", "seconds")}
    path = args.checkpoint
    differ = ", ".join(f"{k} {saved['drawn_from'][k]} there, {v} here"
                       for k, v in drawn_from.items() if saved["drawn_from"][k] != v)
    if position["batch_in_epoch"] and differ:
        raise SystemExit(f"error: cannot resume from {path}: it stopped inside epoch {position['epoch']}, and "
                         f"this run draws other batches ({differ}); use the same --batch-size, --seed and "
                         f"--train-samples, or start without --resume" if master else 1)
    if differ:   # at an epoch's end: the epochs done are what counts, in this run's steps
        position["step"] = (position["epoch"] - 1) * steps_per_epoch
        if master:
            print(f"note: {path} was written with other batches ({differ}); it finished epoch "
                  f"{position['epoch'] - 1}, which is step {position['step']} in this run's batches", flush=True)
    changed = [f"{k} {v} (was {saved['recipe'][k]})" for k, v in recipe.items()
               if saved.get("recipe") and saved["recipe"].get(k, v) != v]
    if changed and master:
        print(f"note: resumed with {', '.join(changed)}: applied from step {position['step']} on", flush=True)
    if args.max_steps and position["step"] >= args.max_steps:
        nothing = f"it is at step {position['step']}, at or past --max-steps {args.max_steps}"
    elif position["epoch"] > args.epochs:
        nothing = f"it has finished epoch {position['epoch'] - 1} of --epochs {args.epochs}"
    else:
        if master:
            where = (f"epoch {position['epoch'] - 1} done" if not position["batch_in_epoch"] else
                     f"epoch {position['epoch']} at batch {position['batch_in_epoch']}/{steps_per_epoch}")
            print(f"resumed from {path}: {where}, step {position['step']}", flush=True)
        return position
    if master:
        print(f"nothing to train: {path}: {nothing}", flush=True)
    return None

def rng_state(device):
    """The random number generators that this process uses: the CPU's, and its own GPU's."""
    return {"cpu_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}

def restore_rng(state, device):
    """Every rank takes the saving rank's state (all ranks start from one seed). A GPU state
    goes to this rank's own GPU; on a machine without one there is none to restore."""
    torch.set_rng_state(state["cpu_rng"].cpu())
    if device.type == "cuda" and state.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(state["cuda_rng"].cpu(), device)

