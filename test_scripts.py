"""The scripts' tests, all on CPU: each approach trains like one device, and the pieces that make
it so. The whole suite: `bash run_all.sh test` (or `python -m pytest -q`); faults and preemption
are in test_faults.py, several machines in test_cluster.py, the README's claims in test_readme.py,
what they share in conftest.py."""
import json, os, re, shutil, subprocess, sys, threading
import pytest
import torch
import common
import ddp_resnet
import ddp_toy
import dp_resnet
import fsdp_resnet
import scratch_lenet
import scratch_ring
from conftest import (DATA, HERE, OFFLINE, ONE_THREAD, RESNET, RESNET_LR, SMALL, TOY, assert_ok, assert_same_weights,
                      load_model, resnet_reference, resnet_step, run)

LENET_PARAMS = sum(p.numel() for p in scratch_lenet.init_params(0))
RESNET_BYTES = 4 * sum(p.numel() for p in common.fashion_resnet18(0).parameters())   # 44,691,240

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


def test_missing_matplotlib_is_said_before_training(tmp_path):
    """curves.png is drawn at the end; without matplotlib the run stops at the start, saying so."""
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "matplotlib.py").write_text("raise ImportError('hidden for this test')")
    result = run(["python", "ddp_resnet.py", "--out", str(tmp_path / "out")] + RESNET,
                 env={"PYTHONPATH": str(tmp_path / "hide")})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "error: matplotlib is missing" in result.stderr and "ddp_resnet:" not in result.stdout   # before training


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
    assert json.load(open(tmp_path / "metrics.json"))["sent_bytes_per_step"] == 4 * LENET_PARAMS   # its gradient, each step


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


def test_scratch_readme_command_learns(tmp_path):
    result = run(["python", "scratch_lenet.py", "--epochs", "1", "--out", str(tmp_path)])
    assert_ok(result)
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert metrics["test_samples"] == 10000 and metrics["test_acc"] >= 0.80
    assert "done:" in result.stdout and "test acc" in result.stdout
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert list(load_model(tmp_path)) == scratch_lenet.PARAM_NAMES


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
    for nproc in (2, 3):
        result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "torchrun_checks.py", "ring-check"])
        assert_ok(result)
        assert result.stdout.count("ring ok") == nproc


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


@pytest.mark.parametrize("nproc, devices, flag", [(2, 2, None), (2, 1, "--overlap"), (3, 1, "--overlap"),
                                                  (2, 2, "--overlap"), (3, 2, "--overlap"),
                                                  (2, 1, "--zero"), (3, 1, "--zero"), (2, 2, "--zero")])
def test_hierarchical_overlap_and_zero_train_like_one_device(nproc, devices, flag, scratch_one_replica, tmp_path):
    """2 processes x 2 replicas is 4 replicas; --overlap (one bucket per layer) and --zero only
    move when and where the sums and updates happen: the weights stay those of one device."""
    flags = [flag] + (["--bucket-kb", "1"] if flag == "--overlap" else []) if flag else []
    result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "scratch_ring.py", "--devices",
                  str(devices)] + flags + SMALL + ["--max-steps", "6", "--batch-size", "96", "--out", str(tmp_path)])
    assert_ok(result)
    assert_same_weights(load_model(tmp_path), scratch_one_replica, tol=1e-6)
    metrics = json.load(open(tmp_path / "metrics.json"))
    layout = f"{nproc} processes x {devices} replica{'s' * (devices > 1)}"
    assert metrics["layout"] == layout and layout in result.stdout
    if flag == "--overlap":
        assert "in 4 buckets" in result.stdout   # --bucket-kb 1: one per LeNet layer
    replicated = 4 * LENET_PARAMS * devices   # momentum for every parameter in every replica
    rank0_chunk = len(torch.empty(LENET_PARAMS).tensor_split(nproc)[scratch_ring.owned_chunk(0, nproc)])
    assert metrics["optimizer_state_bytes"] == (4 * rank0_chunk if flag == "--zero" else replicated)
    if flag == "--zero":   # 1/W of one replica's momentum, up to the uneven last chunk
        assert abs(metrics["optimizer_state_bytes"] - 4 * LENET_PARAMS / nproc) <= 4


def test_overlap_sends_before_backward_ends():
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "torchrun_checks.py", "overlap-order"])
    assert_ok(result)
    assert result.stdout.count("overlap ok") == 2, result.stdout


# ---------------------------------------------------------------- ddp_toy.py
@pytest.mark.parametrize("launch", [["python", "ddp_toy.py", "--world-size", "2"],
                                    ["torchrun", "--standalone", "--nproc_per_node=2", "ddp_toy.py"]])
