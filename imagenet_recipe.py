"""Training an image classifier the way ImageNet is trained at scale: your own images in class
folders read by DataLoader workers, random crops and flips, a torchvision model by name, and the
large-batch recipe (the learning rate scaled with the batch, a warm-up, a schedule, no weight decay
on BatchNorm and biases; Goyal et al., "Accurate, Large Minibatch SGD", 2017). Fashion-MNIST's IDX
files take the same road from memory (load_data chooses by what --data-dir holds).

Used by ddp_resnet.py, fsdp_resnet.py and diloco_resnet.py; dp_resnet.py takes its model and recipe.
`python imagenet_recipe.py --write-images DIR` writes Fashion-MNIST as such a folder, to try it.
"""
import argparse, atexit, math, multiprocessing, os, signal, sys, types, zlib
import torch
from PIL import Image
import common
import faults

# ---------------------------------------------------------------- the model
def fashion_resnet18(seed, num_classes=10):
    """torchvision's ResNet-18 for 1x28x28 images: a 3x3 stride-1 stem and no max-pool, so the
    small images are not shrunk 4x before the first block. The seed fixes the initial weights."""
    import torchvision
    torch.manual_seed(seed)
    net = torchvision.models.resnet18(num_classes=num_classes)
    net.conv1 = torch.nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    torch.nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")   # as torchvision does
    net.maxpool = torch.nn.Identity()
    return net

def make_model(arch, num_classes, seed):
    """fashion_resnet18, or a torchvision classification model by name (its registry) with
    num_classes outputs. The seed fixes the initial weights: the same on every rank."""
    if arch == "fashion_resnet18":
        return fashion_resnet18(seed, num_classes)
    import torchvision
    torch.manual_seed(seed)
    return torchvision.models.get_model(arch, num_classes=num_classes)

def arch_name(text):
    """--arch: fashion_resnet18 or one of torchvision's classification models."""
    import torchvision
    known = ["fashion_resnet18"] + torchvision.models.list_models(module=torchvision.models)
    if text not in known:
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; fashion_resnet18 or one of torchvision's: "
                                         f"{', '.join(known[1:])}")
    return text

