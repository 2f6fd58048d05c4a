"""Tests for the collection, all on CPU: `bash run_all.sh test` (or `python -m pytest -q test_scripts.py`).

They run the README's commands as written, with small sizes through flags, and compare weights,
accuracies and messages. `python test_scripts.py ring-check` is a helper the tests start under
torchrun."""
import json, os, re, shutil, signal, socket, subprocess, sys, threading, time
import pytest
import torch
import common
import scratch_lenet

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
SMALL = ["--train-samples", "1024", "--test-samples", "300", "--data-dir", DATA]
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}   # downloads fail at once


@pytest.fixture(scope="session", autouse=True)
def fashion_mnist():
    problem = common.prepare_fashion_mnist(DATA)
    assert problem is None, problem


def run(command, *, env=None, timeout=300):
    """Run a README command (small sizes through flags) from the repo root."""
    if command[0] in ("python", "torchrun"):
        command = ([sys.executable] if command[0] == "python" else
                   [sys.executable, "-m", "torch.distributed.run"]) + command[1:]
    return subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def load_model(out):
    return torch.load(os.path.join(out, "model.pt"), map_location="cpu")


def assert_same_weights(a, b, tol=1e-5):
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max().item() <= tol, name

# ---------------------------------------------------------------- common.py
def test_backend_is_nccl_only_with_cuda_on_linux():
    assert common.pick_backend(cuda=True, platform="linux") == "nccl"
    assert common.pick_backend(cuda=True, platform="win32") == "gloo"
    assert common.pick_backend(cuda=False, platform="linux") == "gloo"


def test_progress_counts_down_to_where_this_run_stops(monkeypatch, capsys):
    """ETA to --max-steps (last), at the rate of the batches this run did (after `first`)."""
    clock = iter([100.0, 105.0])
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock))
    progress = common.Progress(epoch=2, batches=100, enabled=True, first=20, last=30, every=0)
    progress(25)   # 5 batches in 5 s, 5 to go
    assert capsys.readouterr().out == "  epoch 2 batch 25/100  ETA 5 s\n"


