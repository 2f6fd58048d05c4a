"""ResNet-18 on Fashion-MNIST with nn.DataParallel: one process drives every GPU.

    python dp_resnet.py              # all GPUs; on a machine without one, the CPU as one device
    python dp_resnet.py --gpus 2

Each step DataParallel copies the model from the first GPU to the others, cuts the batch into one
piece per GPU, runs the pieces in threads of this one process, gathers the outputs on the first
GPU, and sums the gradients back there. Simple to use, but every step pays for those copies and the
first GPU's extra work, all driven by one Python process (its threads share one interpreter):
PyTorch recommends DistributedDataParallel (ddp_resnet.py) even on one machine.

On several GPUs BatchNorm normalises each GPU's share of the batch, as each DDP rank does, and only
the first GPU keeps running statistics: DataParallel drops what the replicas on the others write in
their forward. Those replicas get contiguous copies of the weights, not channels_last ones. The
timer waits for the first GPU alone: every step ends there (the gradients summed, the update).
The optimizer is in make_optimizer(): ddp_resnet.py's SGD, at a constant learning rate.
Copy it with common.py. Lines that exist only because of DataParallel are tagged `# DP:`.
"""
import argparse, math, os
import torch
import torch.nn as nn
import torch.nn.functional as F
import common


# ---------------------------------------------------------------- the flags
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=common.positive_int, default=5,
                   help="passes over the training set")
    p.add_argument("--batch-size", type=common.positive_int, default=256,
                   help="the batch, split over the GPUs")
    p.add_argument("--lr", type=common.positive_float, default=0.05,
                   help="learning rate for 256 samples, scaled linearly with the batch")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the batch order")
    p.add_argument("--gpus", type=common.positive_int, help="GPUs to use (default: all)")
    p.add_argument("--data-dir", help="a folder with Fashion-MNIST (FashionMNIST/raw/); default: "
                   "./data, where it is downloaded")
    p.add_argument("--train-samples", type=common.positive_int,
                   help="use only the first N training images")
    p.add_argument("--test-samples", type=common.positive_int,
                   help="use only the first N test images")
    p.add_argument("--max-steps", type=common.positive_int,
                   help="stop after this many optimizer steps")
    p.add_argument("--amp", action="store_true", help="bfloat16 mixed precision")
    p.add_argument("--channels-last", action="store_true",
                   help="NHWC memory layout (faster convolutions on GPUs)")
    p.add_argument("--deterministic", action="store_true", help="cuDNN's deterministic "
                   "algorithms, not its autotuner's fastest (the same bits again, slower)")
    p.add_argument("--print-every", type=common.every, default="10s", help="a progress line "
                   "every N steps (100) or N seconds (10s, the default); 0: none")
    p.add_argument("--out", default="runs/dp_resnet",
                   help="folder for metrics.json, curves.png and model.pt")
    args = p.parse_args(argv)
    if args.gpus and args.gpus > torch.cuda.device_count():
        p.error(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()}")
    return args


# ---------------------------------------------------------------- the model and its optimizer
class Autocast(nn.Module):
    """`module` run in bfloat16 mixed precision (`amp`). DataParallel runs each replica in a thread
    of its own, and autocast's state is per thread: opened around DataParallel, the replicas'
    threads would open it again with float16, CUDA's default. Opened in the forward, it holds in
    every thread."""
    def __init__(self, module, amp):
        super().__init__()
        self.module, self.amp = module, amp

    def forward(self, X):
        with torch.autocast(X.device.type, torch.bfloat16, enabled=self.amp):
            return self.module(X)


