"""Your own model: the README's make_model() (EfficientNet-B0, with dropout and stochastic depth) trains on every ResNet
page, FSDP shards it by its blocks, and a run stopped mid-epoch resumes bit-equal, what its step draws included;
--arch takes torchvision's classifiers, or refuses in one line; --clip-grad-norm clips the averaged gradient alike at
any layout, and the norm a run reports is the one one process computes."""
import json, os, re, shutil, subprocess, sys
import pytest
import torch
import torch.nn.functional as F
import common
import ddp_resnet
import fsdp_resnet
from helpers import (DATA, HERE, RESNET, assert_ok, assert_same_weights, epoch_batches, fashion_resnet, load_model,
                     readme_make_model, resnet_reference, run, with_readme_model)

SMALL = ["--train-samples", "48", "--test-samples", "20", "--batch-size", "16", "--epochs", "1", "--lr", "0.1",
         "--print-every", "0", "--data-dir", DATA]   # 3 steps


@pytest.mark.parametrize("page", ["fsdp_resnet", "diloco_resnet"])
def test_your_own_model_from_the_readme_trains_and_resumes_bit_equal(page, tmp_path):
    """The README's EfficientNet-B0 in make_model(), 2 ranks: stopped by --max-steps at step 1 of 3 (DiLoCo: inside
    a round of 2) and resumed, the run ends with the weights and BatchNorm statistics of the run never stopped, to
    the bit: its dropout and stochastic depth drew after the resume what they would have drawn (before each micro-
    batch was seeded from the step, a ResNet with dropout ended 0.004 away at these sizes, 0.094 at larger ones).
    ddp_resnet.py's proof, with your own Dataset and a SIGTERM too: tests/test_data.py."""
    copy = tmp_path / "job"
    copy.mkdir()
    (copy / f"{page}.py").write_text(with_readme_model(open(os.path.join(HERE, f"{page}.py")).read()))
    shutil.copy(os.path.join(HERE, "common.py"), copy)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", f"{page}.py"]
    flags = SMALL + (["--local-steps", "2"] if page == "diloco_resnet" else [])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    def launch(*more):
        result = subprocess.run(torchrun + flags + list(more), cwd=copy, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout
    whole = launch("--out", "whole")
    assert re.search(r"_resnet: (FSDP)?EfficientNet for \(1, 28, 28\) images, 2 rank\(s\)", whole), whole
    launch("--out", "parts", "--max-steps", "1")
    resumed = launch("--out", "parts", "--resume")
    assert "epoch 1 at batch 1/3, step 1" in resumed and "note:" not in resumed, resumed
    assert_same_weights(load_model(copy / "whole"), load_model(copy / "parts"), tol=0)


def test_fsdp_shards_the_readmes_model_and_a_resnet_by_their_blocks():
    """fsdp_resnet.blocks(): EfficientNet-B0's 16 MBConv blocks, ResNet-18's 8 BasicBlocks; what is left to the root
    (the stems, the heads) holds a small part of the parameters."""
    namespace = {"torch": torch, "torchvision": __import__("torchvision")}
    exec(readme_make_model(), namespace)
    for net, kind, count, rest in ((namespace["make_model"](None, (1, 28, 28), 10), "MBConv", 16, 0.12),
                                   (fashion_resnet(0), "BasicBlock", 8, 0.01)):
        blocks = fsdp_resnet.blocks(net)
        assert [type(block).__name__ for block in blocks] == [kind] * count
        inside = sum(p.numel() for block in blocks for p in block.parameters())
        assert 0 < 1 - inside / sum(p.numel() for p in net.parameters()) < rest


def test_arch_takes_torchvisions_classifiers_and_refuses_others_in_one_line(monkeypatch, capsys, tmp_path):
    """--arch efficientnet_b0 is made for 1x28x28 images: its stem takes one channel, at stride 1. An unknown name,
    a model that cannot take such images (ViT's fixed size), or an option it does not take (--zero-init-residual,
    a ResNet's) is refused in one line, before training."""
    torch.manual_seed(0)
    net = common.classifier("efficientnet_b0", 10, channels=1, image_size=28)
    stem = net.features[0][0]
    assert (stem.in_channels, stem.stride) == (1, (1, 1))
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="0").items():
        monkeypatch.setenv(name, value)
    refused = {("--arch", "nope"): "nope for 1x28x28 images: Unknown model nope",
               ("--arch", "vit_b_16"): "vit_b_16 for 1x28x28 images: Wrong image height! Expected 224 but got 28!",
               ("--arch", "efficientnet_b0", "--zero-init-residual"):
                   "efficientnet_b0 for 1x28x28 images: EfficientNet.__init__() got an unexpected keyword argument "
                   "'zero_init_residual'"}
    for flags, why in refused.items():
        with pytest.raises(SystemExit) as stopped:
            ddp_resnet.main(list(flags) + RESNET + ["--out", str(tmp_path / "out")])
        assert stopped.value.code == f"error: --arch {why}"
        assert "step" not in capsys.readouterr().out and not (tmp_path / "out").exists()


