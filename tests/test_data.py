"""Your own data: an image folder read from disk by DataLoader workers is the same training as the
data held in memory, at any number of workers and ranks, resumed mid-epoch; bad folders are named."""
import json, os, shutil, signal, struct, subprocess, sys
import pytest
import torch
from PIL import Image
from torchvision.datasets import FashionMNIST
import common
from write_images import write_images
from helpers import (DATA, FILES, HERE, RESNET_LR, assert_ok, assert_same_weights, children_of, descendants_of,
                     fashion_resnet, folder_datasets, images_counted, load_model, read, run, running, wait_for,
                     with_readme_model)

TRAIN, VAL = 96, 61   # 61: no world size of 2 or 3 divides it
FOLDER = ["--image-size", "28", "--batch-size", "16", "--epochs", "2"]   # 28x28 grayscale: cheap


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    """Fashion-MNIST's first 96 training and 61 test images as a folder of PNG files."""
    folder = tmp_path_factory.mktemp("images")
    write_images(DATA, str(folder), TRAIN, VAL)
    return folder


# ---------------------------------------------------------------- the same training
def test_any_number_of_workers_trains_like_none(images, tmp_path):
    """Random crops and flips included: each sample's draw comes from (seed, epoch, index)."""
    flags = ["--data-dir", str(images), "--max-steps", "3"] + FOLDER
    for workers in ("0", "1", "2"):
        result = run(["python", "ddp_resnet.py", "--workers", workers, "--out", str(tmp_path / workers)] + flags)
        assert_ok(result)
    for workers in ("1", "2"):
        assert_same_weights(load_model(tmp_path / "0"), load_model(tmp_path / workers), tol=1e-6)


def test_two_ranks_with_workers_train_like_one_process_with_two_micro_batches(images, resnet_tolerance, tmp_path):
    """2 ranks draw the same global batches and augmentations as one process: with --accum-steps 2
    its micro-batches are the ranks' shares, BatchNorm included (the in-memory path's proof), its
    running statistics too (rank 0's share, micro-batch 0, alone moves them)."""
    flags = ["--data-dir", str(images), "--max-steps", "3", "--lr", str(RESNET_LR)] + FOLDER
    ranks = run(["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--workers", "2",
                 "--out", str(tmp_path / "r")] + flags)
    one = run(["python", "ddp_resnet.py", "--workers", "0", "--accum-steps", "2", "--out", str(tmp_path / "a")] + flags)
    assert_ok(ranks)
    assert_ok(one)
    assert_same_weights(load_model(tmp_path / "r"), load_model(tmp_path / "a"), tol=resnet_tolerance)


def write_idx(path, tensor):
    header = bytes([0, 0, 8, tensor.dim()]) + struct.pack(f">{tensor.dim()}I", *tensor.shape)
    path.write_bytes(header + tensor.numpy().tobytes())


def test_folder_trains_like_memory_on_the_same_images_in_the_same_order(images, tmp_path):
    """The folder's order is by class, then file name; IDX files written in that order hold the
    same images at the same indices. Without augmentation, the DataLoader is only plumbing."""
    idx = tmp_path / "idx"
    (idx / "FashionMNIST" / "raw").mkdir(parents=True)
    for (images_file, labels_file), n, train in zip((FILES[:2], FILES[2:]), (TRAIN, VAL), (True, False)):
        data = FashionMNIST(DATA, train=train)
        pixels, labels = data.data[:n], data.targets[:n]
        order = sorted(range(n), key=lambda i: (int(labels[i]), i))
        write_idx(idx / "FashionMNIST" / "raw" / images_file, pixels[order].contiguous())
        write_idx(idx / "FashionMNIST" / "raw" / labels_file, labels[order].to(torch.uint8).contiguous())
    flags = ["--max-steps", "4", "--batch-size", "16", "--epochs", "2"]
    memory = run(["python", "ddp_resnet.py", "--data-dir", str(idx), "--out", str(tmp_path / "m")] + flags)
    folder = run(["python", "ddp_resnet.py", "--data-dir", str(images), "--no-augment", "--image-size", "28",
                  "--workers", "2", "--out", str(tmp_path / "f")] + flags)
    assert_ok(memory)
    assert_ok(folder)
    assert_same_weights(load_model(tmp_path / "m"), load_model(tmp_path / "f"), tol=1e-6)
    accuracy = [json.load(open(tmp_path / out / "metrics.json"))["test_acc"] for out in "mf"]
    assert accuracy[0] == accuracy[1]


