"""The d2l "concise multi-GPU" lesson as published, for speed comparison only: d2l's own
ResNet-18 (1-channel, 3x3 stem), nn.DataParallel, DataLoader + ToTensor with 2 workers.
Prints steady-state samples/s over --steps steps after --warmup steps."""
import argparse, json, time
import torch, torchvision
from torch import nn
from torchvision import transforms

p = argparse.ArgumentParser()
p.add_argument("--data-dir", default="data")
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--steps", type=int, default=8)
args = p.parse_args()

class Residual(nn.Module):
    def __init__(self, inputs, outputs, use_1x1conv=False, strides=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, padding=1, stride=strides)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1)
        self.conv3 = nn.Conv2d(inputs, outputs, 1, stride=strides) if use_1x1conv else None
        self.bn1, self.bn2 = nn.BatchNorm2d(outputs), nn.BatchNorm2d(outputs)
    def forward(self, X):
        Y = torch.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        return torch.relu(Y + (self.conv3(X) if self.conv3 else X))

def resnet_block(inputs, outputs, n, first_block=False):
    return [Residual(inputs if i == 0 else outputs, outputs, use_1x1conv=(i == 0 and not first_block),
                     strides=2 if i == 0 and not first_block else 1) for i in range(n)]

net = nn.Sequential(nn.Conv2d(1, 64, 3, 1, 1), nn.BatchNorm2d(64), nn.ReLU(),
                    *resnet_block(64, 64, 2, first_block=True), *resnet_block(64, 128, 2),
                    *resnet_block(128, 256, 2), *resnet_block(256, 512, 2),
                    nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(512, 10))
model = nn.DataParallel(net)
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
dataset = torchvision.datasets.FashionMNIST(args.data_dir, train=True, transform=transforms.ToTensor())
loader = torch.utils.data.DataLoader(dataset, args.batch_size, shuffle=True, num_workers=2)
done = 0
for X, y in loader:
    if done == args.warmup:
        start = time.perf_counter()
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    done += 1
    if done == args.warmup + args.steps:
        break
print(json.dumps({"samples_per_s": args.steps * args.batch_size / (time.perf_counter() - start)}))
