"""Data parallelism from scratch across processes: scratch_lenet.py's replicas, now in several
processes (on one machine or many), their gradients summed by a ring allreduce written from
point-to-point send/recv. Still by hand; read scratch_lenet.py first.

    torchrun --standalone --nproc_per_node=2 scratch_ring.py              # one replica per process
    torchrun --standalone --nproc_per_node=2 scratch_ring.py --devices 2  # hierarchical: 2 replicas
        # per process sum in memory first, then one ring between processes, as across machines
    ... --overlap     # send each bucket of gradients while backward still runs, as DDP does
    ... --zero        # each process updates 1/W of the parameters with 1/W of the momentum (ZeRO)
    python scratch_ring.py                        # a group of one process, no launcher needed

The model, the replicas, the in-memory allreduce, SGD, the evaluation and the epoch's line come
from scratch_lenet.py; what this file adds exists only because there are several processes, and
lines of the training that exist only for that reason are tagged `# RING:`.
"""
import argparse, collections, math, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
import common
from scratch_lenet import (PARAM_NAMES, add_lenet_flags, allreduce, evaluation_sums, get_params,
                           init_params, lenet, replica_steps, report_epoch, sgd, split_batch)


# ---------------------------------------------------------------- the ring allreduce from send/recv
def flatten(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat, tensors):
    """Copy consecutive pieces of `flat` back into `tensors` (whatever their memory layout)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def owned_chunk(rank, world_size):
    """The chunk whose full sum the reduce-scatter leaves on process `rank`."""
    return (rank + 1) % world_size


# The bytes this process hands to send() in training steps: metrics.json says them.
SENT = collections.Counter()


def _exchange(send_chunk, recv_buffer, rank, world_size):
    """Both directions at once, so no process waits on another. The receive is posted first: gloo
    starts a send only once the peer has posted its receive, and with the sends first both
    directions took turns (twice the time of one message on a simulated 100 Mbit/s link)."""
    SENT["send (to the next process)"] += common.nbytes(send_chunk)
    ops = [dist.P2POp(dist.irecv, recv_buffer, (rank - 1) % world_size),   # RING: from the left
           dist.P2POp(dist.isend, send_chunk, (rank + 1) % world_size)]   # RING: to the right
    for request in dist.batch_isend_irecv(ops):   # RING: both at once
        request.wait()


def ring_reduce_scatter(chunks, rank, world_size):
    """The first half of a ring allreduce, in place on `chunks` (one per process): in W-1 steps
    each process passes one chunk to its right neighbour and adds the one from its left. After
    it, process r holds the full sum of chunk owned_chunk(r) (the other chunks hold partial
    sums)."""
    for step in range(world_size - 1):
        send, recv = (rank - step) % world_size, (rank - step - 1) % world_size
        incoming = torch.empty_like(chunks[recv])
        _exchange(chunks[send], incoming, rank, world_size)
        chunks[recv] += incoming


def ring_all_gather(chunks, rank, world_size):
    """The second half: each process starts with chunk owned_chunk(rank) complete; W-1 steps pass
    the finished chunks around until every process has all of them."""
    for step in range(world_size - 1):
        send, recv = (rank - step + 1) % world_size, (rank - step) % world_size
        _exchange(chunks[send], chunks[recv], rank, world_size)


def ring_allreduce(tensors, rank, world_size):
    """Sum `tensors` over all processes, in place, by point-to-point messages around a ring: a
    reduce-scatter, then an all-gather, on the flat data cut into world_size chunks (any length).
    Each process sends 2(W-1)/W of the data, however many processes there are."""
    flat = flatten(tensors)
    # Views of flat: the ring works on it in place.
    chunks = list(flat.tensor_split(world_size))
    ring_reduce_scatter(chunks, rank, world_size)
    ring_all_gather(chunks, rank, world_size)
    unflatten_into(flat, tensors)


# ---------------------------------------------------------------- hierarchy, overlap, ZeRO
def sum_gradients(replicas, rank, world_size):
    """Hierarchical, as across machines: the replicas of this process sum in memory first, then
    one ring allreduce of that sum runs between processes, then the result goes back to this
    process's replicas. Only one sum per process crosses the network."""
    for i in range(len(replicas[0])):
        allreduce([replica[i].grad for replica in replicas])
    if world_size > 1:   # RING: then across processes
        ring_allreduce([p.grad for p in replicas[0]], rank, world_size)
        for replica in replicas[1:]:
            for p, p0 in zip(replica, replicas[0]):
                p.grad[:] = p0.grad.to(p.device)