def test_augmentation_differs_between_samples_ranks_and_workers_and_repeats_after_a_resume(images, monkeypatch):
    """The same picture at different indices, epochs, ranks or workers is cropped differently;
    the same (epoch, index) is cropped alike again, whoever loads it, as after a resume. Loading
    (in the training process with --workers 0) leaves its generators as they were, the GPU's too."""
    folder, _, _ = folder_datasets(images, 24, augment=True)
    folder.samples = [folder.samples[0]] * 32   # one picture, 32 times
    train = common.Seeded(folder, 0)
    before, gpu_seeded = torch.get_rng_state(), []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: gpu_seeded.append(seed))
    train.epoch.fill_(1)
    draw = train[0][0]
    # the training process's generators untouched
    assert torch.equal(torch.get_rng_state(), before) and gpu_seeded == []
    assert torch.equal(draw, train[0][0]) and not torch.equal(draw, train[1][0])
    train.epoch.fill_(2)
    assert not torch.equal(draw, train[0][0])
    per_rank = []
    for rank in range(2):
        loader, sampler = common.train_loader(train, 16, 0, rank, 2, torch.device("cpu"), workers=2)
        sampler.set_epoch(1)
        per_rank.append([X for X, _ in loader])   # worker 0 loads batch 0, worker 1 batch 1
    (rank0_worker0, rank0_worker1), (rank1_worker0, _) = per_rank
    assert not torch.equal(rank0_worker0, rank0_worker1) and not torch.equal(rank0_worker0, rank1_worker0)
    crops = torch.cat(per_rank[0] + per_rank[1]).flatten(1)
    assert len(crops.unique(dim=0)) == 32   # 32 draws of one picture, all different
    sampler.set_epoch(1, start=1)   # a resume at batch 1: the same crops as the uninterrupted epoch's
    resumed = [X for X, _ in loader]
    assert len(resumed) == 1 and torch.equal(resumed[0], per_rank[1][1])


def test_a_part_of_a_folder_spans_its_classes_and_leaves_the_folder_whole(images):
    """--train-samples 48 of a folder sorted by class: 48 images spread over it, not its first 48 (which come
    from the first five classes), taken with torch's Subset: the folder's samples, targets and imgs stay whole
    and agree."""
    whole, _, _ = folder_datasets(images)
    assert len({label for _, label in whole.samples[:48]}) <= 5
    part, _, _ = folder_datasets(images, train_samples=48)
    labels = [part[i][1] for i in range(len(part))]
    assert len(part) == 48 and set(labels) == set(range(10))
    folder = part.dataset
    assert len(folder.samples) == len(folder.targets) == len(folder.imgs) == TRAIN
    assert labels == [folder.targets[i] for i in part.indices] == [folder.samples[i][1] for i in part.indices]


# ---------------------------------------------------------------- resume, evaluation, uneven data
def test_fsdp_mid_epoch_resume_from_an_image_folder_with_workers_ends_like_one_run(images, tmp_path):
    """2 ranks with 2 workers each, an image folder's random crops, a warm-up and a cosine, stopped
    inside the first of 2 epochs, then --resume: the uninterrupted run's weights. --max-steps 2
    stops a run of 3 steps an epoch (48 images); its --resume first says there is no checkpoint
    yet (a cap at or below the checkpoint's step: test_faults.py), and FSDP's checkpoint folder also
    holds what crashes leave: an older complete checkpoint (step-1, made unreadable, so loading it
    would fail) and a newer one half written (step-5.tmp). SIGTERM to every rank and worker of a
    job with workers: test_your_own_dataset_and_model_in_one_edit_each_train_on_two_ranks_and_resume_exactly."""
    flags = ["--data-dir", str(images), "--workers", "2", "--warmup-epochs", "1", "--checkpoint-every", "2",
             "--train-samples", "48"] + FOLDER
    torchrun = ["torchrun", "--standalone", "--nproc_per_node=2", "fsdp_resnet.py"]
    whole = run(torchrun + ["--out", str(tmp_path / "whole")] + flags)
    assert_ok(whole)
    parts = tmp_path / "parts"
    stopped = run(torchrun + ["--resume", "--max-steps", "2", "--out", str(parts)] + flags)
    assert_ok(stopped)
    said = f"no checkpoint in {parts / 'checkpoint'}: training starts from step 0"
    assert stopped.stdout.count(said) == 1, stopped.stdout   # rank 0 alone says it
    assert "checkpoint: step 2 (epoch 1 at batch 2/3)" in stopped.stdout
    (parts / "checkpoint" / "step-00000001").mkdir()
    (parts / "checkpoint" / "step-00000001" / ".metadata").write_bytes(b"cut short")
    (parts / "checkpoint" / "step-00000005.tmp").mkdir()
    resumed = run(torchrun + ["--resume", "--out", str(parts)] + flags)
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout and ", step 2" in resumed.stdout
    assert_same_weights(load_model(tmp_path / "whole"), load_model(parts), tol=1e-6)
    assert sorted(os.listdir(parts / "checkpoint")) == ["step-00000006"]   # only the newest is kept


