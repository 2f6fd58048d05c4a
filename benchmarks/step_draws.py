"""What exactness costs a step: ddp_resnet.train_step with and without what the page adds to it for
a resume that is exact and for clipping, side by side.

    python benchmarks/step_draws.py [--steps 20] [--rounds 5]

One process (a group of one, gloo), on this machine's CPU or first GPU. Each model (ResNet-18 and
the README's EfficientNet-B0, both for 1x28x28 images, batch 32) takes `--steps` steps in each of
three variants, in turn for `--rounds` rounds: the page's step as it is (each micro-batch seeded
from the step by common.seed_the_step); the same with seed_the_step made a no-op (the step before
it existed); and the page's step with --clip-grad-norm 1. Each figure is the median over rounds of
the mean time of a step (the GPU synchronised at the end of each round, not inside it). Then the
time of one common.seed_the_step call alone, the median of 20,000."""
import argparse, os, statistics, sys, time, timeit
import torch
import torch.distributed as dist
import torchvision
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common
import ddp_resnet


def efficientnet(classes):
    """The README's make_model() for 1x28x28 images."""
    net = torchvision.models.efficientnet_b0(num_classes=classes, dropout=0.2, stochastic_depth_prob=0.2)
    net.features[0][0] = torch.nn.Conv2d(1, 32, 3, padding=1, bias=False)
    return net


def seconds_per_step(model, optimizer, batch, args, steps, device):
    X, y = batch
    sums = common.Sums.on(device, loss=0, correct=0, samples=0, **common.NORM_SUMS)
    started = time.perf_counter()
    for step in range(steps):
        ddp_resnet.train_step(model, optimizer, X, y, step, args, sums)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    common.default_to_one_process()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("gloo", store=common.attempt_store(), rank=0, world_size=1)
    real_seed = common.seed_the_step
    print(f"{'model':16} {'seeded ms':>10} {'not ms':>8} {'ratio':>6} {'clip ms':>8} {'ratio':>6}   ({device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads)")
    for name in ("ResNet-18", "EfficientNet-B0"):
        torch.manual_seed(0)
        raw = common.classifier("resnet18", 10, 1, 28) if name == "ResNet-18" else efficientnet(10)
        model = torch.nn.parallel.DistributedDataParallel(raw.to(device))
        batch = (torch.randn(32, 1, 28, 28, device=device), torch.randint(0, 10, (32,), device=device))
        variants = {"seeded": [], "not": [], "clip": []}
        for round_ in range(options.rounds + 1):
            # Each round in another order: what runs first in a round is not always the same.
            order = list(variants.items())[round_ % 3:] + list(variants.items())[:round_ % 3]
            for variant, times in order:
                args = ddp_resnet.parse_args(["--clip-grad-norm", "1"] if variant == "clip" else [])
                optimizer, _ = ddp_resnet.make_optimizer(raw, args, steps_per_epoch=100)
                # ddp_resnet.train_step finds it in common as it runs.
                common.seed_the_step = (lambda *a: None) if variant == "not" else real_seed
                took = seconds_per_step(model, optimizer, batch, args, options.steps, device)
                if round_:   # the first round warms up
                    times.append(took)
        common.seed_the_step = real_seed
        seeded, plain, clip = (statistics.median(variants[v]) * 1e3 for v in ("seeded", "not", "clip"))
        print(f"{name:16} {seeded:10.1f} {plain:8.1f} {seeded / plain:6.3f} {clip:8.1f} {clip / seeded:6.3f}")
    call = statistics.median(timeit.repeat(lambda: common.seed_the_step(0, 123, 5), number=1, repeat=20000))
    print(f"one common.seed_the_step call: {call * 1e6:.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