def test_rng_restore_sets_this_ranks_gpu_only(monkeypatch):
    """A checkpoint written on a GPU: the state goes to this rank's GPU; on a CPU, nowhere."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append(device))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: calls.append("all"))
    state = {"cpu_rng": torch.get_rng_state(), "cuda_rng": torch.zeros(16, dtype=torch.uint8)}
    common.restore_rng(state, torch.device("cpu"))
    assert calls == []
    common.restore_rng(state, torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]


def test_short_rendezvous_timeout_leaves_collectives_their_own():
    """--init-timeout 2 bounds the rendezvous only: rank 0 then works 6 s (a slow checkpoint)
    while rank 1 waits in a barrier, and both go on."""
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "test_scripts.py", "slow-barrier", "2", "6"],
                 timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("barrier passed") == 2


def test_fashion_mnist_is_the_real_data():
    data = common.load_fashion_mnist(DATA)
    (X_train, y_train), (X_test, y_test) = data["train"], data["test"]
    assert X_train.shape == (60000, 1, 28, 28) and X_test.shape == (10000, 1, 28, 28)
    assert torch.bincount(y_train).tolist() == [6000] * 10
    assert torch.bincount(y_test).tolist() == [1000] * 10
    assert abs(X_train.mean().item()) < 0.01 and abs(X_train.std().item() - 1) < 0.01


def test_debian_copy_is_used_when_download_fails(tmp_path, monkeypatch):
    debian = tmp_path / "debian"
    debian.mkdir()
    for name in (f for pair in common.FILES.values() for f in pair):
        shutil.copy(os.path.join(DATA, name), debian / name)
    monkeypatch.setattr(common, "DEBIAN_DIR", str(debian))
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    assert common.prepare_fashion_mnist(str(tmp_path / "data")) is None
    assert len(common.load_fashion_mnist(str(tmp_path / "data"))["test"][1]) == 10000


def test_missing_data_offline_says_what_to_do(tmp_path):
    result = run(["python", "-c", "import common, scratch_lenet; common.DEBIAN_DIR = '/nonexistent'; "
                  f"scratch_lenet.main(['--data-dir', {str(tmp_path / 'empty')!r}])"], env=OFFLINE)
    assert result.returncode != 0
    for needle in ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                   "t10k-labels-idx1-ubyte.gz", "apt-get install dataset-fashion-mnist", "download=True",
                   str(tmp_path / "empty")]:
        assert needle in result.stderr
    assert "Traceback" not in result.stderr


def test_truncated_data_file_is_named(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(DATA, data, ignore=shutil.ignore_patterns("FashionMNIST"))
    with open(data / "t10k-images-idx3-ubyte.gz", "r+b") as f:
        f.truncate(100_000)
    result = run(["python", "scratch_lenet.py", "--data-dir", str(data), "--out", str(tmp_path / "out")])
    assert result.returncode != 0
    assert "t10k-images-idx3-ubyte.gz is truncated or corrupt" in result.stderr
    assert "Traceback" not in result.stderr


def test_batches_do_not_depend_on_world_size():
    a = common.epoch_batches(1000, 64, seed=3, epoch=1)
    assert a.shape == (15, 64) and len(set(a.flatten().tolist())) == 960
    assert torch.equal(a, common.epoch_batches(1000, 64, seed=3, epoch=1))
    assert not torch.equal(a, common.epoch_batches(1000, 64, seed=3, epoch=2))
    shards = [a.tensor_split(3, dim=1)[r] for r in range(3)]   # what 3 ranks take
    assert torch.equal(torch.cat(shards, dim=1), a)

# ---------------------------------------------------------------- scratch_lenet.py
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


@pytest.fixture(scope="module")
def scratch_one_replica(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("scratch1"))
    scratch_lenet.main(SMALL + ["--devices", "1", "--max-steps", "6", "--batch-size", "96", "--out", out])
    return load_model(out)


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_scratch_replicas_end_with_one_device_weights(replicas, scratch_one_replica, tmp_path):
    out = str(tmp_path)
    final = scratch_lenet.main(SMALL + ["--devices", str(replicas), "--max-steps", "6",
                                        "--batch-size", "96", "--out", out])
    assert_same_weights(load_model(out), scratch_one_replica)
    for W in final[1:]:   # the replicas never drift apart
        assert all(torch.equal(a, b) for a, b in zip(W, final[0]))


def test_compiled_forward_trains_like_eager(scratch_one_replica, tmp_path):
    scratch_lenet.main(SMALL + ["--devices", "2", "--max-steps", "6", "--batch-size", "96", "--compile",
                                "--out", str(tmp_path)])
    assert_same_weights(load_model(tmp_path), scratch_one_replica, tol=1e-4)   # fused kernels round differently


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


def test_ring_allreduce_equals_all_reduce():
    for nproc in (2, 3):
        result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "test_scripts.py", "ring-check"])
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.count("ring ok") == nproc


@pytest.mark.parametrize("nproc", [2, 3])
def test_scratch_under_torchrun_matches_one_process(nproc, scratch_one_replica, tmp_path):
    result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "scratch_lenet.py"] + SMALL +
                 ["--max-steps", "6", "--batch-size", "96", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_weights(load_model(tmp_path), scratch_one_replica)
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert metrics["world_size"] == nproc and metrics["backend"] == "gloo send/recv"


LENET_PARAMS = sum(p.numel() for p in scratch_lenet.init_params(0))


@pytest.mark.parametrize("nproc, devices, flag", [(2, 2, None), (2, 1, "--overlap"), (3, 1, "--overlap"),
                                                  (2, 2, "--overlap"), (3, 2, "--overlap"),
                                                  (2, 1, "--zero"), (3, 1, "--zero"), (2, 2, "--zero")])
def test_hierarchical_overlap_and_zero_train_like_one_device(nproc, devices, flag, scratch_one_replica, tmp_path):
    """2 processes x 2 replicas is 4 replicas; --overlap (one bucket per layer) and --zero only
    move when and where the sums and updates happen: the weights stay those of one device."""
    flags = [flag] + (["--bucket-kb", "1"] if flag == "--overlap" else []) if flag else []
    result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "scratch_lenet.py", "--devices",
                  str(devices)] + flags + SMALL + ["--max-steps", "6", "--batch-size", "96", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_weights(load_model(tmp_path), scratch_one_replica, tol=1e-6)
    metrics = json.load(open(tmp_path / "metrics.json"))
    layout = f"{nproc} processes x {devices} replica{'s' * (devices > 1)}"
    assert metrics["layout"] == layout and layout in result.stdout
    if flag == "--overlap":
        assert "in 4 buckets" in result.stdout   # --bucket-kb 1: one per LeNet layer
    replicated = 4 * LENET_PARAMS * devices   # momentum for every parameter in every replica
    rank0_chunk = len(torch.empty(LENET_PARAMS).tensor_split(nproc)[scratch_lenet.owned_chunk(0, nproc)])
    assert metrics["optimizer_state_bytes"] == (4 * rank0_chunk if flag == "--zero" else replicated)
    if flag == "--zero":   # 1/W of one replica's momentum, up to the uneven last chunk
        assert abs(metrics["optimizer_state_bytes"] - 4 * LENET_PARAMS / nproc) <= 4


def test_overlap_sends_before_backward_ends():
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "test_scripts.py", "overlap-order"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("overlap ok") == 2, result.stdout


def test_scratch_readme_command_learns(tmp_path):
    result = run(["python", "scratch_lenet.py", "--epochs", "1", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert metrics["test_samples"] == 10000 and metrics["test_acc"] >= 0.80
    assert "done:" in result.stdout and "test acc" in result.stdout
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert list(load_model(tmp_path)) == scratch_lenet.PARAM_NAMES


@pytest.mark.parametrize("flags, message", [
    (["--devices", "0"], "error: argument --devices: must be positive, got 0"),
    (["--batch-size", "0"], "error: argument --batch-size: must be positive, got 0"),
    (["--devices", "3", "--batch-size", "2"], "error: --batch-size 2 is smaller than the 3 replicas"),
    (["--lr", "-1"], "error: argument --lr: must be positive, got -1"),
    (["--epochs", "0"], "error: argument --epochs: must be positive, got 0"),
    (["--max-steps", "-3"], "error: argument --max-steps: must be positive, got -3"),
    (["--overlap"], "error: --overlap and --zero work between processes: start the script with torchrun"),
    (["--zero"], "error: --overlap and --zero work between processes: start the script with torchrun"),
    (["--bucket-kb", "0"], "error: argument --bucket-kb: must be positive, got 0"),
])
def test_bad_flags_give_argparse_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        scratch_lenet.parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- ddp_toy.py
import copy
import ddp_toy
import ddp_resnet
import dp_resnet
import torch.nn.functional as F

TOY = ["--epochs", "3", "--train-samples", "600", "--test-samples", "301", "--batch-size", "48"]


@pytest.fixture(scope="module")
def toy_one_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy1")
    result = run(["python", "ddp_toy.py", "--world-size", "1", "--out", str(out)] + TOY)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_model(out)


@pytest.mark.parametrize("launch", [["python", "ddp_toy.py", "--world-size", "2"],
                                    ["python", "ddp_toy.py", "--world-size", "3"],
                                    ["torchrun", "--standalone", "--nproc_per_node=2", "ddp_toy.py"]])
def test_ddp_toy_any_world_size_trains_like_one_rank(launch, toy_one_rank, tmp_path):
    result = run(launch + ["--out", str(tmp_path)] + TOY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_weights(load_model(tmp_path), toy_one_rank)
    assert result.stdout.count("epoch ") == 3   # rank 0 alone prints


def test_ddp_toy_accuracy_is_over_the_whole_test_set(tmp_path):
    result = run(["python", "ddp_toy.py", "--world-size", "3", "--out", str(tmp_path)] + TOY)
    assert result.returncode == 0, result.stderr[-3000:]
    net = ddp_toy.ToyMLP()
    net.load_state_dict(load_model(tmp_path))
    X, y = ddp_toy.toy_data(301, seed=2)   # 301 does not divide by 3
    single = common.evaluate(net, X, y, torch.device("cpu"))
    reported = json.load(open(tmp_path / "metrics.json"))
    assert reported["test_acc"] == single and reported["test_samples"] == 301


def test_ddp_toy_runs_on_eight_ranks(tmp_path):
    result = run(["python", "ddp_toy.py", "--world-size", "8", "--epochs", "1", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.load(open(tmp_path / "metrics.json"))["world_size"] == 8


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
    monkeypatch.setenv("MASTER_PORT", str(common.free_port()))
    ddp_toy.main(TOY + ["--out", str(tmp_path)])
    assert seen == [1, 2, 3]


def test_more_ranks_than_gpus_is_refused_before_nccl(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        common.init_distributed(5)
    assert "2 processes on this node but 1 GPUs" in str(exit_info.value.code)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)   # scratch_lenet --devices 2 under torchrun
    with pytest.raises(SystemExit) as exit_info:
        common.init_distributed(5, gpus_per_process=2)
    assert "2 processes x 2 GPUs each on this node but 3 GPUs" in str(exit_info.value.code)

# ---------------------------------------------------------------- ddp_resnet.py and dp_resnet.py
ONE_THREAD = {"OMP_NUM_THREADS": "1"}   # torchrun's setting with 2+ workers; see resnet_reference
RESNET = ["--train-samples", "64", "--test-samples", "101", "--batch-size", "16", "--max-steps", "2",
          "--data-dir", DATA]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
@pytest.mark.parametrize("script, flags", [("ddp_toy", TOY), ("ddp_resnet", RESNET)])
def test_no_process_group_thread_outlives_the_training(script, flags, tmp_path):
    """A group kept alive past destroy_process_group keeps gloo's threads running into interpreter
    shutdown, where they now and then abort a rank that has finished ("terminate called without
    an active exception", seen in CI). One rank, started as torchrun would start it."""
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(common.free_port()), **ONE_THREAD)
    result = run(["python", "test_scripts.py", "threads-left", script, "--out", str(tmp_path)] + flags, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    def group_threads(label):
        names = result.stdout.split(label)[1].splitlines()[0].split()
        return [t for t in names if "gloo" in t or "tcpstore" in t]
    assert group_threads("threads before destroy:"), result.stdout   # the names this check looks for
    assert group_threads("threads left:") == [], result.stdout


def resnet_reference(shards, steps=2, lr=0.05):
    """Single process, by hand: per-shard BatchNorm (as each DDP rank has), gradients averaged,
    buffers from shard 0 (DDP broadcasts rank 0's). What DDP is supposed to compute. One thread,
    as each torchrun worker has: early ResNet steps amplify the rounding of other summation
    orders from 1e-7 to 1e-4 within two steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _resnet_reference(shards, steps, lr)
    finally:
        torch.set_num_threads(threads)


def _resnet_reference(shards, steps, lr):
    X_train, y_train = common.load_fashion_mnist(DATA, 64, 1)["train"]
    net = common.fashion_resnet18(0)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    for idx in common.epoch_batches(64, 16, seed=0, epoch=1)[:steps]:
        net.zero_grad(set_to_none=True)
        replicas = [copy.deepcopy(net) for _ in range(shards)]
        for replica, part in zip(replicas, idx.view(shards, -1)):
            F.cross_entropy(replica(X_train[part]), y_train[part]).backward()
        for name, p in net.named_parameters():
            p.grad = sum(dict(r.named_parameters())[name].grad for r in replicas) / shards
        for name, b in net.named_buffers():
            b.copy_(dict(replicas[0].named_buffers())[name])
        optimizer.step()
    return net.state_dict()


@pytest.mark.parametrize("nproc", [1, 2])
def test_ddp_resnet_step_is_the_per_shard_batchnorm_step(nproc, tmp_path):
    result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "ddp_resnet.py"] + RESNET +
                 ["--out", str(tmp_path)], env=ONE_THREAD)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_weights(load_model(tmp_path), resnet_reference(nproc))


def test_dataparallel_step_equals_ddp_resnet_step(tmp_path):
    results = [run(["python", script] + RESNET + ["--max-steps", "1", "--out", str(tmp_path / script)])
               for script in ("dp_resnet.py", "ddp_resnet.py")]
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    assert "DataParallel runs the model on the CPU" in results[0].stdout
    assert_same_weights(load_model(tmp_path / "dp_resnet.py"), load_model(tmp_path / "ddp_resnet.py"), tol=1e-6)


def test_ddp_resnet_accuracy_is_over_the_whole_test_set(tmp_path):
    result = run(["torchrun", "--standalone", "--nproc_per_node=3", "ddp_resnet.py"] + RESNET +
                 ["--batch-size", "15", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    net = common.fashion_resnet18(0)
    net.load_state_dict(load_model(tmp_path))
    X_test, y_test = common.load_fashion_mnist(DATA, 1, 101)["test"]
    single = common.evaluate(net.eval(), X_test, y_test, torch.device("cpu"))
    assert json.load(open(tmp_path / "metrics.json"))["test_acc"] == single


def test_gradient_accumulation_equals_ranks(tmp_path):
    """--accum-steps 2 in one process computes BatchNorm over the same half-batches as 2 ranks,
    so the two must give the same weights (buffers: rank 0's vs both micro-batches', not compared)."""
    accum = run(["python", "ddp_resnet.py"] + RESNET + ["--accum-steps", "2", "--out", str(tmp_path / "a")],
                env=ONE_THREAD)
    ranks = run(["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py"] + RESNET +
                ["--out", str(tmp_path / "r")], env=ONE_THREAD)
    assert accum.returncode == 0 and ranks.returncode == 0, accum.stderr[-2000:] + ranks.stderr[-2000:]
    a, r = load_model(tmp_path / "a"), load_model(tmp_path / "r")
    params = dict(common.fashion_resnet18(0).named_parameters())
    assert_same_weights({k: a[k] for k in params}, {k: r[k] for k in params})


def test_two_nodes_train_like_one_process(tmp_path):
    endpoint = f"127.0.0.1:{common.free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node_rank={i}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                               "--rdzv-id=test", "ddp_resnet.py"] + RESNET + ["--out", str(tmp_path / f"n{i}")],
                              cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **ONE_THREAD})
             for i in range(2)]
    for node in nodes:
        out, err = node.communicate(timeout=300)
        assert node.returncode == 0, err[-3000:]
    outs = [p for p in (tmp_path / "n0", tmp_path / "n1") if (p / "model.pt").exists()]
    assert len(outs) == 1   # rank 0 alone writes
    assert_same_weights(load_model(outs[0]), resnet_reference(2))


def test_amp_and_channels_last_run_on_cpu(tmp_path):
    result = run(["python", "ddp_resnet.py"] + RESNET + ["--max-steps", "1", "--amp", "--channels-last",
                                                        "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    # bf16 autocast: not the fp32 step, but the same step direction
    start, reference, got = common.fashion_resnet18(0).state_dict(), resnet_reference(1, steps=1), load_model(tmp_path)
    names = [name for name, _ in common.fashion_resnet18(0).named_parameters()]
    step_fp32 = torch.cat([(reference[n] - start[n]).flatten() for n in names])
    step_amp = torch.cat([(got[n] - start[n]).flatten() for n in names])
    assert F.cosine_similarity(step_fp32, step_amp, dim=0) > 0.9


def test_compiled_ddp_with_accumulation_trains_like_eager(tmp_path):
    """torch.compile of the DDP model, with no_sync on the first of 2 micro-steps: the step of
    eager mode, up to the rounding that BatchNorm over micro-batches of 4 images amplifies (0.5%
    of the step measured; a micro-batch's gradient lost would be half of it)."""
    flags = RESNET + ["--max-steps", "1", "--accum-steps", "2"]
    eager = run(["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--out", str(tmp_path / "e")] + flags)
    compiled = run(["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--compile",
                    "--out", str(tmp_path / "c")] + flags, timeout=600)
    assert eager.returncode == 0 and compiled.returncode == 0, eager.stderr[-2000:] + compiled.stderr[-3000:]
    start, eager, compiled = common.fashion_resnet18(0).state_dict(), load_model(tmp_path / "e"), load_model(tmp_path / "c")
    names = [name for name, _ in common.fashion_resnet18(0).named_parameters()]
    step_eager = torch.cat([(eager[n] - start[n]).flatten() for n in names])
    step_compiled = torch.cat([(compiled[n] - start[n]).flatten() for n in names])
    assert (step_compiled - step_eager).norm() / step_eager.norm() < 0.02


def test_sync_bn_on_cpu_says_so_and_goes_on(tmp_path):
    result = run(["python", "ddp_resnet.py"] + RESNET + ["--max-steps", "1", "--sync-bn", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--sync-bn needs CUDA" in result.stdout


# ---------------------------------------------------------------- fsdp_resnet.py
import fsdp_resnet
RESNET_BYTES = 4 * sum(p.numel() for p in common.fashion_resnet18(0).parameters())   # 44,691,240


@pytest.mark.parametrize("nproc, steps", [(2, 2), (3, 1)])
def test_fsdp_resnet_trains_like_ddp_resnet_with_a_shard_of_the_memory(nproc, steps, tmp_path):
    """Same seed and global batch: the same weights (at 3 ranks after one step: in the first steps
    of a ResNet, the other summation order of a reduce-scatter grows from 1e-7 to 4e-5 by the
    second). Each rank holds 1/W of the parameters, gradients and momentum."""
    flags = RESNET + ["--batch-size", "12", "--max-steps", str(steps)]
    fsdp = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "fsdp_resnet.py"] + flags +
               ["--out", str(tmp_path / "fsdp")], env=ONE_THREAD)
    ddp = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "ddp_resnet.py"] + flags +
              ["--out", str(tmp_path / "ddp")], env=ONE_THREAD)
    assert fsdp.returncode == 0 and ddp.returncode == 0, fsdp.stderr[-3000:] + ddp.stderr[-3000:]
    assert_same_weights(load_model(tmp_path / "fsdp"), load_model(tmp_path / "ddp"))
    metrics = json.load(open(tmp_path / "fsdp" / "metrics.json"))
    assert metrics["test_acc"] == json.load(open(tmp_path / "ddp" / "metrics.json"))["test_acc"]
    held = metrics["bytes_per_rank"]
    assert len(held) == nproc
    for kind in ("params", "grads", "optimizer_state"):
        assert sum(h[kind] for h in held) == RESNET_BYTES   # the shards are the model, once
        assert max(h[kind] for h in held) <= RESNET_BYTES / nproc * 1.01   # each about 1/W of it
    assert f"per rank: {held[0]['params'] / 1e6:.1f} MB parameters" in fsdp.stdout


