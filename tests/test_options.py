"""The scripts' options beyond their approach, and runs longer than a proof needs: torch.compile,
bf16 autocast, channels-last, scratch_ring.py's --overlap and --zero at three processes, eight
ranks, the README's first command to its accuracy, accuracy at three ranks, no process-group thread
left at exit, the CPU path without Linux-only calls, the GPU check on a machine without GPUs, and
the pages other than ddp_resnet.py's family: their outputs after every epoch, their test loss,
dp_resnet.py's progress line, cuDNN settings and evaluation. Run by `bash run_all.sh test`."""
import json, os, re, subprocess, sys, warnings
import pytest
import torch
import common
import ddp_resnet
import ddp_toy
import dp_resnet
import scratch_lenet
import scratch_ring
from as_on_a_gpu import READ_BACK, as_on_a_gpu
from helpers import (DATA, HERE, RESNET, RESNET_LR, SMALL, TOY, TWO_EPOCHS, assert_ok, assert_same_weights,
                     fashion_resnet, free_port, images_counted, load_model, resnet_reference, resnet_step, run,
                     scratch_ring_trains_like_one_device)


def test_compiled_ddp_with_accumulation_trains_like_eager(tmp_path):
    """torch.compile of the DDP model (one rank: DDP's graph is split at its buckets all the same),
    with no_sync on the first of 2 micro-steps: the step of eager mode, up to the rounding that
    BatchNorm over micro-batches of 8 images amplifies (a micro-batch's gradient lost would be
    half of the step). The training forward is compiled once: what the step does between its
    micro-batches (BatchNorm's statistics kept from the first) changes nothing Dynamo guards on; the
    evaluation's forward, without gradients, is the one compiled again."""
    flags = RESNET + ["--max-steps", "1", "--accum-steps", "2"]
    eager = run(["python", "ddp_resnet.py", "--out", str(tmp_path / "e")] + flags)
    compiled = run(["python", "ddp_resnet.py", "--compile", "--out", str(tmp_path / "c")] + flags, timeout=600,
                   env={"TORCH_LOGS": "recompiles"})
    assert_ok(eager)
    assert_ok(compiled)
    assert compiled.stderr.count("Recompiling function") == 1, compiled.stderr[-3000:]
    assert "GLOBAL_STATE changed: grad_mode" in compiled.stderr, compiled.stderr[-3000:]
    step_eager, step_compiled = resnet_step(load_model(tmp_path / "e")), resnet_step(load_model(tmp_path / "c"))
    assert (step_compiled - step_eager).norm() / step_eager.norm() < 0.02


def test_compiled_forward_trains_like_eager(scratch_one_replica, tmp_path):
    scratch_lenet.main(SMALL + ["--devices", "2", "--max-steps", "6", "--batch-size", "96", "--compile",
                                "--out", str(tmp_path)])
    assert_same_weights(load_model(tmp_path), scratch_one_replica, tol=1e-4)   # fused kernels round differently


def test_amp_and_channels_last_run_on_cpu(tmp_path):
    """--sync-bn too: torch refuses SyncBatchNorm on CPU, the script says so and goes on."""
    result = run(["python", "ddp_resnet.py"] + RESNET + ["--max-steps", "1", "--amp", "--channels-last", "--sync-bn",
                                                        "--out", str(tmp_path)])
    assert_ok(result)
    assert "--sync-bn needs CUDA" in result.stdout
    # bf16 autocast: not the fp32 step, but the same step direction
    step_fp32, step_amp = resnet_step(resnet_reference(1, steps=1)), resnet_step(load_model(tmp_path))
    assert torch.nn.functional.cosine_similarity(step_fp32, step_amp, dim=0) > 0.9


