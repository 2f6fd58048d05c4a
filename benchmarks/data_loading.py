"""An image folder read by DataLoader workers against Fashion-MNIST held in memory.

    python benchmarks/data_loading.py            # about 5 minutes on 2 CPU cores

1. The loader alone: images per second that N workers decode and transform (grayscale PNG, 28x28,
   as ddp_resnet.py takes Fashion-MNIST; and resized to 224 with the random crop, as ImageNet-sized
   images are), against the images per second one training step of ddp_resnet.py consumes.
2. ddp_resnet.py's step on the same images, from the folder (2 workers) and from memory: samples
   per second, the runs interleaved, the median of each, and their ratio.
"""
import json, os, statistics, subprocess, sys, tempfile, time
import torch
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "examples"))
import common
from write_images import write_images

IMAGES, STEPS, BATCH, REPEATS = 2048, 12, 64, 3


def loader_rate(dataset, workers, batch=BATCH):
    """Images per second over one pass (the workers' start-up excluded: they live across epochs)."""
    loader, sampler = common.train_loader(dataset, batch, 0, 0, 1, torch.device("cpu"), workers)   # the scripts' own
    sampler.set_epoch(1)
    for _ in loader:   # the first pass starts the workers
        break
    start, n = time.perf_counter(), 0
    for X, _ in loader:
        n += len(X)
    return n / (time.perf_counter() - start)


def training_rate(data_dir, extra, out):
    result = subprocess.run([sys.executable, os.path.join(HERE, "ddp_resnet.py"), "--data-dir", data_dir,
                             "--batch-size", str(BATCH), "--max-steps", str(STEPS), "--epochs", "1",
                             "--test-samples", "100", "--out", out] + extra,
                            cwd=HERE, capture_output=True, text=True)
    if result.returncode:
        sys.exit(result.stderr[-2000:])
    return json.load(open(os.path.join(out, "metrics.json")))["samples_per_s"]


def main():
    print(f"torch {torch.__version__}, {len(os.sched_getaffinity(0))} cores, {time.strftime('%Y-%m-%d')}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "images")
        write_images(os.path.join(HERE, "data"), folder, IMAGES, 100)
        print(f"\n1. the loader alone ({IMAGES} PNG files, batches of {BATCH}), images/s")
        print(f"{'workers':>8} {'28x28 L, no augmentation':>26} {'224x224 L, crop and flip':>28}")
        small = common.image_folders(folder, 28, False)[0]
        large = common.image_folders(folder, 224, True)[0]
        for workers in (0, 1, 2):
            print(f"{workers:>8} {loader_rate(small, workers):>26,.0f} {loader_rate(large, workers):>28,.0f}",
                  flush=True)

        print(f"\n2. ddp_resnet.py, one process, ResNet-18 for 1x28x28, {STEPS} steps of {BATCH}, samples/s")
        idx = os.path.join(HERE, "data")
        rates = {"memory": [], "folder": []}
        for _ in range(REPEATS):   # interleaved: the machine's drift hits both alike
            rates["memory"].append(training_rate(idx, ["--train-samples", str(IMAGES)], os.path.join(tmp, "m")))
            folder_flags = ["--image-size", "28", "--no-augment", "--workers", "2"]
            rates["folder"].append(training_rate(folder, folder_flags, os.path.join(tmp, "f")))
            print(f"   memory {rates['memory'][-1]:6.1f}   folder {rates['folder'][-1]:6.1f}", flush=True)
        memory, from_disk = statistics.median(rates["memory"]), statistics.median(rates["folder"])
        print(f"median: memory {memory:.1f}, folder {from_disk:.1f} samples/s: folder/memory {from_disk / memory:.3f}x")


if __name__ == "__main__":
    main()