def test_evaluation_counts_every_image_once_and_uneven_data_never_hangs(images, tmp_path):
    """3 ranks, 61 validation images (20, 20, 21 each): the reported accuracy is one process's on
    the same weights over all 61, each counted once an epoch. 96 training images in global batches
    of 27 (9 a rank): 3 batches, 15 images left out of each epoch (other ones each epoch)."""
    result = run(["torchrun", "--standalone", "--nproc_per_node=3", "ddp_resnet.py", "--data-dir", str(images),
                  "--image-size", "28", "--batch-size", "27", "--epochs", "2", "--workers", "1",
                  "--out", str(tmp_path)], timeout=300)
    assert_ok(result)
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert metrics["test_samples"] == VAL and metrics["steps"] == 6
    net = fashion_resnet(0)
    net.load_state_dict(load_model(tmp_path))
    _, val, _ = folder_datasets(images)
    correct = count = 0
    with torch.no_grad():
        for X, y in torch.utils.data.DataLoader(val, batch_size=VAL):
            correct += (net.eval()(X).argmax(1) == y).sum().item()
            count += len(y)
    assert metrics["test_acc"] == correct / count and images_counted(tmp_path) == [count] * 2 == [VAL] * 2


def test_a_gray_image_among_colour_ones_is_read_in_colour(images, tmp_path):
    """ImageNet holds grayscale JPEGs among its colour ones: every image is read in the folder's mode, the first
    image's."""
    folder = tmp_path / "colour"
    shutil.copytree(images, folder)
    pictures = sorted(folder.rglob("*.png"))
    for picture in pictures:
        Image.open(picture).convert("RGB").save(picture)
    Image.open(pictures[1]).convert("L").save(pictures[1])
    train, _, _ = folder_datasets(folder)
    assert Image.open(train.samples[1][0]).mode == "L"
    assert [train[i][0].shape for i in range(3)] == [(3, 28, 28)] * 3


def test_importing_common_does_nothing_and_a_runs_workers_end_with_it(images, tmp_path):
    """common.py defines names and does nothing at import: no exit handler, no matplotlib. A run's DataLoader
    workers ignore SIGTERM (SLURM signals every process of a job; the rank decides when to stop): they end with
    the run that made them, as it returns and as it fails (a truncated image read by a worker), and nothing is
    left for the interpreter's exit, which would wait for ever on a worker that ignores SIGTERM."""
    imported = ("import atexit, sys, torch, torch.distributed.nn, torch.distributed.rendezvous, torch.utils.data; "
                "before = atexit._ncallbacks(); import common; "
                "print(atexit._ncallbacks() - before, 'matplotlib' in sys.modules)")
    result = run(["python", "-c", imported])
    assert result.stdout.split() == ["0", "False"], result.stderr[-2000:]
    broken = tmp_path / "broken"
    shutil.copytree(images, broken)
    break_folder("truncated image", broken)
    ends = ("import multiprocessing, sys, ddp_resnet\n"
            "try:\n    ddp_resnet.main(sys.argv[1:])\nexcept RuntimeError as e:\n    print('failed:', e)\n"
            "print('workers left:', len(multiprocessing.active_children()))")
    for folder, said in ((images, "done:"), (broken, "failed: ")):
        result = run(["python", "-c", ends, "--data-dir", str(folder), "--image-size", "28", "--workers", "2",
                      "--batch-size", "16", "--max-steps", "3", "--out", str(tmp_path / "out")], timeout=120)
        assert result.returncode == 0 and said in result.stdout, result.stderr[-2000:]
        assert "workers left: 0" in result.stdout, result.stdout[-2000:]


