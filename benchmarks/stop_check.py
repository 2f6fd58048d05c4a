"""What agreeing to stop costs a DDP step: the same step with no stop check, and with
common.StopSignal.agreed() after every step (a blocking allreduce of the flag on a gloo group of
its own: every rank waits a network round trip).

    torchrun --standalone --nproc_per_node=2 benchmarks/stop_check.py
    python examples/simulated_cluster.py --nodes 2 --rate-mbit 100 -- torchrun --nnodes=2 --nproc_per_node=1 \\
        --node-rank={node} --master-addr={head} --master-port=29500 benchmarks/stop_check.py

The model is a small MLP whose step takes milliseconds, as a GPU step of a larger model does:
the check's share of a step is at its largest there. The variants take turns (--repeats rounds
of --steps steps each, after --warmup), and rank 0 prints the median time per step of each and
its ratio to no check.
"""
import argparse, os, statistics, sys
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="steps per round")
    p.add_argument("--repeats", type=int, default=7, help="rounds; each variant runs once a round")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps of each variant first")
    p.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    args = p.parse_args()
    common.default_to_one_process()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = common.pick_backend()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=common.attempt_store(), rank=rank, world_size=world_size)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                        nn.Linear(args.width, 10)).to(device)
    model = DDP(net, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    X, y = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)
    stop = common.StopSignal()

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(X), y).backward()
        optimizer.step()

    def agreed():
        step()
        assert stop.agreed() is None

    variants = {"no check": step, "StopSignal.agreed": agreed}
    times = {name: [] for name in variants}
    for name, run in variants.items():
        for _ in range(args.warmup):
            run()
    for _ in range(args.repeats):
        for name, run in variants.items():
            dist.barrier()
            timer = common.Timer(device)
            for _ in range(args.steps):
                run()
            times[name].append(timer() / args.steps)
    if rank == 0:
        base = statistics.median(times["no check"])
        print(f"{world_size} ranks on {device} ({dist.get_backend()}), median of {args.repeats} rounds of "
              f"{args.steps} steps")
        for name, seconds in times.items():
            median = statistics.median(seconds)
            print(f"  {name:20} {median * 1e3:8.3f} ms/step  {median / base:5.3f}x no check")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
