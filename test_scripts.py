"""The proofs of every script, all on CPU: each approach trains like one device (or the approach it
derives from), resumes exactly, says a bad input in one line; and each runs copied with only the
files it imports. `bash run_all.sh test quick` runs this file alone; `bash run_all.sh test` adds
tests/ (faults, own data, several machines, slow links, the README), whose helpers.py this imports."""
import argparse, json, math, os, re, shutil, socket, subprocess, sys, threading, traceback
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))
import common
import ddp_resnet
import ddp_toy
import diloco_resnet
import dp_resnet
import fsdp_resnet
import ft_ddp_resnet as ft
import scratch_lenet
import scratch_ring
from as_on_a_gpu import READ_BACK, as_on_a_gpu
from helpers import (DATA, HERE, LENET_PARAMS, OFFLINE, RESNET, RESNET_LR, SMALL, TOY, TWO_EPOCHS, assert_ok,
                     assert_same_weights, assert_toy_evaluated_once, copy_set, epoch_batches, fashion_resnet,
                     free_port, load_model, resnet_reference, run, scratch_ring_trains_like_one_device)
from helpers import (fashion_mnist, launcher_variables_kept, resnet_tolerance,   # noqa: F401  (fixtures)
                     scratch_one_replica, toy_one_rank)

RESNET_BYTES = 4 * sum(p.numel() for p in fashion_resnet(0).parameters())   # 44,691,240

# ---------------------------------------------------------------- common.py
class Formed(Exception):   # init_process_group was called, with this backend
    pass


def formed_with(monkeypatch, main, nccl_built):
    """The backend `main` forms its group with on a machine with one GPU, where torch has NCCL or not (Windows,
    macOS, CPU builds)."""
    pretend_gpus(monkeypatch, 1, 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: nccl_built)
    monkeypatch.setattr(common, "attempt_store", lambda: None)
    def init_process_group(backend, **options):
        raise Formed(backend)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    with pytest.raises((Formed, SystemExit)) as formed:
        main([])
    if formed.type is SystemExit:   # FSDP2 and scratch_ring's send/recv refuse gloo with CUDA tensors, saying so
        assert "over gloo" in str(formed.value.code) or "gloo cannot" in str(formed.value.code)
        return "gloo"
    return str(formed.value)


@pytest.mark.parametrize("script", [ddp_toy, ddp_resnet, fsdp_resnet, diloco_resnet, scratch_ring])
def test_backend_is_nccl_with_gpus_where_torch_has_it_else_gloo(script, monkeypatch):
    assert formed_with(monkeypatch, script.main, nccl_built=True) == "nccl"
    assert formed_with(monkeypatch, script.main, nccl_built=False) == "gloo"


def test_fashion_mnist_is_the_real_data():
    (X_train, y_train), (X_test, y_test) = (d.tensors for d in common.fashion_mnist(DATA)[:2])
    assert X_train.shape == (60000, 1, 28, 28) and X_test.shape == (10000, 1, 28, 28)
    assert torch.bincount(y_train).tolist() == [6000] * 10
    assert torch.bincount(y_test).tolist() == [1000] * 10
    assert abs(X_train.mean().item()) < 0.01 and abs(X_train.std().item() - 1) < 0.01


@pytest.mark.parametrize("case", ["no such folder", "an empty folder"])
def test_a_mistyped_data_dir_is_refused_in_one_line_and_nothing_is_made_there(case, tmp_path):
    """Only the default folder, ./data, is downloaded into: a folder named by --data-dir that is not there, or
    holds neither Fashion-MNIST nor train/ and val/, is refused before anything is written."""
    named = tmp_path / "nope"
    if case == "an empty folder":
        named.mkdir()
    result = run(["python", "ddp_resnet.py", "--data-dir", str(named), "--out", str(tmp_path / "out")] + RESNET[:-2])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    said = f"error: --data-dir {named} does not exist"
    if case == "an empty folder":
        said = (f"error: --data-dir {named} holds neither Fashion-MNIST ({named}/FashionMNIST/raw) nor, for the ResNet "
                f"scripts, train/ and val/ (a subfolder of images per class)")
    assert result.stderr.strip().splitlines() == [said]
    assert sorted(p.name for p in tmp_path.rglob("*")) == (["nope"] if case == "an empty folder" else [])


def test_fashion_mnist_is_fetched_into_the_default_folder_only(tmp_path, monkeypatch):
    """No --data-dir: torchvision downloads it into ./data (here offline, so it says what to do instead)."""
    result = run(["python", "-c", "import scratch_lenet; scratch_lenet.main([])"], env={**OFFLINE, "PYTHONPATH": HERE},
                 cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"error: cannot read Fashion-MNIST in {tmp_path}/data/FashionMNIST/raw (" in result.stderr
    for what_to_do in ("bash run_all.sh", "dataset-fashion-mnist", "FashionMNIST('data', download=True)"):
        assert what_to_do in result.stderr
    assert (tmp_path / "data" / "FashionMNIST" / "raw").is_dir()   # where torchvision tried


def test_curves_have_whole_epochs_on_their_axis(tmp_path, monkeypatch):
    """curves.png of 1, 3 and 12 epochs: every tick an epoch (none at 2.5), every point inside the axis (a single
    epoch's was drawn on an axis from 0.96 to 1.04)."""
    import matplotlib.figure
    figures = []
    class Kept(matplotlib.figure.Figure):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            figures.append(self)
    monkeypatch.setattr(matplotlib.figure, "Figure", Kept)   # common.py imports it where it draws
    for epochs in (1, 3, 12):
        history = [{"epoch": e, "train_loss": 1 / e, "train_acc": 0.5, "test_loss": 1 / e, "test_acc": 0.5,
                    "samples": 10, "seconds": 1.0} for e in range(1, epochs + 1)]
        metrics = {"script": "a.py", "config": {"out": str(tmp_path)}, "devices": ["cpu"], "backend": "gloo",
                   "layout": "1 process x 1 replica", "test_samples": 10, "epochs": history}
        common.finish(metrics, epochs, 1.0, {}, {})
        for ax in figures[-1].axes:
            low, high = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if low <= t <= high]
            assert ticks and all(t == round(t) for t in ticks), ticks
            assert low <= 0.5 and high >= epochs + 0.5


def rank_batches(samples, global_batch, rank, world_size, epoch, start=0):
    dataset = torch.utils.data.TensorDataset(torch.arange(samples))
    loader, sampler = common.train_loader(dataset, global_batch, 3, rank, world_size, torch.device("cpu"))
    sampler.set_epoch(epoch, start)
    return [batch[0].tolist() for batch in loader]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
def test_global_batches_do_not_depend_on_world_size(world_size):
    """DistributedSampler's order, cut by our sampler: the ranks' k-th batches together are the same
    global batch at any world size; each epoch another order; a start skips exactly the batches done."""
    one = rank_batches(1000, 48, 0, 1, epoch=1)
    assert len(one) == 1000 // 48 and len({i for b in one for i in b}) == 1000 // 48 * 48
    ranks = [rank_batches(1000, 48, r, world_size, epoch=1) for r in range(world_size)]
    assert [sorted(sum((r[k] for r in ranks), [])) for k in range(len(one))] == [sorted(b) for b in one]
    assert rank_batches(1000, 48, 0, world_size, epoch=1, start=5) == ranks[0][5:]
    assert rank_batches(1000, 48, 0, 1, epoch=2) != one


def learning_rates(optimizer, scheduler, steps):   # each group's lr at optimizer steps 0 .. steps - 1
    rates = []
    for _ in range(steps):
        rates.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return rates