# A page's main(), with a reference cycle that holds its train() frame made as each epoch's outputs are written (as
# a stored traceback's frames, or matplotlib's, may be), and automatic collection off: the cycle outlives train().
KEEPS_TRAIN = """import gc, multiprocessing, sys, common
def write_outputs(metrics, write=common.write_outputs):
    write(metrics)
    frame = sys._getframe()
    while frame.f_code.co_name != "train":
        frame = frame.f_back
    cycle = [frame]
    cycle.append(cycle)
common.write_outputs = write_outputs
gc.disable()
__import__(sys.argv[1]).main(sys.argv[2:])
print("workers left:", len(multiprocessing.active_children()), flush=True)
"""


@pytest.mark.parametrize("page", ["ddp_resnet", "fsdp_resnet", "diloco_resnet"])
def test_a_runs_workers_end_with_its_loop_when_a_cycle_holds_its_frame(page, images, tmp_path):
    """Loaders held by a frame in a reference cycle are freed only by a garbage collection, where torch's queues
    close before the workers are told to stop: the workers ignore SIGTERM, and the interpreter's exit would wait for
    them for ever. Each page frees its loaders as its loop ends."""
    result = run(["python", "-c", KEEPS_TRAIN, page, "--data-dir", str(images), "--workers", "2", "--max-steps", "4",
                  "--out", str(tmp_path)] + FOLDER, timeout=120)
    assert result.returncode == 0 and "workers left: 0" in result.stdout, (result.stdout + result.stderr)[-2000:]


# ---------------------------------------------------------------- bad folders
def break_folder(case, folder):
    """Make `folder` (a copy of the image folder) bad in one way; return the path the error must name."""
    train, val = folder / "train", folder / "val"
    second = sorted((train / "0_t-shirt_top").iterdir())[1]   # the first is opened to see its mode (grayscale)
    if case == "truncated image":
        second.write_bytes(second.read_bytes()[:100])
        return second
    if case == "empty class":
        (train / "10_extra").mkdir()
        (val / "10_extra").mkdir()
        return "10_extra"
    if case == "other classes":
        shutil.rmtree(val / "9_ankle_boot")
        return "9_ankle_boot"
    if case == "fewer than one batch":
        return "96 training samples are fewer than --batch-size 200"
    if case == "neither":
        shutil.rmtree(train)
        shutil.rmtree(val)
        (folder / "photos.zip").write_text("")
        return folder


@pytest.mark.parametrize("case", ["truncated image", "empty class", "other classes",
                                  "fewer than one batch", "neither"])
