"""What the tests share (test_scripts.py and tests/ import it): paths, the small sizes the scripts
run at, running a README command, comparing weights, and the runs several tests compare against
(session fixtures, each computed once even where both tiers import it)."""
import ast, contextlib, copy, fcntl, functools, gzip, json, math, os, shutil, signal, socket, subprocess, sys, time
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repo root: the scripts run there
sys.path[:0] = [HERE, os.path.join(HERE, "examples")]
import pytest
import torch
import torch.nn.functional as F
import common
import ddp_toy
import local_slurm
import scratch_lenet
import scratch_ring
import simulated_cluster

# Two tests run at a time on two cores (run_all.sh's pytest -n 2), so every process a test starts, and the
# test process itself, computes on one thread. With more threads than cores, OpenMP's threads spin while
# they wait for each other: a ResNet run beside one busy core used 2.5x the CPU on 2 threads as on 1.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


DATA = os.path.join(HERE, "data")


SMALL = ["--train-samples", "1024", "--test-samples", "300", "--data-dir", DATA]


OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}   # downloads fail at once

LENET_PARAMS = sum(p.numel() for p in scratch_lenet.init_params(0))

RESNET_LR = 0.002   # for 256 samples: a rate at which ResNet's first steps do not amplify rounding
RESNET = ["--train-samples", "64", "--test-samples", "101", "--batch-size", "16", "--max-steps", "2",
          "--lr", str(RESNET_LR), "--data-dir", DATA]
TOY = ["--epochs", "3", "--train-samples", "600", "--test-samples", "301", "--batch-size", "48"]
TWO_EPOCHS = ["--epochs", "2", "--train-samples", "96", "--batch-size", "16", "--test-samples", "50",
              "--data-dir", DATA]   # 6 steps an epoch
PREEMPTIBLE = TWO_EPOCHS + ["--checkpoint-every", "2"]
NO_CLUSTER = simulated_cluster.unavailable()   # None here as root with ip, tc and ethtool
NO_SLURM = local_slurm.unavailable()   # None as root with slurm-wlm and munge (.ci/run installs them)


# What a launcher sets, and a page's main() sets for a group of one when it finds none.
LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def launcher_variables_restored():
    """The launcher's variables as they were before, after: a page's main() run in this process sets them, and what
    runs next here would take it for a launcher."""
    kept = {name: os.environ.get(name) for name in LAUNCHER}
    try:
        yield
    finally:
        for name, value in kept.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(autouse=True)
def launcher_variables_kept():
    """Each test finds the launcher's variables as the session had them, and leaves them so."""
    with launcher_variables_restored():
        yield


_computed = {}