def test_fsdp_amp_runs_on_cpu_and_steps_the_fp32_way(tmp_path):
    """--amp: FSDP's mixed precision (bf16 compute, fp32 gradient reduction): not the fp32 step,
    but the same direction."""
    # 4 images per rank and 10 to test: bf16 convolutions are slow on CPUs without bf16 units
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "fsdp_resnet.py", "--amp", "--out", str(tmp_path)] +
                 RESNET + ["--max-steps", "1", "--batch-size", "8", "--test-samples", "10"])
    assert_ok(result)
    reference = resnet_reference(2, steps=1, lr=RESNET_LR * 8 / 256, batch_size=8)
    step_fp32, step_amp = resnet_step(reference), resnet_step(load_model(tmp_path))
    assert torch.nn.functional.cosine_similarity(step_fp32, step_amp, dim=0) > 0.9


def test_fsdp_channels_last_keeps_the_weights_contiguous_and_steps_the_same(tmp_path):
    """fully_shard refuses weights in channels_last ("FSDP does not support non-contiguous parameters"):
    --channels-last puts the inputs in it, and the convolutions follow; the step is the NCHW step."""
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "fsdp_resnet.py", "--channels-last",
                  "--out", str(tmp_path)] + RESNET + ["--max-steps", "1"])
    assert_ok(result)
    step, reference = resnet_step(load_model(tmp_path)), resnet_step(resnet_reference(2, steps=1))
    assert (step - reference).norm() / reference.norm() < 1e-4


# One run of a page, whose model records each of its forwards: (in training mode, under autocast, its input
# channels_last, the logits' dtype); then cuDNN's two settings.
RECORDED = """import json, sys, torch, common
page, forwards, resnet = __import__(sys.argv[1]), [], common.classifier
def recorded(*args, **kwargs):
    net = resnet(*args, **kwargs)
    net.register_forward_hook(lambda m, inputs, logits: forwards.append(
        (m.training, torch.is_autocast_enabled("cpu"), inputs[0].stride(1) == 1, str(logits.dtype))))
    return net
common.classifier = recorded
page.main(sys.argv[2:])
print(json.dumps([forwards, torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic]))
"""


@pytest.mark.parametrize("page", ["fsdp_resnet", "diloco_resnet"])
def test_fsdp_and_diloco_autotune_and_evaluate_as_they_train(page, tmp_path):
    """cuDNN's autotuner is on, and off with --deterministic; every evaluation forward runs as the training's
    do: in bfloat16 with --amp (DiLoCo's autocast; FSDP's mixed precision policy, without autocast, in both),
    on channels_last inputs with --channels-last, else in float32 on contiguous ones. One process on the CPU,
    for real: the meta device of as_on_a_gpu.py runs no mixed precision policy."""
    from PIL import Image
    for split in ("train", "val"):   # colour images: channels_last is another layout only with several channels
        for label in ("a", "b"):
            (tmp_path / "rgb" / split / label).mkdir(parents=True)
            for i in range(8):
                Image.new("RGB", (28, 28), (i, 20 * i, 30)).save(tmp_path / "rgb" / split / label / f"{i}.png")
    folder = ["--data-dir", str(tmp_path / "rgb"), "--image-size", "28", "--workers", "0", "--batch-size", "8",
              "--epochs", "1", "--out", str(tmp_path / "out")]
    for flags, autotuned in ((["--amp", "--channels-last"], True), (["--deterministic"], False)):
        result = run(["python", "-c", RECORDED, page] + folder + flags)
        assert_ok(result)
        forwards, benchmark, deterministic = json.loads(result.stdout.splitlines()[-1])
        assert benchmark == autotuned and deterministic != autotuned
        trained = {tuple(f[1:]) for f in forwards if f[0]}
        evaluated = {tuple(f[1:]) for f in forwards if not f[0]}
        dtype = "torch.bfloat16" if autotuned else "torch.float32"
        assert evaluated == trained == {(autotuned and page == "diloco_resnet", autotuned, dtype)}, forwards


@pytest.mark.parametrize("devices, flag", [(1, "--overlap"), (2, "--overlap"), (1, "--zero")])
def test_overlap_and_zero_at_three_processes_train_like_one_device(devices, flag, scratch_one_replica, tmp_path):
    """scratch_ring.py's --overlap and --zero where the ring's chunks are unequal (3 processes), --overlap
    with 2 replicas each too: one device's weights (test_scripts.py proves them at 2 x 2 replicas)."""
    scratch_ring_trains_like_one_device(3, devices, flag, scratch_one_replica, tmp_path)


