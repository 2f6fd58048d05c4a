"""Fine-tuning your own model, and state of your own: the README's fine-tuning lines (a previous run's weights, a frozen
part in eval mode) train on ddp_resnet.py, fsdp_resnet.py and diloco_resnet.py and resume bit-equal, the frozen part
untouched; a frozen part trains alike on DDP, FSDP and one process, clipped or not; a weight tied in two modules and a
buffer kept out of state_dict train, evaluate and resume; BatchNorm of every kind stays float32 under FSDP's --amp; the
README's EMA is one entry of `things` and resumes bit-equal."""
import json, os, shutil, subprocess, sys
import pytest
import torch
import torch.nn.functional as F
import common
import ddp_resnet
import diloco_resnet
import fsdp_resnet
from helpers import (DATA, HERE, RESNET, assert_same_weights, fashion_resnet, launcher_variables_restored, load_model,
                     readme_block, readme_fine_tune, with_make_model)

PAGES = [ddp_resnet, fsdp_resnet, diloco_resnet]
# 3 steps an epoch; DiLoCo's rounds of 4 steps (a sync at step 4, and at the last)
TWO_EPOCHS = ["--train-samples", "48", "--test-samples", "20", "--batch-size", "16", "--epochs", "2", "--lr", "0.1",
              "--print-every", "0", "--data-dir", DATA]
ROUNDS = {diloco_resnet: ["--local-steps", "4"]}


def metrics(out):
    return json.load(open(os.path.join(out, "metrics.json")))


def stopped_and_resumed(page, flags, stop_at):
    """`page` run here (one rank) to its end in whole/, and in parts/ stopped by --max-steps `stop_at` and resumed:
    their model.pt."""
    page.main(flags + ["--out", "whole"])
    page.main(flags + ["--out", "parts", "--max-steps", str(stop_at)])
    page.main(flags + ["--out", "parts", "--resume"])
    return load_model("whole"), load_model("parts")


@pytest.fixture(scope="module")
def previous_run(tmp_path_factory):
    """A previous run's model.pt: ddp_resnet.py --arch efficientnet_b0, two steps (its BatchNorm statistics moved).
    The launcher's variables its main() sets are taken back: set up before a test's own fixtures, it is not theirs."""
    out = tmp_path_factory.mktemp("previous") / "out"
    with launcher_variables_restored():
        ddp_resnet.main(TWO_EPOCHS + ["--arch", "efficientnet_b0", "--max-steps", "2", "--out", str(out)])
    return out / "model.pt"


@pytest.mark.parametrize("page", PAGES, ids=[page.__name__ for page in PAGES])
def test_the_readmes_fine_tune_trains_what_is_not_frozen_and_resumes_bit_equal(page, previous_run, monkeypatch,
                                                                              tmp_path):
    """The README's make_model() with its fine-tuning lines, from a previous run's model.pt: 2 epochs, stopped at step
    5 (after the first evaluation; DiLoCo: inside a round) and resumed, bit-equal to the run never stopped. The frozen
    stem and two stages end with the file's weights and BatchNorm statistics, bit for bit, through an evaluation and
    the epoch after it (a BatchNorm set back to training mode by the evaluation would move its statistics); the rest
    trained. The optimizer holds only what trains (DDP's checkpoint); DiLoCo sends only it."""
    monkeypatch.chdir(tmp_path)
    os.makedirs("runs/base")
    shutil.copy(previous_run, "runs/base/model.pt")
    with_make_model(page, readme_fine_tune(), monkeypatch)
    whole, parts = stopped_and_resumed(page, TWO_EPOCHS + ROUNDS.get(page, []), stop_at=5)
    assert_same_weights(whole, parts, tol=0)
    start = torch.load(previous_run)
    frozen = [name for name in start if name.split(".")[:2] in (["features", "0"], ["features", "1"],
                                                                  ["features", "2"])]
    assert frozen and all(torch.equal(whole[name], start[name]) for name in frozen), frozen
    trained = [name for name in start if name not in frozen and start[name].is_floating_point()]
    assert all(not torch.equal(whole[name], start[name]) for name in trained if "running" not in name)
    net = page.make_model(None, (1, 28, 28), 10)
    learning = [p for p in net.parameters() if p.requires_grad]
    if page is ddp_resnet:
        optimizer = torch.load("parts/checkpoint.pt", weights_only=False)["state"]["optimizer"]["state"]
        assert sum(len(group["params"]) for group in optimizer["param_groups"]) == len(learning)
        assert len(optimizer["state"]) == len(learning)   # momentum for those alone
    if page is diloco_resnet:
        syncs = 2   # at steps 4 and 6
        sent = metrics("whole")["sent_bytes_by_collective"]["all_reduce (1 ranks)"]
        assert sent == round(syncs * common.nbytes(*learning) / 6)


