"""Which CPU levers pay for scratch_lenet.py's step? Measured, not assumed.

    python benchmarks/lenet_levers.py

Times scratch_lenet.train_batch (2 replicas, global batch 256) fed four ways: batches sliced from
the in-memory tensors (what the script does), the same in channels_last layout, with the forward
pass through torch.compile, and from a DataLoader with ToTensor and 2 workers (what the d2l original
does). The variants take turns for several rounds; each figure is the median.
"""
import os, shutil, statistics, sys, time
import torch
import torchvision
from torchvision import transforms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common, scratch_lenet
from bench import torchvision_layout   # the DataLoader variant reads torchvision's layout

BATCH, STEPS, ROUNDS = 256, 40, 5
devices = [torch.device("cpu")] * 2
X_train, y_train = common.load_fashion_mnist(os.path.join(ROOT, "data"))["train"]
batches = common.epoch_batches(len(y_train), BATCH, seed=0, epoch=1)
TORCHVISION_ROOT = torchvision_layout()

def in_memory(layout=torch.contiguous_format):
    for idx in batches:
        yield X_train[idx].contiguous(memory_format=layout), y_train[idx]

def dataloader():
    dataset = torchvision.datasets.FashionMNIST(TORCHVISION_ROOT, train=True, transform=transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize(common.MEAN, common.STD)]))
    return iter(torch.utils.data.DataLoader(dataset, BATCH, shuffle=True, num_workers=2, drop_last=True))

def rate(batch_source, forward):
    replicas = [scratch_lenet.get_params(scratch_lenet.init_params(0), d) for d in devices]
    velocities = [[torch.zeros_like(p) for p in W] for W in replicas]
    for i, (X, y) in enumerate(batch_source):
        if i == 5:   # warm-up steps (and compilation) stay out of the figure
            start = time.perf_counter()
        scratch_lenet.train_batch(X, y, replicas, velocities, devices, 0.05, BATCH, forward=forward)
        if i == 5 + STEPS - 1:
            return STEPS * BATCH / (time.perf_counter() - start)

compiled = torch.compile(scratch_lenet.lenet)
variants = {
    "in-memory tensors (the script)": lambda: rate(in_memory(), scratch_lenet.lenet),
    "  + channels_last": lambda: rate(in_memory(torch.channels_last), scratch_lenet.lenet),
    "  + torch.compile (--compile)": lambda: rate(in_memory(), compiled),
    "DataLoader + ToTensor, 2 workers": lambda: rate(dataloader(), scratch_lenet.lenet),
}
rates = {name: [] for name in variants}
for _ in range(ROUNDS):
    for name, measure in variants.items():
        rates[name].append(measure())
shutil.rmtree(TORCHVISION_ROOT)
base = statistics.median(rates["in-memory tensors (the script)"])
print(f"LeNet step, 2 CPU replicas, batch {BATCH}, {common.cpu_cores()} cores, torch {torch.__version__}; "
      f"median of {ROUNDS} rounds of {STEPS} steps")
for name, values in rates.items():
    print(f"{name:36} {statistics.median(values):7,.0f} samples/s  {statistics.median(values) / base:5.2f}x   "
          f"({' / '.join(f'{v:,.0f}' for v in values)})")