def test_ddp_toy_runs_on_eight_ranks(tmp_path):
    result = run(["python", "ddp_toy.py", "--world-size", "8", "--epochs", "1", "--train-samples", "480",
                  "--out", str(tmp_path)])
    assert_ok(result)
    assert json.load(open(tmp_path / "metrics.json"))["world_size"] == 8


def test_scratch_readme_command_learns(tmp_path):
    result = run(["python", "scratch_lenet.py", "--epochs", "1", "--out", str(tmp_path)])
    assert_ok(result)
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert metrics["test_samples"] == 10000 and metrics["test_acc"] >= 0.80
    assert "done:" in result.stdout and "test acc" in result.stdout
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert list(load_model(tmp_path)) == scratch_lenet.PARAM_NAMES


def test_ddp_resnet_accuracy_is_over_the_whole_test_set(tmp_path):
    """3 ranks, 101 test images: one process's accuracy on the same weights, each image counted once."""
    result = run(["torchrun", "--standalone", "--nproc_per_node=3", "ddp_resnet.py"] + RESNET +
                 ["--batch-size", "15", "--out", str(tmp_path)])
    assert_ok(result)
    net = fashion_resnet(0)
    net.load_state_dict(load_model(tmp_path))
    test_set = common.fashion_mnist(DATA, 1, 101)[1]
    cpu = torch.device("cpu")
    tested = dp_resnet.evaluate(net, common.test_loader(test_set, 0, 1, cpu), cpu)
    assert json.load(open(tmp_path / "metrics.json"))["test_acc"] == tested["test_acc"]
    assert images_counted(tmp_path) == [tested["test_count"]] == [101]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
@pytest.mark.parametrize("script, flags", [("ddp_toy", TOY), ("ddp_resnet", RESNET),
                                           ("ddp_resnet", ["--data-dir", "not-a-folder"])])
def test_no_process_group_thread_outlives_the_training(script, flags, tmp_path):
    """A group kept alive past destroy_process_group keeps gloo's threads running into interpreter
    shutdown, where one that drops a finished collective's tensors now and then aborts the rank
    ("terminate called without an active exception"). torch.distributed.nn's functions take the
    group of the moment as a default argument when first imported (torch.compile, DDP and torchvision
    import it): common.py imports it before any group exists. A DDP wrap is a cycle of references to
    its group: common.leaving_the_group collects it first (the check turns automatic collection off).
    One rank, started as torchrun would start it, after a training and after a refusal. (fsdp_resnet.py
    is not here: with torch 2.14, DTensor's caches keep FSDP2's DeviceMesh, and the mesh its groups,
    until the process ends.)"""
    refused = "not-a-folder" in flags
    flags = [str(tmp_path / f) if f == "not-a-folder" else f for f in flags]
    (tmp_path / "not-a-folder").write_text("a file")
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    result = run(["python", "tests/torchrun_checks.py", "threads-left", script, "--out", str(tmp_path)] + flags,
                 env=env)
    if refused:
        assert result.returncode == 1 and "not-a-folder is not a folder" in result.stderr, result.stderr
    else:
        assert_ok(result)
    def group_threads(label):
        names = result.stdout.split(label)[1].splitlines()[0].split()
        return [t for t in names if "gloo" in t or "tcpstore" in t]
    assert group_threads("threads before destroy:"), result.stdout   # the names this check looks for
    assert group_threads("threads left:") == [], result.stdout