def test_the_recipe_decays_only_weights_and_warms_up_then_follows_the_cosine_to_zero():
    """ddp_resnet.make_optimizer itself (a decay or a schedule gone wrong can stay within the ResNet comparisons'
    tolerance over their few steps): weight decay on every weight but BatchNorm's and the biases; momentum 0.9; the
    learning rate of step k, with a warm-up of W steps and T in all: (k + 1) / W of the rate for k < W, then half a
    cosine from the whole rate at step W down to zero at step T, which the last step (T - 1) is one cosine step
    short of; with no warm-up, the cosine from step 0."""
    net = fashion_resnet(0)
    flags = ["--lr", "0.4", "--batch-size", "256", "--epochs", "2"]
    optimizer, scheduler = ddp_resnet.make_optimizer(net, ddp_resnet.parse_args(flags + ["--warmup-epochs", "0.75"]),
                                                     steps_per_epoch=4)
    name = {p: n for n, p in net.named_parameters()}
    norms = {name[p] for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters()}
    biases = {n for n in name.values() if n.endswith("bias")}
    assert len(norms) == 40 and len(biases) == 21   # 20 BatchNorms' weights and biases, and the last layer's bias
    decayed, not_decayed = optimizer.param_groups
    assert {name[p] for p in not_decayed["params"]} == norms | biases and not_decayed["weight_decay"] == 0
    assert {name[p] for p in decayed["params"]} == set(name.values()) - norms - biases
    assert decayed["weight_decay"] == 5e-4
    assert decayed["momentum"] == not_decayed["momentum"] == 0.9
    cosine = [0.2 * (1 + math.cos(math.pi * k / 5)) for k in range(5)]   # from step 3 to 7 of 8
    expected = [0.4 / 3, 0.8 / 3, 0.4] + cosine + [0.0]   # the rate after the last step: zero
    assert learning_rates(optimizer, scheduler, 9) == [[pytest.approx(lr, abs=1e-15)] * 2 for lr in expected]
    optimizer, scheduler = ddp_resnet.make_optimizer(net, ddp_resnet.parse_args(flags), steps_per_epoch=2)
    expected = [0.2 * (1 + math.cos(math.pi * k / 4)) for k in range(4)] + [0.0]
    assert learning_rates(optimizer, scheduler, 5) == [[pytest.approx(lr, abs=1e-15)] * 2 for lr in expected]


# ---------------------------------------------------------------- every tensor on the model's device
# On a CPU-only machine a tensor made without device= lands where the model is anyway. The meta device stands in for
# the GPU: tests/as_on_a_gpu.py refuses an op on two devices as CUDA does, and nothing can be read back from meta, so
# each page or call below must get as far as its first read-back, and no further.
META = torch.device("meta")


@pytest.mark.parametrize("world_size", [1, 2])
def test_evaluation_counts_on_the_models_device(world_size):
    """The batches come as an image folder's workers give them (on the CPU), the model is on meta."""
    net = fashion_resnet(0).to(META).eval()
    batches = [(torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,)))] * 2
    with pytest.raises((RuntimeError, NotImplementedError), match=READ_BACK):
        dp_resnet.evaluate(net, batches, META)
    toy = ddp_toy.ToyMLP().to(META)
    with pytest.raises((RuntimeError, NotImplementedError), match=READ_BACK):
        ddp_toy.evaluate(toy, common.test_loader(torch.utils.data.TensorDataset(*ddp_toy.toy_data(9, 2)), 0,
                                                 world_size, META), META)


def test_accuracy_counts_exactly_past_float32s_integers():
    """2^24 + 1 test images, one of them wrong: float32 would count 2^24 of 2^24 (its next integer is 2^24 + 2). The
    loss: log(1 + e) for the wrong one, log(1 + 1/e) for the others."""
    n = 2**24 + 1
    X, y = torch.zeros(n, 2), torch.zeros(n, dtype=torch.long)
    X[:, 0], y[0] = 1, 1
    tested = ddp_toy.evaluate(lambda X: X, [(X, y)], torch.device("cpu"))
    loss = (math.log1p(math.e) + (n - 1) * math.log1p(1 / math.e)) / n
    assert tested == {"test_loss": pytest.approx(loss, rel=1e-6), "test_acc": (n - 1) / n, "test_count": n}


GPU_RESNET = ["--train-samples", "32", "--test-samples", "20", "--batch-size", "16", "--epochs", "1", "--data-dir",
              DATA]   # two steps, then the evaluation: its count is the first read-back
GPU_LENET = ["--train-samples", "64", "--test-samples", "20", "--batch-size", "32", "--epochs", "1", "--data-dir", DATA]
GPU_PAGES = [   # (page, GPUs, flags): each page with its GPU flags
    (scratch_lenet, 2, GPU_LENET), (scratch_ring, 2, GPU_LENET + ["--devices", "2"]),
    (scratch_ring, 1, GPU_LENET + ["--overlap"]), (scratch_ring, 1, GPU_LENET + ["--zero"]),
    (dp_resnet, 1, GPU_RESNET), (dp_resnet, 2, GPU_RESNET + ["--amp", "--channels-last"]),
    (ddp_toy, 1, ["--epochs", "1", "--train-samples", "96", "--test-samples", "20"]),
    (ddp_resnet, 1, GPU_RESNET), (ddp_resnet, 1, GPU_RESNET + ["--amp", "--channels-last", "--accum-steps", "2"]),
    (fsdp_resnet, 1, GPU_RESNET + ["--amp", "--channels-last"]),
    (diloco_resnet, 1, GPU_RESNET + ["--amp", "--channels-last", "--local-steps", "2"]),
    (diloco_resnet, 1, GPU_RESNET + ["--local-steps", "2", "--fragments", "2", "--sync-delay", "0"])]


@pytest.mark.parametrize("page, gpus, flags", GPU_PAGES, ids=[
    " ".join([page.__name__, f"{gpus}gpu"] + [f for f in flags if f.startswith("--") and f not in GPU_RESNET])
    for page, gpus, flags in GPU_PAGES])
