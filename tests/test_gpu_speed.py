"""benchmarks/gpu_speed.py where there is no GPU: the FLOP count of a training sample, then one line, exit 0."""
import gzip, json, re
import torch
import common
from helpers import assert_ok, run


def forward_flops_from_the_layers():
    """2 x the multiply-adds of one image's forward pass, from each convolution's and linear layer's shapes:
    each output value is one dot product of a filter (in_channels x kh x kw) or a weight row."""
    net = common.resnet("resnet18", 10, 0, channels=1, image_size=28).eval()
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