class OverlappedAllreduce:
    """--overlap: sum the gradients across processes while backward is still running, as DDP
    does. The parameters are grouped into buckets in the order backward produces their gradients
    (last layer first). When autograd has accumulated a parameter's gradient in every replica of
    this process, a hook sums it in memory; a complete bucket goes to a communication thread, which
    runs the ring allreduce on it while backward goes on with the earlier layers. Buckets are sent
    in one fixed order, the same on every process, as the ring requires."""
    def __init__(self, replicas, rank, world_size, bucket_bytes, device):
        self.replicas, self.rank, self.world_size = replicas, rank, world_size
        self.buckets, size = [[]], 0
        # Backward reaches the last layer first.
        for i in reversed(range(len(replicas[0]))):
            if size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += common.nbytes(replicas[0][i])
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        # A new thread's current GPU is GPU 0: NCCL's send/recv from it could wait on the wrong
        # GPU, or hang.
        on_gpu = {}
        if device.type == "cuda":
            on_gpu = dict(initializer=torch.cuda.set_device, initargs=(device,))
        self.comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="comm", **on_gpu)
        self.lock = threading.Lock()
        self._reset()
        for replica in replicas:
            for i, p in enumerate(replica):
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))

    def _reset(self):
        self.arrived = [0] * len(self.replicas[0])
        self.missing = [len(bucket) for bucket in self.buckets]
        self.next_bucket, self.sends = 0, []

    def _grad_ready(self, i):
        """Inside backward, in the replica's thread."""
        with self.lock:
            self.arrived[i] += 1
            if self.arrived[i] < len(self.replicas):
                return
            # This process's replicas, in memory.
            allreduce([replica[i].grad for replica in self.replicas])
            self.missing[self.bucket_of[i]] -= 1
            while self.next_bucket < len(self.buckets) and self.missing[self.next_bucket] == 0:
                self.sends.append(self.comm.submit(self._send, self.buckets[self.next_bucket]))
                self.next_bucket += 1

    def _send(self, bucket):
        """In the communication thread, while backward runs."""
        with torch.no_grad():
            grads = [self.replicas[0][i].grad for i in bucket]
            ring_allreduce(grads, self.rank, self.world_size)
            for replica in self.replicas[1:]:
                for i in bucket:
                    replica[i].grad.copy_(self.replicas[0][i].grad)

    def wait(self):
        """Block until every bucket is summed and back in every replica."""
        for send in self.sends:
            send.result()
        self._reset()


def zero_step(replicas, velocity, lr, global_batch, rank, world_size, momentum=0.9):
    """--zero: the ring allreduce's two halves with the update between them (ZeRO). The
    reduce-scatter leaves this process the summed gradient of one chunk; it updates that chunk of
    the parameters alone, with momentum kept for that chunk alone (1/W of the optimizer state);
    the all-gather then hands every process all the updated parameters. The bytes on the wire are
    those of the allreduce."""
    # This process's replicas first, in memory.
    for i in range(len(replicas[0])):
        allreduce([replica[i].grad for replica in replicas])
    grads, params = flatten([p.grad for p in replicas[0]]), flatten(replicas[0])
    grad_chunks = list(grads.tensor_split(world_size))
    param_chunks = list(params.tensor_split(world_size))
    mine = owned_chunk(rank, world_size)
    ring_reduce_scatter(grad_chunks, rank, world_size)
    # As sgd() does, on one chunk.
    velocity.mul_(momentum).add_(grad_chunks[mine], alpha=1 / global_batch)
    param_chunks[mine] -= lr * velocity
    ring_all_gather(param_chunks, rank, world_size)
    for replica in replicas:
        unflatten_into(params.to(replica[0].device), replica)
        for p in replica:
            p.grad.zero_()


def train_batch(X, y, replicas, velocities, devices, lr, global_batch, rank, world_size,
                forward=lenet, overlap=None, zero=False, in_turn=False):
    """One step on this process's share of the global batch; returns the summed loss and right
    answers. `velocities`: one list per replica, or with zero=True this process's one chunk.
    `in_turn`: the replicas one by one."""
    X_shards, y_shards = split_batch(X, y, devices)
    # With --overlap, complete buckets are already being summed across processes during this.
    losses, hits = replica_steps(X_shards, y_shards, replicas, forward, in_turn)
    with torch.no_grad():
        if zero:
            zero_step(replicas, velocities[0], lr, global_batch, rank, world_size)
        else:
            if overlap:
                overlap.wait()
            else:
                sum_gradients(replicas, rank, world_size)
            for replica, velocity in zip(replicas, velocities):
                sgd(replica, velocity, lr, global_batch)
    return sum(l.to(devices[0]) for l in losses), sum(h.to(devices[0]) for h in hits)