class Halved(torch.nn.Module):
    """The images times a constant, a buffer kept out of state_dict."""
    def __init__(self):
        super().__init__()
        self.register_buffer("factor", torch.full((1,), 0.5), persistent=False)

    def forward(self, x):
        return x * self.factor


def tied_and_halved(args, shape, classes):
    """ResNet-18 whose first two blocks share a weight, and whose images are first halved by a buffer kept out of
    state_dict."""
    net = common.classifier("resnet18", classes, shape[0], shape[-1])
    net.layer1[1].conv2.weight = net.layer1[0].conv2.weight
    net.conv1 = torch.nn.Sequential(Halved(), net.conv1)
    return net


@pytest.mark.parametrize("page", PAGES, ids=[page.__name__ for page in PAGES])
def test_a_weight_tied_in_two_modules_and_a_buffer_out_of_state_dict_train_evaluate_and_resume(page, monkeypatch,
                                                                                               tmp_path):
    """A model with a weight tied in two of its blocks (FSDP: one unit of both) and a buffer kept out of state_dict
    (persistent=False), which its forward reads: it trains, evaluates, checkpoints and resumes (stopped at step 4
    of 6, DiLoCo inside a round) bit-equal; model.pt holds the model's own state_dict keys, the tied weight under
    both names, equal, and no buffer out of it. (DiLoCo named its shared weights by named_parameters() and
    named_buffers(): the evaluation refused "Unexpected key(s)"; FSDP's units each took the tied weight.)"""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(page, "make_model", tied_and_halved)
    whole, parts = stopped_and_resumed(page, TWO_EPOCHS + ROUNDS.get(page, []), stop_at=4)
    assert_same_weights(whole, parts, tol=0)
    torch.manual_seed(0)   # as the page seeds it: the first weights
    net = tied_and_halved(None, (1, 28, 28), 10)
    assert whole.keys() == net.state_dict().keys() and "conv1.0.factor" not in whole
    assert torch.equal(whole["layer1.1.conv2.weight"], whole["layer1.0.conv2.weight"])
    assert not torch.equal(whole["layer1.0.conv2.weight"], net.state_dict()["layer1.0.conv2.weight"])
    if page is fsdp_resnet:
        units = fsdp_resnet.blocks(net)
        assert [net.layer1[0], net.layer1[1]] in units and len(units) == 7


def with_batchnorm1d_head(args, shape, classes):
    """ResNet-18 whose last layer is a BatchNorm1d, then the classes."""
    net = common.classifier("resnet18", classes, shape[0], shape[-1])
    net.fc = torch.nn.Sequential(torch.nn.BatchNorm1d(512), torch.nn.Linear(512, classes))
    return net