def gradients_of_each_shard(shards=2):
    """The first step's gradient of each rank's share of the first global batch (RESNET's sizes, seed 0), on
    ResNet-18's first weights, as one process computes it."""
    X, y = common.fashion_mnist(DATA, 64, 1)[0].tensors
    batch = epoch_batches(64, 16, seed=0, epoch=1)[0]
    gradients = []
    for r in range(shards):
        net = fashion_resnet(0)
        F.cross_entropy(net(X[batch[r::shards]]), y[batch[r::shards]]).backward()
        gradients.append([p.grad for p in net.parameters()])
    return gradients


def total_norm(gradients):
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gradients])).item()


def test_clipping_scales_the_averaged_gradient_alike_at_any_layout_and_reports_its_norm(resnet_tolerance, tmp_path):
    """--clip-grad-norm 1, two steps, where the gradient's norm is about 12 (it clips): ddp_resnet.py on 2 ranks, on 1
    with --accum-steps 2, and fsdp_resnet.py on 2 end with the weights of one process that clips the averaged
    gradient with torch's clip_grad_norm_ (within the ResNet tolerance; far from the step unclipped). The progress
    line after step 1 prints that step's norm, and metrics.json holds the mean of both steps' norms, each counted
    once. diloco_resnet.py clips each rank's own gradient: its first step's record is the mean of the two ranks'
    norms."""
    norms = []
    clipped = resnet_reference(2, clip=1.0, norms=norms)
    assert min(norms) > 5
    assert norms[0] == pytest.approx(total_norm([(a + b) / 2 for a, b in zip(*gradients_of_each_shard())]), rel=1e-5)
    runs = {"ddp_resnet 2": (2, "ddp_resnet.py", []), "ddp_resnet 1": (1, "ddp_resnet.py", ["--accum-steps", "2"]),
            "fsdp_resnet 2": (2, "fsdp_resnet.py", [])}
    for name, (nproc, script, flags) in runs.items():
        out = tmp_path / name.replace(" ", "_")
        result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", script, "--clip-grad-norm", "1",
                      "--print-every", "1", "--out", str(out)] + RESNET + flags)
        assert_ok(result)
        lines = [line for line in result.stdout.splitlines() if line.startswith("  step ")]
        assert len(lines) == 1 and f"  grad norm {norms[0]:.4g}  " in lines[0], result.stdout
        record = json.load(open(out / "metrics.json"))["epochs"][-1]
        assert record["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-4), name
        assert_same_weights(load_model(out), clipped, tol=resnet_tolerance)
    unclipped = resnet_reference(2)
    assert max((clipped[k] - unclipped[k]).abs().max().item() for k in clipped) > 100 * resnet_tolerance
    diloco = tmp_path / "diloco"
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "diloco_resnet.py"] + RESNET +
                 ["--clip-grad-norm", "1", "--local-steps", "1", "--max-steps", "1", "--out", str(diloco)])
    assert_ok(result)
    each = [total_norm(gradients) for gradients in gradients_of_each_shard()]
    record = json.load(open(diloco / "metrics.json"))["epochs"][-1]
    assert record["grad_norm"] == pytest.approx(sum(each) / 2, rel=1e-4)


def test_a_resume_compares_how_each_global_batch_is_cut_into_micro_batches():
    """What a checkpoint keeps of the layout, which a resume compares (a difference goes on, saying "close to"):
    ranks x --accum-steps, the same for 2 ranks and for 1 with 2 micro-batches; with --sync-bn on CUDA, where
    BatchNorm normalises micro-batch i of every rank together, the ranks and the micro-batches each."""
    def cut(world_size, accum, sync_bn=False, device="cpu"):
        args = ddp_resnet.parse_args(["--accum-steps", str(accum)] + ["--sync-bn"] * sync_bn)
        return ddp_resnet.resume_flags(args, (1, 28, 28), 96, torch.device(device), world_size)["micro_batches"]
    assert cut(2, 1) == cut(1, 2) == 2 and cut(2, 2) == 4 != cut(2, 1)
    assert cut(2, 1, sync_bn=True) == 2   # no SyncBatchNorm on a CPU: per-rank BatchNorm
    assert cut(2, 2, sync_bn=True, device="cuda") == "2 ranks x 2" != cut(4, 1, sync_bn=True, device="cuda")
    assert fsdp_resnet.resume_flags(fsdp_resnet.parse_args([]), (1, 28, 28), 96, 2)["micro_batches"] == 2
