"""Tests for the collection, all on CPU: `bash run_all.sh test` (or `python -m pytest -q test_scripts.py`).

They run the README's commands as written, with small sizes through flags, and compare weights,
accuracies and messages. `python test_scripts.py ring-check` is a helper the tests start under
torchrun."""
import json, os, shutil, subprocess, sys
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
    scratch_lenet.train_batch(X, y, replicas, ["cpu"] * 3, lr=0.5, global_batch=10)
    for i, p in enumerate(reference):
        for W in replicas:
            assert torch.allclose(W[i], p - 0.5 * p.grad, atol=1e-6)


@pytest.fixture(scope="module")
def scratch_one_replica(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("scratch1"))
    scratch_lenet.main(SMALL + ["--devices", "1", "--max-steps", "6", "--batch-size", "96", "--out", out])
    return load_model(out)


@pytest.mark.parametrize("replicas", [2, 3])
def test_scratch_replicas_end_with_one_device_weights(replicas, scratch_one_replica, tmp_path):
    out = str(tmp_path)
    final = scratch_lenet.main(SMALL + ["--devices", str(replicas), "--max-steps", "6",
                                        "--batch-size", "96", "--out", out])
    assert_same_weights(load_model(out), scratch_one_replica)
    for W in final[1:]:   # the replicas never drift apart
        assert all(torch.equal(a, b) for a, b in zip(W, final[0]))


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


def test_scratch_readme_command_learns(tmp_path):
    result = run(["python", "scratch_lenet.py", "--epochs", "1", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert metrics["test_samples"] == 10000 and metrics["test_acc"] >= 0.80
    assert "done:" in result.stdout and "test acc" in result.stdout
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert list(load_model(tmp_path)) == scratch_lenet.PARAM_NAMES


@pytest.mark.parametrize("flags, message", [
    (["--devices", "0"], "--devices: invalid positive_int value: '0'"),
    (["--batch-size", "0"], "--batch-size: invalid positive_int value: '0'"),
    (["--devices", "3", "--batch-size", "2"], "--batch-size 2 is smaller than the 3 replicas"),
    (["--lr", "-1"], "--lr: invalid positive_float value: '-1'"),
])
def test_bad_flags_give_argparse_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        scratch_lenet.parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


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
    print("ring ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:] == ["ring-check"]:
    ring_check()