def make_optimizer(raw_model, args):
    """ddp_resnet.py's SGD, at a constant rate: momentum, and weight decay on the weights only
    (decaying BatchNorm's parameters and the biases, the 1-D ones, only fights the normalisation).
    --lr is for 256 samples, scaled to the batch."""
    decay = [p for p in raw_model.parameters() if p.ndim > 1]
    no_decay = [p for p in raw_model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.SGD(groups, lr=args.lr * args.batch_size / 256, momentum=0.9)


# ---------------------------------------------------------------- one step, and the evaluation
def train_step(model, optimizer, X, y, sums):
    """One step on the whole batch. The epoch's sums grow on the device: nothing here waits."""
    optimizer.zero_grad()
    logits = model(X).float()   # DP: scatter, replicate, run, gather
    loss = F.cross_entropy(logits, y)
    # DP: each replica's gradients are summed into the original module.
    loss.backward()
    optimizer.step()
    sums["loss"] += loss.detach() * len(y)
    sums["correct"] += (logits.argmax(1) == y).sum()
    # A Python number: no copy to the device.
    sums["samples"] += len(y)


@torch.no_grad()
def evaluate(model, batches, device, memory_format=torch.contiguous_format):
    """The test loss (plain cross-entropy) and accuracy, and the number of test images they
    counted: in the training's precision (the wrapped model's autocast) and memory layout."""
    model.eval()
    sums = common.Sums.on(device, loss=0, correct=0, samples=0)
    for X, y in batches:
        X, y = X.to(device).contiguous(memory_format=memory_format), y.to(device)
        logits = model(X)   # DP: split over the GPUs too
        sums["loss"] += F.cross_entropy(logits.float(), y, reduction="sum")
        sums["correct"] += (logits.argmax(1) == y).sum()
        sums["samples"] += len(y)
    model.train()
    tested = sums.total()
    return {"test_loss": tested["loss"] / tested["samples"],
            "test_acc": tested["correct"] / tested["samples"],
            "test_count": round(tested["samples"])}


# ---------------------------------------------------------------- training
def train_epoch(model, optimizer, batches, here, final_step, progress, memory_format, device):
    """Epoch `here.epoch`'s steps, to its end or the run's last step; `here.step` moves with them.
    Returns the epoch's sums and seconds. Only a progress line reads anything back."""
    timer = common.Timer(device)
    progress.new_epoch(here.step)
    sums = common.Sums.on(device, loss=0, correct=0, samples=0)
    # Both to the first GPU: DataParallel scatters X from it and gathers the logits on it.
    for X, y in batches:
        X = X.to(device, non_blocking=True).contiguous(memory_format=memory_format)
        train_step(model, optimizer, X, y.to(device, non_blocking=True), sums)
        here.step += 1
        if here.step == final_step:
            break
        # One process has no vote to carry its clock: it asks itself.
        if progress.due(here.step, progress.asks()):
            progress.say(here, sums.total(), optimizer.param_groups[0]["lr"])
    return sums, timer()


def train(args):
    """The set-up, then the epochs, each evaluated. Returns the bare model."""
    os.makedirs(args.out, exist_ok=True)
    gpus = [torch.device("cuda", i) for i in range(args.gpus or torch.cuda.device_count())]
    device = gpus[0] if gpus else torch.device("cpu")
    if not gpus:
        print("note: no GPU here, so DataParallel runs the model on the CPU as a single device",
              flush=True)
    train_set, test_set, classes = common.fashion_mnist(args.data_dir, args.train_samples,
                                                        args.test_samples)
    common.check_batch(args.batch_size, 1, len(train_set), rank=0)
    # ddp_resnet.py's batches: DistributedSampler's order, for one process that takes them whole.
    train_batches, sampler = common.train_loader(train_set, args.batch_size, args.seed, 0, 1,
                                                 device)
    test_batches = common.test_loader(test_set, 0, 1, device)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    # From the seed: ddp_resnet.py's initial weights.
    torch.manual_seed(args.seed)
    raw_model = common.classifier("resnet18", classes, channels=1, image_size=28)
    raw_model = raw_model.to(device, memory_format=memory_format)
    model = nn.DataParallel(Autocast(raw_model, args.amp), device_ids=gpus or None)   # DP: the wrap
    optimizer = make_optimizer(raw_model, args)
    metrics = common.new_metrics(__file__, args, gpus or [device], "DataParallel", 1,
                                 len(test_set))
    print(f"dp_resnet: DataParallel over {[str(d) for d in gpus or [device]]}, batch "
          f"{args.batch_size}, lr {optimizer.param_groups[0]['lr']:g}, constant", flush=True)
    final_step = min(args.max_steps or math.inf, len(train_set) // args.batch_size * args.epochs)
    progress = common.Progress(args.print_every, 0, final_step, args.batch_size, master=True)
    here = common.Position()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        here.epoch = epoch
        sums, seconds = train_epoch(model, optimizer, train_batches, here, final_step, progress,
                                    memory_format, device)
        tested = evaluate(model, test_batches, device, memory_format)
        record = common.epoch_record(epoch, sums.total(), seconds, tested)
        metrics["epochs"].append(record)
        print(f"epoch {epoch:3d}  loss {record['train_loss']:.4f}  train acc "
              f"{record['train_acc']:.4f}  test loss {record['test_loss']:.4f}  test acc "
              f"{record['test_acc']:.4f}  {record['samples_per_s']:,.0f} samples/s  "
              f"{seconds:.1f} s", flush=True)
        # Also metrics.json and curves.png, after every epoch: a run cut short keeps them.
        common.write_outputs(metrics)
        if here.step == final_step:
            break
    # Each GPU's peak memory, one entry per GPU DataParallel drives ([None] on a CPU).
    metrics["peak_memory_bytes"] = [common.peak_memory(d) for d in gpus or [device]]
    # DP: each step's forward broadcasts the weights and buffers from the first GPU, and backward
    # sums the gradients there.
    sent = {}
    if len(gpus) > 1:
        weights = common.nbytes(*raw_model.parameters())
        sent = {f"broadcast ({len(gpus)} GPUs)": weights + common.nbytes(*raw_model.buffers()),
                f"reduce_add ({len(gpus)} GPUs)": weights}
    common.finish(metrics, here.step, progress.spent(), raw_model.state_dict(), sent)
    return raw_model


def main(argv=None):
    args = parse_args(argv)
    # Every batch has one shape: on GPUs, cuDNN's autotuner picks each convolution's fastest
    # algorithm once, unless the run must repeat its bits.
    torch.backends.cudnn.benchmark = not args.deterministic
    torch.backends.cudnn.deterministic = args.deterministic
    return train(args)


if __name__ == "__main__":
    main()
