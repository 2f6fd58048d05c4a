"""Your own model: the README's make_model() (EfficientNet-B0, with dropout and stochastic depth) trains on every ResNet
page, FSDP shards it by its blocks, and a run stopped mid-epoch resumes bit-equal, what its step draws included;
--arch takes torchvision's classifiers, or refuses in one line; --clip-grad-norm clips the averaged gradient alike at
any layout, and the norm a run reports is the one one process computes."""
import collections, functools, json, os, re, shutil, subprocess, sys
import pytest
import torch
import torch.nn.functional as F
import torchvision
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
    """--arch efficientnet_b0 is made for 1x28x28 images: its stem takes one channel, at stride 1. An unknown name, a
    model that is no classifier (segmentation's FCN, whose builder would download a backbone; a video model), a
    model that cannot take such images (ViT's patches must divide them), or an option it does not take
    (--zero-init-residual, a ResNet's) is refused in one line, before training, saying what would work; nothing is
    downloaded."""
    torch.manual_seed(0)
    net = common.classifier("efficientnet_b0", 10, channels=1, image_size=28)
    stem = net.features[0][0]
    assert (stem.in_channels, stem.stride) == (1, (1, 1))
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="0").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", download_refused)
    listed = "all: torchvision.models.list_models(module=torchvision.models))"
    refused = {("--arch", "nope"): f"nope for 1x28x28 images: not one of torchvision's classification models "
                                   f"(closest: none; {listed}",
               ("--arch", "fcn_resnet50"): f"fcn_resnet50 for 1x28x28 images: not one of torchvision's "
                                           f"classification models (closest: resnet50, wide_resnet50_2, resnet152; "
                                           f"{listed}",
               ("--arch", "r3d_18"): f"r3d_18 for 1x28x28 images: not one of torchvision's classification models "
                                     f"(closest: none; {listed}",
               ("--arch", "vit_b_16"): "vit_b_16 for 1x28x28 images: Input shape indivisible by patch size! (it takes "
                                       "32x32 images; image folders: --image-size 32)",
               ("--arch", "efficientnet_b0", "--zero-init-residual"):
                   "efficientnet_b0 for 1x28x28 images: EfficientNet.__init__() got an unexpected keyword argument "
                   "'zero_init_residual'"}
    for flags, why in refused.items():
        with pytest.raises(SystemExit) as stopped:
            ddp_resnet.main(list(flags) + RESNET + ["--out", str(tmp_path / "out")])
        assert stopped.value.code == f"error: --arch {why}"
        assert "step" not in capsys.readouterr().out and not (tmp_path / "out").exists()


def download_refused(*args, **kwargs):
    raise AssertionError(f"a download: {args}")


@functools.lru_cache(maxsize=1)
def parameters_of_every_classifier():
    """{name: its parameters} of every classification model torchvision lists, each built once on the meta device
    (no memory, no weights), with its 1,000 classes; RegNet's widths, which it computes with tensors, on the CPU."""
    from torchvision.models import regnet
    widths = regnet.BlockParams.from_init_params.__func__
    def on_the_cpu(cls, *args, **kwargs):
        with torch.device("cpu"):
            return widths(cls, *args, **kwargs)
    regnet.BlockParams.from_init_params = classmethod(on_the_cpu)
    try:
        with torch.device("meta"):
            return {name: torchvision.models.get_model(name)
                    for name in torchvision.models.list_models(module=torchvision.models)}
    finally:
        regnet.BlockParams.from_init_params = classmethod(widths)