def test_each_page_runs_on_the_gpu_up_to_its_first_read_back(page, gpus, flags, monkeypatch, tmp_path):
    """The page's own main(), as on a machine with `gpus` GPUs (tests/as_on_a_gpu.py): its loader, loop, steps, sums,
    collectives and evaluation forwards all run on the "GPU", so the first thing that fails is the read-back of the
    evaluation's sums, which meta cannot give. A batch left on the CPU, a count made there, a CPU tensor handed to
    NCCL fail earlier, naming the op. It cannot see a cuda:0/cuda:1 mix-up (one meta device stands for all), the
    page's branches on `device.type == "cuda"` (they take their CPU side), CUDA's autocast rules, anything between
    processes (one process: no ring's send/recv, no `world_size > 1` path), or what comes after the first evaluation
    (checkpoints, --resume, the outputs); ft_ddp_resnet.py trains on CPUs by design and is not here."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    if page not in (scratch_lenet, dp_resnet):   # one rank of a launcher, its own port
        for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                                MASTER_ADDR="127.0.0.1", MASTER_PORT="0").items():
            monkeypatch.setenv(name, value)
    with as_on_a_gpu(monkeypatch, gpus) as collectives:
        with pytest.raises((RuntimeError, NotImplementedError)) as failed:
            page.main(flags + ["--out", str(tmp_path)])
    stack = "".join(traceback.format_exception(failed.value))[-3000:]
    frames = traceback.extract_tb(failed.value.__traceback__)
    ours = [frame for frame in frames if os.path.dirname(frame.filename) == HERE]   # the pages' and common.py's
    assert re.search(READ_BACK, str(failed.value)), stack
    assert (os.path.basename(ours[-1].filename), ours[-1].name, ours[-1].line) == (
        "common.py", "total", "return dict(zip(self, values.tolist()))"), stack
    assert (os.path.basename(ours[-2].filename), ours[-2].name) == (f"{page.__name__}.py", "evaluate"), stack
    if page in (ddp_resnet, fsdp_resnet, diloco_resnet):   # the epoch's sums and BatchNorm's buffers, handed to NCCL
        assert {"all_reduce", "broadcast"} <= set(collectives.calls), collectives.calls


# What a page calls on torch.distributed that waits for the other ranks (unless handed async_op=True).
BLOCKING = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "broadcast_object_list",
            "send", "recv")


@pytest.mark.parametrize("page, flags, waits", [
    (ddp_resnet, ["--clip-grad-norm", "1", "--accum-steps", "2"], [[], [], []]), (fsdp_resnet, [], [[], [], []]),
    (diloco_resnet, ["--local-steps", "4", "--clip-grad-norm", "1"], [[], [], []]),
    (diloco_resnet, ["--local-steps", "4", "--fragments", "2", "--sync-delay", "1"], [[], ["broadcast"], []])],
    ids=["ddp_resnet", "fsdp_resnet", "diloco_resnet", "streaming diloco_resnet"])
def test_an_ordinary_step_waits_for_no_other_rank_and_reads_nothing_back(page, flags, waits, monkeypatch, tmp_path):
    """The page's own main() as on a GPU (tests/as_on_a_gpu.py), 4 steps in its epoch: between steps 1 and 2, 2
    and 3, 3 and 4, the page and common.py call no collective that waits for the other ranks (the stop vote
    starts without waiting, and is read a step later), and no step reads anything back from the GPU (meta
    cannot: the first read-back, the evaluation's, is where the run fails). The epoch's last step may wait:
    the evaluation follows. Torch's own collectives inside DDP and FSDP are the approach's, not counted.
    --print-every 0: no progress line, which would read the sums back. Every step's draws are seeded, DDP keeps
    BatchNorm's statistics of its first micro-batch (--accum-steps 2), and with --clip-grad-norm (DDP, DiLoCo)
    the norm and the clipping stay on the GPU. (FSDP clips sharded gradients, DTensors, which the harness's
    stand-in for fully_shard does not make.) Streaming DiLoCo, a fragment sent a step ahead of its outer step (after
    steps 1 and 3), waits only at step 2, the outer step, for rank 0's BatchNorm statistics."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    events = []
    real_step = page.train_step
    def train_step(*args, **kwargs):
        real_step(*args, **kwargs)
        events.append("step")
    monkeypatch.setattr(page, "train_step", train_step)
    with as_on_a_gpu(monkeypatch, 1):
        for name in BLOCKING:   # after the harness's own patches: these see every call the page makes
            def counted(*args, real=getattr(dist, name), name=name, **kwargs):
                if not kwargs.get("async_op") and os.path.dirname(sys._getframe(1).f_code.co_filename) == HERE:
                    events.append(name)
                return real(*args, **kwargs)
            monkeypatch.setattr(dist, name, counted)
        with pytest.raises((RuntimeError, NotImplementedError)) as failed:
            page.main(["--train-samples", "64", "--test-samples", "20", "--batch-size", "16", "--epochs", "1",
                       "--print-every", "0", "--data-dir", DATA, "--out", str(tmp_path)] + flags)
    frames = [f for f in traceback.extract_tb(failed.value.__traceback__) if os.path.dirname(f.filename) == HERE]
    assert re.search(READ_BACK, str(failed.value)) and frames[-2].name == "evaluate", failed.value
    steps = [i for i, event in enumerate(events) if event == "step"]
    assert len(steps) == 4, events
    between = [sorted(set(events[a + 1:b])) for a, b in zip(steps, steps[1:])]
    assert between == waits, events


def test_dataparallel_amp_is_bfloat16_in_every_replica_thread():
    """DataParallel runs each replica in a thread of its own and opens autocast there without a dtype: a
    thread reads the device's default, CUDA's float16. dp_resnet's wrapped forward opens bfloat16 itself."""
    net, dtypes = torch.nn.Linear(4, 3), {}
    def replica_thread(amp):
        torch.set_autocast_dtype("cpu", torch.float16)   # what such a thread reads on CUDA
        with torch.autocast("cpu"):   # as DataParallel's parallel_apply opens it
            dtypes[amp] = dp_resnet.Autocast(net, amp)(torch.randn(2, 4)).dtype
    for amp in (True, False):
        thread = threading.Thread(target=replica_thread, args=(amp,))
        thread.start()
        thread.join()
    assert dtypes == {True: torch.bfloat16, False: torch.float32}


# ---------------------------------------------------------------- scratch_lenet.py: replicas in one process
def test_allreduce_leaves_the_sum_in_every_replica():
    grads = [torch.full((3, 2), float(i)) for i in (1, 2, 3)]
    originals = list(grads)
    scratch_lenet.allreduce(grads)
    for g, original in zip(grads, originals):
        assert g is original and torch.equal(g, torch.full((3, 2), 6.0))


def test_step_equals_single_device_gradient_step():
    torch.manual_seed(0)
    X, y = torch.randn(10, 1, 28, 28), torch.randint(0, 10, (10,))
    start = scratch_lenet.init_params(0)
    reference = [p.clone().requires_grad_() for p in start]
    torch.nn.functional.cross_entropy(scratch_lenet.lenet(X, reference), y).backward()
    replicas = [scratch_lenet.get_params(start, "cpu") for _ in range(3)]
    velocities = [[torch.zeros_like(p) for p in W] for W in replicas]
    scratch_lenet.train_batch(X, y, replicas, velocities, ["cpu"] * 3, lr=0.5, global_batch=10)
    for i, p in enumerate(reference):
        for W in replicas:
            assert torch.allclose(W[i], p - 0.5 * p.grad, atol=1e-6)


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_scratch_replicas_end_with_one_device_weights(replicas, scratch_one_replica, tmp_path):
    out = str(tmp_path)
    final = scratch_lenet.main(SMALL + ["--devices", str(replicas), "--max-steps", "6",
                                        "--batch-size", "96", "--out", out])
    assert_same_weights(load_model(out), scratch_one_replica)
    for W in final[1:]:   # the replicas never drift apart
        assert all(torch.equal(a, b) for a, b in zip(W, final[0]))
    sent = json.load(open(tmp_path / "metrics.json"))["sent_bytes_per_step"]
    assert sent == 4 * LENET_PARAMS   # its gradient, each step


def test_both_layouts_train_alike(scratch_one_replica, tmp_path):
    # The default keeps the conv weights (and so the activations) channels_last; NCHW is the same math.
    final = scratch_lenet.main(SMALL + ["--devices", "2", "--max-steps", "6", "--batch-size", "96",
                                        "--no-channels-last", "--out", str(tmp_path)])
    assert not final[0][2].is_contiguous(memory_format=torch.channels_last)
    assert_same_weights(load_model(tmp_path), scratch_one_replica)
    assert scratch_lenet.parse_args([]).channels_last   # the fixture's run used channels_last


def test_replicas_compute_at_the_same_time(monkeypatch):
    # Each replica's step waits at a barrier for the others: if they took turns, the first would
    # wait alone and the barrier would break.
    barrier, threads = threading.Barrier(3, timeout=60), set()
    def replica_step(*args):
        threads.add(threading.get_ident())
        barrier.wait()
        return real_step(*args)
    real_step = scratch_lenet.replica_step
    monkeypatch.setattr(scratch_lenet, "replica_step", replica_step)
    X, y = torch.randn(9, 1, 28, 28), torch.randint(0, 10, (9,))
    replicas = [scratch_lenet.get_params(scratch_lenet.init_params(0), "cpu") for _ in range(3)]
    velocities = [[torch.zeros_like(p) for p in W] for W in replicas]
    scratch_lenet.train_batch(X, y, replicas, velocities, ["cpu"] * 3, lr=0.1, global_batch=9)
    assert len(threads) == 3 and threading.get_ident() not in threads


@pytest.mark.parametrize("script, flags, message", [
    (scratch_lenet, ["--devices", "0"], "error: argument --devices: must be positive, got 0"),
    (scratch_lenet, ["--batch-size", "0"], "error: argument --batch-size: must be positive, got 0"),
    (scratch_lenet, ["--devices", "3", "--batch-size", "2"], "error: --batch-size 2 is smaller than the 3 replicas"),
    (scratch_lenet, ["--lr", "-1"], "error: argument --lr: must be positive, got -1"),
    (scratch_lenet, ["--epochs", "0"], "error: argument --epochs: must be positive, got 0"),
    (scratch_lenet, ["--max-steps", "-3"], "error: argument --max-steps: must be positive, got -3"),
    (scratch_lenet, ["--overlap"], "error: unrecognized arguments: --overlap"),   # scratch_ring.py's
    (scratch_ring, ["--overlap", "--zero"], "error: --overlap and --zero: choose one"),
    (scratch_ring, ["--bucket-kb", "0"], "error: argument --bucket-kb: must be positive, got 0"),
    (ddp_resnet, ["--epochs", "abc"], "error: argument --epochs: invalid int value: 'abc'"),
    (ddp_resnet, ["--lr", "fast"], "error: argument --lr: invalid float value: 'fast'"),
    (ddp_resnet, ["--label-smoothing", "1.5"], "error: argument --label-smoothing: must be at most 1, got 1.5"),
])
def test_bad_flags_give_argparse_errors(script, flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_scratch_lenet_under_torchrun_points_to_scratch_ring():
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "scratch_lenet.py"])
    assert result.returncode != 0
    said = "scratch_lenet.py runs its replicas in one process; under torchrun run scratch_ring.py"
    assert result.stderr.count(said) == 1, result.stderr[-3000:]   # local rank 0 alone says it
    assert not re.search(r"\[rank\d+\]: Traceback", result.stderr)