def once(fixture):
    """A session fixture, computed once per run: pytest would compute it once for test_scripts.py and
    again for tests/, which both import it, and once more in each pytest-xdist worker. The first to
    ask computes it under a lock in the folder all workers of the run share (above each worker's
    temporary folder, which pytest deletes after a few runs); the others load it. The fixture
    takes tmp_path_factory."""
    @functools.wraps(fixture)
    def computed_once(*args, **kwargs):
        name = fixture.__name__
        if name not in _computed:
            if "PYTEST_XDIST_WORKER" not in os.environ:
                _computed[name] = fixture(*args, **kwargs)
            else:
                shared = kwargs["tmp_path_factory"].getbasetemp().parent   # pytest-N, above popen-gwK
                with open(shared / f"{name}.lock", "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    if not (shared / f"{name}.pt").exists():
                        torch.save(fixture(*args, **kwargs), shared / f"{name}.pt")
                    _computed[name] = torch.load(shared / f"{name}.pt", weights_only=False)
        return _computed[name]
    return computed_once


FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"   # apt-get install dataset-fashion-mnist: the four files, gzipped


def unpack_debian_files(data_dir, debian_dir=DEBIAN_DIR):
    """The set-up run_all.sh does: Debian's .gz files unpacked where torchvision's FashionMNIST reads them."""
    raw = os.path.join(data_dir, "FashionMNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for name in FILES:
        if not os.path.exists(os.path.join(raw, name)):
            with gzip.open(os.path.join(debian_dir, name + ".gz")) as packed, open(os.path.join(raw, name), "wb") as f:
                shutil.copyfileobj(packed, f)


@pytest.fixture(scope="session", autouse=True)
def fashion_mnist():
    if not all(os.path.exists(os.path.join(DATA, "FashionMNIST", "raw", name)) for name in FILES):
        unpack_debian_files(DATA)
    try:
        common.fashion_mnist(DATA)
    except SystemExit as e:
        pytest.fail(str(e.code))


def copy_fashion_mnist(data_dir):
    """DATA's Fashion-MNIST, as torchvision unpacks it, in another folder (another node's disk)."""
    shutil.copytree(os.path.join(DATA, "FashionMNIST", "raw"), os.path.join(data_dir, "FashionMNIST", "raw"))


def free_port():
    """A port no one listens on now (port 0: the OS picks one); another process may take it before the test does,
    which the tests live with."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def folder_datasets(folder, image_size=28, augment=False, train_samples=None):
    """What ddp_resnet.py's datasets() makes of an image folder: (training set, validation set, classes)."""
    import ddp_resnet
    flags = ["--data-dir", str(folder), "--image-size", str(image_size)] + ([] if augment else ["--no-augment"])
    if train_samples:
        flags += ["--train-samples", str(train_samples)]
    return ddp_resnet.datasets(ddp_resnet.parse_args(flags))


def fashion_resnet(seed=0):
    """The ResNet-18 the scripts make for Fashion-MNIST: 1x28x28 images, a 3x3 stem, no max-pool."""
    torch.manual_seed(seed)
    return common.classifier("resnet18", 10, channels=1, image_size=28)


def run(command, *, env=None, timeout=300, cwd=HERE):
    """Run a README command (small sizes through flags), from the repo root unless told."""
    if command[0] in ("python", "torchrun"):
        command = ([sys.executable] if command[0] == "python" else
                   [sys.executable, "-m", "torch.distributed.run"]) + command[1:]
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:   # the timeout, or the test run interrupted: every process it started goes too
        kill_tree(process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)



def assert_ok(result):
    """The command exited 0; if not, show the end of what it said."""
    assert result.returncode == 0, (result.stderr or result.stdout)[-3000:]


def load_model(out):
    return torch.load(os.path.join(out, "model.pt"), map_location="cpu")


def images_counted(out):
    """The test images each epoch's evaluation counted, summed over the ranks (metrics.json's test_count)."""
    with open(os.path.join(out, "metrics.json")) as f:
        return [epoch["test_count"] for epoch in json.load(f)["epochs"]]


def assert_toy_evaluated_once(out, reference=None):
    """ddp_toy.py's run in `out`, at TOY's sizes: each epoch's evaluation counted the 301 test images once, and the
    last one's accuracy and test loss are one process's, computed here over the whole test set on the weights the
    run saved (the loss up to float32's order of summation), and, given a `reference` (one rank's weights), on those
    too: the same test loss at every world size."""
    assert images_counted(out) == [301] * 3
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    net = ddp_toy.ToyMLP()
    X, y = ddp_toy.toy_data(301, seed=2)   # 301 divides by neither 2 nor 3
    for weights in [load_model(out)] + ([reference] if reference else []):
        net.load_state_dict(weights)
        with torch.no_grad():
            logits = net(X)
        assert metrics["test_acc"] == (logits.argmax(1) == y).sum().item() / 301 and metrics["test_samples"] == 301
        loss = F.cross_entropy(logits, y).item()
        assert metrics["epochs"][-1]["test_loss"] == pytest.approx(loss, rel=1e-6)


def max_difference(a, b):
    """The largest difference of any weight or buffer between two state dicts of one model."""
    assert a.keys() == b.keys()
    return max((a[name].float() - b[name].float()).abs().max().item() for name in a)


def assert_same_weights(a, b, tol=1e-5):
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max().item() <= tol, name



def resnet_step(weights):
    """The step from ResNet-18's initial weights (seed 0) to `weights`, as one flat vector of its
    parameters: steps that are not equal (bf16, compiled kernels) are compared by direction."""
    start = fashion_resnet(0).state_dict()
    names = [name for name, _ in fashion_resnet(0).named_parameters()]
    return torch.cat([(weights[n].float() - start[n]).flatten() for n in names])


def resnet_reference(shards, steps=2, lr=RESNET_LR * 16 / 256, batch_size=16, samples=64, threads=1,
                     total_steps=None, consecutive=False, exact_mean=False, clip=None, norms=None):
    """Single process, by hand: per-shard BatchNorm (as each DDP rank has), gradients averaged,
    buffers from shard 0 (DDP broadcasts rank 0's). What DDP is supposed to compute. One thread,
    as each torchrun worker has (another number sums in another order inside the kernels).
    `total_steps`: the cosine's length (default: 5 epochs, ddp_resnet.py's); `consecutive`: the
    shards are the batch's consecutive pieces (ft_ddp_resnet.py's micro-batches), not every
    W-th image (DistributedSampler's shares); `exact_mean`: their gradients summed in float64,
    the mean rounded once to float32 (ft_ddp_resnet.py's sums; an allreduce's are float32); `clip`: the
    averaged gradient clipped to that total norm (torch's clip_grad_norm_), each step's norm before it
    appended to the list `norms`."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _resnet_reference(shards, steps, lr, batch_size, samples, total_steps or 5 * (samples // batch_size),
                                 consecutive, torch.float64 if exact_mean else torch.float32, clip, norms)
    finally:
        torch.set_num_threads(before)


def _resnet_reference(shards, steps, lr, batch_size, samples, total_steps, consecutive, sums, clip, norms):
    X_train, y_train = common.fashion_mnist(DATA, samples, 1)[0].tensors
    net = fashion_resnet(0)
    # ddp_resnet's recipe: --lr for 256 samples, scaled to the global batch; no weight decay on
    # BatchNorm and biases; the cosine over total_steps
    decay = [p for p in net.parameters() if p.ndim > 1]
    rest = [p for p in net.parameters() if p.ndim == 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": rest, "weight_decay": 0}],
                                lr=lr, momentum=0.9)
    for step, idx in enumerate(epoch_batches(samples, batch_size, seed=0, epoch=1)[:steps]):
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total_steps))
        net.zero_grad(set_to_none=True)
        replicas = [copy.deepcopy(net) for _ in range(shards)]
        parts = idx.chunk(shards) if consecutive else [idx[r::shards] for r in range(shards)]
        for replica, part in zip(replicas, parts):
            F.cross_entropy(replica(X_train[part]), y_train[part]).backward()
        for name, p in net.named_parameters():
            p.grad = (sum(dict(r.named_parameters())[name].grad.to(sums) for r in replicas) / shards).float()
        for name, b in net.named_buffers():
            b.copy_(dict(replicas[0].named_buffers())[name])
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), clip).item())
        optimizer.step()
    return net.state_dict()


def epoch_batches(samples, batch_size, seed, epoch):
    """The global batches every script draws: DistributedSampler's order of the epoch, cut into batches."""
    sampler = torch.utils.data.DistributedSampler(range(samples), num_replicas=1, rank=0, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    return torch.tensor(list(sampler))[: samples // batch_size * batch_size].view(-1, batch_size)


def scratch_ring_trains_like_one_device(nproc, devices, flag, reference, tmp_path):
    """scratch_ring.py on nproc processes x devices replicas, with --overlap (one bucket per LeNet
    layer), --zero or neither: one device's weights (1e-6), its layout said, and the optimizer state
    each process keeps (ZeRO: its chunk of one replica's momentum)."""
    flags = [flag] + (["--bucket-kb", "1"] if flag == "--overlap" else []) if flag else []
    result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "scratch_ring.py", "--devices",
                  str(devices)] + flags + SMALL + ["--max-steps", "6", "--batch-size", "96", "--out", str(tmp_path)])
    assert_ok(result)
    assert_same_weights(load_model(tmp_path), reference, tol=1e-6)
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


def descendants_of(pid):
    """Every process below `pid`: children, theirs, and so on."""
    found = children_of(pid)
    return found + [d for child in found for d in descendants_of(child)]


def kill_tree(pid):
    """SIGKILL to `pid`, then to every process that was below it (torchrun starts each rank in a session of its
    own, so killing torchrun's process group would leave them running); the first before the rest, so that a
    torchrun cannot start its ranks again."""
    for each in [pid] + descendants_of(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


def wait_for(condition, seconds, what):
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.2)


def read(path):
    return path.read_text() if path.exists() else ""


def running(pid):
    """Whether the process exists and is not a zombie (one waiting for its parent to collect it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="session")
@once
def resnet_tolerance(tmp_path_factory):
    """How far two ResNet runs that compute the same sums in another order may differ, measured on
    this CPU (fitted on one machine, a fixed number failed on another): the 2-shard reference's
    weights after 2 steps with 1 thread against 2 threads (only the order of sums inside the
    kernels differs), never below one float32 rounding step of the largest weight; times 10."""
    one, two = resnet_reference(2), resnet_reference(2, threads=2)
    rounding = torch.finfo(torch.float32).eps * max(t.abs().max().item() for t in one.values() if t.is_floating_point())
    return 10 * max(max_difference(one, two), rounding)


# ---------------------------------------------------------------- runs several tests compare against
@pytest.fixture(scope="session")
@once
def scratch_one_replica(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("scratch1"))
    scratch_lenet.main(SMALL + ["--devices", "1", "--max-steps", "6", "--batch-size", "96", "--out", out])
    return load_model(out)


@pytest.fixture(scope="session")
@once
def toy_one_rank(tmp_path_factory):
    """ddp_toy.py's weights on one rank, whose evaluations each count the 301 test images once, its test loss one
    process's over them."""
    out = tmp_path_factory.mktemp("toy1")
    result = run(["python", "ddp_toy.py", "--world-size", "1", "--out", str(out)] + TOY)
    assert_ok(result)
    assert_toy_evaluated_once(out)
    return load_model(out)


@pytest.fixture(scope="session")
@once
def resnet_uninterrupted_run(tmp_path_factory):
    """ddp_resnet.py on 2 ranks, never stopped: its weights, and what it printed, a progress line
    after every step (a logging flag: the training is the same without it)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--print-every", "1",
                  "--out", str(out)] + PREEMPTIBLE)
    assert_ok(result)
    return {"weights": load_model(out), "stdout": result.stdout}


@pytest.fixture(scope="session")
def resnet_uninterrupted(resnet_uninterrupted_run):
    return resnet_uninterrupted_run["weights"]


@pytest.fixture(scope="session")
@once
def mid_epoch_checkpoint_of_2_ranks(tmp_path_factory):
    """A checkpoint written at step 2 of 6 in epoch 1 by 2 ranks (global batch 16, seed 0, 96 samples)."""
    out = tmp_path_factory.mktemp("mid_epoch")
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--max-steps", "2",
                  "--out", str(out)] + PREEMPTIBLE)
    assert_ok(result)
    assert "checkpoint: step 2 (epoch 1 at batch 2/6)" in result.stdout
    return out / "checkpoint.pt"


def readme_block(marker):
    """The first Python block of the README that holds `marker`, as it stands there."""
    text = open(os.path.join(HERE, "README.md")).read()
    return next(block for block in text.split("```")[1::2] if marker in block).removeprefix("python\n")


def readme_make_model():
    """The README's make_model() (its "Your own model"), as it stands there."""
    return readme_block("def make_model")


def readme_fine_tune():
    """The README's make_model() with its fine-tuning lines before `return net`, as the README says."""
    return readme_make_model().replace("    return net\n", readme_block("requires_grad_(False)") + "    return net\n")


def with_make_model(page, source, monkeypatch):
    """`page`'s make_model() replaced by the one defined in `source` (run with the page's names and torchvision), in
    this process, until the test ends."""
    namespace = {**vars(page), "torchvision": __import__("torchvision")}
    exec(source, namespace)
    monkeypatch.setattr(page, "make_model", namespace["make_model"])


def with_readme_model(page_text):
    """A page's text with its make_model() replaced by the README's, and `import torchvision` at its top, as the
    README says."""
    start = page_text.index("def make_model(args, shape, classes):")
    end = page_text.index("# ----------------------------------------------------------------", start)
    page_text = page_text[:start] + readme_make_model() + "\n\n" + page_text[end:]
    return page_text.replace("\nimport common\n", "\nimport torchvision\nimport common\n", 1)


def copy_set(script):
    """The script and the files of this folder it imports, followed from their import lines."""
    found, todo = set(), [script]
    while todo:
        name = todo.pop()
        if name in found or not os.path.isfile(os.path.join(HERE, name + ".py")):
            continue
        found.add(name)
        for node in ast.walk(ast.parse(open(os.path.join(HERE, name + ".py")).read())):
            if isinstance(node, ast.Import):
                todo += [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                todo.append(node.module.split(".")[0])
    return sorted(found)