def test_fsdp_amp_runs_on_cpu_and_steps_the_fp32_way(tmp_path):
    """--amp: FSDP's mixed precision (bf16 compute, fp32 gradient reduction): not the fp32 step,
    but the same direction."""
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "fsdp_resnet.py", "--amp", "--out", str(tmp_path)] +
                 RESNET + ["--max-steps", "1"], env=ONE_THREAD)
    assert result.returncode == 0, result.stderr[-3000:]
    start, reference, got = common.fashion_resnet18(0).state_dict(), resnet_reference(2, steps=1), load_model(tmp_path)
    names = [name for name, _ in common.fashion_resnet18(0).named_parameters()]
    step_fp32 = torch.cat([(reference[n] - start[n]).flatten() for n in names])
    step_amp = torch.cat([(got[n].float() - start[n]).flatten() for n in names])
    assert F.cosine_similarity(step_fp32, step_amp, dim=0) > 0.9


def test_fsdp_checkpoint_saved_by_2_ranks_loads_on_1_and_3(tmp_path):
    """Each rank writes its own shard; 1 or 3 ranks read them back into their own shards (DCP
    reshards), and the whole model they then hold is the one the 2 ranks saved."""
    flags = ["--train-samples", "48", "--batch-size", "12", "--test-samples", "50", "--data-dir", DATA]
    saved = run(["torchrun", "--standalone", "--nproc_per_node=2", "fsdp_resnet.py", "--epochs", "1"] + flags +
                ["--out", str(tmp_path)], env=ONE_THREAD)
    assert saved.returncode == 0, saved.stderr[-3000:]
    newest = fsdp_resnet.newest_checkpoint(str(tmp_path / "checkpoint"))
    assert newest.endswith("step-00000004"), newest   # 48 samples, 12 a step: 4 steps
    shards = sorted(p.name for p in (tmp_path / "checkpoint" / newest).iterdir() if p.suffix == ".distcp")
    assert len(shards) == 2, shards   # one file per rank
    for nproc in (1, 3):
        loaded = tmp_path / f"loaded{nproc}.pt"
        result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "test_scripts.py", "fsdp-load",
                      str(tmp_path / "checkpoint"), str(loaded)], env=ONE_THREAD)
        assert result.returncode == 0, result.stderr[-3000:]
        assert_same_weights(torch.load(loaded), load_model(tmp_path), tol=0)
    resumed = run(["torchrun", "--standalone", "--nproc_per_node=3", "fsdp_resnet.py", "--epochs", "2", "--resume"] +
                  flags + ["--out", str(tmp_path)], env=ONE_THREAD)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "epoch 1 done, step 4" in resumed.stdout
    assert [e["epoch"] for e in json.load(open(tmp_path / "metrics.json"))["epochs"]] == [1, 2]