# ---------------------------------------------------------------- scratch_ring.py: the ring between processes
def test_ring_allreduce_equals_all_reduce():
    """3 ranks: chunks of unequal sizes (2 ranks train like one device in the tests below)."""
    result = run(["torchrun", "--standalone", "--nproc_per_node=3", "tests/torchrun_checks.py", "ring-check"])
    assert_ok(result)
    assert result.stdout.count("ring ok") == 3


@pytest.mark.parametrize("nproc", [2, 3])
def test_scratch_under_torchrun_matches_one_process(nproc, scratch_one_replica, tmp_path):
    result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "scratch_ring.py"] + SMALL +
                 ["--max-steps", "6", "--batch-size", "96", "--out", str(tmp_path)])
    assert_ok(result)
    assert_same_weights(load_model(tmp_path), scratch_one_replica)
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert metrics["world_size"] == nproc and metrics["backend"] == "gloo send/recv"
    # each process sends 2(W-1) chunks of 1/W of the gradients per step (chunks differ by <= 1 float)
    ring = 2 * (nproc - 1) / nproc * 4 * LENET_PARAMS
    assert abs(metrics["sent_bytes_per_step"] - ring) <= 4 * 2 * (nproc - 1)


@pytest.mark.parametrize("flag", [None, "--overlap", "--zero"])
def test_hierarchical_overlap_and_zero_train_like_one_device(flag, scratch_one_replica, tmp_path):
    """2 processes x 2 replicas is 4 replicas; --overlap (one bucket per layer) and --zero only
    move when and where the sums and updates happen: the weights stay those of one device. The sum
    inside a process comes first. (At 3 processes, whose chunks are unequal: tests/test_options.py.)"""
    scratch_ring_trains_like_one_device(2, 2, flag, scratch_one_replica, tmp_path)


def test_overlap_sends_before_backward_ends():
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "tests/torchrun_checks.py", "overlap-order"])
    assert_ok(result)
    assert result.stdout.count("overlap ok") == 2, result.stdout


# ---------------------------------------------------------------- ddp_toy.py
@pytest.mark.parametrize("launch", [["python", "ddp_toy.py", "--world-size", "2"],
                                    ["torchrun", "--standalone", "--nproc_per_node=2", "ddp_toy.py"]])
def test_ddp_toy_any_world_size_trains_like_one_rank(launch, toy_one_rank, tmp_path):
    """2 ranks (1: the fixture; 3: the test below); each epoch's evaluation counts the 301 test images once, the test
    loss one process's on the same weights."""
    result = run(launch + ["--out", str(tmp_path)] + TOY)
    assert_ok(result)
    assert_same_weights(load_model(tmp_path), toy_one_rank)
    assert_toy_evaluated_once(tmp_path, toy_one_rank)
    assert [line.split()[:2] for line in result.stdout.splitlines() if line.startswith("epoch")] == [
        ["epoch", "1"], ["epoch", "2"], ["epoch", "3"]]   # rank 0 alone prints


def test_ddp_toy_accuracy_is_over_the_whole_test_set(toy_one_rank, tmp_path):
    """World size 3 (the third of test_ddp_toy_any_world_size_trains_like_one_rank's sizes): one process's accuracy
    and test loss on the same weights, each test image counted once (every rank evaluating all 301 would count 903,
    at the same accuracy and loss)."""
    result = run(["python", "ddp_toy.py", "--world-size", "3", "--out", str(tmp_path)] + TOY)
    assert_ok(result)
    assert_same_weights(load_model(tmp_path), toy_one_rank)
    assert_toy_evaluated_once(tmp_path, toy_one_rank)


def test_sampler_order_changes_each_epoch_and_shards_partition_the_data():
    X, y = ddp_toy.toy_data(600, seed=1)
    loaders = [ddp_toy.train_loader(X, y, 25, rank, 3, seed=0) for rank in range(3)]
    orders = {}
    for epoch in (1, 2):
        for rank, loader in enumerate(loaders):
            loader.sampler.set_epoch(epoch)
            orders[epoch, rank] = list(loader.sampler)
        everything = sum((orders[epoch, r] for r in range(3)), [])
        assert sorted(everything) == list(range(600))   # disjoint, and together the whole set
    for rank in range(3):
        assert orders[1, rank] != orders[2, rank]


def test_ddp_toy_calls_set_epoch_every_epoch(monkeypatch, tmp_path):
    seen = []
    original = torch.utils.data.DistributedSampler.set_epoch
    monkeypatch.setattr(torch.utils.data.DistributedSampler, "set_epoch",
                        lambda self, epoch: (seen.append(epoch), original(self, epoch)))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    ddp_toy.main(TOY + ["--out", str(tmp_path)])
    assert seen == [1, 2, 3]


def test_more_ranks_than_gpus_is_refused_before_nccl(monkeypatch):
    """The scripts' own set-up refuses before init_process_group: a CUDA machine with too few GPUs."""
    pretend_gpus(monkeypatch, 1, 2)
    with pytest.raises(SystemExit) as exit_info:
        ddp_toy.main([])
    assert "2 processes x 1 GPUs on this node, which has 1;" in str(exit_info.value.code)
    assert "let them share: --backend gloo" in str(exit_info.value.code)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(SystemExit) as exit_info:
        scratch_ring.main(["--devices", "2"])
    assert "2 processes x 2 GPUs on this node, which has 3;" in str(exit_info.value.code)