def test_bad_image_folders_are_named(images, case, tmp_path):
    """Exit status 1, one line naming the folder, no traceback, nothing written over. The truncated image is
    read by a worker process (all 96 are in the first batch): its error, which names the file, comes with the
    worker's traceback, as DataLoader raises it."""
    folder = tmp_path / "data"
    shutil.copytree(images, folder)
    named = break_folder(case, folder)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.json").write_text("an earlier run's")
    batch = "200" if case == "fewer than one batch" else "96"
    result = run(["python", "ddp_resnet.py", "--data-dir", str(folder), "--image-size", "28", "--workers", "2",
                  "--batch-size", batch, "--max-steps", "1", "--out", str(out)], timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    if case == "truncated image":
        assert f"RuntimeError: error: cannot read {named} (" in result.stderr, result.stderr[-2000:]
    else:
        assert len(lines) == 1 and lines[0].startswith("error: ") and str(named) in lines[0], result.stderr[-2000:]
    assert os.listdir(out) == ["metrics.json"] and (out / "metrics.json").read_text() == "an earlier run's"


# ---------------------------------------------------------------- your own Dataset, in one edit
YOUR_DATA = '''class Pictures(torch.utils.data.Dataset):
    """CIFAR's shape: 3x32x32 image tensors and 10 classes; flipped at random, with torch's generator."""
    def __init__(self, n, seed):
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, 3, 32, 32, generator=generator)
        self.labels = torch.randint(0, 10, (n,), generator=generator)
    def __len__(self):
        return len(self.labels)
    def __getitem__(self, index):
        image = self.images[index]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image, int(self.labels[index])

def datasets(args):
    return Pictures(96, seed=1), Pictures(20, seed=2), 10

'''


def test_your_own_dataset_and_model_in_one_edit_each_train_on_two_ranks_and_resume_exactly(tmp_path):
    """ddp_resnet.py and common.py copied, and the two edits the README shows: the section where the data goes
    replaced by a Dataset of CIFAR's shape made here, its random flips drawn from torch's generator, and the one
    where the model goes by the README's EfficientNet-B0 (dropout, stochastic depth). Two ranks with 2 workers each,
    a warm-up and a cosine over 2 epochs, SIGTERM to every process of the job (every rank and worker, as SLURM sends
    it) mid-epoch: the ranks stop together at a step boundary, and the resumed run ends with the weights and
    BatchNorm statistics of a run never stopped, to the bit; the model is made for 3x32x32 images. --train-samples,
    which this datasets() does not apply, is said to be left unapplied."""
    page = with_readme_model(open(os.path.join(HERE, "ddp_resnet.py")).read())
    start = page.index("def datasets(args):")
    end = page.index("# ---------------------------------------------------------------- your model goes here")
    copy = tmp_path / "job"
    copy.mkdir()
    (copy / "ddp_resnet.py").write_text(page[:start] + YOUR_DATA + page[end:])
    shutil.copy(os.path.join(HERE, "common.py"), copy)
    flags = ["--batch-size", "16", "--epochs", "2", "--workers", "2", "--warmup-epochs", "1", "--checkpoint-every",
             "2", "--lr", "0.01", "--train-samples", "48"]   # which this datasets() does not apply: said
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "ddp_resnet.py"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    whole = subprocess.run(torchrun + flags + ["--out", "whole"], cwd=copy, env=env, capture_output=True, text=True,
                           timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "EfficientNet for (3, 32, 32) images" in whole.stdout
    assert "note: datasets() gave 96 training samples: it does not apply --train-samples 48" in whole.stdout
    log = tmp_path / "log"
    with open(log, "w") as f:
        job = subprocess.Popen(torchrun + flags + ["--out", "parts"], cwd=copy, stdout=f, stderr=subprocess.STDOUT,
                               env={**env, "PYTHONUNBUFFERED": "1"})
        wait_for(lambda: "checkpoint: step 2 " in read(log), 240, "the first checkpoint")
        everyone = descendants_of(job.pid)   # the ranks, each one's fork server and its 2 workers
        assert len(children_of(job.pid)) == 2 and len(everyone) >= 2 + 4, everyone
        for pid in everyone:   # every rank and worker, as SLURM signals a job
            os.kill(pid, signal.SIGTERM)
        job.wait(timeout=120)
    text = read(log)
    assert "stopped by SIGTERM at step" in text and "DataLoader worker" not in text, text[-3000:]
    assert "exitcode  : 75" in text, text[-3000:]
    wait_for(lambda: not any(running(pid) for pid in everyone), 30, "every rank and worker to exit")
    stopped_at = int(text.split("stopped by SIGTERM at step ")[1].split(",")[0])
    assert 2 <= stopped_at < 6, text[-3000:]   # inside the first epoch: 6 steps an epoch
    resumed = subprocess.run(torchrun + flags + ["--out", "parts", "--resume"], cwd=copy, env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"epoch 1 at batch {stopped_at}/6, step {stopped_at}" in resumed.stdout
    assert_same_weights(load_model(copy / "whole"), load_model(copy / "parts"), tol=0)


def test_the_test_loaders_workers_stay_from_one_evaluation_to_the_next():
    images = torch.utils.data.Subset(torch.utils.data.TensorDataset(torch.zeros(10, 1, 2, 2)), range(10))
    assert common.test_loader(images, 0, 1, torch.device("cpu"), workers=2).persistent_workers
    assert not common.test_loader(images, 0, 1, torch.device("cpu")).persistent_workers