@pytest.mark.parametrize("page", [ddp_resnet, fsdp_resnet], ids=["ddp_resnet", "fsdp_resnet"])
def test_a_batchnorm1d_head_trains_with_amp(page, monkeypatch, tmp_path):
    """--amp with a BatchNorm1d head: FSDP keeps it in float32, as every BatchNorm (it failed at step 1, "expected
    scalar type BFloat16 but found Float"), and counts its gathered bytes as float32; DDP's autocast takes it. Both
    train to finite losses and an evaluation of every test image."""
    monkeypatch.setattr(page, "make_model", with_batchnorm1d_head)
    page.main(TWO_EPOCHS + ["--amp", "--epochs", "1", "--out", str(tmp_path)])
    record = metrics(tmp_path)["epochs"][-1]
    assert record["test_count"] == 20 and 0 < record["train_loss"] < 10 and 0 < record["test_loss"] < 10, record


def test_fsdps_amp_keeps_every_kind_of_batchnorm_in_float32_and_counts_it(monkeypatch):
    """fsdp_resnet.shard() with --amp gives BatchNorm1d, 2d, 3d and SyncBatchNorm (which needs a GPU to run: here
    only sharded) the float32 policy, each its own unit, the rest bfloat16. (What it gathers, counted in float32:
    tests/torchrun_checks.py, with a BatchNorm1d head.)"""
    policies = {}
    def fully_shard(module, mesh=None, mp_policy=None):
        policies[module] = mp_policy.param_dtype
        return module
    monkeypatch.setattr(fsdp_resnet, "fully_shard", fully_shard)
    kinds = [torch.nn.BatchNorm1d(3), torch.nn.BatchNorm2d(3), torch.nn.BatchNorm3d(3), torch.nn.SyncBatchNorm(3)]
    net = torch.nn.Sequential(*kinds, torch.nn.Linear(3, 3))
    fsdp_resnet.shard(net, mesh=None, amp=True)
    assert [policies[norm] for norm in kinds] == [torch.float32] * 4 and policies[net] == torch.bfloat16