@pytest.mark.parametrize("script", ["ddp_resnet.py", "fsdp_resnet.py"])
def test_resume_without_a_checkpoint_says_so_once_and_starts_at_step_0(script, tmp_path):
    """A mistyped --checkpoint, or an empty checkpoint folder: rank 0 says so in one line."""
    checkpoint = tmp_path / ("checkpoint" if script == "fsdp_resnet.py" else "checkpont.pt")
    if script == "fsdp_resnet.py":
        checkpoint.mkdir()
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", script, "--resume", "--checkpoint", str(checkpoint),
                  "--out", str(tmp_path)] + RESNET + ["--max-steps", "1"], env=ONE_THREAD)
    assert result.returncode == 0, result.stderr[-3000:]
    said = f"no checkpoint {'in' if script == 'fsdp_resnet.py' else 'at'} {checkpoint}: training starts from step 0"
    assert result.stdout.count(said) == 1, result.stdout
    assert "done: 1 steps" in result.stdout

# ---------------------------------------------------------------- faults and bad input


def children_of(pid):
    """Pids whose parent is `pid`, read from /proc: how the tests find a worker, never by name."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except OSError:
            pass
    return found


def test_killed_worker_restarts_mid_epoch_and_ends_with_uninterrupted_weights(resnet_uninterrupted, tmp_path):
    """SIGKILL (no handler can run) mid-epoch under torchrun --max-restarts=1: the workers restart
    from the last --checkpoint-every checkpoint, inside the epoch, recomputing fewer than K steps."""
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "--max-restarts=1", "ddp_resnet.py", "--resume", "--out", str(tmp_path)] + PREEMPTIBLE,
                           cwd=HERE, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    watchdog = threading.Timer(240, job.kill)   # a hung job fails the test instead of CI
    watchdog.start()
    lines = []
    for line in job.stdout:   # --checkpoint-every 2: steps 2 and 4 are checkpointed inside epoch 1
        lines.append(line)
        if line.startswith("  checkpoint: step 4 "):
            break
    workers = children_of(job.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    lines += job.stdout.readlines()
    assert job.wait(timeout=300) == 0, "".join(lines)[-3000:]
    watchdog.cancel()
    log = "".join(lines)
    assert "resumed from" in log and "epoch 1 at batch 4/6, step 4" in log, log[-3000:]   # 4 = the last checkpoint
    assert_same_weights(load_model(tmp_path), resnet_uninterrupted, tol=1e-6)
    assert [e["samples"] for e in json.load(open(tmp_path / "metrics.json"))["epochs"]] == [96, 96]


def test_checkpoint_every_must_be_positive(capsys):
    for value in ("0", "-3"):
        with pytest.raises(SystemExit) as exit_info:
            ddp_resnet.parse_args(["--checkpoint-every", value])
        assert exit_info.value.code == 2
        assert f"argument --checkpoint-every: must be positive, got {value}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def mid_epoch_checkpoint_of_2_ranks(tmp_path_factory):
    """A checkpoint written at step 2 of 6 in epoch 1 by 2 ranks (global batch 16, seed 0, 96 samples)."""
    out = tmp_path_factory.mktemp("mid_epoch")
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--max-steps", "2",
                  "--out", str(out)] + PREEMPTIBLE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoint: step 2 (epoch 1, batch 2/6)" in result.stdout
    return out / "checkpoint.pt"


@pytest.mark.parametrize("flags, differs", [(["--batch-size", "32"], "global batch 16 there, 32 here"),
                                            (["--seed", "1"], "seed 0 there, 1 here"),
                                            (["--train-samples", "128"], "training samples 96 there, 128 here")])
def test_mid_epoch_checkpoint_of_other_batches_is_refused(flags, differs, mid_epoch_checkpoint_of_2_ranks, tmp_path):
    result = run(["python", "ddp_resnet.py", "--resume", "--checkpoint", str(mid_epoch_checkpoint_of_2_ranks),
                  "--out", str(tmp_path)] + PREEMPTIBLE + flags)
    assert result.returncode != 0
    assert "it stopped inside epoch 1, and this run draws other batches" in result.stderr
    assert differs in result.stderr and "Traceback" not in result.stderr


def test_mid_epoch_checkpoint_resumes_at_another_world_size(mid_epoch_checkpoint_of_2_ranks, resnet_uninterrupted, tmp_path):
    """Same global batch, same batches: 1 process with 2 micro-batches (the per-rank BatchNorm of
    2 ranks) goes on from the 2 ranks' checkpoint and ends with their uninterrupted weights."""
    checkpoint = tmp_path / "checkpoint.pt"
    shutil.copy(mid_epoch_checkpoint_of_2_ranks, checkpoint)
    result = run(["python", "ddp_resnet.py", "--resume", "--accum-steps", "2", "--out", str(tmp_path)] + PREEMPTIBLE,
                 env=ONE_THREAD)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "epoch 1 at batch 2/6, step 2" in result.stdout
    got, params = load_model(tmp_path), dict(common.fashion_resnet18(0).named_parameters())
    assert_same_weights({k: got[k] for k in params}, {k: resnet_uninterrupted[k] for k in params})