def test_ddp_toy_any_world_size_trains_like_one_rank(launch, toy_one_rank, tmp_path):
    result = run(launch + ["--out", str(tmp_path)] + TOY)
    assert_ok(result)
    assert_same_weights(load_model(tmp_path), toy_one_rank)
    assert result.stdout.count("epoch ") == 3   # rank 0 alone prints


def test_ddp_toy_accuracy_is_over_the_whole_test_set(toy_one_rank, tmp_path):
    """World size 3 (the third of test_ddp_toy_any_world_size_trains_like_one_rank's sizes)."""
    result = run(["python", "ddp_toy.py", "--world-size", "3", "--out", str(tmp_path)] + TOY)
    assert_ok(result)
    assert_same_weights(load_model(tmp_path), toy_one_rank)
    net = ddp_toy.ToyMLP()
    net.load_state_dict(load_model(tmp_path))
    X, y = ddp_toy.toy_data(301, seed=2)   # 301 does not divide by 3
    single = common.evaluate(net, X, y, torch.device("cpu"))
    reported = json.load(open(tmp_path / "metrics.json"))
    assert reported["test_acc"] == single and reported["test_samples"] == 301


def test_ddp_toy_runs_on_eight_ranks(tmp_path):
    result = run(["python", "ddp_toy.py", "--world-size", "8", "--epochs", "1", "--train-samples", "480",
                  "--out", str(tmp_path)])
    assert_ok(result)
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


def test_more_ranks_than_gpus_is_refused_before_nccl(monkeypatch):
    """The scripts' own set-up refuses before init_process_group: a CUDA machine with too few GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("the group was formed"))
    for name, value in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        ddp_toy.main([])
    assert "2 processes on this node but 1 GPUs" in str(exit_info.value.code)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(SystemExit) as exit_info:
        scratch_ring.main(["--devices", "2"])
    assert "2 processes x 2 GPUs each on this node but 3 GPUs" in str(exit_info.value.code)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
@pytest.mark.parametrize("script, flags", [("ddp_toy", TOY), ("ddp_resnet", RESNET)])
def test_no_process_group_thread_outlives_the_training(script, flags, tmp_path):
    """A group kept alive past destroy_process_group keeps gloo's threads running into interpreter
    shutdown, where they now and then abort a rank that has finished ("terminate called without
    an active exception", seen in CI). One rank, started as torchrun would start it."""
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(common.free_port()), **ONE_THREAD)
    result = run(["python", "torchrun_checks.py", "threads-left", script, "--out", str(tmp_path)] + flags, env=env)
    assert_ok(result)
    def group_threads(label):
        names = result.stdout.split(label)[1].splitlines()[0].split()
        return [t for t in names if "gloo" in t or "tcpstore" in t]
    assert group_threads("threads before destroy:"), result.stdout   # the names this check looks for
    assert group_threads("threads left:") == [], result.stdout


# ---------------------------------------------------------------- ddp_resnet.py and dp_resnet.py
@pytest.mark.parametrize("nproc", [1, 2])
def test_ddp_resnet_step_is_the_per_shard_batchnorm_step(nproc, resnet_tolerance, tmp_path):
    result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "ddp_resnet.py"] + RESNET +
                 ["--out", str(tmp_path)], env=ONE_THREAD)
    assert_ok(result)
    assert_same_weights(load_model(tmp_path), resnet_reference(nproc), tol=resnet_tolerance)
    sent = json.load(open(tmp_path / "metrics.json"))["sent_bytes_by_collective"]
    expected = RESNET_BYTES if nproc > 1 else 0   # every gradient, once per step; one rank sends nothing
    assert sent == ({f"all_reduce ({nproc} ranks)": RESNET_BYTES} if nproc > 1 else {})
    assert f"{expected / 1e6:.3g} MB to collectives per step and rank" in result.stdout


def test_dataparallel_step_equals_ddp_resnet_step(resnet_tolerance, tmp_path):
    """One step of dp_resnet.py is the step of one DDP rank (the reference, which
    ddp_resnet.py computes: test above), with the same flags: --lr is for 256 samples in both."""
    result = run(["python", "dp_resnet.py"] + RESNET + ["--max-steps", "1", "--out", str(tmp_path)], env=ONE_THREAD)
    assert_ok(result)
    assert "DataParallel runs the model on the CPU" in result.stdout
    assert json.load(open(tmp_path / "metrics.json"))["sent_bytes_per_step"] == 0   # one device: nothing moves
    assert_same_weights(load_model(tmp_path), resnet_reference(1, steps=1), tol=resnet_tolerance)


