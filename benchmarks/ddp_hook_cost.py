"""What a Python communication hook costs plain DDP: ResNet-18 steps with DDP's own C++ allreduce
against the same steps with PyTorch's `allreduce_hook` registered (what ddp_resnet.py did for every
run before it registered a hook only for --comm-hook), and one process with every core as the base.

    python benchmarks/ddp_hook_cost.py [--batch-size 64] [--steps 10] [--rounds 3]

Each variant runs in fresh processes (2 ranks x 1 thread under torchrun, or 1 process x all
cores), takes 2 untimed steps, then times --steps steps of ddp_resnet.train_step; the variants
take turns, round after round, and each figure is the median of its rounds.
"""
import argparse, json, os, statistics, subprocess, sys, time
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
VARIANTS = {"one process (all cores)": 1, "DDP, 2 ranks, C++ allreduce": 2, "DDP, 2 ranks, Python allreduce_hook": 2}

def worker(args):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    import common, ddp_resnet
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    X, y = common.fashion_mnist(os.path.join(ROOT, "data"), args.batch_size, 1)[0].tensors
    X, y = X.chunk(world_size)[rank], y.chunk(world_size)[rank]
    net = common.resnet("resnet18", 10, 0, channels=1, image_size=28)
    model = DDP(net)
    if "hook" in args.variant:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    totals = torch.zeros(3, dtype=torch.float64)
    for step in range(2 + args.steps):
        if step == 2:
            dist.barrier()
            start = time.perf_counter()
        ddp_resnet.train_step(model, model, optimizer, X, y, 1, False, totals)
    seconds = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"seconds_per_step": seconds / args.steps}))
    dist.destroy_process_group()

def measure(args, variant):
    ranks = VARIANTS[variant]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                if ranks > 1 else [sys.executable, "-c", "import common; common.default_to_one_process(); "
                                   "import runpy, sys; sys.argv = sys.argv[1:]; "
                                   "runpy.run_path(sys.argv[0], run_name='__main__')"])
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}   # torchrun sets 1 per rank itself
    result = subprocess.run(launcher + [os.path.abspath(__file__), "--worker", "--variant", variant, "--batch-size",
                                        str(args.batch_size), "--steps", str(args.steps)],
                            cwd=ROOT, capture_output=True, text=True, env=env, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["seconds_per_step"]

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=64, help="global batch")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    times = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            times[variant].append(measure(args, variant))
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}; ResNet-18, global batch {args.batch_size}, "
          f"{args.steps} timed steps a run, median of {args.rounds} rounds")
    base = statistics.median(times["one process (all cores)"])
    plain = statistics.median(times["DDP, 2 ranks, C++ allreduce"])
    for variant, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{variant:38} {median:6.3f} s/step  {args.batch_size / median:6.1f} samples/s  "
              f"{base / median:5.2f}x one process  {plain / median:5.2f}x plain DDP   "
              f"rounds: {'/'.join(f'{s:.3f}' for s in seconds)}")

if __name__ == "__main__":
    main()