# ---------------------------------------------------------------- the large-batch recipe
def param_groups(net, weight_decay):
    """Weight decay on the weights of convolutions and linear layers only, not on BatchNorm's
    scales and shifts nor on biases (the 1-D parameters): decaying those only fights the
    normalisation (Jia et al. 2018; He et al., "Bag of Tricks", 2019)."""
    params = list(net.parameters())
    return [{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]

def scaled_lr(lr_per_256, global_batch):
    """The linear scaling rule (Goyal et al., "Accurate, Large Minibatch SGD", 2017): --lr is given
    for 256 samples; k times the batch takes k times the learning rate."""
    return lr_per_256 * global_batch / 256

def lr_schedule(optimizer, warmup_steps, total_steps, kind):
    """Stepped after every optimizer step: a linear warm-up to the scaled rate over the first
    `warmup_steps` (large batches diverge without it: Goyal et al.), then `kind`: cosine to zero at
    `total_steps`, step (a tenth at 1/3 and again at 2/3 of the rest), or constant. The total comes
    from --epochs, never --max-steps: a run stopped early and resumed follows one schedule."""
    def factor(step):   # the multiplier for optimizer step `step` (0-based)
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        done = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return {"cosine": 0.5 * (1 + math.cos(math.pi * min(done, 1.0))),
                "step": 0.1 ** min(2, int(done * 3)), "constant": 1.0}[kind]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

def continue_schedule(optimizer, scheduler, lr, weight_decay, step):
    """After a resume the optimizer's state (momentum) is the checkpoint's, and its learning
    rate, weight decay and schedule are this run's flags, taken up at `step`: the schedule is a
    function of the step, so with the same flags this is where the checkpoint's would be, and
    with other ones they apply from here. (The optimizer's and a scheduler's saved state would
    bring back the checkpoint's rate whatever --lr says.)"""
    for group, decay in zip(optimizer.param_groups, (weight_decay, 0.0)):   # as param_groups makes them
        group.update(initial_lr=lr, weight_decay=decay)
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    scheduler.last_epoch = step - 1
    scheduler.step()   # sets every group's rate for step `step`

def recipe_of(args):
    """The flags of the large-batch recipe, kept in checkpoints to say what a resume changes."""
    return {"--lr": args.lr, "--weight-decay": args.weight_decay, "--schedule": args.schedule,
            "--warmup-epochs": args.warmup_epochs, "--epochs": args.epochs}

def add_recipe_flags(p):
    """The recipe's flags and those of the model and of image folders, on common.base_parser's."""
    p.add_argument("--warmup-epochs", type=common.non_negative_float, default=0.0,
                   help="raise the learning rate linearly from ~0 over these epochs (5 for batches of 8k)")
    p.add_argument("--schedule", choices=("cosine", "step", "constant"), default="cosine",
                   help="after the warm-up: cosine to 0 at the last epoch, a tenth at 1/3 and 2/3, or constant")
    p.add_argument("--weight-decay", type=common.non_negative_float, default=5e-4,
                   help="on convolution and linear weights (none on BatchNorm and biases)")
    p.add_argument("--arch", type=arch_name, metavar="NAME",
                   help="a torchvision model for an image folder (default resnet18); IDX data: fashion_resnet18")
    p.add_argument("--image-size", type=common.positive_int, help="image folders: images resized and cropped "
                   "to this (default 224; 28 for fashion_resnet18)")
    p.add_argument("--workers", type=common.non_negative_int, default=2, help="DataLoader worker processes per rank "
                   "reading an image folder (0: in the training process)")
    p.add_argument("--no-augment", action="store_true",
                   help="image folders: no random crop and flip in training (centre crop as in evaluation)")
    return p

# ---------------------------------------------------------------- the batches: from memory, or a folder read by DataLoader workers
def rank_shares(num_samples, global_batch, seed, epoch, rank, world_size, start=0, stop=None):
    """This rank's 1/world_size of each global batch of the epoch, from batch `start` to `stop`."""
    batches = common.epoch_batches(num_samples, global_batch, seed, epoch)[start:stop]
    return batches.view(len(batches), world_size, global_batch // world_size)[:, rank]

class MemoryBatches:
    """Fashion-MNIST held on the device: each epoch, this rank's share of every global batch."""
    def __init__(self, images, labels, global_batch, seed, rank, world_size, device, memory_format):
        self.images, self.labels, self.num_samples = images.to(device), labels.to(device), len(labels)
        self.global_batch, self.seed, self.rank, self.world_size = global_batch, seed, rank, world_size
        self.memory_format = memory_format

    def __len__(self):   # batches per epoch
        return self.num_samples // self.global_batch

    def epoch(self, epoch, start, stop):
        shares = rank_shares(self.num_samples, self.global_batch, self.seed, epoch, self.rank, self.world_size,
                             start, stop).to(self.labels.device)   # one copy an epoch, none per step
        for idx in shares:
            yield self.images[idx].contiguous(memory_format=self.memory_format), self.labels[idx]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
FASHION_CLASSES = ("t-shirt_top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                   "ankle_boot")

def data_kind(data_dir):
    """"folder" when data_dir holds train/ and val/, "fashion-mnist" when it holds the IDX files or
    nothing yet (they are then fetched); anything else exits, saying what the folder lacks."""
    has = [s for s in ("train", "val") if os.path.isdir(os.path.join(data_dir, s))]
    if len(has) == 2:
        return "folder"
    if has:
        missing = {"train", "val"} - set(has)
        sys.exit(f"error: {data_dir} has {has[0]}/ but no {missing.pop()}/: an image folder needs both, "
                 f"each with one subfolder per class")
    if common.find_files(data_dir) or not os.path.isdir(data_dir) or not os.listdir(data_dir):
        return "fashion-mnist"
    sys.exit(f"error: {data_dir} holds neither Fashion-MNIST's four IDX files nor train/ and val/ folders "
             f"of images (one subfolder per class); point --data-dir at one of these")

def scan_image_folder(data_dir):
    """The class names and each split's (path, class index) list, classes and files sorted by name
    (as torchvision's ImageFolder does). Hidden files are skipped; anything else that is not an
    image, an empty class, or classes that differ between train/ and val/ exit, naming the path."""
    def refuse(message):
        sys.exit(f"error: {message}")
    splits = {}
    for split in ("train", "val"):
        root = os.path.join(data_dir, split)
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        if not classes:
            refuse(f"{root} has no class folders: put each class's images in a subfolder named after it")
        samples = []
        for label, name in enumerate(classes):
            folder = os.path.join(root, name)
            files = sorted(e.name for e in os.scandir(folder) if e.is_file() and not e.name.startswith("."))
            for f in files:
                if not f.lower().endswith(IMAGE_EXTENSIONS):
                    refuse(f"{os.path.join(folder, f)} is not an image ({' '.join(IMAGE_EXTENSIONS)}): "
                           f"move it out of {folder}")
            if not files:
                refuse(f"{folder} holds no images: add its images or remove the empty class folder")
            samples += [(os.path.join(folder, f), label) for f in files]
        splits[split] = (classes, samples)
    (train_classes, train), (val_classes, val) = splits["train"], splits["val"]
    if train_classes != val_classes:   # both sorted: they differ only in which classes they hold
        only = lambda a, b: ", ".join(sorted(set(a) - set(b))) or "none"
        refuse(f"{data_dir}/train and {data_dir}/val have different classes (only in train/: "
               f"{only(train_classes, val_classes)}; only in val/: {only(val_classes, train_classes)}): "
               f"give both the same class folders")
    return train_classes, train, val

class UnreadableImage(Exception):
    """A file that cannot be decoded. Raised in a DataLoader worker, it comes back to the training
    process as this type with the worker's traceback as its text; `line()` is our one line of it."""
    def line(self):
        text = str(self)
        return text[text.rfind("error: cannot read "):].strip()

class ImageFiles(torch.utils.data.Dataset):
    """Images from disk, decoded and transformed where the DataLoader calls it (its workers). It is
    indexed by (epoch, index) pairs: each sample's random crop and flip are drawn from (seed,
    epoch, index) alone. So a sample is augmented alike at any world size, any number of workers
    and after a resume; different samples, on any rank or in any worker, draw differently. (Seeding
    each worker's generator instead, from (seed, rank, worker), makes the draws depend on how work
    is divided, and a resume exact only if every worker's generator state were saved.)"""
    def __init__(self, samples, transform, mode, seed):
        self.samples, self.transform, self.mode, self.seed = samples, transform, mode, seed

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, epoch_and_index):
        epoch, index = epoch_and_index
        path, label = self.samples[index]
        try:
            with Image.open(path) as image:
                image = image.convert(self.mode)   # decodes the whole file: truncation shows here
        except Exception as e:   # PIL says "cannot identify image file", "image file is truncated", ...
            raise UnreadableImage(f"error: cannot read {path} ({' '.join(str(e).split())[:200]}): "
                                  f"replace or remove the file") from None
        with torch.random.fork_rng(devices=[]):   # leaves the caller's generator as it was
            torch.default_generator.manual_seed(((self.seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63)
            return self.transform(image), label

def image_transforms(image_size, one_channel, augment):
    """Training: random crop (8-100% of the area, resized) and flip, when `augment`; otherwise and
    for evaluation: the shorter side resized to image_size and the centre cut out. Normalised
    with Fashion-MNIST's statistics for a one-channel model, else ImageNet's (torchvision's)."""
    from torchvision import transforms as T
    mean, std = ((common.MEAN,), (common.STD,)) if one_channel else (IMAGENET_MEAN, IMAGENET_STD)
    finish = [T.ToTensor(), T.Normalize(mean, std)]
    fixed = T.Compose([T.Resize(image_size), T.CenterCrop(image_size)] + finish)
    random = T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()] + finish)
    return (random if augment else fixed), fixed

class RankBatches(torch.utils.data.Sampler):
    """This rank's share of each global batch of `epoch_batches` (the in-memory path's batches),
    from batch `start` to `stop` of the epoch: a resume starts at the batch the training loop had
    reached. The loop counts the batches it has taken, so batches that workers had fetched
    ahead and never handed over do not count. (torchdata's StatefulDataLoader saves a loader's
    position and its workers' state; here the batches are a function of (seed, epoch) and the
    augmentation of (seed, epoch, index), so an offset is all a resume needs.)"""
    def __init__(self, num_samples, global_batch, seed, rank, world_size):
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.rank, self.world_size = rank, world_size
        self.set_epoch(1)

    def set_epoch(self, epoch, start=0, stop=None):   # what DistributedSampler.set_epoch is for, and the offset
        self.epoch, self.start, self.stop = epoch, start, stop

    def __len__(self):
        return len(range(self.num_samples // self.global_batch)[self.start:self.stop])

    def __iter__(self):
        for share in rank_shares(self.num_samples, self.global_batch, self.seed, self.epoch, self.rank,
                                 self.world_size, self.start, self.stop).tolist():
            yield [(self.epoch, i) for i in share]

def leave_stop_signals_to_the_rank(worker_id):
    """DataLoader workers ignore SIGTERM and SIGUSR1. SLURM signals every process of a job, the
    workers too, and a worker killed by it makes its rank raise "DataLoader worker is killed by
    signal" mid-step instead of stopping at the agreed step boundary. The rank's own handler
    decides, and the rank ends its workers itself when it exits (end_workers_at_exit)."""
    for name in ("SIGTERM", "SIGUSR1"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)

def end_workers_at_exit():
    """At the interpreter's exit, multiprocessing ends its daemonic children (DataLoader workers
    are) with SIGTERM and waits for them: ours ignore SIGTERM, and the wait would last for ever
    (seen: a rank that met a truncated image hung). End them with SIGKILL first, however the run
    ends (done, stopped, failed); atexit runs this before multiprocessing's own handler, which
    was registered earlier."""
    def kill_daemonic_children():
        if hasattr(signal, "SIGCHLD"):   # DataLoader's SIGCHLD handler would report these kills as failures
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in multiprocessing.active_children():
            if child.daemon:
                child.kill()
    atexit.register(kill_daemonic_children)

def worker_start_method(workers):
    """How DataLoader starts its workers: from a fork server where there is one (Linux, macOS), not by
    forking the rank itself. The rank runs threads (gloo's, the stop flag's allreduce in flight), and
    a child forked while one of them holds a lock can wait on it for ever (Python 3.12 warns of
    this; 3.14 made forkserver Linux's default). Seen here once in ~60 resumed runs: an evaluation
    worker of fsdp_resnet.py stuck inside os.fork (PyOS_AfterFork_Child waiting for a lock another
    thread of the rank held), its rank waiting on it. The server is a fresh process that imports
    the script once; each worker is forked from it."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver") if workers and "forkserver" in methods else None

def from_workers(iterator):
    """A DataLoader iterator's batches; an image a worker could not read ends the run with its
    one line."""
    try:
        yield from iterator
    except UnreadableImage as e:   # from a worker, with its traceback as text
        raise SystemExit(e.line()) from None

class FolderBatches:
    """The same batches read from disk: DataLoader workers decode and augment this rank's share
    of each global batch; pinned memory and non-blocking copies on CUDA; the workers live
    across epochs."""
    def __init__(self, dataset, global_batch, seed, rank, world_size, device, memory_format, workers):
        self.sampler = RankBatches(len(dataset), global_batch, seed, rank, world_size)
        self.loader = torch.utils.data.DataLoader(dataset, batch_sampler=self.sampler, num_workers=workers,
                                                  pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                                                  worker_init_fn=leave_stop_signals_to_the_rank,
                                                  multiprocessing_context=worker_start_method(workers))
        self.global_batch, self.num_samples = global_batch, len(dataset)
        self.device, self.memory_format = device, memory_format
        end_workers_at_exit()

    def __len__(self):
        return self.num_samples // self.global_batch

    def epoch(self, epoch, start, stop):
        self.sampler.set_epoch(epoch, start, stop)
        for X, y in from_workers(iter(self.loader)):   # the same workers every epoch (persistent)
            yield (X.to(self.device, non_blocking=True).contiguous(memory_format=self.memory_format),
                   y.to(self.device, non_blocking=True))

def evaluate_folder(predict, dataset, device, rank=0, world_size=1, batch_size=250, workers=0):
    """Accuracy on a folder split, as `evaluate` scores the in-memory one (the same slices),
    its images read by workers."""
    chunks = common.eval_chunks(len(dataset), rank, world_size, batch_size)
    workers = min(workers, len(chunks))
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=[[(0, i) for i in c.tolist()] for c in chunks],
                                         num_workers=workers, pin_memory=device.type == "cuda",
                                         worker_init_fn=leave_stop_signals_to_the_rank,
                                         multiprocessing_context=worker_start_method(workers))
    return common.accuracy(predict, from_workers(iter(loader)), device, world_size)

def spread(samples, n):
    """n of the samples, evenly spaced: a folder's list is sorted by class, and its first n would
    all come from the first classes (--train-samples, --test-samples)."""
    return samples if n is None or n >= len(samples) else [samples[i * len(samples) // n] for i in range(n)]

def load_data(args, rank, world_size, device, memory_format, master):
    """What --data-dir holds, ready to train on: the training batches, evaluate(model) -> accuracy
    (every rank calls it), the model's name and number of classes. Fashion-MNIST's IDX
    files are held in memory (the fastest for data that small); a folder of images is read by
    --workers DataLoader workers. The global batch is fixed here; what it leaves out is said."""
    # Each rank checks what its node holds (each node may have its own disk); all hear every problem.
    def check_kind():
        if master:
            common.check_out_dir(args.out)
        kind = data_kind(args.data_dir)   # told to every rank below: the nodes must agree on it
        if kind == "fashion-mnist" and (args.arch not in (None, "fashion_resnet18") or args.image_size not in (None, 28)):
            sys.exit("error: Fashion-MNIST's IDX files train fashion_resnet18 on 28x28 images; for --arch or "
                     "--image-size, write them as an image folder first (python imagenet_recipe.py --write-images DIR)")
        return kind
    kind, problem = faults.problem_of(check_kind)
    faults.check_together(problem, rank, world_size, same=f"{args.data_dir} holds {kind}")
    arch = args.arch or ("fashion_resnet18" if kind == "fashion-mnist" else "resnet18")
    one_channel = arch == "fashion_resnet18"
    if kind == "fashion-mnist":
        data = faults.fashion_mnist_on_every_node(args.data_dir, args.train_samples, args.test_samples, rank, world_size)
        (X_train, y_train), (X_test, y_test) = data["train"], data["test"]
        rank_batch = faults.rank_batch_size(args.batch_size, world_size, len(y_train), master)
        train = MemoryBatches(X_train, y_train, rank_batch * world_size, args.seed, rank, world_size, device,
                              memory_format)
        evaluate_on_test = lambda model: common.evaluate(model, X_test, y_test, device, rank, world_size)
        said = f"Fashion-MNIST in memory ({len(y_train)} training, {len(y_test)} test images)"
        classes, test_samples = 10, len(y_test)
    else:
        found, problem = faults.problem_of(scan_image_folder, args.data_dir)
        names, train_samples, val_samples = found or ([], [], [])
        listing = " ".join(os.path.relpath(path, args.data_dir) for path, _ in train_samples + val_samples)
        faults.check_together(problem, rank, world_size, same=f"{len(train_samples)} training, {len(val_samples)} validation "
                       f"images of {len(names)} classes, names crc {zlib.crc32(listing.encode())}")
        train_samples, val_samples = spread(train_samples, args.train_samples), spread(val_samples, args.test_samples)
        if len(val_samples) < world_size:
            sys.exit(f"error: {args.data_dir}/val has {len(val_samples)} images, fewer than the {world_size} ranks; "
                     f"add images or use fewer ranks" if master else 1)
        size = args.image_size or (28 if one_channel else 224)
        train_transform, val_transform = image_transforms(size, one_channel, augment=not args.no_augment)
        mode = "L" if one_channel else "RGB"
        rank_batch = faults.rank_batch_size(args.batch_size, world_size, len(train_samples), master,
                                     what=f"images in {args.data_dir}/train")
        train = FolderBatches(ImageFiles(train_samples, train_transform, mode, args.seed),
                              rank_batch * world_size, args.seed, rank, world_size, device, memory_format,
                              args.workers)
        val = ImageFiles(val_samples, val_transform, mode, args.seed)
        evaluate_on_test = lambda model: evaluate_folder(model, val, device, rank, world_size, workers=args.workers)
        said = (f"{args.data_dir}: {len(train_samples)} training and {len(val_samples)} validation images of "
                f"{len(names)} classes from disk, {size}x{size} {mode}, {args.workers} worker(s) per rank, "
                f"{'random crop and flip' if not args.no_augment else 'no augmentation'}")
        classes, test_samples = len(names), len(val_samples)
    dropped = train.num_samples % train.global_batch
    if master:
        print(f"data: {said}", flush=True)
        if dropped:
            print(f"note: {len(train) * train.global_batch + dropped} training images make {len(train)} global "
                  f"batches of {train.global_batch} per epoch: {dropped} are left out of each epoch "
                  f"(other ones each epoch, drawn with the order)", flush=True)
    return types.SimpleNamespace(train=train, evaluate=evaluate_on_test, arch=arch, classes=classes,
                                 test_samples=test_samples)


def write_images(data_dir, out, train_samples=None, test_samples=None):
    """Fashion-MNIST as an image folder: out/train/<class>/<index>.png and out/val/... (the test
    set), one grayscale 28x28 PNG per image, classes named with their label first so that sorting
    keeps the label order."""
    problem = common.prepare_fashion_mnist(data_dir)
    if problem:
        sys.exit(problem)
    paths = common.find_files(data_dir)
    for i, (split, n) in enumerate((("train", train_samples), ("val", test_samples))):
        images = common.read_idx(paths[2 * i], (28, 28))[:n]
        labels = common.read_idx(paths[2 * i + 1], ())[:n]
        for label, name in enumerate(FASHION_CLASSES):
            os.makedirs(os.path.join(out, split, f"{label}_{name}"), exist_ok=True)
        for index, (image, label) in enumerate(zip(images, labels.tolist())):
            Image.frombytes("L", (28, 28), image.numpy().tobytes()).save(
                os.path.join(out, split, f"{label}_{FASHION_CLASSES[label]}", f"{index:05d}.png"))
        print(f"wrote {len(labels)} images to {os.path.join(out, split)}")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write Fashion-MNIST (prepared in --data-dir) as a folder of PNG "
                                                 "files: DIR/train/<class>/*.png and DIR/val/...")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--write-images", metavar="DIR", required=True, help="the folder to write")
    parser.add_argument("--train-samples", type=common.positive_int, help="only the first N training images")
    parser.add_argument("--test-samples", type=common.positive_int, help="only the first N test images")
    args = parser.parse_args()
    write_images(args.data_dir, args.write_images, args.train_samples, args.test_samples)
