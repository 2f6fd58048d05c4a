"""Data parallelism from scratch: LeNet on Fashion-MNIST, nothing but tensors, in one process.

Each replica holds its own copy of the parameters. A step splits the global batch across the
replicas, each computes the gradient of its share, a hand-written allreduce sums the gradients so
every replica holds the total, and every replica takes the same SGD step: the replicas stay equal,
and the step equals the one a single device takes on the whole batch.

    python scratch_lenet.py                       # N replicas: every GPU, else 2 on the CPU
    python scratch_lenet.py --devices 4

The next step, several processes (on one machine or many) and a ring allreduce written from
send/recv, is scratch_ring.py: it imports the pieces below and adds only what processes need.
"""
import argparse, collections, contextlib, ctypes, math, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
import torch.nn.functional as F
import common


# ---------------------------------------------------------------- LeNet from raw tensors
PARAM_NAMES = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
               "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def he(generator, *shape, gain=2.0):
    """He initialisation: it keeps the activations' scale through the ReLUs. The d2l original's
    N(0, 0.01) starts so small that the first epoch ends at 10% accuracy."""
    return torch.randn(shape, generator=generator) * math.sqrt(gain / math.prod(shape[1:]))


def init_params(seed):
    """LeNet's parameters, in PARAM_NAMES' order, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    # The output layer gets gain 1 (no ReLU follows it), which keeps the first losses near log(10).
    return [he(g, 20, 1, 3, 3), torch.zeros(20), he(g, 50, 20, 5, 5), torch.zeros(50),
            he(g, 128, 800), torch.zeros(128), he(g, 10, 128, gain=1.0), torch.zeros(10)]


def lenet(X, params):
    """1x28x28 images -> 20x13x13 -> 50x4x4 -> 800 -> 128 -> 10 logits. relu_ works in place: a
    layer's backward needs its input, not its output, so the ReLU may overwrite that output and
    spare a new buffer (7 MB for the first one at 128 images)."""
    h = F.avg_pool2d(F.relu_(F.conv2d(X, params[0], params[1])), 2)
    h = F.avg_pool2d(F.relu_(F.conv2d(h, params[2], params[3])), 2)
    h = F.relu_(F.linear(h.flatten(1), params[4], params[5]))
    return F.linear(h, params[6], params[7])


# ---------------------------------------------------------------- the data-parallel pieces
def get_params(params, device, memory_format=torch.contiguous_format):
    """A replica: the parameters copied to `device`, with their own gradients. Conv weights in
    channels_last make the convolutions, and the activations after them, use that layout."""
    replica = []
    for p in params:
        layout = memory_format if p.dim() == 4 else torch.contiguous_format
        replica.append(p.detach().to(device).clone(memory_format=layout).requires_grad_())
    return replica


def split_batch(X, y, devices):
    """Cut the batch into one share per device (sizes differ by at most one), each copied there
    without waiting: the loader's batch is in pinned memory, so the copies overlap the work already
    queued on the GPUs."""
    assert len(X) >= len(devices), "a batch needs at least one sample per replica"
    return ([x.to(d, non_blocking=True) for x, d in zip(X.tensor_split(len(devices)), devices)],
            [t.to(d, non_blocking=True) for t, d in zip(y.tensor_split(len(devices)), devices)])


def allreduce(data):
    """Sum the tensors in `data` (one per device) and leave the sum in every one of them."""
    for i in range(1, len(data)):
        data[0] += data[i].to(data[0].device)
    for i in range(1, len(data)):
        # [:] writes into the replica's tensor; a plain `data[i] = ...` would only rebind the
        # list's slot.
        data[i][:] = data[0].to(data[i].device)


def sgd(params, velocities, lr, batch_size, momentum=0.9):
    """SGD with momentum; every replica keeps its own velocities, equal since the gradients are.
    The losses are sums: the gradients are divided by the global batch."""
    with torch.no_grad():
        for p, v in zip(params, velocities):
            v.mul_(momentum).add_(p.grad, alpha=1 / batch_size)
            p -= lr * v
            p.grad.zero_()


def replica_step(X, y, params, forward):
    """One replica's forward and backward on its share of the batch: fills its parameters' .grad.
    Returns the summed loss and the right answers."""
    logits = forward(X, params)
    loss = F.cross_entropy(logits, y, reduction="sum")
    loss.backward()
    return loss.detach(), (logits.argmax(1) == y).sum()


# The replicas compute at the same time, one thread each, as nn.DataParallel does. One thread
# would do on GPUs (a kernel launch returns at once, so the devices overlap anyway), but a CPU op
# returns only when it is done: without threads the CPU replicas would take turns. The threads live
# for the whole run, so each keeps its OpenMP team.
REPLICA_THREADS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="replica")


def replica_steps(X_shards, y_shards, replicas, forward, in_turn=False):
    """Every replica's step, each in its thread at once (`in_turn`: one after another); their
    losses and right answers."""
    run = map if in_turn else REPLICA_THREADS.map
    return zip(*run(replica_step, X_shards, y_shards, replicas, [forward] * len(replicas)))


# The bytes each replica hands to the allreduce: metrics.json and the closing line say them.
SENT = collections.Counter()


def train_batch(X, y, replicas, velocities, devices, lr, global_batch, forward=lenet,
                in_turn=False):
    """One step on the global batch; returns the summed loss and right answers. `in_turn`: the
    replicas one by one."""
    X_shards, y_shards = split_batch(X, y, devices)
    losses, hits = replica_steps(X_shards, y_shards, replicas, forward, in_turn)
    with torch.no_grad():
        # Every parameter's gradient, summed over the replicas.
        for i in range(len(replicas[0])):
            allreduce([replica[i].grad for replica in replicas])
            if len(replicas) > 1:
                sent = common.nbytes(replicas[0][i].grad)
                SENT[f"allreduce in memory ({len(replicas)} replicas)"] += sent
        for replica, velocity in zip(replicas, velocities):
            sgd(replica, velocity, lr, global_batch)
    return sum(l.to(devices[0]) for l in losses), sum(h.to(devices[0]) for h in hits)


# ---------------------------------------------------------------- the evaluation, the epoch's line
@torch.no_grad()
def evaluation_sums(params, batches, device):
    """The summed loss (plain cross-entropy) and right answers of the replica `params` on the test
    batches, and their images: Sums on `device`, not yet read."""
    sums = common.Sums.on(device, loss=0, correct=0, samples=0)
    for X, y in batches:
        y = y.to(device)
        logits = lenet(X.to(device), params)
        sums["loss"] += F.cross_entropy(logits, y, reduction="sum")
        sums["correct"] += (logits.argmax(1) == y).sum()
        sums["samples"] += len(y)
    return sums


def evaluate(params, batches, device):
    """The test loss and accuracy, and the number of test images they counted."""
    tested = evaluation_sums(params, batches, device).total()
    return {"test_loss": tested["loss"] / tested["samples"],
            "test_acc": tested["correct"] / tested["samples"],
            "test_count": round(tested["samples"])}


def report_epoch(metrics, epoch, trained, seconds, tested, master=True):
    """The epoch's line, in metrics["epochs"] and, from the first process, on the screen, in
    metrics.json and curves.png: a run cut short keeps them."""
    record = common.epoch_record(epoch, trained, seconds, tested)
    metrics["epochs"].append(record)
    if master:
        print(f"epoch {epoch:3d}  loss {record['train_loss']:.4f}  train acc "
              f"{record['train_acc']:.4f}  test loss {record['test_loss']:.4f}  test acc "
              f"{record['test_acc']:.4f}  {record['samples_per_s']:,.0f} samples/s  "
              f"{seconds:.1f} s", flush=True)
        common.write_outputs(metrics)


# ---------------------------------------------------------------- training
def train(args, devices):
    """The set-up, then the epochs, each evaluated. Returns the replicas."""
    os.makedirs(args.out, exist_ok=True)
    train_set, test_set, _ = common.fashion_mnist(args.data_dir, args.train_samples,
                                                  args.test_samples)
    common.check_batch(args.batch_size, 1, len(train_set), rank=0)
    train_batches, sampler = common.train_loader(train_set, args.batch_size, args.seed, 0, 1,
                                                 devices[0])
    test_batches = common.test_loader(test_set, 0, 1, devices[0])
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    # All equal, from one seed.
    replicas = [get_params(init_params(args.seed), d, layout) for d in devices]
    # Momentum, in every replica.
    velocities = [[torch.zeros_like(p) for p in replica] for replica in replicas]
    forward = torch.compile(lenet) if args.compile else lenet
    metrics = common.new_metrics(__file__, args, devices, "hand-written allreduce", 1,
                                 len(test_set))
    print(f"scratch_lenet: {metrics['layout']} on {devices[0]} (hand-written allreduce), "
          f"global batch {args.batch_size}", flush=True)
    total_steps = min(args.epochs * (len(train_set) // args.batch_size),
                      args.max_steps or math.inf)
    step, start = 0, time.perf_counter()
    SENT.clear()
    for epoch in range(1, args.epochs + 1):
        timer = common.Timer(devices[0])
        # A new order each epoch.
        sampler.set_epoch(epoch)
        sums = common.Sums.on(devices[0], loss=0, correct=0, samples=0)
        for X, y in train_batches:
            # Linear decay to zero: a calmer finish.
            lr = args.lr * (1 - step / total_steps)
            # A compiled forward is compiled in the first step, in one thread: torch 2.9 fails in
            # two at once.
            in_turn = args.compile and step == 0
            loss, hits = train_batch(X, y, replicas, velocities, devices, lr, args.batch_size,
                                     forward, in_turn)
            sums["loss"] += loss
            sums["correct"] += hits
            # A Python number: no host-to-device copy (a GPU sync) per step.
            sums["samples"] += len(y)
            step += 1
            if step == args.max_steps:
                break
        seconds = timer()
        tested = evaluate(replicas[0], test_batches, devices[0])
        report_epoch(metrics, epoch, sums.total(), seconds, tested)
        if step == args.max_steps:
            break
    weights = {name: p.contiguous() for name, p in zip(PARAM_NAMES, replicas[0])}
    sent = {k: v / step for k, v in SENT.items()}
    common.finish(metrics, step, time.perf_counter() - start, weights, sent)
    return replicas


# ---------------------------------------------------------------- command line
def add_lenet_flags(p):
    """The flags of the training itself, which scratch_ring.py shares."""
    p.add_argument("--epochs", type=common.positive_int, default=10,
                   help="passes over the training set")
    p.add_argument("--batch-size", type=common.positive_int, default=256,
                   help="global batch, over all replicas")
    p.add_argument("--lr", type=common.positive_float, default=0.05,
                   help="learning rate, decayed linearly to 0")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the batch order")
    p.add_argument("--data-dir", help="a folder with Fashion-MNIST (FashionMNIST/raw/); default: "
                   "./data, where it is downloaded")
    p.add_argument("--train-samples", type=common.positive_int,
                   help="use only the first N training images")
    p.add_argument("--test-samples", type=common.positive_int,
                   help="use only the first N test images")
    p.add_argument("--max-steps", type=common.positive_int,
                   help="stop after this many optimizer steps")
    p.add_argument("--compile", action="store_true", help="torch.compile the forward pass "
                   "(needs a C++ compiler on CPU; see the README)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                   help="NHWC layout for the convolutions (default: on; faster on CPU, see the "
                   "README)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=common.positive_int,
                   help="replicas in this process (default: every GPU, else 2 on the CPU)")
    add_lenet_flags(p)
    p.add_argument("--out", default="runs/scratch_lenet",
                   help="folder for metrics.json, curves.png and model.pt")
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count()
    if args.devices and torch.cuda.is_available() and args.devices > gpus:
        p.error(f"--devices {args.devices}: only {gpus} GPUs here")
    args.devices = args.devices or gpus or 2
    if args.batch_size < args.devices:
        p.error(f"--batch-size {args.batch_size} is smaller than the {args.devices} replicas: "
                f"each needs a sample")
    return args


def keep_freed_memory():
    """glibc's malloc hands big freed buffers back to the system, and the next step pays a page
    fault per 4 KiB to take them again: about a fifth of a LeNet step on CPU. Ask it to keep them,
    as MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ would. Where there is no glibc, nothing."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def main(argv=None):
    # Started by torchrun: that is the next lesson's job. One process per machine says so and
    # fails; the others end quietly with 0. (Had they failed too, torchrun could stop the one that
    # speaks before it has said a word.)
    if "RANK" in os.environ:
        sys.exit("scratch_lenet.py runs its replicas in one process; under torchrun run "
                 "scratch_ring.py" if os.environ.get("LOCAL_RANK", "0") == "0" else 0)
    args = parse_args(argv)
    # Float32 convolutions on GPUs too (PyTorch's default there is TF32, 10-bit mantissas): then
    # N replicas match one device up to float rounding, as on the CPU.
    torch.backends.cudnn.allow_tf32 = False
    if torch.cuda.is_available():
        devices = [torch.device("cuda", i) for i in range(args.devices)]
    else:
        # No GPU: the replicas are CPU copies, each with its share of the cores; the lesson is
        # the same.
        devices = [torch.device("cpu")] * args.devices
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, torch.get_num_threads() // args.devices))
        keep_freed_memory()
    return train(args, devices)


if __name__ == "__main__":
    main()