def test_ddp_resnet_accuracy_is_over_the_whole_test_set(tmp_path):
    result = run(["torchrun", "--standalone", "--nproc_per_node=3", "ddp_resnet.py"] + RESNET +
                 ["--batch-size", "15", "--out", str(tmp_path)])
    assert_ok(result)
    net = common.fashion_resnet18(0)
    net.load_state_dict(load_model(tmp_path))
    X_test, y_test = common.load_fashion_mnist(DATA, 1, 101)["test"]
    single = common.evaluate(net.eval(), X_test, y_test, torch.device("cpu"))
    assert json.load(open(tmp_path / "metrics.json"))["test_acc"] == single


def test_gradient_accumulation_equals_ranks(resnet_tolerance, tmp_path):
    """--accum-steps 2 in one process computes BatchNorm over the same half-batches as 2 ranks,
    so it must end with their weights: the 2-shard reference's, which 2 ranks reach (test above).
    Buffers: rank 0's there, both micro-batches' here: not compared."""
    accum = run(["python", "ddp_resnet.py"] + RESNET + ["--accum-steps", "2", "--out", str(tmp_path)], env=ONE_THREAD)
    assert_ok(accum)
    a, r = load_model(tmp_path), resnet_reference(2)
    params = dict(common.fashion_resnet18(0).named_parameters())
    assert_same_weights({k: a[k] for k in params}, {k: r[k] for k in params}, tol=resnet_tolerance)


def test_two_nodes_train_like_one_process(resnet_tolerance, tmp_path):
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
    assert_same_weights(load_model(outs[0]), resnet_reference(2), tol=resnet_tolerance)


def test_amp_and_channels_last_run_on_cpu(tmp_path):
    """--sync-bn too: torch refuses SyncBatchNorm on CPU, the script says so and goes on."""
    result = run(["python", "ddp_resnet.py"] + RESNET + ["--max-steps", "1", "--amp", "--channels-last", "--sync-bn",
                                                        "--out", str(tmp_path)])
    assert_ok(result)
    assert "--sync-bn needs CUDA" in result.stdout
    # bf16 autocast: not the fp32 step, but the same step direction
    step_fp32, step_amp = resnet_step(resnet_reference(1, steps=1)), resnet_step(load_model(tmp_path))
    assert torch.nn.functional.cosine_similarity(step_fp32, step_amp, dim=0) > 0.9


def test_compiled_ddp_with_accumulation_trains_like_eager(tmp_path):
    """torch.compile of the DDP model, with no_sync on the first of 2 micro-steps: the step of
    eager mode, up to the rounding that BatchNorm over micro-batches of 4 images amplifies (0.5%
    of the step measured; a micro-batch's gradient lost would be half of it)."""
    flags = RESNET + ["--max-steps", "1", "--accum-steps", "2"]
    eager = run(["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--out", str(tmp_path / "e")] + flags)
    compiled = run(["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--compile",
                    "--out", str(tmp_path / "c")] + flags, timeout=600)
    assert_ok(eager)
    assert_ok(compiled)
    step_eager, step_compiled = resnet_step(load_model(tmp_path / "e")), resnet_step(load_model(tmp_path / "c"))
    assert (step_compiled - step_eager).norm() / step_eager.norm() < 0.02


@pytest.mark.parametrize("hook, nproc", [("bf16", 2), ("fp16", 1)])
def test_16_bit_comm_hooks_step_the_fp32_way(hook, nproc, tmp_path):
    """PyTorch's bf16/fp16 compression hooks: the reference step up to gradients rounded to 16
    bits (not exactly it: the hook is in use)."""
    result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "ddp_resnet.py"] + RESNET +
                 ["--comm-hook", hook, "--max-steps", "1", "--out", str(tmp_path)], env=ONE_THREAD)
    assert_ok(result)
    step_fp32, step_16 = resnet_step(resnet_reference(nproc, steps=1)), resnet_step(load_model(tmp_path))
    assert 0 < (step_16 - step_fp32).norm() / step_fp32.norm() < 0.02