# ---------------------------------------------------------------- the evaluation, the epoch's sums
def evaluate(params, batches, device):
    """The test loss and accuracy over all processes, each test image counted once, and that
    count."""
    tested = evaluation_sums(params, batches, device).total()   # RING: over all processes
    return {"test_loss": tested["loss"] / tested["samples"],
            "test_acc": tested["correct"] / tested["samples"],
            "test_count": round(tested["samples"])}


def ring_total(sums, rank, world_size):
    """{name: sum over all processes} of the epoch's sums, by the ring. What it sends is not a
    training step's, and is not counted."""
    in_steps = SENT.copy()
    ring_allreduce(list(sums.values()), rank, world_size)   # RING: over all processes
    SENT.clear()
    SENT.update(in_steps)
    return {name: value.item() for name, value in sums.items()}


# ---------------------------------------------------------------- training
def make_velocities(replicas, rank, world_size, zero):
    """The momentum, and the tensors of it this process holds: with --zero for the chunk of the
    parameters this process owns alone; else for every parameter in every replica."""
    if zero:   # RING: 1/W of one replica's momentum
        flat = flatten([p.detach() for p in replicas[0]])
        velocity = torch.zeros_like(flat.tensor_split(world_size)[owned_chunk(rank, world_size)])
        return [velocity], [velocity]
    velocities = [[torch.zeros_like(p) for p in replica] for replica in replicas]
    return velocities, sum(velocities, [])


def say_start(metrics, args, overlap, replicas, devices, world_size):
    """The run's first line, and with --zero the optimizer state it spares."""
    mode = ""
    if overlap:
        mode = f", gradients sent during backward in {len(overlap.buckets)} buckets"
    elif args.zero:
        mode = ", ZeRO: reduce-scatter, update 1/W, all-gather"
    print(f"scratch_ring: {metrics['layout']} on {devices[0]} ({metrics['backend']}{mode}), "
          f"global batch {args.batch_size}", flush=True)
    if args.zero:
        model_bytes = common.nbytes(*replicas[0])
        print(f"  optimizer state in this process: {metrics['optimizer_state_bytes']:,} bytes of "
              f"momentum, where every replica keeps {model_bytes:,} without --zero; each process "
              f"sends 2(W-1)/W = {2 * (world_size - 1) / world_size:.2f} x the model's bytes per "
              f"step, as the allreduce does", flush=True)