def test_the_gpu_check_on_a_machine_without_gpus_says_so_in_one_line():
    result = run(["python", "benchmarks/gpu_check.py"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert_ok(result)
    assert result.stdout.splitlines() == [
        "gpu_check: no GPU here, nothing to check (bash run_all.sh test proves the CPU path)"]


def test_the_cpu_path_runs_where_there_is_no_sched_getaffinity(tmp_path):
    """macOS and Windows have no os.sched_getaffinity: the CPU path counts the cores another way."""
    hide = "import os; del os.sched_getaffinity; "
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}   # else nothing counts the cores
    for code, data in (("import scratch_lenet; scratch_lenet.main(sys.argv[1:])", ["--data-dir", DATA]),
                       ("import common, ddp_toy; common.default_to_one_process(); ddp_toy.main(sys.argv[1:])", [])):
        result = subprocess.run([sys.executable, "-c", hide + "import sys; " + code, "--epochs", "1",
                                 "--train-samples", "256", "--test-samples", "50", "--max-steps", "2",
                                 "--batch-size", "32", "--out", str(tmp_path)] + data,
                                cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
        assert_ok(result)
        assert "done: 2 steps" in result.stdout


def test_any_seed_seeds_the_augmentation():
    """manual_seed takes 64 bits; seeds from (seed, epoch, index) past them once crashed every worker
    (--seed 18447 and up). Any --seed works, each gives its own draws, the same each time."""
    class Draws(torch.utils.data.Dataset):
        def __len__(self):
            return 4
        def __getitem__(self, index):
            return torch.rand(3)
    draws = {seed: common.Seeded(Draws(), seed)[2] for seed in (0, 18_447, 2**70, -5)}
    assert len({tuple(d.tolist()) for d in draws.values()}) == 4
    assert torch.equal(common.Seeded(Draws(), 2**70)[2], draws[2**70])


# ---------------------------------------------------------------- the small pages: outputs, test loss, progress
PROGRESS = re.compile(r"^  step +(\d+)/(\d+)  epoch (\d+)  loss (\d\.\d{4})  acc (\d\.\d{4})  lr \S+  "
                      r"[\d,]+ samples/s  \d+:\d\d spent, \d+:\d\d left$", re.M)
EPOCH = re.compile(r"^epoch +\d+  loss \S+  train acc \S+  test loss (\S+)  test acc (\S+)  [\d,]+ samples/s  ", re.M)


def outputs_written(monkeypatch):
    """Watches common.write_outputs: after each call, the epochs of the metrics.json on disk, whether each of its rows
    has a test loss, and whether curves.png and model.pt are there."""
    written, real = [], common.write_outputs
    def write_outputs(metrics):
        real(metrics)
        out = metrics["config"]["out"]
        with open(os.path.join(out, "metrics.json")) as f:
            rows = json.load(f)["epochs"]
        written.append(([row["epoch"] for row in rows], all("test_loss" in row for row in rows),
                        os.path.exists(os.path.join(out, "curves.png")), os.path.exists(os.path.join(out, "model.pt"))))
    monkeypatch.setattr(common, "write_outputs", write_outputs)
    return written


AFTER_TWO_EPOCHS = [([1], True, True, False), ([1, 2], True, True, False), ([1, 2], True, True, False)]


@pytest.mark.parametrize("page, flags", [(ddp_toy, TOY), (scratch_lenet, SMALL + ["--batch-size", "128"]),
                                         (scratch_ring, SMALL + ["--batch-size", "128"])],
                         ids=["ddp_toy", "scratch_lenet", "scratch_ring"])
def test_each_small_page_writes_its_outputs_after_every_epoch_and_prints_its_test_loss(page, flags, monkeypatch,
                                                                                      capfd, tmp_path):
    """In this process (ddp_toy.py and scratch_ring.py as a group of one), 2 epochs: after each, metrics.json on disk
    holds the epochs so far, each row with its test loss, beside curves.png; model.pt comes after the last write, at
    the end. Each epoch line prints its row's test loss and accuracy."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    if page is not scratch_lenet:   # which refuses a launcher's variables
        for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
            monkeypatch.setenv(name, value)
    written = outputs_written(monkeypatch)
    page.main(flags + ["--epochs", "2", "--out", str(tmp_path)])
    assert written == AFTER_TWO_EPOCHS and (tmp_path / "model.pt").exists()
    rows = json.load(open(tmp_path / "metrics.json"))["epochs"]
    assert EPOCH.findall(capfd.readouterr().out) == [(f"{r['test_loss']:.4f}", f"{r['test_acc']:.4f}") for r in rows]


def test_dp_resnet_prints_progress_at_the_steps_asked_and_writes_its_outputs_after_every_epoch(monkeypatch, capfd,
                                                                                              tmp_path):
    """dp_resnet.py in this process, 2 epochs of 6 steps, --print-every 2: progress lines after steps 2, 4, 6, 8 and
    10 (12, the last, ends with its epoch line), at step 6 with the epoch's loss and accuracy; after each epoch,
    metrics.json on disk holds the epochs so far, each with its test loss (the epoch line's), beside curves.png, and
    model.pt comes at the end; cuDNN's autotuner is on; the peak memory of each GPU (on a CPU: [None]). Then
    --print-every 0 --deterministic for 3 steps: no progress line, cuDNN deterministic, its autotuner off."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    written = outputs_written(monkeypatch)
    dp_resnet.main(TWO_EPOCHS + ["--print-every", "2", "--out", str(tmp_path)])
    out = capfd.readouterr().out
    lines = PROGRESS.findall(out)
    assert [line[:3] for line in lines] == [("2", "12", "1"), ("4", "12", "1"), ("6", "12", "1"), ("8", "12", "2"),
                                            ("10", "12", "2")], out
    metrics = json.load(open(tmp_path / "metrics.json"))
    rows = metrics["epochs"]
    assert lines[2][3:] == (f"{rows[0]['train_loss']:.4f}", f"{rows[0]['train_acc']:.4f}")
    assert written == AFTER_TWO_EPOCHS and (tmp_path / "model.pt").exists()
    assert EPOCH.findall(out) == [(f"{r['test_loss']:.4f}", f"{r['test_acc']:.4f}") for r in rows]
    assert metrics["peak_memory_bytes"] == [None] and "peak GPU memory" not in out
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (True, False)
    dp_resnet.main(TWO_EPOCHS + ["--print-every", "0", "--deterministic", "--max-steps", "3",
                                 "--out", str(tmp_path / "quiet")])
    out = capfd.readouterr().out
    assert "done: 3 steps" in out and not PROGRESS.findall(out), out
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (False, True)


def test_dp_resnet_evaluates_in_the_trainings_precision_and_layout():
    """The test batches reach the model in the layout asked (channels_last: colour images, where it is another
    layout), and DataParallel's replica runs them in bf16 autocast with --amp (dp_resnet.Autocast), in eval mode;
    the model is back in training mode after."""
    seen = []
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 10, 8), torch.nn.Flatten())
    net.register_forward_pre_hook(lambda m, inputs: seen.append(
        (m.training, torch.is_autocast_enabled("cpu"), inputs[0].stride(1) == 1)))   # channels_last: C is innermost
    model = torch.nn.DataParallel(dp_resnet.Autocast(net, True))
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))] * 2
    cpu = torch.device("cpu")
    tested = dp_resnet.evaluate(model, batches, cpu, torch.channels_last)
    assert seen == [(False, True, True)] * 2 and model.training and tested["test_count"] == 8
    seen.clear()
    dp_resnet.evaluate(torch.nn.DataParallel(dp_resnet.Autocast(net, False)), batches, cpu)
    assert seen == [(False, False, False)] * 2


