"""The d2l "multiple GPUs from scratch" lesson as published, made to run on the CPU, for speed
comparison only: DataLoader + ToTensor with 2 workers, N(0, 0.01) init, an allreduce that gathers
on device 0. Prints steady-state samples/s over --steps steps after --warmup steps."""
import argparse, json, time
import torch, torchvision
import torch.nn.functional as F
from torchvision import transforms

p = argparse.ArgumentParser()
p.add_argument("--data-dir", default="data")
p.add_argument("--batch-size", type=int, default=256)
p.add_argument("--devices", type=int, default=2)
p.add_argument("--warmup", type=int, default=5)
p.add_argument("--steps", type=int, default=40)
args = p.parse_args()

scale = 0.01   # the original's init
params = [torch.randn(20, 1, 3, 3) * scale, torch.zeros(20), torch.randn(50, 20, 5, 5) * scale, torch.zeros(50),
          torch.randn(800, 128) * scale, torch.zeros(128), torch.randn(128, 10) * scale, torch.zeros(10)]

def lenet(X, p):
    h = F.avg_pool2d(F.relu(F.conv2d(X, p[0], p[1])), 2)
    h = F.avg_pool2d(F.relu(F.conv2d(h, p[2], p[3])), 2)
    h = F.relu(h.reshape(h.shape[0], -1) @ p[4] + p[5])
    return h @ p[6] + p[7]

def allreduce(data):   # gather on device 0, then broadcast
    for i in range(1, len(data)):
        data[0][:] += data[i].to(data[0].device)
    for i in range(1, len(data)):
        data[i][:] = data[0].to(data[i].device)

devices = [torch.device("cpu")] * args.devices
replicas = [[p.clone().requires_grad_() for p in params] for _ in devices]
dataset = torchvision.datasets.FashionMNIST(args.data_dir, train=True, transform=transforms.ToTensor())
loader = torch.utils.data.DataLoader(dataset, args.batch_size, shuffle=True, num_workers=2)
done = 0
for X, y in loader:
    if done == args.warmup:
        start = time.perf_counter()
    Xs, ys = X.chunk(len(devices)), y.chunk(len(devices))
    losses = [F.cross_entropy(lenet(a, W), b, reduction="sum") for a, b, W in zip(Xs, ys, replicas)]
    for l in losses:
        l.backward()
    with torch.no_grad():
        for i in range(len(params)):
            allreduce([W[i].grad for W in replicas])
        for W in replicas:
            for p in W:
                p -= 0.9 * p.grad / X.shape[0]
                p.grad.zero_()
    done += 1
    if done == args.warmup + args.steps:
        break
print(json.dumps({"samples_per_s": args.steps * args.batch_size / (time.perf_counter() - start)}))