def test_checkpoint_only_rank_0_sees_is_resumed_by_every_rank(mid_epoch_checkpoint_of_2_ranks, resnet_uninterrupted, tmp_path):
    """Node-local disks: two torchrun "nodes" in folders of their own, the checkpoint (a relative
    path) only in node 0's. Rank 0 reads it and sends it on; both ranks go on from step 2."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for folder in folders:
        (folder / "out").mkdir(parents=True)
    shutil.copy(mid_epoch_checkpoint_of_2_ranks, folders[0] / "out" / "checkpoint.pt")
    port = common.free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node_rank={i}", "--master_addr=127.0.0.1", f"--master_port={port}",
                               os.path.join(HERE, "ddp_resnet.py"), "--resume", "--out", "out"] + PREEMPTIBLE,
                              cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **ONE_THREAD})
             for i, folder in enumerate(folders)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    assert "resumed from out/checkpoint.pt: epoch 1 at batch 2/6, step 2" in outputs[0][0]
    assert_same_weights(load_model(folders[0] / "out"), resnet_uninterrupted, tol=1e-6)


def test_partner_that_never_comes_gives_an_error_not_a_hang():
    port = common.free_port()
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    started = time.time()
    result = run(["python", "ddp_toy.py", "--init-timeout", "3"], env=env, timeout=60)
    took = time.time() - started
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr and "world size 2" in result.stderr
    assert "Traceback" not in result.stderr
    assert took < 3 + 15   # the timeout, plus starting Python and importing torch


def test_two_jobs_side_by_side_both_finish(tmp_path):
    commands = [[sys.executable, "ddp_toy.py", "--epochs", "2"],
                [sys.executable, "ddp_toy.py", "--epochs", "2"],
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "ddp_toy.py", "--epochs", "2"],
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "ddp_toy.py", "--epochs", "2"]]
    jobs = [subprocess.Popen(c + ["--out", str(tmp_path / str(i))], cwd=HERE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i, c in enumerate(commands)]
    for job in jobs:
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-3000:]


def test_data_is_prepared_once_by_rank_zero(tmp_path):
    fresh = tmp_path / "fresh"
    result = run(["torchrun", "--standalone", "--nproc_per_node=3", "scratch_lenet.py", "--data-dir", str(fresh),
                  "--max-steps", "1", "--train-samples", "300", "--test-samples", "30", "--out", str(tmp_path / "out")])
    assert result.returncode == 0, result.stderr[-3000:]
    files = sorted(p.name for p in fresh.rglob("*") if p.is_file())
    assert not any(".tmp" in f for f in files), files
    assert len(common.load_fashion_mnist(str(fresh))["train"][1]) == 60000


@pytest.mark.parametrize("case", ["data-dir-is-a-file", "out-not-writable"])
def test_unusable_folders_are_named(case, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    flags = (["--data-dir", str(blocker)] if case == "data-dir-is-a-file" else
             ["--data-dir", DATA, "--out", str(blocker / "out")])
    result = run(["python", "ddp_resnet.py", "--max-steps", "1"] + flags, env=OFFLINE)
    assert result.returncode != 0
    assert str(blocker) in result.stderr and "error:" in result.stderr
    assert "Traceback" not in result.stderr


def test_batch_not_dividing_by_world_size_is_stated(tmp_path):
    result = run(["python", "ddp_toy.py", "--world-size", "3", "--batch-size", "50", "--epochs", "1",
                  "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "does not divide by 3 ranks: each takes 16, a global batch of 48" in result.stdout


def test_world_size_larger_than_the_data_is_refused(tmp_path):
    result = run(["python", "ddp_toy.py", "--world-size", "8", "--train-samples", "5", "--batch-size", "8",
                  "--out", str(tmp_path)])
    assert result.returncode != 0
    assert "5 training samples are fewer than one global batch of 8" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("bad", ["not-a-checkpoint", "another-model"])
def test_resume_from_a_wrong_file_says_what_is_wrong_once(bad, tmp_path):
    checkpoint = tmp_path / "checkpoint.pt"
    if bad == "not-a-checkpoint":
        checkpoint.write_bytes(b"these bytes are no checkpoint")
        expected = f"cannot resume from {checkpoint}"
    else:
        torch.save({"arch": "fashion_resnet18", "model": ddp_toy.ToyMLP().state_dict()}, checkpoint)
        expected = "Missing key(s) in state_dict"
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--resume", "--checkpoint",
                  str(checkpoint), "--out", str(tmp_path)] + RESNET)
    assert result.returncode != 0
    assert result.stderr.count(expected) == 1, result.stderr[-3000:]   # rank 0 alone says it
    assert not re.search(r"\[rank\d+\]: Traceback", result.stderr)   # torchrun's own report aside, no traceback


@pytest.mark.parametrize("script", [ddp_toy, ddp_resnet, dp_resnet, fsdp_resnet])
@pytest.mark.parametrize("flag", ["--epochs", "--max-steps", "--batch-size", "--lr"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_zero_or_negative_numbers_are_refused(script, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args([flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be positive, got {value}" in capsys.readouterr().err


# ---------------------------------------------------------------- several machines, simulated
import simulated_cluster
NO_CLUSTER = simulated_cluster.unavailable()   # None here as root with ip, tc and ethtool


@pytest.mark.skipif(NO_CLUSTER is not None, reason=str(NO_CLUSTER))
def test_ddp_toy_on_two_simulated_nodes_trains_like_one_rank(toy_one_rank, tmp_path):
    """The command line of simulated_cluster.py: two nodes with their own addresses and 1 Gbit/s
    links, one torchrun per node, rendezvous at node 0's address."""
    torchrun = f"{sys.executable} -m torch.distributed.run"
    result = run(["python", "simulated_cluster.py", "--nodes", "2", "--rate-mbit", "1000", "--"] + torchrun.split() +
                 ["--nnodes=2", "--nproc_per_node=1", "--node-rank={node}", "--master-addr={head}",
                  f"--master-port={common.free_port()}", "ddp_toy.py", "--out", str(tmp_path / "node{node}")] + TOY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_weights(load_model(tmp_path / "node0"), toy_one_rank)
    assert not (tmp_path / "node1").exists()   # rank 0 alone writes


@pytest.mark.skipif(NO_CLUSTER is not None, reason=str(NO_CLUSTER))
def test_scratch_hierarchical_on_two_simulated_nodes_trains_like_one_device(scratch_one_replica, tmp_path):
    port = common.free_port()
    with simulated_cluster.SimulatedCluster(2, rate_mbit=300) as cluster:
        jobs = [cluster.popen(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                                  f"--node-rank={i}", f"--master-addr={cluster.addresses[0]}", f"--master-port={port}",
                                  "scratch_lenet.py", "--devices", "2", "--overlap", "--out", str(tmp_path)] + SMALL +
                              ["--max-steps", "6", "--batch-size", "96"],
                              cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i in range(2)]
        for job in jobs:
            _, err = job.communicate(timeout=300)
            assert job.returncode == 0, err[-3000:]
    assert_same_weights(load_model(tmp_path), scratch_one_replica, tol=1e-6)
    assert json.load(open(tmp_path / "metrics.json"))["layout"] == "2 processes x 2 replicas"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in namespaces for name in cluster.names + [cluster.switch])   # all deleted


