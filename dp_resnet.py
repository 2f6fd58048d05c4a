"""ResNet-18 on Fashion-MNIST with nn.DataParallel: one process drives every GPU.

    python dp_resnet.py              # all GPUs; on a machine without one, the CPU as one device
    python dp_resnet.py --gpus 2

Each step DataParallel copies the model from the first GPU to the others, cuts the batch into one piece per GPU, runs
the pieces in threads of this one process, gathers the outputs on the first GPU, and sums the gradients back there.
Simple to use, but every step pays for those copies and the first GPU's extra work, all driven by one Python process
(its threads share one interpreter): PyTorch recommends DistributedDataParallel (ddp_resnet.py) even on one machine.

On several GPUs BatchNorm normalises each GPU's share of the batch, as each DDP rank does, and only the first GPU keeps
running statistics: DataParallel drops what the replicas on the others write in their forward. Those replicas get
contiguous copies of the weights, not channels_last ones. The timer waits for the first GPU alone: every step ends there
(the gradients summed, the update).
Copy it with common.py. Lines that exist only because of DataParallel are tagged `# DP:`.
"""
import argparse, os, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import common

class Autocast(nn.Module):
    """`net` run in bfloat16 mixed precision (`amp`). DP: DataParallel runs each replica in a thread of its
    own, and autocast's state is per thread: opened around DataParallel, the replicas' threads would open
    it again with float16, CUDA's default. Opened in the forward, it holds in every thread."""
    def __init__(self, net, amp):
        super().__init__()
        self.net, self.amp = net, amp
    def forward(self, X):
        with torch.autocast(X.device.type, torch.bfloat16, enabled=self.amp):
            return self.net(X)

def train_step(model, optimizer, X, y, totals):
    """One step on the whole batch; adds the summed loss, the hits and the samples to `totals`."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(X).float()   # DP: scatter X, replicate the model, run in parallel, gather logits
    loss = F.cross_entropy(logits, y)
    loss.backward()        # DP: each replica's gradients are summed into the original module
    optimizer.step()
    totals[0] += loss.detach() * len(y)
    totals[1] += (logits.argmax(1) == y).sum()
    totals[2] += len(y)   # a Python number: no copy to the device

def train(args):
    os.makedirs(args.out, exist_ok=True)
    gpus = [torch.device("cuda", i) for i in range(torch.cuda.device_count())][: args.gpus]
    device = gpus[0] if gpus else torch.device("cpu")
    if not gpus:
        print("note: no GPU here, so DataParallel runs the model on the CPU as a single device", flush=True)
    train_set, test_set, classes = common.fashion_mnist(args.data_dir, args.train_samples, args.test_samples)
    common.check_batch(args.batch_size, 1, len(train_set), rank=0)
    # the batches of ddp_resnet.py: DistributedSampler's order, here for one process that takes them whole
    train_batches, sampler = common.train_loader(train_set, args.batch_size, args.seed, 0, 1, device)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format

    # A new network every run, from the seed: the same initial weights as ddp_resnet.py.
    net = common.resnet("resnet18", classes, args.seed, channels=1, image_size=28)
    net = net.to(device, memory_format=memory_format)
    model = nn.DataParallel(Autocast(net, args.amp), device_ids=gpus or None)   # DP: the whole change
    lr = args.lr * args.batch_size / 256   # --lr is for 256 samples, as in ddp_resnet.py
    optimizer, _ = common.sgd_recipe(net, lr, 5e-4, 0, 1)   # ddp_resnet.py's optimizer, at a constant rate
    metrics = common.new_metrics(__file__, args, gpus or [device], "DataParallel", 1, len(test_set))
    # DP: each step's forward broadcasts the weights from the first GPU; backward sums the gradients there
    sent = {f"broadcast ({len(gpus)} GPUs)": common.nbytes(*net.parameters(), *net.buffers()),
            f"reduce_add ({len(gpus)} GPUs)": common.nbytes(*net.parameters())} if len(gpus) > 1 else {}
    print(f"dp_resnet: DataParallel over {[str(d) for d in gpus or [device]]}, batch {args.batch_size}, "
          f"lr {lr:g} ({args.lr:g} x {args.batch_size}/256), constant", flush=True)
    step, start = 0, time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        timer = common.Timer(device)
        totals = torch.zeros(3, device=device, dtype=torch.float64)   # summed loss, hits, samples
        net.train()
        for X, y in train_batches:   # both to the first GPU: DataParallel scatters X from it, gathers logits on it
            X = X.to(device, non_blocking=True).contiguous(memory_format=memory_format)
            train_step(model, optimizer, X, y.to(device, non_blocking=True), totals)
            step += 1
            if step == args.max_steps:
                break
        seconds = timer()
        net.eval()
        tested = common.accuracy(model, common.test_loader(test_set, 0, 1, device), device, 1)   # DP: split too
        common.record_epoch(metrics, epoch, totals, seconds, tested, True)
        if step == args.max_steps:
            break
    common.finish(metrics, step, time.perf_counter() - start, net.state_dict(), sent)
    return net

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=common.positive_int, default=5, help="passes over the training set")
    p.add_argument("--batch-size", type=common.positive_int, default=256, help="the batch, split over the GPUs")
    p.add_argument("--lr", type=common.positive_float, default=0.05,
                   help="learning rate for 256 samples, scaled linearly with the batch")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the batch order")
    p.add_argument("--gpus", type=common.positive_int, help="GPUs to use (default: all)")
    p.add_argument("--data-dir", help="a folder with Fashion-MNIST (FashionMNIST/raw/); default: ./data, where "
                   "it is downloaded")
    p.add_argument("--train-samples", type=common.positive_int, help="use only the first N training images")
    p.add_argument("--test-samples", type=common.positive_int, help="use only the first N test images")
    p.add_argument("--max-steps", type=common.positive_int, help="stop after this many optimizer steps")
    p.add_argument("--amp", action="store_true", help="bfloat16 mixed precision")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory layout (faster convolutions on GPUs)")
    p.add_argument("--out", default="runs/dp_resnet", help="folder for metrics.json, curves.png and model.pt")
    args = p.parse_args(argv)
    if args.gpus and args.gpus > torch.cuda.device_count():
        p.error(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()}")
    return args

def main(argv=None):
    return train(parse_args(argv))

if __name__ == "__main__":
    main()
