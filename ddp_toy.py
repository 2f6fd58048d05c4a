"""The smallest complete DistributedDataParallel program: a small MLP on a toy 2-class problem.

    python ddp_toy.py                          # starts --world-size processes itself (free port)
    torchrun --nproc_per_node=4 ddp_toy.py     # or let torchrun start them
    srun -n 4 python ddp_toy.py                # or SLURM: its tasks are the ranks

Lines that exist only because of DDP are tagged `# DDP:`.
"""
import argparse, os, socket, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
import common


# ---------------------------------------------------------------- the flags
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=common.positive_int, default=20,
                   help="passes over the training set")
    p.add_argument("--batch-size", type=common.positive_int, default=96,
                   help="global batch, over all ranks")
    p.add_argument("--lr", type=common.positive_float, default=0.2, help="learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the batch order")
    p.add_argument("--train-samples", type=common.positive_int, default=2000,
                   help="toy training points")
    p.add_argument("--test-samples", type=common.positive_int, default=1000, help="toy test points")
    p.add_argument("--max-steps", type=common.positive_int,
                   help="stop after this many optimizer steps")
    p.add_argument("--world-size", type=common.positive_int, help="processes to start when run "
                   "without torchrun (default: one per GPU, else 2)")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl on CUDA (one "
                   "process per GPU), else gloo; gloo on GPUs lets several ranks share one")
    p.add_argument("--out", default="runs/ddp_toy",
                   help="folder for metrics.json, curves.png and model.pt")
    return p.parse_args(argv)


# ---------------------------------------------------------------- the data and the model
def toy_data(n, seed):
    """Points in the plane, labelled by quadrant (XOR): a hidden layer is needed to separate
    them."""
    X = torch.randn(n, 2, generator=torch.Generator().manual_seed(seed))
    return X, (X[:, 0] * X[:, 1] > 0).long()


class ToyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 30), nn.ReLU(), nn.Linear(30, 20), nn.ReLU(),
                                    nn.Linear(20, 2))

    def forward(self, x):
        return self.layers(x)


def train_loader(X, y, rank_batch, rank, world_size, seed):
    """DDP: each rank reads every world_size-th sample of one shared shuffled order. drop_last
    trims the tail instead of padding it with repeats, so no sample is trained on twice."""
    sampler = DistributedSampler(TensorDataset(X, y), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed, drop_last=True)
    return DataLoader(TensorDataset(X, y), batch_size=rank_batch, sampler=sampler, drop_last=True)


# ---------------------------------------------------------------- one step, and the evaluation
def train_step(model, optimizer, X, y, sums):
    """One optimizer step; the epoch's sums grow on the device, and nothing here waits for it."""
    logits = model(X)
    loss = F.cross_entropy(logits, y)
    optimizer.zero_grad()
    # DDP: the gradients are averaged over the ranks as backward makes them.
    loss.backward()
    optimizer.step()
    sums["loss"] += loss.detach() * len(y)
    sums["correct"] += (logits.argmax(1) == y).sum()
    # A Python number: no copy to the device (a GPU sync) per step.
    sums["samples"] += len(y)


@torch.no_grad()
def evaluate(raw_model, batches, device):
    """The test loss (plain cross-entropy) and accuracy over all ranks, each test image counted
    once, and that count."""
    sums = common.Sums.on(device, loss=0, correct=0, samples=0)
    for X, y in batches:
        y = y.to(device)
        logits = raw_model(X.to(device))
        sums["loss"] += F.cross_entropy(logits, y, reduction="sum")
        sums["correct"] += (logits.argmax(1) == y).sum()
        sums["samples"] += len(y)
    tested = sums.total()   # DDP: summed over all ranks
    return {"test_loss": tested["loss"] / tested["samples"],
            "test_acc": tested["correct"] / tested["samples"],
            "test_count": round(tested["samples"])}