@pytest.mark.skipif(NO_CLUSTER is not None, reason=str(NO_CLUSTER))
def test_simulated_cluster_is_deleted_after_an_error():
    with pytest.raises(RuntimeError):
        with simulated_cluster.SimulatedCluster(2) as cluster:
            sleeper = cluster.popen(1, ["sleep", "600"])
            raise RuntimeError("a failing run")
    assert sleeper.poll() is not None   # what it started was stopped
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in namespaces for name in cluster.names + [cluster.switch])


@pytest.mark.skipif(NO_CLUSTER is not None, reason=str(NO_CLUSTER))
def test_simulated_cluster_killed_with_sigterm_deletes_its_nodes_and_their_processes(tmp_path):
    """A command whose node runs a process that starts a child in a session of its own, as
    torchrun starts its workers."""
    child_pid = tmp_path / "child.pid"
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '600'], start_new_session=True); "
              f"open({str(child_pid)!r}, 'w').write(str(p.pid)); time.sleep(600)")
    job = subprocess.Popen([sys.executable, "simulated_cluster.py", "--nodes", "2", "--", sys.executable, "-c", script],
                           cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not child_pid.exists() and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mine = [line.split()[0] for line in names.splitlines() if line.startswith(f"dpc{job.pid}-")]
    assert len(mine) == 3, names   # two nodes and the switch
    job.terminate()
    assert job.wait(timeout=30) == 143
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in names for name in mine)
    assert not running(int(child_pid.read_text()))   # the child was stopped too