def test_the_gpu_defaults_autotune_and_evaluate_as_the_training_runs(monkeypatch, tmp_path):
    """As on a GPU (tests/as_on_a_gpu.py): cuDNN's autotuner is on (every batch has one shape), and off with
    --deterministic; the evaluation's forwards run in the training's bf16 autocast and channels_last
    layout; under --compile the evaluation runs the bare model compiled (torch.compile recorded here, not run);
    DDP's warning of stride "mismatches" is silenced for dimensions of size 1 alone (pytorch#47163)."""
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="0").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    seen, compiled = [], []
    real_resnet = common.classifier
    def resnet(*args, **kwargs):
        net = real_resnet(*args, **kwargs)
        net.register_forward_pre_hook(lambda m, inputs: seen.append(
            (m.training, torch.is_autocast_enabled("cpu"), inputs[0].stride(1) == 1)))   # channels_last
        return net
    monkeypatch.setattr(common, "classifier", resnet)
    monkeypatch.setattr(torch, "compile", lambda module, **options: compiled.append(module) or module)
    size_1 = ("Grad strides do not match bucket view strides. This may indicate grad was not created according to "
              "the gradient layout contract.\ngrad.sizes() = [64, 1, 3, 3], strides() = [9, 1, 3, 1]\n"
              "bucket_view.sizes() = [64, 1, 3, 3], strides() = [9, 9, 3, 1]")
    from PIL import Image
    for split in ("train", "val"):   # colour images: channels_last is another layout only with several channels
        for label in ("a", "b"):
            (tmp_path / "rgb" / split / label).mkdir(parents=True)
            for i in range(8):
                Image.new("RGB", (28, 28), (i, 20 * i, 30)).save(tmp_path / "rgb" / split / label / f"{i}.png")
    folder = ["--data-dir", str(tmp_path / "rgb"), "--image-size", "28", "--workers", "0", "--batch-size", "8",
              "--epochs", "1"]
    with warnings.catch_warnings(record=True) as caught:
        for flags, autotuned in ((["--amp", "--channels-last", "--compile"], True), (["--deterministic"], False)):
            seen.clear()
            with as_on_a_gpu(monkeypatch, 1):
                with pytest.raises((RuntimeError, NotImplementedError), match=READ_BACK):
                    ddp_resnet.main(folder + flags + ["--out", str(tmp_path / "out")])
            assert torch.backends.cudnn.benchmark == autotuned and torch.backends.cudnn.deterministic != autotuned
            evaluated = [forward for forward in seen if not forward[0]]
            assert evaluated and set(evaluated) == {(False, autotuned, autotuned)}, seen
        warnings.warn(size_1)
        warnings.warn(size_1.replace("[64, 1, 3, 3]", "[64, 2, 3, 3]"))
    assert [str(w.message)[-40:] for w in caught if "Grad strides" in str(w.message)] == [size_1[-40:].replace("1, 3, 3]", "2, 3, 3]")]
    assert [type(m).__name__ for m in compiled] == ["DistributedDataParallel", "ResNet"]