def test_powersgd_compresses_after_plain_steps_and_a_resume_starts_it_afresh(resnet_tolerance, tmp_path):
    """--powersgd-start 2: two plain allreduce steps (the reference's), then rank-1 factors
    (another step). A resume at step 2 starts PowerSGD afresh, says so, and its next two steps
    are plain again: the reference's 4 steps."""
    torchrun = ["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--comm-hook", "powersgd",
                "--powersgd-rank", "1", "--powersgd-start", "2"] + RESNET
    whole = run(torchrun + ["--max-steps", "4", "--out", str(tmp_path / "whole")], env=ONE_THREAD)
    stopped = run(torchrun + ["--max-steps", "2", "--out", str(tmp_path / "parts")], env=ONE_THREAD)
    assert_ok(whole)
    assert_ok(stopped)
    assert_same_weights(load_model(tmp_path / "parts"), resnet_reference(2, steps=2), tol=resnet_tolerance)
    resumed = run(torchrun + ["--max-steps", "4", "--resume", "--out", str(tmp_path / "parts")], env=ONE_THREAD)
    assert_ok(resumed)
    assert "note: PowerSGD starts afresh after a resume: plain allreduce for 2 steps" in resumed.stdout
    plain = resnet_reference(2, steps=4)
    assert_same_weights(load_model(tmp_path / "parts"), plain, tol=resnet_tolerance)
    compressed = resnet_step(load_model(tmp_path / "whole")) - resnet_step(plain)
    assert compressed.norm() > 1e-3 * resnet_step(plain).norm()   # steps 3 and 4 were compressed


# ---------------------------------------------------------------- fsdp_resnet.py
@pytest.mark.parametrize("nproc, steps", [(2, 2), (3, 1)])
def test_fsdp_resnet_trains_like_ddp_resnet_with_a_shard_of_the_memory(nproc, steps, resnet_tolerance, tmp_path):
    """Same seed and global batch: the same weights (at 3 ranks after one step: in the first steps
    of a ResNet, the other summation order of a reduce-scatter grows from 1e-7 to 4e-5 by the
    second). Each rank holds 1/W of the parameters, gradients and momentum."""
    flags = RESNET + ["--batch-size", "12", "--max-steps", str(steps)]
    fsdp = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "fsdp_resnet.py"] + flags +
               ["--out", str(tmp_path / "fsdp")], env=ONE_THREAD)
    ddp = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "ddp_resnet.py"] + flags +
              ["--out", str(tmp_path / "ddp")], env=ONE_THREAD)
    assert_ok(fsdp)
    assert_ok(ddp)
    assert_same_weights(load_model(tmp_path / "fsdp"), load_model(tmp_path / "ddp"), tol=resnet_tolerance)
    metrics = json.load(open(tmp_path / "fsdp" / "metrics.json"))
    assert metrics["test_acc"] == json.load(open(tmp_path / "ddp" / "metrics.json"))["test_acc"]
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


@pytest.mark.parametrize("nproc, mesh", [(2, "flat"), (3, "flat"), (4, "hsdp")])
def test_fsdp_bytes_computed_from_the_shards_are_what_torch_distributed_is_handed(nproc, mesh):
    """fsdp_resnet.py counts what FSDP2 sends from the shards' sizes (public APIs only); one
    step's all-gathers, reduce-scatters and (HSDP, 2 x 2) all-reduces, counted where
    torch.distributed is called, are those bytes exactly, in fp32 and with --amp."""
    result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "torchrun_checks.py", "fsdp-sent", mesh],
                 env=ONE_THREAD)
    assert_ok(result)
    assert "fsdp sent ok" in result.stdout


def test_fsdp_amp_runs_on_cpu_and_steps_the_fp32_way(tmp_path):
    """--amp: FSDP's mixed precision (bf16 compute, fp32 gradient reduction): not the fp32 step,
    but the same direction."""
    # 4 images per rank and 10 to test: bf16 convolutions are slow on CPUs without bf16 units
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "fsdp_resnet.py", "--amp", "--out", str(tmp_path)] +
                 RESNET + ["--max-steps", "1", "--batch-size", "8", "--test-samples", "10"], env=ONE_THREAD)
    assert_ok(result)
    reference = resnet_reference(2, steps=1, lr=RESNET_LR * 8 / 256, batch_size=8)
    step_fp32, step_amp = resnet_step(reference), resnet_step(load_model(tmp_path))
    assert torch.nn.functional.cosine_similarity(step_fp32, step_amp, dim=0) > 0.9


# ---------------------------------------------------------------- every script's command line
@pytest.mark.parametrize("script", [ddp_toy, ddp_resnet, dp_resnet, fsdp_resnet])
@pytest.mark.parametrize("flag", ["--epochs", "--max-steps", "--batch-size", "--lr"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_zero_or_negative_numbers_are_refused(script, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args([flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be positive, got {value}" in capsys.readouterr().err

