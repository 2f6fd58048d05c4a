"""The smallest complete DistributedDataParallel program: a small MLP on a toy 2-class problem.

    python ddp_toy.py                          # starts --world-size processes itself (free port)
    torchrun --nproc_per_node=4 ddp_toy.py     # or let torchrun start them

Lines that exist only because of DDP are tagged `# DDP:`.
"""
import os, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
import common
import faults

def toy_data(n, seed):
    """Points in the plane, labelled by quadrant (XOR): a hidden layer is needed to separate them."""
    X = torch.randn(n, 2, generator=torch.Generator().manual_seed(seed))
    return X, (X[:, 0] * X[:, 1] > 0).long()

class ToyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 30), nn.ReLU(), nn.Linear(30, 20), nn.ReLU(), nn.Linear(20, 2))
    def forward(self, x):
        return self.layers(x)

def train_loader(X, y, rank_batch, rank, world_size, seed):
    # DDP: each rank reads every world_size-th sample of one shared shuffled order. drop_last
    # trims the tail instead of padding it with repeats, so no sample is trained on twice.
    sampler = DistributedSampler(TensorDataset(X, y), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed, drop_last=True)
    return DataLoader(TensorDataset(X, y), batch_size=rank_batch, sampler=sampler, drop_last=True)

def train(args):
    # DDP: join the process group. torchrun sets these variables (a plain `python` run: a group of one).
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, processes_here = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    backend = common.pick_backend()   # DDP: NCCL between GPUs (on Linux), gloo between CPUs
    if backend == "nccl":
        common.check_gpu_count(processes_here, rank=rank)   # DDP: one GPU per process
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        common.share_cores(processes_here)
    # DDP: join the group the way torchrun documents it, with one change: the wait for every rank has a
    # bound of its own (--init-timeout), as init_process_group's `timeout` bounds every collective too (there, 2 s
    # ended an allreduce whose peer came 4 s late: gloo, 2026-11-24), and ranks wait on each other mid-run.
    dist.init_process_group(backend, store=common.rendezvous_store(args.init_timeout),   # DDP: wait for all ranks
                            rank=rank, world_size=world_size, device_id=device if backend == "nccl" else None)
    master = rank == 0   # DDP: rank 0 alone prints and writes
    if master:
        common.check_out_dir(args.out)
    rank_batch = faults.rank_batch_size(args.batch_size, world_size, args.train_samples, master)
    X_train, y_train = toy_data(args.train_samples, seed=1)
    X_test, y_test = toy_data(args.test_samples, seed=2)
    loader = train_loader(X_train, y_train, rank_batch, rank, world_size, args.seed)

    torch.manual_seed(args.seed)   # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = DDP(ToyMLP().to(device))   # DDP: averages the gradients across ranks during backward
    # the bytes of every gradient, which DDP allreduces once per step (none in a group of one)
    sent = {f"all_reduce ({world_size} ranks)": common.nbytes(*model.parameters())} if world_size > 1 else {}
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    metrics = common.new_metrics(__file__, args, [device] * world_size, dist.get_backend(),
                                 world_size, len(y_test))
    step, start = 0, time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        loader.sampler.set_epoch(epoch)   # DDP: a new order each epoch, the same on every rank
        timer = common.Timer(device)
        totals = torch.zeros(3, device=device)   # summed loss, hits, samples
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            logits = model(X)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            totals[:2] += torch.stack([loss.detach() * len(y), (logits.argmax(1) == y).sum().float()])
            totals[2] += len(y)   # a Python number: no host-to-device copy (a GPU sync) per step
            step += 1
            if step == args.max_steps:
                break
        seconds = timer()
        dist.all_reduce(totals)   # DDP: loss and hits over all ranks, not just this one
        test_acc = common.evaluate(model.module, X_test, y_test, device, rank, world_size)
        common.record_epoch(metrics, epoch, totals, seconds, test_acc, master)
        if step == args.max_steps:
            break
    if master:
        common.finish(metrics, step, time.perf_counter() - start, model.module.state_dict(), sent)
    dist.destroy_process_group()   # DDP: leave cleanly
    return model.module

def parse_args(argv=None):
    p = common.base_parser(__file__, __doc__.splitlines()[0], epochs=20, batch_size=96, lr=0.2,
                           data=False, distributed=True)
    p.set_defaults(train_samples=2000, test_samples=1000)
    p.add_argument("--world-size", type=common.positive_int,
                   help="processes to start when run without torchrun (default: one per GPU, else 2)")
    return p.parse_args(argv)

def run_rank(local_rank, args):   # DDP: one process of mp.spawn, told its rank as torchrun would tell it
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    with faults.one_line_per_rank():   # a failed rank, or a lost peer: one line each
        train(args)

def main(argv=None):
    args = parse_args(argv)
    if "RANK" in os.environ:   # DDP: torchrun (or a user) already started the processes
        with faults.one_line_per_rank():
            return train(args)
    # DDP: start the processes here, with the variables torchrun would set; port 0 lets the OS
    # pick a free one, so two jobs on one machine never collide.
    world_size = args.world_size or torch.cuda.device_count() or 2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(common.free_port()),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    try:
        mp.spawn(run_rank, args=(args,), nprocs=world_size)   # DDP: one process per rank
    except mp.ProcessExitedException as e:   # the rank already printed why; no parent traceback
        sys.exit(e.exit_code or 1)

if __name__ == "__main__":
    main()