def pretend_gpus(monkeypatch, count, ranks_here):
    """A CUDA machine with `count` GPUs as the scripts' set-up sees it, and this process one of `ranks_here`."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)   # every process sees all of them
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("the group was formed"))
    for name, value in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE=str(ranks_here),
                            LOCAL_WORLD_SIZE=str(ranks_here)).items():
        monkeypatch.setenv(name, value)


def test_a_launcher_that_shows_each_process_its_own_gpus_is_taken_at_its_word(monkeypatch):
    """srun --gpus-per-task starts several processes on a node and shows each its own GPUs alone, numbered from 0
    (CUDA_VISIBLE_DEVICES differs per process): local rank 1 of 2 takes the one it sees, over NCCL, as does scratch_ring
    with 2 GPUs each. Without CUDA_VISIBLE_DEVICES the same count is a node with too few GPUs (refused: test above)."""
    pretend_gpus(monkeypatch, 1, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert common.pick_device("nccl") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert common.pick_device("nccl", gpus_each=2) == torch.device("cuda", 0)
    monkeypatch.setattr(common, "attempt_store", lambda: None)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    def init_process_group(backend, device_id=None, **options):
        raise Formed(device_id)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    with pytest.raises(Formed, match="^cuda:0$"):   # not refused: its group forms on cuda:0
        scratch_ring.main(["--devices", "2"])


def test_gloo_shares_a_gpu_where_it_can_and_says_where_it_cannot(monkeypatch):
    """--backend gloo puts two ranks on one GPU (NCCL refuses that); scratch_ring's send/recv and FSDP2 do not
    run over gloo with CUDA tensors: each says so before the group forms."""
    pretend_gpus(monkeypatch, 1, 2)
    assert common.pick_device("gloo") == torch.device("cuda", 0)
    assert common.pick_device("gloo", cuda=False) == torch.device("cpu")
    for script, says in ((scratch_ring, "gloo cannot send CUDA tensors point to point"),
                         (fsdp_resnet, "FSDP2 over gloo crashes with CUDA tensors")):
        with pytest.raises(SystemExit) as exit_info:
            script.main(["--backend", "gloo"])
        assert says in str(exit_info.value.code) and "--backend nccl" in str(exit_info.value.code)


def test_nccl_without_gpus_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("the group was formed"))
    with pytest.raises(SystemExit) as exit_info:
        common.pick_device("nccl", cuda=False)
    assert "--backend nccl needs GPUs, and this machine has none" in str(exit_info.value.code)


# ---------------------------------------------------------------- ddp_resnet.py and dp_resnet.py
@pytest.mark.parametrize("nproc", [1, 2])
def test_ddp_resnet_step_is_the_per_shard_batchnorm_step(nproc, resnet_tolerance, tmp_path):
    """The reference's weights. The bytes reported are the script's formula, restated here, not a count (DDP's reducer
    calls its allreduce from C++, out of Python's sight): every parameter's gradient once a step; one rank, none."""
    result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "ddp_resnet.py"] + RESNET +
                 ["--out", str(tmp_path)])
    assert_ok(result)
    assert_same_weights(load_model(tmp_path), resnet_reference(nproc), tol=resnet_tolerance)
    sent = json.load(open(tmp_path / "metrics.json"))["sent_bytes_by_collective"]
    expected = RESNET_BYTES if nproc > 1 else 0
    assert sent == ({f"all_reduce ({nproc} ranks)": RESNET_BYTES} if nproc > 1 else {})
    assert f"{expected / 1e6:.3g} MB to collectives per step and rank" in result.stdout


PROGRESS = re.compile(r"^  step +(\d+)/(\d+)  epoch (\d+)  loss (\d\.\d{4})  acc (\d\.\d{4})  lr \S+  [\d,]+ samples/s  "
                      r"\d+:\d\d spent, \d+:\d\d left$", re.M)


def test_progress_lines_come_at_the_steps_asked_from_rank_0_alone(tmp_path):
    """2 ranks, 2 epochs of 6 steps. --print-every 3: lines after steps 3, 6 and 9 (12, the last, ends with its epoch
    line), each once: the step of the run's 12, the epoch, the epoch's loss and accuracy so far over all ranks, the
    learning rate, samples/s, the time spent and left. --print-every 1s: rank 0's clock, which the stop vote carries
    to rank 1, so both sum their sums at the same step: lines at steps rising, each once."""
    torchrun = ["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py"] + TWO_EPOCHS
    result = run(torchrun + ["--print-every", "3", "--out", str(tmp_path / "steps")])
    assert_ok(result)
    assert [line[:3] for line in PROGRESS.findall(result.stdout)] == [
        ("3", "12", "1"), ("6", "12", "1"), ("9", "12", "2")], result.stdout
    result = run(torchrun + ["--print-every", "1s", "--out", str(tmp_path / "seconds")])
    assert_ok(result)
    steps = [int(line[0]) for line in PROGRESS.findall(result.stdout)]
    assert steps and steps == sorted(set(steps)) and max(steps) < 12, result.stdout


def residual_bn_weights(net):   # each residual block's last BatchNorm's weights (ResNet-18's blocks: bn2)
    return [block.bn2.weight for block in net.modules() if isinstance(block, torchvision.models.resnet.BasicBlock)]


def test_the_large_batch_recipe_flags_reach_the_optimizer_the_model_and_the_loss(monkeypatch, tmp_path):
    """One step of ddp_resnet.main() with --nesterov --label-smoothing 0.1 --zero-init-residual: SGD's groups are
    Nesterov's; each residual block's last BatchNorm weight starts at 0 (torchvision's zero_init_residual); the loss
    is cross-entropy against smoothed targets, (1 - 0.1) x -log p(true class) + 0.1 x the mean of -log p over the
    classes, and it is the training loss reported."""
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="0").items():
        monkeypatch.setenv(name, value)
    made, losses = {}, []
    def resnet(*args, **kwargs):
        made["net"] = net = real_resnet(*args, **kwargs)
        made["bn"] = [w.detach().clone() for w in residual_bn_weights(net)]   # as made, before any step
        return net
    def make_optimizer(*args, **kwargs):
        made["optimizer"], scheduler = real_make_optimizer(*args, **kwargs)
        return made["optimizer"], scheduler
    def cross_entropy(logits, y, **kwargs):
        loss = real_cross_entropy(logits, y, **kwargs)
        if "reduction" not in kwargs:   # the training's loss; the evaluation's test loss sums
            losses.append((logits.detach(), y, loss.detach()))
        return loss
    real_resnet, real_make_optimizer, real_cross_entropy = common.classifier, ddp_resnet.make_optimizer, F.cross_entropy
    monkeypatch.setattr(common, "classifier", resnet)
    monkeypatch.setattr(ddp_resnet, "make_optimizer", make_optimizer)
    monkeypatch.setattr(F, "cross_entropy", cross_entropy)
    ddp_resnet.main(RESNET + ["--max-steps", "1", "--nesterov", "--label-smoothing", "0.1", "--zero-init-residual",
                              "--out", str(tmp_path)])
    assert len(made["bn"]) == 8 and all((w == 0).all() for w in made["bn"])
    assert [group["nesterov"] for group in made["optimizer"].param_groups] == [True, True]
    (logits, y, loss), = losses
    log_p = logits.float().log_softmax(1)
    smoothed = 0.9 * -log_p[torch.arange(len(y)), y].mean() + 0.1 * -log_p.mean(1).mean()
    assert torch.allclose(loss, smoothed, atol=1e-6)
    assert not torch.allclose(loss, -log_p[torch.arange(len(y)), y].mean(), atol=1e-3)   # not the plain loss
    assert json.load(open(tmp_path / "metrics.json"))["epochs"][0]["train_loss"] == pytest.approx(loss.item())


def test_the_large_batch_recipe_is_off_by_default_and_zero_init_changes_only_the_residual_batchnorms():
    args = ddp_resnet.parse_args([])
    assert (args.nesterov, args.label_smoothing, args.zero_init_residual) == (False, 0.0, False)
    plain = fashion_resnet(0)
    torch.manual_seed(0)
    zeroed = common.classifier("resnet18", 10, channels=1, image_size=28, zero_init_residual=True)
    assert all((w == 1).all() for w in residual_bn_weights(plain))
    optimizer, _ = ddp_resnet.make_optimizer(plain, args, steps_per_epoch=1)
    assert [group["nesterov"] for group in optimizer.param_groups] == [False, False]
    residual = {id(w) for w in residual_bn_weights(zeroed)}
    same = [name for (name, a), b in zip(zeroed.named_parameters(), plain.parameters())
            if id(a) not in residual and torch.equal(a, b)]
    assert len(same) == len(list(plain.parameters())) - 8   # the same seed: every other weight as without it


def test_dataparallel_step_equals_ddp_resnet_step(resnet_tolerance, tmp_path):
    """One step of dp_resnet.py on one device is the step of one DDP rank (the reference, which
    ddp_resnet.py computes: test above), with the same flags: --lr is for 256 samples in both. On a
    CPU, DataParallel with no GPUs calls the module itself: this proves the page's step and recipe,
    not the split of the batch over devices."""
    result = run(["python", "dp_resnet.py"] + RESNET + ["--max-steps", "1", "--out", str(tmp_path)])
    assert_ok(result)
    assert "DataParallel runs the model on the CPU" in result.stdout
    assert json.load(open(tmp_path / "metrics.json"))["sent_bytes_per_step"] == 0   # one device: nothing moves
    assert_same_weights(load_model(tmp_path), resnet_reference(1, steps=1), tol=resnet_tolerance)


def test_gradient_accumulation_equals_ranks(resnet_tolerance, tmp_path):
    """--accum-steps 2 in one process computes BatchNorm over the same half-batches as 2 ranks,
    so it must end with their weights: the 2-shard reference's, which 2 ranks reach (test above).
    And with their running statistics, rank 0's: micro-batch 0 alone moves them here."""
    accum = run(["python", "ddp_resnet.py"] + RESNET + ["--accum-steps", "2", "--out", str(tmp_path)])
    assert_ok(accum)
    assert_same_weights(load_model(tmp_path), resnet_reference(2), tol=resnet_tolerance)


# ---------------------------------------------------------------- fsdp_resnet.py
@pytest.mark.parametrize("nproc, steps", [(2, 2), (3, 1)])
def test_fsdp_resnet_trains_like_ddp_resnet_with_a_shard_of_the_memory(nproc, steps, resnet_tolerance, tmp_path):
    """Same seed and global batch: DDP's weights (the reference, which ddp_resnet.py computes: test
    above; at 3 ranks after one step: in the first steps of a ResNet, the other summation order of
    a reduce-scatter grows from 1e-7 to 4e-5 by the second), and one process's accuracy and test
    loss on them. Each rank holds 1/W of the parameters, gradients and momentum."""
    flags = RESNET + ["--batch-size", "12", "--max-steps", str(steps)]
    fsdp = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "fsdp_resnet.py"] + flags +
               ["--out", str(tmp_path / "fsdp")])
    assert_ok(fsdp)
    reference = resnet_reference(nproc, steps=steps, lr=RESNET_LR * 12 / 256, batch_size=12)
    assert_same_weights(load_model(tmp_path / "fsdp"), reference, tol=resnet_tolerance)
    metrics = json.load(open(tmp_path / "fsdp" / "metrics.json"))
    net = fashion_resnet(0)
    net.load_state_dict(load_model(tmp_path / "fsdp"))
    _, test_set, _ = common.fashion_mnist(DATA, 64, 101)
    X, y = test_set.tensors
    logits = net.eval()(X).detach()
    correct, count, loss = (logits.argmax(1) == y).sum().item(), len(y), F.cross_entropy(logits, y).item()
    assert metrics["test_acc"] == correct / count and metrics["epochs"][-1]["test_count"] == count == 101
    assert metrics["epochs"][-1]["test_loss"] == pytest.approx(loss, rel=1e-6), loss   # float32 sums, another order
    held = metrics["bytes_per_rank"]
    assert len(held) == nproc
    for kind in ("params", "grads", "optimizer_state"):
        assert sum(h[kind] for h in held) == RESNET_BYTES   # the shards are the model, once
        assert max(h[kind] for h in held) <= RESNET_BYTES / nproc * 1.01   # each about 1/W of it
    assert f"per rank: {held[0]['params'] / 1e6:.1f} MB parameters" in fsdp.stdout
    # gradients: all of them go into the reduce-scatter (each padded to rows divisible by W: +0.4%
    # at 3 ranks); parameters: each rank's shard into an all-gather before forward, and again
    # before backward for all but the root
    sent = metrics["sent_bytes_by_collective"]
    assert RESNET_BYTES <= sent[f"reduce_scatter ({nproc} ranks)"] <= RESNET_BYTES * 1.01
    assert RESNET_BYTES / nproc < sent[f"all_gather ({nproc} ranks)"] <= 2 * RESNET_BYTES / nproc * 1.01