def train(args, devices, rank, world_size):
    """The set-up, then the epochs, each evaluated. Returns this process's replicas."""
    master = rank == 0   # RING: process 0 prints and writes
    if master:
        os.makedirs(args.out, exist_ok=True)
    train_set, test_set, _ = common.load_on_every_rank(   # RING: each node reads its disk
        lambda: common.fashion_mnist(args.data_dir, args.train_samples, args.test_samples),
        world_size)
    common.check_batch(args.batch_size, world_size, len(train_set), rank)
    # RING: this process's 1/W of each global batch (DistributedSampler), and of the test set
    train_batches, sampler = common.train_loader(train_set, args.batch_size, args.seed, rank,
                                                 world_size, devices[0])
    test_batches = common.test_loader(test_set, rank, world_size, devices[0])
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    # Every process starts from the same seed, so all replicas start equal.
    replicas = [get_params(init_params(args.seed), d, layout) for d in devices]
    velocities, held = make_velocities(replicas, rank, world_size, args.zero)
    overlap = None
    if args.overlap:
        overlap = OverlappedAllreduce(replicas, rank, world_size, args.bucket_kb * 1024, devices[0])
    forward = torch.compile(lenet) if args.compile else lenet
    every = sum(common.every_rank([str(d) for d in devices], world_size), [])   # RING: all replicas
    backend = f"{dist.get_backend()} send/recv"
    metrics = common.new_metrics(__file__, args, every, backend, world_size, len(test_set))
    metrics["optimizer_state_bytes"] = common.nbytes(*held)
    if master:
        say_start(metrics, args, overlap, replicas, devices, world_size)
    total_steps = min(args.epochs * (len(train_set) // args.batch_size),
                      args.max_steps or math.inf)
    step, start = 0, time.perf_counter()
    SENT.clear()
    for epoch in range(1, args.epochs + 1):
        timer = common.Timer(devices[0])
        # RING: a new order each epoch, the same on every process.
        sampler.set_epoch(epoch)
        sums = common.Sums.on(devices[0], loss=0, correct=0, samples=0)
        for X, y in train_batches:
            # Linear decay to zero: a calmer finish.
            lr = args.lr * (1 - step / total_steps)
            # Compiled in one thread: torch 2.9 fails in two at once.
            in_turn = args.compile and step == 0
            loss, hits = train_batch(X, y, replicas, velocities, devices, lr, args.batch_size,
                                     rank, world_size, forward, overlap, args.zero, in_turn)
            sums["loss"] += loss
            sums["correct"] += hits
            # A Python number: no host-to-device copy (a GPU sync) per step.
            sums["samples"] += len(y)
            step += 1
            if step == args.max_steps:
                break
        seconds = timer()
        tested = evaluate(replicas[0], test_batches, devices[0])
        report_epoch(metrics, epoch, ring_total(sums, rank, world_size), seconds, tested, master)
        if step == args.max_steps:
            break
    if master:
        weights = {name: p.contiguous() for name, p in zip(PARAM_NAMES, replicas[0])}
        sent = {k: v / step for k, v in SENT.items()}
        common.finish(metrics, step, time.perf_counter() - start, weights, sent)
    return replicas


# ---------------------------------------------------------------- command line
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=common.positive_int, default=1, help="replicas in each "
                   "process (on GPUs, process r drives GPUs r*K .. r*K+K-1 of its node)")
    p.add_argument("--overlap", action="store_true",
                   help="send each bucket of gradients as soon as backward has made it")
    p.add_argument("--bucket-kb", type=common.positive_float, default=128, help="with --overlap: "
                   "gradient kilobytes per bucket (1 gives one bucket per layer)")
    p.add_argument("--zero", action="store_true", help="each process updates 1/W of the "
                   "parameters and keeps 1/W of the optimizer state (ZeRO)")
    add_lenet_flags(p)
    p.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl on CUDA (one "
                   "process per GPU), else gloo; gloo on GPUs lets several processes share one")
    p.add_argument("--out", default="runs/scratch_ring",
                   help="folder for metrics.json, curves.png and model.pt")
    args = p.parse_args(argv)
    if args.overlap and args.zero:
        p.error("--overlap and --zero: choose one (this ZeRO sends its two halves after backward)")
    replicas = args.devices * int(os.environ.get("WORLD_SIZE", 1))
    if args.batch_size < replicas:
        p.error(f"--batch-size {args.batch_size} is smaller than the {replicas} replicas: each "
                f"needs a sample")
    return args


# RING: an error's traceback goes to torchrun's error file, and its summary names the rank.
@record
def main(argv=None):
    args = parse_args(argv)
    # Float32 convolutions, as in scratch_lenet.py.
    torch.backends.cudnn.allow_tf32 = False
    # A plain `python scratch_ring.py`: a group of one.
    common.default_to_one_process()
    # RING: join the process group. torchrun sets these variables. The backend: NCCL between GPUs,
    # else gloo (CPUs, and GPUs without NCCL).
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nccl = torch.cuda.is_available() and dist.is_nccl_available()   # RING: where torch has it
    backend = args.backend or ("nccl" if nccl else "gloo")
    device = common.pick_device(backend, gpus_each=args.devices)   # RING: K GPUs each
    # gloo's TCP transport reads a CUDA pointer as host memory.
    if backend == "gloo" and device.type == "cuda":
        sys.exit(f"rank {rank}: error: gloo cannot send CUDA tensors point to point (\"Bad "
                 f"address\"): use --backend nccl (one process per GPU), or the CPU: "
                 f"CUDA_VISIBLE_DEVICES=")
    dist.init_process_group(backend, store=common.attempt_store(), rank=rank,   # RING: join
                            world_size=world_size, device_id=device if backend == "nccl" else None)
    # RING: this process's GPUs, K in a row
    devices = [device] * args.devices
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        devices = [torch.device("cuda", (device.index + i) % gpus) for i in range(args.devices)]
    with common.leaving_the_group():   # RING: leaves the group afterwards
        return train(args, devices, rank, world_size)


if __name__ == "__main__":
    main()
