"""Which CPU levers pay for scratch_lenet.py's step? Measured, not assumed.

    python benchmarks/lenet_levers.py

Times scratch_lenet.train_batch (2 replicas, global batch 256) with each lever on and off, next to
the d2l original (benchmarks/original_lenet.py, which times itself the same way: steady-state
steps after a warm-up). The levers: the replicas computing at the same time in their own threads
(one core each) instead of taking turns (two cores each); batches sliced from in-memory tensors
instead of a DataLoader with ToTensor and 2 workers (what the original does); channels_last conv
weights (--channels-last); the forward pass through torch.compile (--compile). The variants take
turns for several rounds; each figure is the median, and every ratio is to the original.
"""
import json, os, shutil, statistics, subprocess, sys, time, types
import torch
import torchvision
from torchvision import transforms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common, scratch_lenet
from bench import torchvision_layout   # the DataLoader variant and the original read torchvision's layout

BATCH, WARMUP, STEPS, ROUNDS = 256, 5, 40, 5
devices = [torch.device("cpu")] * 2
cores = common.cpu_cores()
X_train, y_train = common.load_fashion_mnist(os.path.join(ROOT, "data"))["train"]
batches = common.epoch_batches(len(y_train), BATCH, seed=0, epoch=1)
TORCHVISION_ROOT = torchvision_layout()
THREADS = scratch_lenet.REPLICA_THREADS
TAKING_TURNS = types.SimpleNamespace(map=map)   # replica_step called one replica after the other

def in_memory():
    for idx in batches:
        yield X_train[idx], y_train[idx]

def dataloader():
    dataset = torchvision.datasets.FashionMNIST(TORCHVISION_ROOT, train=True, transform=transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize(common.MEAN, common.STD)]))
    return iter(torch.utils.data.DataLoader(dataset, BATCH, shuffle=True, num_workers=2, drop_last=True))

def rate(batch_source, forward=scratch_lenet.lenet, layout=torch.contiguous_format, threads=THREADS):
    scratch_lenet.REPLICA_THREADS = threads
    torch.set_num_threads(max(1, cores // len(devices)) if threads is THREADS else cores)
    replicas = [scratch_lenet.get_params(scratch_lenet.init_params(0), d, layout) for d in devices]
    velocities = [[torch.zeros_like(p) for p in W] for W in replicas]
    for i, (X, y) in enumerate(batch_source):
        if i == WARMUP:   # warm-up steps (and compilation) stay out of the figure
            start = time.perf_counter()
        scratch_lenet.train_batch(X, y, replicas, velocities, devices, 0.05, BATCH, forward=forward)
        if i == WARMUP + STEPS - 1:
            return STEPS * BATCH / (time.perf_counter() - start)

def original():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "original_lenet.py"),
                             "--data-dir", TORCHVISION_ROOT, "--batch-size", str(BATCH),
                             "--warmup", str(WARMUP), "--steps", str(STEPS)],
                            check=True, capture_output=True, text=True)
    return json.loads(result.stdout.splitlines()[-1])["samples_per_s"]

compiled = torch.compile(scratch_lenet.lenet)
CL = torch.channels_last
variants = {
    "d2l original (DataLoader, turns)": original,
    "replicas take turns, 2 threads each": lambda: rate(in_memory(), threads=TAKING_TURNS),
    "replica threads (the script)": lambda: rate(in_memory()),
    "  with a DataLoader instead": lambda: rate(dataloader()),
    "  + --channels-last": lambda: rate(in_memory(), layout=CL),
    "  + --compile": lambda: rate(in_memory(), compiled),
    "  + --compile --channels-last": lambda: rate(in_memory(), compiled, CL),
}
rates = {name: [] for name in variants}
for _ in range(ROUNDS):
    for name, measure in variants.items():
        rates[name].append(measure())
shutil.rmtree(TORCHVISION_ROOT)
base = statistics.median(rates["d2l original (DataLoader, turns)"])
print(f"LeNet step, 2 CPU replicas, batch {BATCH}, {cores} cores, torch {torch.__version__}; "
      f"median of {ROUNDS} rounds of {STEPS} steps; ratios to the d2l original")
for name, values in rates.items():
    print(f"{name:36} {statistics.median(values):7,.0f} samples/s  {statistics.median(values) / base:5.2f}x   "
          f"({' / '.join(f'{v:,.0f}' for v in values)})")