def test_every_torchvision_classifier_under_100m_parameters_trains_or_is_refused_in_one_line(monkeypatch):
    """Each of the classification models torchvision lists that has under 100 M parameters (63 of 80), made by --arch
    for 1x28x28 images and 10 classes with no network (a download fails the test): taken, a training-mode forward
    and backward of two images gives 10 logits each and a gradient to every parameter; refused, one line that says
    why and the size it takes. At 28 pixels GoogLeNet is taken (built without its auxiliary outputs, it trains on its
    main one); ViT-B/16 and B/32 (their patches must tile the image), Inception v3 and MaxViT-T are refused."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", download_refused)
    models = parameters_of_every_classifier()
    small = [name for name, net in models.items() if sum(p.numel() for p in net.parameters()) < 100e6]
    assert len(models) == 80 and len(small) == 63, len(small)
    refused = {}
    for arch in small:
        torch.manual_seed(0)
        try:
            net = common.classifier(arch, 10, channels=1, image_size=28)
        except SystemExit as stopped:
            refused[arch] = stopped.code
            continue
        logits = net(torch.randn(2, 1, 28, 28))
        assert torch.is_tensor(logits) and logits.shape == (2, 10), arch
        logits.sum().backward()
        assert all(p.grad is not None for p in net.parameters()), arch
    assert sorted(refused) == ["inception_v3", "maxvit_t", "vit_b_16", "vit_b_32"], refused
    for arch, line in refused.items():
        assert line.startswith(f"error: --arch {arch} for 1x28x28 images: ") and "\n" not in line, line
        assert re.search(r" \(it takes (64|224|32)x\1 images; image folders: --image-size \1\)$", line), line


def held_by_each_unit(model, units):
    """{unit: the parameters it holds}, the model's own (its root's rest) under the model."""
    held = {id(model): sum(p.numel() for p in model.parameters())}
    for unit in units:
        inside = set(p for module in (unit if isinstance(unit, list) else [unit]) for p in module.parameters())
        held[id(unit)] = sum(p.numel() for p in inside)
        held[id(model)] -= held[id(unit)]
    return held


def test_fsdp_units_hold_at_most_a_quarter_of_every_torchvision_classifier():
    """fsdp_resnet.blocks() on each of the 80 classification models torchvision lists (on the meta device, 1,000
    classes): no unit, nor what is left to the root, holds more than a quarter of the parameters, unless it is a
    single layer or a block of layers alone (of a class the model repeats, with no such block inside: ResNet-18's
    BasicBlocks, up to 42% each, stay its 8 units). VGG's and AlexNet's layers are their units, the largest
    classifier layer one of its own (VGG-16's: 77%); DenseNet-121's dense blocks give their 58 layers; MobileNetV3's
    and ShuffleNetV2's rests, which were the root's, are cut into their layers."""
    holders = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
    for name, model in parameters_of_every_classifier().items():
        units = fsdp_resnet.blocks(model)
        repeats = collections.Counter(type(m) for m in model.modules())
        blocks = {m for m in model.modules()
                  if repeats[type(m)] > 1 and list(m.children()) and not isinstance(m, holders)}
        quarter = sum(p.numel() for p in model.parameters()) / 4
        for unit, held in zip([model] + units, held_by_each_unit(model, units).values()):
            layer = not isinstance(unit, list) and not list(unit.children())
            alone = unit in blocks and not blocks.intersection(unit.modules()) - {unit}
            assert held <= quarter or layer or alone, (name, type(unit).__name__, held / quarter / 4)
        kinds = [type(unit).__name__ for unit in units]
        if name == "resnet18":
            assert kinds == ["BasicBlock"] * 8
        if name in ("vgg16", "alexnet"):
            assert all(not list(unit.children()) for unit in units) and len(units) == {"vgg16": 16, "alexnet": 8}[name]
            largest = max(units, key=lambda unit: sum(p.numel() for p in unit.parameters()))
            assert isinstance(largest, torch.nn.Linear) and largest in model.classifier
        if name == "densenet121":
            assert kinds == ["_DenseLayer"] * 58


def test_modules_that_share_a_parameter_are_one_fsdp_unit():
    """ResNet-18 with a weight shared by the two blocks of its first stage: blocks() gives them as one unit (a list),
    the other six alone; with a weight a block shares with a layer of the root's, that block is left to the root."""
    net = fashion_resnet(0)
    net.layer1[1].conv1.weight = net.layer1[0].conv1.weight
    units = fsdp_resnet.blocks(net)
    assert [net.layer1[0], net.layer1[1]] in units and len(units) == 7
    assert all(isinstance(unit, torch.nn.Module) for unit in units if unit != [net.layer1[0], net.layer1[1]])
    net = fashion_resnet(0)
    net.extra = torch.nn.Conv2d(64, 64, 3, bias=False)
    net.extra.weight = net.layer1[0].conv2.weight
    units = fsdp_resnet.blocks(net)
    assert net.layer1[0] not in units and len(units) == 7


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
    line after step 1 prints that step's norm as the mean and the largest of the steps since the line before, and
    metrics.json holds the mean of both steps' norms, each counted once, and the larger. diloco_resnet.py clips each
    rank's own gradient: its first step's record is the mean of the two ranks' norms, and the larger of them (the
    largest is taken over the ranks)."""
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
        assert len(lines) == 1 and f"  grad norm {norms[0]:.4g}  max grad norm {norms[0]:.4g}  " in lines[0], lines
        record = json.load(open(out / "metrics.json"))["epochs"][-1]
        assert record["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-4), name
        assert record["max_grad_norm"] == pytest.approx(max(norms), rel=1e-4), name
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
    assert record["max_grad_norm"] == pytest.approx(max(each), rel=1e-4) and max(each) > min(each) * 1.01


def test_the_norms_a_resumed_run_prints_and_records_are_the_run_never_stopped(monkeypatch, capsys, tmp_path):
    """ddp_resnet.py clipping at 1 (every step clipped), 3 epochs of 3 steps, a line every 2 steps: each line shows
    the gradient norm's mean and largest over the steps since the line before or the epoch's start (the line after
    step 2: steps 1 and 2), each epoch's record those of its steps. Stopped by --max-steps 5 and resumed, the lines
    after step 5 (step 6's covers steps 5 and 6, one before the stop) and every record are the run never stopped's:
    the checkpoint keeps the sums and largest of the epoch and since the last line."""
    monkeypatch.chdir(tmp_path)
    flags = ["--train-samples", "48", "--test-samples", "20", "--batch-size", "16", "--epochs", "3", "--lr", "0.5",
             "--clip-grad-norm", "1", "--print-every", "2", "--data-dir", DATA]
    def norms_said():
        lines = re.findall(r"  step (\d)/\d .*  grad norm (\S+)  max grad norm (\S+)  ", capsys.readouterr().out)
        return {int(step): (mean, largest) for step, mean, largest in lines}
    ddp_resnet.main(flags + ["--out", "whole"])
    whole = norms_said()
    assert sorted(whole) == [2, 4, 6, 8] and all(float(mean) <= float(largest) for mean, largest in whole.values())
    assert float(whole[2][0]) < float(whole[2][1]) and float(whole[6][0]) < float(whole[6][1])
    ddp_resnet.main(flags + ["--out", "parts", "--max-steps", "5"])
    assert norms_said() == {2: whole[2], 4: whole[4]}
    ddp_resnet.main(flags + ["--out", "parts", "--resume"])
    assert norms_said() == {6: whole[6], 8: whole[8]}
    records = [json.load(open(tmp_path / out / "metrics.json"))["epochs"] for out in ("whole", "parts")]
    norms = [[(e["grad_norm"], e["max_grad_norm"]) for e in epochs] for epochs in records]
    assert norms[0] == norms[1] and len(norms[0]) == 3


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
