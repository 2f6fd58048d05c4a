"""The benchmarks for one GPU, where there is none: gpu_speed.py (the FLOPs of a sample; its profile on the CPU),
recipe_sweep.py (its plan; --quick trains as the page does) and phases.py (a small run's phases)."""
import gzip, json, re
import torch
import common
from helpers import DATA, assert_ok, run


def forward_flops_from_the_layers():
    """2 x the multiply-adds of one image's forward pass, from each convolution's and linear layer's shapes:
    each output value is one dot product of a filter (in_channels x kh x kw) or a weight row."""
    torch.manual_seed(0)
    net = common.classifier("resnet18", 10, channels=1, image_size=28).eval()
    multiply_adds = []
    def count(layer, inputs, output):
        multiply_adds.append(output[0].numel() * layer.weight[0].numel())
    for layer in net.modules():
        if isinstance(layer, (torch.nn.Conv2d, torch.nn.Linear)):
            layer.register_forward_hook(count)
    with torch.no_grad():
        net(torch.zeros(1, 1, 28, 28))
    return 2 * sum(multiply_adds)


def test_gpu_speed_without_a_gpu_counts_the_flops_of_a_training_sample_and_says_so_in_one_line():
    """ResNet-18 at 28x28 (a 3x3 stride-1 stem, no max-pool): ~0.91 GFLOP forward; backward computes the
    gradients of the inputs and of the weights, twice the forward but for the stem's input, ~2.73 in all."""
    result = run(["python", "benchmarks/gpu_speed.py"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert_ok(result)
    count, no_gpu = result.stdout.splitlines()
    assert no_gpu == "gpu_speed: no GPU here, nothing to time"
    found = re.fullmatch(r"gpu_speed: ResNet-18 for 1x28x28 images, ([\d.]+) GFLOP per training sample "
                         r"\(forward ([\d.]+), backward ([\d.]+); FlopCounterMode\)", count)
    total, forward, backward = (float(g) * 1e9 for g in found.groups())
    expected_forward = forward_flops_from_the_layers()
    assert abs(forward - expected_forward) < 2e6
    assert 1.99 * expected_forward < backward < 2 * expected_forward
    assert abs(total - forward - backward) < 2e6
    assert 2.6e9 < total < 2.85e9


def test_gpu_speed_profiles_the_step_on_a_cpu_into_a_trace_and_a_summary(tmp_path):
    """--profile where there is no GPU: the step profiled on the CPU, each part of it labelled; a Chrome trace (gzip
    JSON) and a summary per row, whose first line is printed; then the line that says the table was not timed."""
    result = run(["python", "benchmarks/gpu_speed.py", "--profile", str(tmp_path), "--profile-rows", "default@4",
                  "--warmup", "1", "--profile-steps", "2"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert_ok(result)
    lines = result.stdout.splitlines()
    assert lines[-1] == "gpu_speed: no GPU here, the table not timed"
    summary = (tmp_path / "profile_default_at_4.txt").read_text().splitlines()
    assert summary[0] in lines
    found = re.fullmatch(r"profile default@4 \(batch 4\), 2 steps under torch.profiler on cpu: a step ([\d.]+) ms; "
                         r"the host in it ([\d.]+) ms \(its parts, ms: next batch ([\d.]+), train_step ([\d.]+), "
                         r"scheduler.step ([\d.]+), stop vote ([\d.]+)\); the device busy 0.00 ms, 0 kernels and "
                         r"copies; host syncs 0", summary[0])
    wall, host, *parts = (float(g) for g in found.groups())
    assert sum(parts) <= host <= wall   # the parts inside the step, the step inside the wall-clock time
    assert "aten::convolution_backward" in "\n".join(summary)
    with gzip.open(tmp_path / "trace_default_at_4.json.gz") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert {"step", "next batch", "train_step", "scheduler.step", "stop vote"} <= names


def test_the_sweep_without_a_gpu_says_what_it_would_run_and_runs_nothing():
    result = run(["python", "benchmarks/recipe_sweep.py", "--settings", "1024 w1 nzs", "512 w1 nzs"],
                 env={"CUDA_VISIBLE_DEVICES": ""})
    assert_ok(result)
    lines = result.stdout.splitlines()
    assert lines[0].startswith("recipe_sweep: no GPU here, nothing run.")
    assert [line.split()[:3] for line in lines[1:3]] == [["1024", "w1", "nzs"], ["512", "w1", "nzs"]]
    assert "--batch-size 512 --warmup-epochs 1 --nesterov --zero-init-residual --label-smoothing 0.1" in lines[2]
    assert "x 3 seeds" in lines[2] and "on one H200 in all" in lines[3]


def test_a_second_run_in_the_sweeps_process_trains_as_the_same_command_alone(tmp_path):
    """recipe_sweep.py --quick calls ddp_resnet.main() for seed 0, then seed 1, in one process: the second run ends
    with the training loss and test accuracy of the same command run alone (nothing carries over from the first)."""
    sweep = run(["python", "benchmarks/recipe_sweep.py", "--quick", "--settings", "1024 w1 nzs", "--data-dir", DATA,
                 "--json", str(tmp_path / "sweep.json"), "--logs", str(tmp_path / "logs")],
                env={"CUDA_VISIBLE_DEVICES": ""})
    assert_ok(sweep)
    ran = json.load(open(tmp_path / "sweep.json"))["1024 w1 nzs"]
    assert sorted(ran) == ["0", "1"]
    row = next(line for line in sweep.stdout.splitlines() if line.startswith("1024 w1 nzs ") and "seed" not in line)
    assert row.split()[3:5] == [f"{ran['0']['test_acc']:.4f}", f"{ran['1']['test_acc']:.4f}"]
    assert "epoch   1" in (tmp_path / "logs" / "1024_w1_nzs_seed1.log").read_text()   # the page's own lines
    alone = run(["python", "ddp_resnet.py", "--batch-size", "32", "--warmup-epochs", "1", "--nesterov",
                 "--zero-init-residual", "--label-smoothing", "0.1", "--train-samples", "128", "--test-samples", "100",
                 "--epochs", "1", "--data-dir", DATA, "--seed", "1", "--out", str(tmp_path / "alone")])
    assert_ok(alone)
    metrics = json.load(open(tmp_path / "alone" / "metrics.json"))
    assert metrics["epochs"][-1]["train_loss"] == ran["1"]["train_loss"]
    assert metrics["test_acc"] == ran["1"]["test_acc"]


def test_phases_of_a_small_run_add_up_to_its_time_from_the_command_to_its_done_line(tmp_path):
    result = run(["python", "benchmarks/phases.py", "--first-steps", "1", "--json", str(tmp_path / "phases.json"),
                  "--", "--train-samples", "64", "--test-samples", "50", "--batch-size", "32", "--epochs", "2",
                  "--data-dir", DATA, "--out", str(tmp_path / "out")], env={"CUDA_VISIBLE_DEVICES": ""})
    assert_ok(result)
    table = result.stdout[result.stdout.index("\nphase "):].splitlines()[1:]
    phases = [m for m in (re.match(r"(.+?) +(-?[\d.]+) +[\d.]+%$", line) for line in table) if m]
    named = [m.group(1) for m in phases]
    for expected in ("the rank's python, import torch", "the device (on CUDA: its context, set_device)",
                     "the data (datasets(), on every rank)", "the DDP wrap (rank 0's weights broadcast)",
                     "the banner, the first batch, the first 1 step(s) (synchronised)", "epoch 1: its other 1 steps",
                     "epoch 2: the evaluation (BatchNorm's buffers, the test set)",
                     "the last barrier, metrics.json, curves.png (drawn, saved), model.pt (the weights to the CPU)",
                     "the done: line"):
        assert expected in named, (expected, named)
    before_done = [float(m.group(2)) for m in phases[:named.index("the done: line") + 1]]
    total = float(re.search(r"= from the command to its done: line +([\d.]+)", result.stdout).group(1))
    rounding = 0.005 * (len(before_done) + 1)   # each figure printed to 0.01 s: their sum drifts from the total's
    assert all(seconds >= 0 for seconds in before_done) and abs(sum(before_done) - total) <= rounding
    metrics = json.load(open(tmp_path / "out" / "metrics.json"))
    training = sum(e["seconds"] for e in metrics["epochs"])
    assert f"training, the page's own epoch seconds: {training:.2f} s (4 steps" in result.stdout
    assert re.search(r"in torch.save and fsync, s \(each file's writes summed\): .*checkpoint.pt fsync [\d.]+, "
                     r"torch.save [\d.]+; ", result.stdout)