# ---------------------------------------------------------------- every script's command line
@pytest.mark.parametrize("script", [ddp_toy, ddp_resnet, dp_resnet, fsdp_resnet])
@pytest.mark.parametrize("flag", ["--epochs", "--max-steps", "--batch-size", "--lr"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_zero_or_negative_numbers_are_refused(script, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args([flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be positive, got {value}" in capsys.readouterr().err


# Every float flag of every page, read from its parser, with the flags the parser requires.
JOIN, SERVE = ["--join", "127.0.0.1:1"], ["--serve", "127.0.0.1:1"]
FLOAT_FLAGS = ([(ddp_resnet, [], f) for f in ("--lr", "--warmup-epochs", "--label-smoothing", "--weight-decay")] +
               [(fsdp_resnet, [], f) for f in ("--lr", "--warmup-epochs", "--weight-decay")] +
               [(diloco_resnet, [], f) for f in ("--lr", "--warmup-epochs", "--weight-decay", "--outer-lr",
                                                 "--outer-momentum")] +
               [(dp_resnet, [], "--lr"), (ddp_toy, [], "--lr"), (scratch_lenet, [], "--lr"),
                (scratch_ring, [], "--lr"), (scratch_ring, [], "--bucket-kb")] +
               [(ft, JOIN, f) for f in ("--lr", "--weight-decay", "--init-timeout")] +
               [(ft, SERVE, "--member-timeout")])


@pytest.mark.parametrize("script, required, flag", FLOAT_FLAGS, ids=[s.__name__ + f for s, _, f in FLOAT_FLAGS])
def test_numbers_that_are_not_finite_are_refused(script, required, flag, capsys):
    """nan passes every comparison with 0 (a run would train on NaNs) and inf overflows (the warm-up's
    steps): each is refused as the flags are read, with -inf; a finite number still parses."""
    for value in ("nan", "inf", "-inf"):
        with pytest.raises(SystemExit) as exit_info:
            script.parse_args(required + [f"{flag}={value}"])
        assert exit_info.value.code == 2
        assert f"argument {flag}: must be a finite number, got {value}" in capsys.readouterr().err
    args = script.parse_args(required + [flag, "0.5"])
    assert getattr(args, flag[2:].replace("-", "_")) == 0.5



# ---------------------------------------------------------------- each script copied with only what it imports
SCRIPTS = ("scratch_lenet", "scratch_ring", "ddp_toy", "dp_resnet", "ddp_resnet", "fsdp_resnet", "diloco_resnet",
           "ft_ddp_resnet")


@pytest.mark.parametrize("script, flags", [
    ("scratch_lenet", SMALL + ["--max-steps", "2"]), ("scratch_ring", SMALL + ["--max-steps", "2"]),
    ("ddp_toy", ["--world-size", "1", "--epochs", "1", "--train-samples", "200", "--test-samples", "50"]),
    ("dp_resnet", RESNET + ["--max-steps", "1"]), ("ddp_resnet", RESNET + ["--max-steps", "1"]),
    ("fsdp_resnet", RESNET + ["--max-steps", "1"]), ("diloco_resnet", RESNET + ["--max-steps", "1"]),
    ("ft_ddp_resnet", RESNET + ["--max-steps", "1", "--micro-batch", "8", "--join"])])
def test_each_script_runs_copied_with_only_the_files_it_imports(script, flags, tmp_path):
    """What a user copies into their job: the script, common.py and the modules its import lines
    name (each named for what it gives). Run from that folder alone, it trains and writes its files."""
    files = copy_set(script)
    assert "common" in files and set(files) <= set(SCRIPTS) | {"common"}, files
    for name in files:
        shutil.copy(os.path.join(HERE, name + ".py"), tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if flags[-1] == "--join":   # a member of a run: its coordinator first, from the same folder
        flags = flags + [f"127.0.0.1:{free_port()}"]
        coordinator = subprocess.Popen([sys.executable, f"{script}.py", "--serve", flags[-1]], cwd=tmp_path, env=env,
                                       stdout=subprocess.DEVNULL)
    result = subprocess.run([sys.executable, f"{script}.py", "--out", "out"] + flags, cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    if flags[-2] == "--join":
        assert coordinator.wait(timeout=30) == 0   # the run is over: the coordinator ends by itself
    assert_ok(result)
    assert {"metrics.json", "model.pt", "curves.png"} <= set(os.listdir(tmp_path / "out")), result.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_is_copied_with_common_alone(script):
    """Standalone: a script imports nothing of ours but common.py (scratch_ring.py builds on
    scratch_lenet.py, the lesson it carries across processes); no line over 120 characters."""
    assert copy_set(script) == sorted({"common", script} | ({"scratch_lenet"} if script == "scratch_ring" else set()))
    for name in copy_set(script):
        long = [n for n, line in enumerate(open(os.path.join(HERE, name + ".py")), 1) if len(line.rstrip("\n")) > 120]
        assert long == [], f"{name}.py: lines over 120 characters: {long}"


# ---------------------------------------------------------------- ft_ddp_resnet.py: the coordinator's decisions
# Pure functions of its state (who stalled, commit or not, the next quorum, who joins, when the run is over), each
# returning its decision and why: no process starts. Beside them what a CPU sees of its step (BatchNorm's momentum,
# the epoch's order drawn once), the store's signed values, the wire's refusals, the coordinator's own flags.
def member(i, since=0.0, request=None):   # a connection that joined
    return ft.Connection(i, f"127.0.0.1:{5000 + i}", since, "", joined=True, request=request)


def vote(step, ok=True, waited=0.0, error=""):
    return {"op": "vote", "step": step, "ok": ok, "next": True, "waited": waited, "error": error}


def ready(step):
    return {"op": "ready", "step": step}


def live(*connections):
    return {c.id: c for c in connections}


def test_a_member_that_holds_the_others_up_past_the_timeout_is_stalled_and_only_then():
    run = ft.Run(members=[0, 1])
    waiting = live(member(0, since=10.0, request=vote(3)), member(1, since=9.0))
    assert ft.stalled(13.9, waiting, run, timeout=4) == {}
    assert ft.stalled(14.1, waiting, run, timeout=4) == {1: "no vote and no request for 4 s while the others waited"}
    assert ft.stalled(100.0, live(member(0, since=1.0), member(1, since=1.0)), run, timeout=4) == {}   # none waits
    later = live(member(0, since=10.0, request=vote(3)), member(1, since=12.0))   # it asked after they began to wait
    assert ft.stalled(15.0, later, run, timeout=4) == {}


def test_a_member_its_peers_collective_gave_up_on_is_stalled_once_they_voted():
    gave_up = vote(3, ok=False, waited=3.9, error="Connection closed by peer")
    run = ft.Run(members=[0, 1, 2])
    peers = live(member(0, since=10.0, request=gave_up), member(1, since=10.0, request=gave_up), member(2, since=6.0))
    assert ft.stalled(10.2, peers, run, timeout=4) == {}   # those whose collective failed with it vote soon
    assert ft.stalled(10.3, peers, run, timeout=4) == {2: "its peers' collective waited 4 s for it"}
    quick = vote(3, ok=False, waited=0.1, error="Connection reset by peer")   # a death: no one waited for it
    assert ft.stalled(10.3, live(member(0, since=10.0, request=quick), member(2, since=6.0)), run, timeout=4) == {}
    other = ft.Run(members=[0, 1])   # not of the generation: not held to its vote
    assert ft.stalled(10.3, live(member(0, since=10.0, request=gave_up), member(2, since=9.0)), other, 4) == {}


def test_a_step_is_committed_when_all_its_members_voted_yes_for_it_and_by_none_otherwise():
    run = ft.Run(members=[0, 1, 2])
    assert ft.commit_or_not(live(member(0, request=vote(5)), member(1, request=vote(5)), member(2)), run) == (
        None, "waiting for the votes of members [2]")
    assert ft.commit_or_not(live(*[member(i, request=vote(5)) for i in range(3)]), run) == (
        True, "members [0, 1, 2] voted yes for step 5")
    broken = vote(5, ok=False, error="Connection reset by peer")
    assert ft.commit_or_not(live(member(0, request=vote(5)), member(1, request=broken), member(2, request=vote(5))),
                            run) == (False, "member 1: Connection reset by peer")
    assert ft.commit_or_not(live(member(0, request=vote(5)), member(1, request=vote(5))), run) == (
        False, "member 2 is gone")
    assert ft.commit_or_not(live(member(0, request=vote(5)), member(1, request=vote(5)), member(2, request=vote(4))),
                            run) == (False, "votes for steps [4, 5]")
    asked = live(*[member(i, request=ready(6)) for i in range(3)])   # the verdict was given: they ask for the next
    assert ft.commit_or_not(asked, run)[0] is None


def test_the_next_quorum_waits_for_every_live_member_and_the_first_for_min_members():
    first = ft.Run(flags={"min_members": 3})
    two = live(member(0, request=ready(0)), member(1, request=ready(0)))
    assert ft.next_quorum(two, first) == (None, "members [0, 1] asked; waiting for all 3")
    three = live(member(0, request=ready(0)), member(1, request=ready(0)), member(2))
    assert ft.next_quorum(three, first) == (None, "members [0, 1] asked; waiting for all 3")
    three[2].request = ready(0)
    assert ft.next_quorum(three, first) == ({"gen": 1, "members": [0, 1, 2], "step": 0, "src": None},
                                            "generation 1: members [0, 1, 2]")
    assert ft.next_quorum(live(member(0)), first) == (None, "no member asks")


def test_a_new_generation_comes_with_other_members_or_after_a_failed_step_and_the_member_ahead_sends():
    run = ft.Run(flags={"min_members": 2}, gen=4, members=[0, 2])
    same = live(member(0, request=ready(7)), member(2, request=ready(7)))
    assert ft.next_quorum(same, run)[0] == {"gen": 4, "members": [0, 2], "step": 7, "src": None}
    back = live(member(0, request=ready(7)), member(2, request=ready(7)), member(5, request=ready(3)))
    assert ft.next_quorum(back, run)[0] == {"gen": 5, "members": [0, 2, 5], "step": 7, "src": 0}
    behind = live(member(0, request=ready(3)), member(2, request=ready(7)))
    assert ft.next_quorum(behind, run)[0] == {"gen": 4, "members": [0, 2], "step": 7, "src": 1}
    failed = ft.Run(flags={"min_members": 2}, gen=4, members=[])   # its members left their group
    assert ft.next_quorum(same, failed)[0]["gen"] == 5
    over = ft.Run(flags={"min_members": 2}, gen=4, members=[0, 2], finished=1.0)
    assert ft.next_quorum(same, over) == (None, "the run is over")


FLAGS = {"batch_size": 16, "seed": 0, "final_step": 6, "min_members": 2, "torch": "2.14.1", "threads": 1,
         "data": "labels crc 1"}


def test_a_member_joins_with_the_runs_flags_and_is_told_what_to_match_otherwise():
    run = ft.Run(flags=FLAGS)
    assert ft.admit(run, "r1", {**FLAGS, "min_members": 3}, None) == ("joined", None)   # (the first quorum's)
    assert ft.admit(run, "r1", FLAGS, "r1") == ("joined", None)
    assert ft.admit(run, "r1", {**FLAGS, "batch_size": 32}, None) == (
        "refused", "error: this member differs from the run (batch_size 32 here, 16 in the run): start it with the "
                   "run's training flags")
    verdict, why = ft.admit(run, "r1", {**FLAGS, "threads": 2, "torch": "2.9.0"}, None)
    assert verdict == "refused" and "flags" not in why, why   # neither is a flag: it names what to set
    assert why.endswith("start it with the run's OMP_NUM_THREADS and torch version"), why
    verdict, why = ft.admit(run, "r1", FLAGS, "r0")
    assert verdict == "refused" and why.startswith("error: its checkpoint is of run r0, and this coordinator serves "
                                                   "run r1"), why
    over = ft.Run(flags=FLAGS, step=6, finished=1.0)
    assert ft.admit(over, "r1", FLAGS, None) == ("over", "the run is over: its members finished step 6")
    assert ft.admit(over, "r1", FLAGS, "r1") == ("over", "the run is over: its members finished step 6")
    assert ft.admit(over, "r1", FLAGS, "r0")[0] == "refused"   # another run's member: its run is not over


def coordinator_without_sockets():   # its decisions and its wire, on a socket pair: no port, no store
    coordinator = object.__new__(ft.Coordinator)
    coordinator.secret, coordinator.run_id, coordinator.timeout, coordinator.store_port = b"secret", "r1", 4.0, 1
    coordinator.connections, coordinator.run = {}, ft.Run()
    return coordinator


def joins(coordinator, i, proof, flags=FLAGS, run=None):   # connection i sends a join; what it is answered
    ours, theirs = socket.socketpair()
    c = coordinator.connections[i] = ft.Connection(i, f"127.0.0.1:{5000 + i}", 0.0, f"challenge {i}", ours)
    theirs.sendall(json.dumps({"op": "join", "proof": proof, "challenge": "mine", "flags": flags, "step": 0,
                               "run": run}).encode() + b"\n")
    coordinator.read(c)
    return c, json.loads(theirs.recv(65536).split(b"\n")[0])


def test_a_stranger_ends_only_its_own_connection_and_a_refused_member_sets_nothing_of_the_run():
    coordinator = coordinator_without_sockets()
    stranger, answer = joins(coordinator, 0, "\u00e9" * 64)   # not ASCII: hmac's compare would raise on it as text
    assert answer == {"refused": "FT_SECRET"} and stranger.lost == "refused: it does not know FT_SECRET"
    other_run, answer = joins(coordinator, 1, ft.proof(b"secret", "challenge 1"), {**FLAGS, "batch_size": 32}, "r0")
    assert answer["refused"].startswith("error: its checkpoint is of run r0") and coordinator.run.flags is None
    member_, answer = joins(coordinator, 2, ft.proof(b"secret", "challenge 2"))   # the run's flags: the first admitted's
    assert member_.joined and answer["id"] == 2 and coordinator.run.flags == FLAGS


def test_a_member_stopped_before_its_coordinator_answers_leaves_with_75():
    member_ = object.__new__(ft.Member)
    member_.args = argparse.Namespace(join=("127.0.0.1", free_port()), init_timeout=30.0)   # no one listens there
    member_.stop = {"signal": "SIGTERM", "at": 0.0}
    member_.leave = lambda why, status: sys.exit(f"{status}: {why}")   # the checkpoint aside
    with pytest.raises(SystemExit, match="^75: stopped by SIGTERM while it waited for 127.0.0.1:"):
        member_.join()


def test_the_coordinator_ends_once_the_run_is_over_and_waits_for_a_member_that_may_come_back():
    run = ft.Run(step=6, finished=100.0)
    assert ft.run_over(101.0, ft.Run(), [], timeout=4)[0] is False   # not finished: members may still come
    assert ft.run_over(101.0, run, [member(0)], timeout=4) == (False, "the run goes on")
    assert ft.run_over(101.0, run, [], timeout=4) == (True, "the run is over (step 6)")
    dropped = member(1)   # dropped, still connected: it may wake, 10 x timeout after the end
    dropped.dropped = "no vote and no request for 4 s while the others waited"
    assert ft.run_over(139.0, run, [dropped], timeout=4) == (False, "a member may still wake or come back")
    assert ft.run_over(141.0, run, [dropped], timeout=4)[0] is True
    run.left = 98.0   # one left mid-run (told it was dropped, killed): its loop may bring it back within 10 x timeout
    assert ft.run_over(137.0, run, [], timeout=4) == (False, "a member may still wake or come back")
    assert ft.run_over(139.0, run, [], timeout=4) == (True, "the run is over (step 6)")


# ---------------------------------------------------------------- ft_ddp_resnet.py: its store, its wire, its flags
def test_a_value_in_the_groups_store_counts_only_if_signed_with_the_secret():
    store = torch.distributed.HashStore()
    prefix = ft.generation_prefix(b"secret", "r1", 2)
    assert prefix != ft.generation_prefix(b"secret", "r1", 3) != ft.generation_prefix(b"other", "r1", 3)
    assert len(prefix) == 33 and prefix.endswith("/") and "r1" not in prefix   # nothing a stranger could guess
    signed = ft.SignedStore(store, b"secret", prefix)
    signed.set("0//cpu//0/0", b"10.0.0.1:4242")
    signed.wait(["0//cpu//0/0"])
    assert signed.get("0//cpu//0/0") == b"10.0.0.1:4242"
    store.set(prefix + "0//cpu//0/1", b"10.6.6.6:1")   # a stranger's, under the right key
    with pytest.raises(RuntimeError, match="is not signed with FT_SECRET"):
        signed.get("0//cpu//0/1")
    ft.SignedStore(store, b"other", prefix).set("0//cpu//0/2", b"10.6.6.6:1")   # signed with another secret
    with pytest.raises(RuntimeError, match="is not signed with FT_SECRET"):
        signed.get("0//cpu//0/2")


def test_the_wire_takes_only_messages_of_its_protocol():
    assert ft.parse(b'{"op": "vote", "step": 3, "ok": true, "next": true, "waited": 0, "error": ""}')["step"] == 3
    for line, why in ((b"GET / HTTP/1.0", "not a line of JSON"), (b"[" * 5000, "not a line of JSON"),
                      (b"[]", "not a message of this protocol"), (b'{"op": "ready", "step": 1}',
                                                                  "not a message of this protocol"),
                      (b'{"op": "vote", "step": "3"}', "vote without a proper step, ok, next, waited, error")):
        with pytest.raises(ValueError, match=why.replace("(", r"\(")):
            ft.parse(line)


def test_the_coordinator_takes_only_its_own_flags_and_a_member_not_the_coordinators(capsys):
    args = ft.parse_args(["--serve", "127.0.0.1:29600", "--member-timeout", "3"])
    assert args.member_timeout == 3 and args.store_port is None and "batch_size" not in args
    for argv, flag in ((["--serve", "127.0.0.1:29600", "--batch-size", "32"], "--batch-size 32"),
                       (["--join", "127.0.0.1:29600", "--member-timeout", "3"], "--member-timeout 3")):
        with pytest.raises(SystemExit) as refused:
            ft.parse_args(argv)
        assert refused.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err


# ---------------------------------------------------------------- ft_ddp_resnet.py: what a CPU sees of its step
def test_a_members_step_leaves_batchnorms_momentum_as_it_found_it():
    """Only micro-batch 0 moves the running statistics (the others run at momentum 0): the net a member returns,
    or evaluates, has torch's 0.1 back whichever micro-batches it computed."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Flatten(),
                              torch.nn.Linear(2 * 4 * 4, 10))
    grads = ft.gradients_of(net)
    message = torch.zeros(len(grads) + 4 + 3, dtype=torch.float64)
    X, y = torch.randn(8, 1, 6, 6), torch.arange(8) % 10
    before = net[1].running_mean.clone()
    ft.compute(net, grads, message, X, y, 4, range(1, 2), 0, 0)   # micro-batch 1 alone: statistics untouched
    assert torch.equal(net[1].running_mean, before) and net[1].momentum == 0.1
    ft.compute(net, grads, message, X, y, 4, range(0, 2), 0, 0)
    assert not torch.equal(net[1].running_mean, before) and net[1].momentum == 0.1


def test_what_a_members_micro_batch_draws_is_the_same_whoever_computes_it():
    """A net with dropout: micro-batches 0 to 3 of a step summed by one member, or 0-1 and 2-3 by two members (their
    float64 sums added), or in another order, give the same bits; the next step draws other masks."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 16), torch.nn.Dropout(0.5),
                              torch.nn.Linear(16, 10))
    grads = ft.gradients_of(net)
    X, y = torch.randn(16, 1, 6, 6), torch.arange(16) % 10
    def summed(*shares, step=3):
        total = torch.zeros(len(grads) + 3, dtype=torch.float64)
        for mine in shares:
            message = torch.zeros_like(total)
            ft.compute(net, grads, message, X, y, 4, mine, 7, step)
            total += message
        return total
    alone = summed(range(0, 4))
    assert torch.equal(alone, summed(range(0, 2), range(2, 4))) and torch.equal(alone, summed(range(2, 4), range(0, 2)))
    assert not torch.equal(alone, summed(range(0, 4), step=4))


def test_an_epochs_order_is_drawn_once_and_is_the_other_scripts(monkeypatch):
    sampler = torch.utils.data.DistributedSampler
    draw = sampler.__iter__
    drawn = []

    def counted(self):
        drawn.append(self.epoch)
        return draw(self)
    monkeypatch.setattr(sampler, "__iter__", counted)
    ft.epoch_order.cache_clear()
    for epoch in (1, 2):
        batches = epoch_batches(96, 16, seed=0, epoch=epoch)
        drawn.clear()
        for step in range(6):
            assert torch.equal(ft.epoch_order(96, 0, epoch)[step * 16:][:16], batches[step])
        assert drawn == [epoch], drawn   # once for the 6 steps of the epoch (epoch_batches drew before)