@pytest.mark.parametrize("clip", [[], ["--clip-grad-norm", "1"]], ids=["unclipped", "clipped"])
def test_a_frozen_part_trains_alike_on_ddp_fsdp_and_one_process(clip, resnet_tolerance, monkeypatch, tmp_path):
    """ResNet-18 from a file, its stem and first stage frozen (BatchNorm in eval mode), 2 steps: DDP and FSDP at 2
    ranks and one process with --accum-steps 2 end within the ResNet tolerance of each other, clipped (the norm
    above 5, clipped to 1: more than 10 tolerances from unclipped) or not. The frozen part ends as the file has it on each of DDP's
    ranks, in FSDP's model.pt (every rank's shards) and in one process's; DDP sends the gradients of what trains
    alone."""
    job = tmp_path / "job"
    job.mkdir()
    start = fashion_resnet(1).state_dict()
    torch.save(start, job / "start.pt")
    source = FROZEN_RESNET
    for name in ("ddp_resnet", "fsdp_resnet"):
        page = open(os.path.join(HERE, f"{name}.py")).read()
        at = page.index("def make_model(args, shape, classes):")
        end = page.index("# ----------------------------------------------------------------", at)
        (job / f"{name}.py").write_text(page[:at] + source + "\n\n" + page[end:])
    shutil.copy(os.path.join(HERE, "common.py"), job)
    (job / "each_rank.py").write_text(EACH_RANK)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for script, out in (("each_rank.py", "ddp"), ("fsdp_resnet.py", "fsdp")):
        result = subprocess.run(torchrun + [script] + RESNET + clip + ["--out", out], cwd=job, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    monkeypatch.chdir(job)
    with_make_model(ddp_resnet, source, monkeypatch)
    ddp_resnet.main(RESNET + clip + ["--accum-steps", "2", "--out", "one"])
    runs = {"ddp rank 0": torch.load(job / "ddp/rank0.pt"), "ddp rank 1": torch.load(job / "ddp/rank1.pt"),
            "fsdp": load_model(job / "fsdp"), "one process": load_model(job / "one")}
    frozen = [name for name in start if name.split(".")[0] in ("conv1", "bn1", "layer1")]
    for name, weights in runs.items():
        assert all(torch.equal(weights[k], start[k]) for k in frozen), name
        assert_same_weights(weights, runs["ddp rank 0"], tol=resnet_tolerance)
    assert runs["ddp rank 0"].keys() == start.keys() and load_model(job / "ddp").keys() == start.keys()
    learning = sum(p.numel() for name, p in fashion_resnet(1).named_parameters() if name not in frozen)
    assert metrics(job / "ddp")["sent_bytes_by_collective"] == {"all_reduce (2 ranks)": 4 * learning}
    if clip:
        assert metrics(job / "one")["epochs"][-1]["grad_norm"] > 5
        unclipped = ddp_resnet.main(RESNET + ["--accum-steps", "2", "--out", "unclipped"]).state_dict()
        assert max((unclipped[k] - runs["one process"][k]).abs().max() for k in start) > 10 * resnet_tolerance


FROZEN_RESNET = '''def make_model(args, shape, classes):
    net = common.classifier(args.arch, classes, shape[0], shape[-1])
    net.load_state_dict(torch.load("start.pt"))
    torch.nn.ModuleList([net.conv1, net.bn1, net.layer1]).requires_grad_(False).eval()
    return net'''

EACH_RANK = '''import os, sys, torch
import ddp_resnet

# ddp_resnet.py's run, then this rank's own weights beside its outputs.
model = ddp_resnet.main(sys.argv[1:])
out = sys.argv[sys.argv.index("--out") + 1]
torch.save(model.state_dict(), os.path.join(out, f"rank{os.environ['RANK']}.pt"))
'''


def test_the_readmes_ema_is_one_entry_of_things_evaluated_saved_and_resumed_bit_equal(tmp_path):
    """ddp_resnet.py with the README's EMA lines after `evaluated = raw_model`, 2 ranks, 2 epochs of 3 steps: stopped
    by --max-steps at step 4 and resumed, model.pt (the EMA's weights) and the EMA in the checkpoint are bit-equal to
    the run never stopped's; model.pt is not the trained weights, and the epoch's accuracy and loss are those of
    model.pt, evaluated here."""
    page = open(os.path.join(HERE, "ddp_resnet.py")).read()
    at = page.index("    evaluated = raw_model\n") + len("    evaluated = raw_model\n")
    job = tmp_path / "job"
    job.mkdir()
    (job / "ddp_resnet.py").write_text(page[:at] + readme_block("AveragedModel") + page[at:])
    shutil.copy(os.path.join(HERE, "common.py"), job)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "ddp_resnet.py"]
    flags = TWO_EPOCHS + ["--lr", "0.5"]
    for more in (["--out", "whole"], ["--out", "parts", "--max-steps", "4"], ["--out", "parts", "--resume"]):
        result = subprocess.run(torchrun + flags + more, cwd=job, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    whole, parts = load_model(job / "whole"), load_model(job / "parts")
    assert_same_weights(whole, parts, tol=0)
    saved = [torch.load(job / out / "checkpoint.pt", weights_only=False)["state"] for out in ("whole", "parts")]
    assert saved[0]["ema"]["kind"] == "AveragedModel"
    assert_same_weights(saved[0]["ema"]["state"], saved[1]["ema"]["state"], tol=0)
    assert saved[0]["ema"]["state"]["n_averaged"] == 6
    trained = saved[0]["model"]["state"]
    assert max((whole[k] - trained[k]).abs().max().item() for k in whole if k.endswith("weight")) > 1e-3
    net = common.classifier("resnet18", 10, 1, 28).eval()
    net.load_state_dict(whole)
    X, y = common.fashion_mnist(DATA, 48, 20)[1].tensors
    with torch.no_grad():
        logits = net(X)
    record = metrics(job / "whole")["epochs"][-1]
    assert record["test_acc"] == (logits.argmax(1) == y).sum().item() / 20
    assert record["test_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)