def running(pid):
    """Whether the process exists and is not a zombie (one waiting for its parent to collect it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_simulated_cluster_without_root_says_why_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    reason = "simulated cluster: needs root (or CAP_NET_ADMIN) to create network namespaces"
    assert simulated_cluster.unavailable() == reason
    with pytest.raises(SystemExit) as exit_info:
        simulated_cluster.main(["--nodes", "2", "--", "true"])
    assert exit_info.value.code == reason   # printed to stderr, exit status 1


# ---------------------------------------------------------------- preemption, and a real SLURM
sys.path.insert(0, os.path.join(HERE, "examples"))
import local_slurm
NO_SLURM = local_slurm.unavailable()   # None as root with slurm-wlm and munge (.ci/run installs them)
PREEMPTIBLE = ["--epochs", "2", "--train-samples", "96", "--batch-size", "16", "--test-samples", "50",
               "--data-dir", DATA, "--checkpoint-every", "2"]   # 6 steps an epoch


@pytest.fixture(scope="module")
def resnet_uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--out", str(out)] + PREEMPTIBLE)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_model(out)


def wait_for(condition, seconds, what):
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.2)


def read(path):
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("script, signalled", [("ddp_resnet.py", "rank 1 alone"), ("ddp_resnet.py", "every rank"),
                                               ("fsdp_resnet.py", "rank 1 alone")])
def test_sigterm_mid_epoch_checkpoints_and_exits_75_then_resume_finishes_the_same(script, signalled, resnet_uninterrupted, tmp_path):
    """The handler only notes the signal; the ranks agree at a step boundary (so a rank signalled
    alone does not leave the other waiting), the checkpoint is written, all exit with status 75.
    FSDP's uninterrupted weights are DDP's (tested above)."""
    log = tmp_path / "log"
    with open(log, "w") as f:
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                script, "--out", str(tmp_path)] + PREEMPTIBLE, cwd=HERE, stdout=f,
                               stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_for(lambda: "checkpoint: step 2 " in read(log), 240, "the first checkpoint")
        workers = sorted(children_of(job.pid))
        assert len(workers) == 2, workers
        for pid in workers[1:] if signalled == "rank 1 alone" else workers:
            os.kill(pid, signal.SIGTERM)
        job.wait(timeout=120)
    text = read(log)
    assert "stopped by SIGTERM at step" in text and "exitcode  : 75" in text, text[-3000:]
    stopped_at = int(text.split("stopped by SIGTERM at step ")[1].split(";")[0])
    assert 2 <= stopped_at < 6   # inside the first epoch
    resumed = run(["torchrun", "--standalone", "--nproc_per_node=2", script, "--resume", "--out",
                   str(tmp_path)] + PREEMPTIBLE)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"epoch 1 at batch {stopped_at}/6, step {stopped_at}" in resumed.stdout
    assert_same_weights(load_model(tmp_path), resnet_uninterrupted, tol=1e-6)
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert [e["samples"] for e in metrics["epochs"]] == [96, 96]   # the interrupted epoch counted once


@pytest.fixture(scope="module")
def resnet_8_steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("eight_steps")
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--max-steps", "8",
                  "--out", str(out)] + PREEMPTIBLE)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_model(out)


@pytest.mark.parametrize("script", ["ddp_resnet.py", "fsdp_resnet.py"])
def test_max_steps_leaves_a_checkpoint_and_resume_ends_like_one_run(script, resnet_8_steps, tmp_path):
    """--max-steps 3 stops inside epoch 1 and leaves a checkpoint of step 3; a cap at or below it
    stops at once; --resume --max-steps 8 ends with the weights of one --max-steps 8 run. For
    FSDP, the folder also holds what crashes leave: an older complete checkpoint (step-1, made
    unreadable here, so loading it would fail) and a newer one half written (step-9.tmp)."""
    torchrun = ["torchrun", "--standalone", "--nproc_per_node=2", script, "--out", str(tmp_path)] + PREEMPTIBLE
    first = run(torchrun + ["--max-steps", "3"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "checkpoint: step 3 (epoch 1, batch 3/6)" in first.stdout
    capped = run(torchrun + ["--resume", "--max-steps", "2"])
    assert capped.returncode == 0, capped.stderr[-3000:]
    assert "nothing to train" in capped.stdout and "at step 3, at or past --max-steps 2" in capped.stdout
    assert "done:" not in capped.stdout
    if script == "fsdp_resnet.py":
        (tmp_path / "checkpoint" / "step-00000001").mkdir()
        (tmp_path / "checkpoint" / "step-00000001" / ".metadata").write_bytes(b"cut short")
        (tmp_path / "checkpoint" / "step-00000009.tmp").mkdir()
    resumed = run(torchrun + ["--resume", "--max-steps", "8"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "epoch 1 at batch 3/6, step 3" in resumed.stdout
    assert "done: 8 steps" in resumed.stdout
    assert_same_weights(load_model(tmp_path), resnet_8_steps, tol=1e-6)
    assert [e["samples"] for e in json.load(open(tmp_path / "metrics.json"))["epochs"]] == [96, 32]
    if script == "fsdp_resnet.py":   # only the newest is kept
        assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-00000008"]


@pytest.mark.skipif(NO_SLURM is not None or NO_CLUSTER is not None, reason=str(NO_SLURM or NO_CLUSTER))
@pytest.mark.parametrize("stop", ["signal ahead of the time limit", "scontrol requeue"])
def test_slurm_job_stopped_requeues_once_resumes_and_ends_with_uninterrupted_weights(stop, resnet_uninterrupted, tmp_path):
    """examples/slurm_ddp_resnet.sbatch as submitted on a cluster: two nodes with their own
    addresses (each slurmd in a node of a simulated cluster) whose hostname resolves elsewhere
    (a loopback address here), one torchrun each, c10d rendezvous on the first."""
    out, log = tmp_path / "out", tmp_path / "job.out"
    with simulated_cluster.SimulatedCluster(2) as cluster, local_slurm.LocalSlurm(cluster=cluster) as slurm:
        resolved = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
        assert not resolved & set(cluster.addresses), resolved   # torchrun's own guess cannot work
        submitted = slurm.run("sbatch", f"--output={log}", "--gpus-per-node=0", "--cpus-per-task=1",
                              f"--export=ALL,PYTHON={sys.executable},OUT={out},RDZV_PORT={common.free_port()},"
                              f"GLOO_SOCKET_IFNAME=eth0,PYTHONUNBUFFERED=1",
                              "examples/slurm_ddp_resnet.sbatch", *PREEMPTIBLE, cwd=HERE)
        job = submitted.stdout.split()[-1]
        wait_for(lambda: "checkpoint: step 2 " in read(log), 240, f"the first checkpoint:\n{read(log)[-3000:]}")
        if stop == "scontrol requeue":   # what preemption with requeue does: SIGTERM to every process
            slurm.run("scontrol", "requeue", job)
        else:                            # what --signal=B:USR1@90 sends 90 s before the time limit
            slurm.run("scancel", "--batch", "--signal=USR1", job)
        wait_for(lambda: slurm.job(job)["JobState"] == "PENDING", 120, "the requeue")
        # SLURM would start it again after about 90 s; here at once, once the first run is gone
        # and a second has passed: slurmd refuses a job whose credential was revoked (by the
        # requeue) in the second the new one is made ("Job credential revoked").
        wait_for(slurm.idle, 120, "the first run's end")
        time.sleep(2)
        slurm.run("scontrol", "update", f"jobid={job}", "StartTime=now")
        wait_for(lambda: slurm.job(job)["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"),
                 300, "the restarted job")
        info = slurm.job(job)
    text = read(log)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, text[-3000:])
    signal_name = "SIGTERM" if stop == "scontrol requeue" else "SIGUSR1"
    assert f"stopped by {signal_name} at step" in text, text[-3000:]
    assert text.count("requeueing job") == (1 if signal_name == "SIGUSR1" else 0)   # SLURM requeues on its own
    assert f"restart 1 of job {job}" in text and "resumed from" in text
    assert_same_weights(load_model(out), resnet_uninterrupted, tol=1e-6)


@pytest.mark.skipif(NO_SLURM is not None, reason=str(NO_SLURM))
def test_slurm_job_that_asked_for_gpus_and_sees_none_stops_saying_so(tmp_path):
    """SLURM gives the job 2 GPUs per node (by count, with no devices behind them): the batch
    script stops before any training instead of going on with gloo on CPU."""
    log = tmp_path / "job.out"
    with local_slurm.LocalSlurm(gpus_per_node=2) as slurm:
        submitted = slurm.run("sbatch", f"--output={log}", "--gpus-per-node=2", "--cpus-per-task=1",
                              f"--export=ALL,PYTHON={sys.executable},OUT={tmp_path / 'out'}",
                              "examples/slurm_ddp_resnet.sbatch", *PREEMPTIBLE, cwd=HERE)
        job = submitted.stdout.split()[-1]
        wait_for(lambda: slurm.job(job)["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"),
                 120, "the job's end")
        info = slurm.job(job)
    assert info["JobState"] == "FAILED", (info, read(log))
    assert "the job has 2 GPU(s) per node from SLURM, but torch sees 0" in read(log)
    assert "ddp_resnet:" not in read(log) and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the README says what is true
def readme_commands():
    """(script, arguments, launched by torchrun) for every command in README.md's code blocks."""
    text = open(os.path.join(HERE, "README.md")).read()
    blocks = text.split("```")[1::2]
    for line in (l.split(" #")[0].strip() for block in blocks for l in block.splitlines()[1:]):
        words = line.split()
        scripts = [i for i, w in enumerate(words) if w.endswith((".py", ".sbatch", ".sh"))]
        if scripts:
            i = scripts[-1]   # the script torchrun, sbatch or simulated_cluster.py runs
            yield words[i], words[i + 1:], "torchrun" in words[:i]


