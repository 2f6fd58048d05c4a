"""Which CPU levers pay for scratch_lenet.py's step? Measured, not assumed.

    python benchmarks/lenet_levers.py

Times scratch_lenet.train_batch (2 replicas, global batch 256) as the levers are switched on one
by one, next to the d2l original (benchmarks/original_lenet.py): from replicas that take turns
(the original's loop, two cores each), to replicas in their own threads (one core each), then the
allocator keeping freed memory, then channels_last: that is the script as it runs by default.
Two more rows start from the script: --compile on top, and a DataLoader with ToTensor and 2 workers
(the original's input pipeline) in place of slicing the in-memory tensors. Every figure comes from
a fresh process (the allocator setting cannot be undone) and is steady state: WARMUP steps first,
then STEPS timed. The variants take turns for ROUNDS rounds; each figure is the median, and every
ratio is to the original.
"""
import json, os, shutil, statistics, subprocess, sys, time, types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
BATCH, WARMUP, STEPS, ROUNDS = 256, 5, 40, 5
SCRIPT = dict(threads=True, keep_memory=True, channels_last=True, compile=False, dataloader=False)
VARIANTS = {   # name: the levers, or None for the d2l original
    "d2l original (DataLoader, turns)": None,
    "replicas take turns, 2 cores each": dict(SCRIPT, threads=False, keep_memory=False, channels_last=False),
    "+ a thread (1 core) per replica": dict(SCRIPT, keep_memory=False, channels_last=False),
    "+ allocator keeps freed memory": dict(SCRIPT, channels_last=False),
    "+ channels_last = the script": SCRIPT,
    "the script + --compile": dict(SCRIPT, compile=True),
    "the script with a DataLoader": dict(SCRIPT, dataloader=True),
}

def measure(levers, torchvision_root):
    """One variant, in this (fresh) process: samples/s over STEPS steps after WARMUP."""
    import torch, torchvision
    from torchvision import transforms
    import common, scratch_lenet
    devices = [torch.device("cpu")] * 2
    if levers["threads"]:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // len(devices)))
    else:   # replica_step called in this thread, one replica after the other
        scratch_lenet.REPLICA_THREADS = types.SimpleNamespace(map=map)
    if levers["keep_memory"]:
        scratch_lenet.keep_freed_memory()
    if levers["dataloader"]:
        dataset = torchvision.datasets.FashionMNIST(torchvision_root, train=True, transform=transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize(common.MEAN, common.STD)]))
        batches = torch.utils.data.DataLoader(dataset, BATCH, shuffle=True, num_workers=2, drop_last=True)
    else:
        train_set = common.fashion_mnist(os.path.join(ROOT, "data"))[0]
        batches, sampler = common.train_loader(train_set, BATCH, 0, 0, 1, devices[0])   # the scripts' own
        sampler.set_epoch(1)
    layout = torch.channels_last if levers["channels_last"] else torch.contiguous_format
    forward = torch.compile(scratch_lenet.lenet) if levers["compile"] else scratch_lenet.lenet
    replicas = [scratch_lenet.get_params(scratch_lenet.init_params(0), d, layout) for d in devices]
    velocities = [[torch.zeros_like(p) for p in W] for W in replicas]
    for i, (X, y) in enumerate(batches):
        if i == WARMUP:   # warm-up steps (and compilation) stay out of the figure
            start = time.perf_counter()
        scratch_lenet.train_batch(X, y, replicas, velocities, devices, 0.05, BATCH, forward=forward)
        if i == WARMUP + STEPS - 1:
            return STEPS * BATCH / (time.perf_counter() - start)

def run(name, torchvision_root):
    if VARIANTS[name] is None:
        command = [os.path.join(ROOT, "benchmarks", "original_lenet.py"), "--data-dir", torchvision_root,
                   "--batch-size", str(BATCH), "--warmup", str(WARMUP), "--steps", str(STEPS)]
    else:
        command = [__file__, "--variant", name, torchvision_root]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run([sys.executable] + command, check=True, capture_output=True, text=True, env=env)
    return json.loads(result.stdout.splitlines()[-1])["samples_per_s"]

def main():
    from bench import torchvision_layout   # the DataLoader rows read torchvision's layout
    import torch, common
    torchvision_root = torchvision_layout()
    rates = {name: [] for name in VARIANTS}
    try:
        for _ in range(ROUNDS):
            for name in VARIANTS:
                rates[name].append(run(name, torchvision_root))
    finally:
        shutil.rmtree(torchvision_root)
    base = statistics.median(rates["d2l original (DataLoader, turns)"])
    print(f"LeNet step, 2 CPU replicas, batch {BATCH}, {len(os.sched_getaffinity(0))} cores, "
          f"torch {torch.__version__}; median of {ROUNDS} rounds of {STEPS} steps; ratios to the d2l original")
    for name, values in rates.items():
        print(f"{name:36} {statistics.median(values):7,.0f} samples/s  {statistics.median(values) / base:5.2f}x   "
              f"({' / '.join(f'{v:,.0f}' for v in values)})")

if __name__ == "__main__":
    if sys.argv[1:2] == ["--variant"]:
        print(json.dumps({"samples_per_s": measure(VARIANTS[sys.argv[2]], sys.argv[3])}))
    else:
        main()