# ---------------------------------------------------------------- training
def train(args):
    """The set-up, then the epochs, each evaluated. Returns the bare model."""
    # DDP: join the process group. torchrun sets these variables (a plain `python` run: a group
    # of one). The backend: NCCL between GPUs, else gloo (CPUs, and GPUs without NCCL).
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nccl = torch.cuda.is_available() and dist.is_nccl_available()   # DDP: where torch has it
    backend = args.backend or ("nccl" if nccl else "gloo")
    device = common.pick_device(backend)   # DDP: one GPU per process
    # Refused before any connection.
    rank_batch = common.check_batch(args.batch_size, world_size, args.train_samples, rank)
    dist.init_process_group(backend, store=common.attempt_store(), rank=rank,   # DDP: join
                            world_size=world_size, device_id=device if backend == "nccl" else None)
    master = rank == 0   # DDP: rank 0 prints and writes
    if master:
        os.makedirs(args.out, exist_ok=True)
    X_train, y_train = toy_data(args.train_samples, seed=1)
    loader = train_loader(X_train, y_train, rank_batch, rank, world_size, args.seed)
    test_set = TensorDataset(*toy_data(args.test_samples, seed=2))
    test_batches = common.test_loader(test_set, rank, world_size, device)   # DDP: 1/W of it
    # The same initial weights on every rank (DDP also broadcasts rank 0's).
    torch.manual_seed(args.seed)
    raw_model = ToyMLP().to(device)
    model = DDP(raw_model)   # DDP: the wrap
    # DDP: the bytes of every gradient, allreduced once per step (none in a group of one).
    sent = {}
    if world_size > 1:
        sent = {f"all_reduce ({world_size} ranks)": common.nbytes(*raw_model.parameters())}
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=args.lr)
    devices = common.every_rank(str(device), world_size)
    metrics = common.new_metrics(__file__, args, devices, backend, world_size, len(test_set))
    step, start = 0, time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        # DDP: a new order each epoch, the same on every rank.
        loader.sampler.set_epoch(epoch)
        timer = common.Timer(device)
        sums = common.Sums.on(device, loss=0, correct=0, samples=0)
        for X, y in loader:
            train_step(model, optimizer, X.to(device), y.to(device), sums)
            step += 1
            if step == args.max_steps:
                break
        seconds = timer()
        tested = evaluate(raw_model, test_batches, device)
        trained = sums.total()   # DDP: summed over all ranks
        record = common.epoch_record(epoch, trained, seconds, tested)
        metrics["epochs"].append(record)
        # Also metrics.json and curves.png, after every epoch: a run cut short keeps them.
        if master:
            print(f"epoch {epoch:3d}  loss {record['train_loss']:.4f}  train acc "
                  f"{record['train_acc']:.4f}  test loss {record['test_loss']:.4f}  test acc "
                  f"{record['test_acc']:.4f}  {record['samples_per_s']:,.0f} samples/s  "
                  f"{seconds:.1f} s", flush=True)
            common.write_outputs(metrics)
        if step == args.max_steps:
            break
    if master:
        common.finish(metrics, step, time.perf_counter() - start, raw_model.state_dict(), sent)
    return raw_model


# ---------------------------------------------------------------- launching
def run_rank(local_rank, args):
    """DDP: one process of mp.spawn, told its rank as torchrun would tell it."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    with common.leaving_the_group():   # DDP: leaves the group afterwards
        train(args)


# DDP: under torchrun, an error's traceback goes to its error file, and its summary names the rank.
@record
def main(argv=None):
    args = parse_args(argv)
    # DDP: torchrun, srun (a step of several tasks: they are the ranks) or a user already started
    # the processes.
    common.ranks_from_srun()
    if "RANK" in os.environ:
        with common.leaving_the_group():   # DDP: leaves the group afterwards
            return train(args)
    world_size = args.world_size or torch.cuda.device_count() or 2
    # Refused before any process starts.
    common.check_batch(args.batch_size, world_size, args.train_samples, rank=0)
    # DDP: start the processes here, with the variables torchrun would set, on a port free now,
    # which the OS picks (port 0). Another job could take it before rank 0 listens: this one would
    # then fail to start.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        mp.spawn(run_rank, args=(args,), nprocs=world_size)   # DDP: one process per rank
    except mp.ProcessExitedException as e:
        # The rank already said why: no traceback of the parent's.
        sys.exit(e.exit_code or 1)


if __name__ == "__main__":
    main()