def test_a_time_cadence_asks_once_an_interval_and_only_on_rank_0(monkeypatch):
    """common.Progress with "10s": rank 0 asks for a line once 10 s have passed since it last asked, and not at the
    next step, which prints the line the vote carried (asking there too printed two lines in a row); no other rank
    asks, and a step count ("3") decides alone, the same on every rank."""
    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    progress, other = common.Progress("10s", 0, 100, 64, True), common.Progress("10s", 0, 100, 64, False)
    asked = []
    for now[0] in (1.0, 9.9, 10.0, 10.3, 19.9, 20.1, 20.2):
        asked.append((progress.asks(), other.asks()))
    assert asked == [(False, False)] * 2 + [(True, False)] + [(False, False)] * 2 + [(True, False), (False, False)]
    counted = common.Progress("3", 0, 100, 64, False)
    assert [counted.due(step, voted=False) for step in range(1, 8)] == [False, False, True, False, False, True, False]


def test_a_progress_lines_samples_per_s_counts_training_alone(monkeypatch, capsys):
    """common.Progress: samples/s over the steps since the last line, or since the epoch's start (new_epoch), which the
    pages call when an epoch's steps begin: the evaluation and checkpoint between epochs are not counted in it; the
    time spent and left count everything."""
    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    progress = common.Progress("2", 0, 8, 64, True)
    trained = {"loss": 8.0, "correct": 4.0, "samples": 8.0}
    now[0] = 2.0
    progress.say(common.Position(1, 2, 2), trained, 0.1)   # 2 steps of 64 in 2 s
    now[0] = 12.0   # the epoch ends at step 4 (in 2 s more), then 8 s of evaluation
    progress.new_epoch(4)
    now[0] = 13.0
    progress.say(common.Position(2, 2, 6), trained, 0.1)   # 2 steps of 64 in 1 s
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[-2] for line in lines] == ["64 samples/s", "128 samples/s"], lines
    assert lines[1].endswith("0:13 spent, 0:04 left"), lines
