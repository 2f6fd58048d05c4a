"""One node's share of benchmarks/cluster_bench.py: time the parts of a data-parallel step.

Run under torchrun in every node of a simulated cluster (cluster_bench.py does that). Rank 0
prints one JSON line: seconds per step (the median of --repeats means of --steps steps, after
--warmup steps; the variants take turns) for each variant:

  lenet:  compute (this process's replicas, summed in memory, no network), comm (the ring
          allreduce of the gradients alone), forward, after_backward (scratch_ring's step: the ring
          after backward), overlap (scratch_ring --overlap), and with one replica per process
          ddp (DistributedDataParallel on the same LeNet, same bucket size)
  resnet: compute (DDP under no_sync: no communication), comm (one allreduce of all gradients),
          ddp (default 25 MB buckets), ddp_one_bucket (a bucket larger than the model: the
          allreduce starts after backward)
and alpha, the per-message cost, from a ring allreduce of one float.
"""
import argparse, json, os, statistics, sys, time
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common, scratch_lenet, scratch_ring


def timed(variants, args):
    """Seconds per step of each variant: the median of --repeats means of --steps steps. The
    variants take turns, repeat after repeat, so a slow minute of a shared machine hits them all
    alike; every rank starts each turn together."""
    for step in variants.values():
        for _ in range(args.warmup):
            step()
    means = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, step in variants.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            means[name].append((time.perf_counter() - start) / args.steps)
    return {name: statistics.median(m) for name, m in means.items()}


class LeNet(nn.Module):   # scratch_lenet's parameters in a module, for DDP
    def __init__(self, params):
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(p.clone()) for p in params])
    def forward(self, X):
        return scratch_lenet.lenet(X, list(self.params))


def lenet(args, rank, world_size, results):
    devices = [torch.device("cpu")] * args.devices
    share = args.batch_size // world_size   # this process's share of the global batch
    X, y = torch.randn(share, 1, 28, 28), torch.randint(0, 10, (share,))
    params = scratch_lenet.init_params(0)

    def replicas():
        W = [scratch_lenet.get_params(params, d, torch.channels_last) for d in devices]
        return W, [[torch.zeros_like(p) for p in R] for R in W]

    W, V = replicas()
    W2, V2 = replicas()   # the overlap's own: its hooks stay on the replicas they were put on
    overlap = scratch_ring.OverlappedAllreduce(W2, rank, world_size, args.bucket_kb * 1024, devices[0])
    step = lambda W, V, **kw: scratch_ring.train_batch(X, y, W, V, devices, 0.01, args.batch_size, **kw)
    variants = {
        "compute": lambda: step(W, V, rank=0, world_size=1),   # summed in memory, no network
        "forward": lambda: list(scratch_lenet.REPLICA_THREADS.map(scratch_lenet.lenet,
                                                                  X.tensor_split(len(devices)), W)),
        "comm": lambda: scratch_ring.ring_allreduce([p.grad for p in W[0]], rank, world_size),
        "after_backward": lambda: step(W, V, rank=rank, world_size=world_size),
        "overlap": lambda: step(W2, V2, rank=rank, world_size=world_size, overlap=overlap),
    }
    if args.devices == 1:   # DDP drives one device per process
        model = DDP(LeNet(params).to(memory_format=torch.channels_last), bucket_cap_mb=args.bucket_kb / 1024)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        def ddp_step():
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(X), y, reduction="sum").backward()
            optimizer.step()
        def ddp_compute():
            with model.no_sync():   # the same step without any communication
                ddp_step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        variants.update(ddp=ddp_step, ddp_compute=ddp_compute, ddp_comm=lambda: dist.all_reduce(flat))
    results.update(timed(variants, args))
    tiny = timed({"alpha": lambda: scratch_ring.ring_allreduce([torch.zeros(1)], rank, world_size)}, args)
    results["alpha"] = tiny["alpha"] / max(1, 2 * (world_size - 1))
    results["buckets"] = [sum(4 * W2[0][i].numel() for i in bucket) for bucket in overlap.buckets]
    results["bytes"] = sum(4 * p.numel() for p in params)


def resnet(args, rank, world_size, results):
    share = args.batch_size // world_size
    X, y = torch.randn(share, 1, 28, 28), torch.randint(0, 10, (share,))
    def ddp_step(model, optimizer):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(X), y).backward()
        optimizer.step()
    models = {}
    for name, cap_mb in (("ddp", None), ("ddp_one_bucket", 1024)):   # 1 GB: one bucket for all
        net = common.resnet("resnet18", 10, 0, channels=1, image_size=28)
        models[name] = (DDP(net) if cap_mb is None else DDP(net, bucket_cap_mb=cap_mb),
                        torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    model, optimizer = models["ddp"]
    def compute():
        with model.no_sync():   # the same step without any communication
            ddp_step(model, optimizer)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    results.update(timed({"compute": compute, "comm": lambda: dist.all_reduce(flat),
                          "ddp": lambda: ddp_step(*models["ddp"]),
                          "ddp_one_bucket": lambda: ddp_step(*models["ddp_one_bucket"])}, args))
    results["alpha"] = timed({"a": lambda: dist.all_reduce(torch.zeros(1))}, args)["a"] / max(1, 2 * (world_size - 1))
    results["bytes"] = 4 * flat.numel()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["lenet", "resnet"], required=True)
    p.add_argument("--devices", type=int, default=1, help="LeNet replicas per process")
    p.add_argument("--batch-size", type=int, required=True, help="global batch")
    p.add_argument("--bucket-kb", type=float, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    common.pick_device("gloo", cuda=False)   # this process's share of the cores
    dist.init_process_group("gloo")
    results = {"world_size": world_size}
    (lenet if args.model == "lenet" else resnet)(args, rank, world_size, results)
    if rank == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