def test_readme_cites_only_tests_that_exist():
    cited = set(re.findall(r"`(test_\w+)`", open(os.path.join(HERE, "README.md")).read()))
    defined = set(re.findall(r"^def (test_\w+)", open(__file__).read(), re.M))
    assert cited and cited <= defined, cited - defined


def test_readme_commands_name_files_and_flags_that_exist(monkeypatch, capsys):
    commands = list(readme_commands())
    assert len(commands) >= 10
    for script, argv, torchrun in commands:
        assert os.path.isfile(os.path.join(HERE, script)), script
        module = "ddp_resnet" if script.endswith(".sbatch") else os.path.splitext(script)[0]   # it runs ddp_resnet.py
        if module not in ("scratch_lenet", "dp_resnet", "ddp_toy", "ddp_resnet", "fsdp_resnet"):
            continue
        if torchrun or script.endswith(".sbatch"):   # how a script sees torchrun: flags valid only there
            monkeypatch.setenv("RANK", "0")
            monkeypatch.setenv("WORLD_SIZE", "2")
        else:
            monkeypatch.delenv("RANK", raising=False)
        try:
            __import__(module).parse_args(argv)
        except SystemExit:
            pytest.fail(f"README: {script} {' '.join(argv)}: {capsys.readouterr().err}")


def ring_check():
    """Under torchrun: the hand-written ring equals dist.all_reduce, for lengths that don't divide."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    for shapes in ([(1,)], [(2,)], [(7,)], [(5, 3), (11,), (2, 2, 2)], [(1001,)]):
        mine = [torch.randn(s) for s in shapes]
        expected = [t.clone() for t in mine]
        for t in expected:
            dist.all_reduce(t)
        scratch_lenet.ring_allreduce(mine, rank, world_size)
        for a, b in zip(mine, expected):
            assert torch.allclose(a, b, atol=1e-5), (shapes, a, b)
        # The first half alone leaves this process the full sum of the chunk it owns.
        chunks = list(torch.randn(sum(torch.Size(s).numel() for s in shapes)).tensor_split(world_size))
        total = torch.cat(chunks).clone()
        dist.all_reduce(total)
        scratch_lenet.ring_reduce_scatter(chunks, rank, world_size)
        mine = scratch_lenet.owned_chunk(rank, world_size)
        assert torch.allclose(chunks[mine], total.tensor_split(world_size)[mine], atol=1e-5)
    print("ring ok", flush=True)
    dist.destroy_process_group()


def overlap_order():
    """Under torchrun: with --overlap a bucket's ring allreduce starts before backward has produced
    the last gradient (the first layer's)."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    events, ring = [], scratch_lenet.ring_allreduce
    def recorded_ring(tensors, *args):
        events.append("send")
        ring(tensors, *args)
    scratch_lenet.ring_allreduce = recorded_ring
    replicas = [scratch_lenet.get_params(scratch_lenet.init_params(0), "cpu")]
    overlap = scratch_lenet.OverlappedAllreduce(replicas, rank, world_size, bucket_bytes=1024)
    for p in replicas[0]:   # registered after the class's own hook, so it runs after it
        p.register_post_accumulate_grad_hook(lambda p: events.append("grad"))
    X, y = torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,))
    velocities = [[torch.zeros_like(p) for p in replicas[0]]]
    scratch_lenet.train_batch(X, y, replicas, velocities, ["cpu"], 0.1, 256, rank, world_size, overlap=overlap)
    last_grad = len(events) - 1 - events[::-1].index("grad")
    assert events.count("send") == 4 and events.index("send") < last_grad, events
    print("overlap ok", events, flush=True)
    dist.destroy_process_group()


def fsdp_load(checkpoint, out):
    """Under torchrun: shard a fresh model over this world size, load the checkpoint into it, and
    write the whole model it then holds."""
    rank, world_size, device = common.init_distributed(60)
    model = fsdp_resnet.shard(common.fashion_resnet18(1), device, world_size, amp=False)   # other weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fsdp_resnet.load_checkpoint(checkpoint, model, optimizer, device, rank, world_size)
    state = fsdp_resnet.full_state_dict(model)
    if rank == 0:
        torch.save(state, out)
    torch.distributed.destroy_process_group()


def threads_left(script, argv):
    """Run one rank of `script` in this process; print the names of its threads just before it
    destroys the process group, and after the script has returned."""
    import torch.distributed as dist
    def thread_names():
        return " ".join(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
    destroy = dist.destroy_process_group
    def destroy_and_report(*args, **kwargs):
        print("threads before destroy:", thread_names(), flush=True)
        destroy(*args, **kwargs)
    dist.destroy_process_group = destroy_and_report
    __import__(script).main(argv)
    print("threads left:", thread_names(), flush=True)


def slow_barrier(rendezvous_timeout, work_seconds):
    """Under torchrun: join with a short rendezvous timeout, then rank 0 works while the others wait."""
    rank, _, _ = common.init_distributed(float(rendezvous_timeout))
    if rank == 0:
        time.sleep(float(work_seconds))
    torch.distributed.barrier()
    print("barrier passed", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:] == ["ring-check"]:
    ring_check()
if __name__ == "__main__" and sys.argv[1:] == ["overlap-order"]:
    overlap_order()
if __name__ == "__main__" and sys.argv[1:2] == ["fsdp-load"]:
    fsdp_load(*sys.argv[2:])
if __name__ == "__main__" and sys.argv[1:2] == ["threads-left"]:
    threads_left(sys.argv[2], sys.argv[3:])
if __name__ == "__main__" and sys.argv[1:2] == ["slow-barrier"]:
    slow_barrier(*sys.argv[2:])
