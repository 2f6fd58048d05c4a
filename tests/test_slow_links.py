"""Training over slow links: DiLoCo is DDP when it syncs every step, its outer step is Nesterov's,
and it resumes inside a round; DDP's compression hooks step the fp32 way, and what the 16-bit ones
and FSDP hand to collectives is counted right."""
import json, math, re
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import common
import diloco_resnet
from helpers import (DATA, RESNET, RESNET_LR, TWO_EPOCHS, assert_ok, assert_same_weights, epoch_batches, fashion_resnet,
                     load_model, max_difference, resnet_reference, resnet_step, run)

RESNET_BYTES = 4 * sum(p.numel() for p in fashion_resnet(0).parameters())   # 44,691,240
BUFFER_BYTES = sum(b.numel() * b.element_size() for b in fashion_resnet(0).buffers())


def metrics(out):
    return json.load(open(out / "metrics.json"))


@pytest.mark.parametrize("nproc, batch_size", [(2, 16), (3, 24)])
def test_diloco_with_one_local_step_is_ddp(nproc, batch_size, tmp_path):
    """--local-steps 1 --outer-lr 1 --outer-momentum 0: the ranks' averaged SGD updates (with
    momentum, kept per rank) are the update of the averaged gradient: ddp_resnet.py's step (the
    reference, which ddp_resnet.py is tested to take), 3 steps. A small learning rate: DiLoCo
    averages weight differences, rounded at the weights' scale (1e-7), and at --lr 0.05 ResNet's
    first steps on 8 images per rank amplify that to 3e-4 in 3 steps (2e-5 in 2). That rounding
    is not a summation order, so the measured floor of the other ResNet comparisons does not
    bound it: a fixed tolerance here."""
    lr = RESNET_LR
    result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "diloco_resnet.py", "--local-steps", "1",
                  "--outer-lr", "1", "--outer-momentum", "0", "--lr", str(lr), "--batch-size", str(batch_size),
                  "--train-samples", str(4 * batch_size), "--test-samples", "101", "--max-steps", "3",
                  "--data-dir", DATA, "--out", str(tmp_path)])
    assert_ok(result)
    reference = resnet_reference(nproc, steps=3, lr=lr * batch_size / 256, batch_size=batch_size,
                                 samples=4 * batch_size)
    assert_same_weights(load_model(tmp_path), reference, tol=1e-5)   # 3.7e-6 measured at 2 ranks (EPYC)
    # every step: the pseudo-gradient (every parameter, fp32) and rank 0's BatchNorm statistics
    assert metrics(tmp_path)["sent_bytes_by_collective"] == {f"all_reduce ({nproc} ranks)": RESNET_BYTES,
                                                             f"broadcast ({nproc} ranks)": BUFFER_BYTES}
    assert f"{(RESNET_BYTES + BUFFER_BYTES) / 1e6:.3g} MB to collectives per step and rank" in result.stdout


def test_diloco_outer_step_is_nesterov_on_the_pseudo_gradient_with_momentum_across_rounds():
    """diloco_resnet.Outer against the outer step written out, H = 2, two rounds (one rank: the average
    over ranks is the test above's): the pseudo-gradient g is the round's start minus the replica;
    the outer momentum v = 0.9 v + g is kept from round to round; the shared weights move by
    -0.7 (g + 0.9 v) (Nesterov); every replica starts the next round from them, with its own
    BatchNorm statistics (rank 0's, on one rank)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        outer = diloco_resnet.Outer(net, lr=0.7, momentum=0.9, local_steps=2)
        inner = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        shared = [p.detach().clone() for p in net.parameters()]
        velocity = [torch.zeros_like(p) for p in shared]
        for step in range(1, 5):   # H = 2 inner steps on the replica, two rounds
            inner.zero_grad()
            net(torch.randn(8, 4)).square().mean().backward()
            inner.step()
            if step % 2:
                assert outer.after_step(net, step) == (0, 0)   # no sync inside the round
                continue
            statistics = [b.clone() for b in net.buffers()]
            for i, replica in enumerate(net.parameters()):
                g = shared[i] - replica.detach()
                velocity[i] = 0.9 * velocity[i] + g
                shared[i] = shared[i] - 0.7 * (g + 0.9 * velocity[i])
            outer.after_step(net, step)
            for replica, expected, kept in zip(net.parameters(), shared, outer.params):
                assert (replica.detach() - expected).abs().max().item() <= 1e-6 and torch.equal(replica, kept)
            assert all(torch.equal(b, s) for b, s in zip(net.buffers(), statistics))
            assert all(torch.equal(outer.shared[name], b) for name, b in net.named_buffers())
    finally:
        dist.destroy_process_group()


def test_diloco_resumes_inside_a_round(tmp_path):
    """Rounds of 4 steps over epochs of 6 (the round from step 5 to 8 spans an epoch's end, where
    the shared weights of step 4 are evaluated), outer Nesterov momentum: stopped at step 5 (a
    round under way, the replicas apart), resumed to step 12, it ends with the uninterrupted
    run's weights and accuracies. The stopped run's model.pt is the shared weights of step 4, and
    it says so. Each rank's replica is a file of its own beside the checkpoint; only the newest
    checkpoint's are kept."""
    # no --checkpoint-every: a DiLoCo checkpoint holds every rank's replica; the stop writes one
    torchrun = ["torchrun", "--standalone", "--nproc_per_node=2", "diloco_resnet.py", "--local-steps", "4"] + TWO_EPOCHS
    whole = run(torchrun + ["--out", str(tmp_path / "whole")])
    stopped = run(torchrun + ["--max-steps", "5", "--out", str(tmp_path / "parts")])
    assert_ok(whole)
    assert_ok(stopped)
    assert "model.pt holds the shared weights of the last sync (step 4)" in stopped.stdout
    parts = tmp_path / "parts"
    replicas = lambda: sorted(str(p.relative_to(parts)) for p in parts.glob("checkpoint.pt.*/*"))
    assert replicas() == ["checkpoint.pt.replicas-step5/rank0.pt", "checkpoint.pt.replicas-step5/rank1.pt"]
    resumed = run(torchrun + ["--resume", "--out", str(tmp_path / "parts")])
    assert_ok(resumed)
    assert replicas() == ["checkpoint.pt.replicas-step12/rank0.pt", "checkpoint.pt.replicas-step12/rank1.pt"]
    assert "resumed from" in resumed.stdout and "batch 5/6, step 5" in resumed.stdout
    assert_same_weights(load_model(tmp_path / "parts"), load_model(tmp_path / "whole"), tol=1e-6)
    for parts, whole in zip(metrics(tmp_path / "parts")["epochs"], metrics(tmp_path / "whole")["epochs"]):
        assert parts["test_acc"] == whole["test_acc"]
        assert parts["train_loss"] == pytest.approx(whole["train_loss"], abs=1e-6)
    # 12 steps, 3 syncs: a quarter of the pseudo-gradient per step
    assert metrics(tmp_path / "whole")["sent_bytes_by_collective"]["all_reduce (2 ranks)"] == RESNET_BYTES / 4


# MobileNetV3-small: BatchNorm, Dropout and 142 parameters, a step 15 times quicker than ResNet-18's
STREAMING = ["--arch", "mobilenet_v3_small", "--local-steps", "12", "--fragments", "4", "--batch-size", "16",
             "--train-samples", "144", "--epochs", "1", "--test-samples", "50", "--data-dir", DATA]


def mobilenet():
    torch.manual_seed(0)
    return common.classifier("mobilenet_v3_small", 10, channels=1, image_size=28)


def streaming_reference(delay, alpha, threads=1, steps=9, every=3, count=4, ranks=2):
    """Streaming DiLoCo written out, the W replicas in one process, STREAMING's run: each replica's
    inner steps are ddp_resnet.py's recipe on its share of the global batch (its dropout seeded as
    the page seeds it); the k-th sync, after
    step k * every, is of fragment (k - 1) mod count (diloco_resnet.fragments' runs): its
    pseudo-gradient (the shared weights minus the replica's) is taken `delay` steps before and
    averaged over the replicas; at its step the outer SGD (lr 0.7, Nesterov momentum 0.9, kept per
    parameter) steps the fragment's shared weights with it, and each replica takes lerp(shared,
    its own, alpha) and replica 0's buffers. A sync due after the last step is not started; at the
    last step the fragments not synced there are synced at once. Returns the shared parameters by
    name and the bytes sent after each step."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    X, y = common.fashion_mnist(DATA, 144, 1)[0].tensors
    replicas = [mobilenet() for _ in range(ranks)]
    names = [name for name, _ in replicas[0].named_parameters()]
    params = [list(r.parameters()) for r in replicas]
    index = {id(p): j for j, p in enumerate(params[0])}
    runs = [[index[id(p)] for p in run] for run in diloco_resnet.fragments(replicas[0], count)]
    shared = [p.detach().clone() for p in params[0]]
    outer = torch.optim.SGD(shared, lr=0.7, momentum=0.9, nesterov=True)
    lr = 0.05 * 16 / 256
    inner = [torch.optim.SGD([{"params": [p for p in ps if p.ndim > 1], "weight_decay": 5e-4},
                              {"params": [p for p in ps if p.ndim == 1], "weight_decay": 0}], lr=lr, momentum=0.9)
             for ps in params]
    buffer_bytes = sum(b.numel() * b.element_size() for b in replicas[0].buffers())
    pseudo = lambda which: [sum(shared[j] - ps[j].detach() for ps in params) / ranks for j in which]
    flight, sent = None, []

    def end(which, average):
        for j, g in zip(which, average):
            shared[j].grad = g
        outer.step()
        outer.zero_grad()
        with torch.no_grad():
            for ps, replica in zip(params, replicas):
                for j in which:
                    ps[j].copy_(shared[j].lerp(ps[j], alpha))
                for b, b0 in zip(replica.buffers(), replicas[0].buffers()):
                    b.copy_(b0)
        return buffer_bytes

    try:
        for i, idx in enumerate(epoch_batches(144, 16, seed=0, epoch=1)[:steps]):
            step, nbytes = i + 1, 0
            for r, (replica, optimizer) in enumerate(zip(replicas, inner)):
                for group in optimizer.param_groups:
                    group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * i / steps))
                optimizer.zero_grad()
                common.seed_the_step(0, i, r)
                F.cross_entropy(replica(X[idx[r::ranks]]), y[idx[r::ranks]]).backward()
                optimizer.step()
            if (step + delay) % every == 0 and step + delay <= steps:
                which = runs[((step + delay) // every - 1) % count]
                flight = (which, pseudo(which))
                nbytes += 4 * sum(shared[j].numel() for j in which)
            ended = []
            if step % every == 0:
                nbytes += end(*flight)
                ended = flight[0]
            if step == steps:
                rest = [j for j in range(len(shared)) if j not in ended]
                nbytes += 4 * sum(shared[j].numel() for j in rest) + end(rest, pseudo(rest))
            sent.append(nbytes)
    finally:
        torch.set_num_threads(before)
    return {name: t for name, t in zip(names, shared)}, sent


@pytest.fixture(scope="module")
def streaming_references():
    """The reference of each (delay, alpha), computed once, and the floor: the reference with the
    most to round (delay 2, alpha 0.5) on 2 threads against 1 (only the order of sums inside the
    kernels differs), never below one float32 rounding step of the largest weight; times 10."""
    references = {}
    for delay in (0, 1, 2):
        for alpha in (0.0, 0.5):
            references[delay, alpha] = streaming_reference(delay, alpha)
    one, two = references[2, 0.5][0], streaming_reference(2, 0.5, threads=2)[0]
    rounding = torch.finfo(torch.float32).eps * max(t.abs().max().item() for t in one.values())
    return references, 10 * max(max_difference(one, two), rounding)


@pytest.mark.parametrize("delay, alpha", [(0, 0.0), (0, 0.5), (1, 0.0), (1, 0.5), (2, 0.0), (2, 0.5)])
def test_streaming_diloco_is_the_schedule_written_out(delay, alpha, streaming_references, tmp_path):
    """--fragments 4 --local-steps 12 at 2 ranks, 9 steps (a sync every 3: fragments 0, 1, 2, then
    at the last step 0, 1 and 3 at once): the shared weights equal the reference's within the
    floor measured here, and not another delay's or alpha's; the progress line after each step
    says what that step sent, its fragment's pseudo-gradient or BatchNorm's buffers; the epoch's
    record the syncs and their bytes."""
    references, tolerance = streaming_references
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "diloco_resnet.py", "--sync-delay", str(delay),
                  "--fragment-alpha", str(alpha), "--print-every", "1", "--out", str(tmp_path)] + STREAMING)
    assert_ok(result)
    weights = load_model(tmp_path)
    expected, sent = references[delay, alpha]
    page = {name: weights[name] for name in expected}
    assert max_difference(page, expected) <= tolerance
    others = [max_difference(page, weights) for key, (weights, _) in references.items() if key != (delay, alpha)]
    assert min(others) > 10 * tolerance
    lines = re.findall(r"step +(\d+)/9 .* sent MB ([\d.e+-]+) +largest fragment MB ([\d.]+)", result.stdout)
    assert [(int(step), float(mb)) for step, mb, _ in lines] == [(i + 1, float(f"{b / 1e6:.4g}")) for i, b in
                                                                  enumerate(sent[:8])]
    largest = max(4 * sum(p.numel() for p in run) for run in diloco_resnet.fragments(mobilenet(), 4))
    assert {float(mb) for *_, mb in lines} == {float(f"{largest / 1e6:.4g}")}
    epoch = metrics(tmp_path)["epochs"][0]
    assert (epoch["syncs"], epoch["sent_bytes"], epoch["largest_fragment_bytes"]) == (4, sum(sent), largest)


def test_streaming_diloco_stopped_with_a_fragment_in_flight_resumes_bit_equal(tmp_path):
    """Fragments of 2 steps, each sent a step ahead (a sync in flight after every odd step), alpha
    0.5, over two epochs of 6 steps: a checkpoint at step 3 and a stop at step 5, each with a
    fragment's pseudo-gradient on its way, then --resume: the weights and accuracies of the run
    never stopped, bit for bit."""
    torchrun = ["torchrun", "--standalone", "--nproc_per_node=2", "diloco_resnet.py", "--local-steps", "6",
                "--fragments", "3", "--sync-delay", "1", "--fragment-alpha", "0.5"] + TWO_EPOCHS + STREAMING[:2]
    whole = run(torchrun + ["--out", str(tmp_path / "whole")])
    stopped = run(torchrun + ["--checkpoint-every", "3", "--max-steps", "5", "--out", str(tmp_path / "parts")])
    assert_ok(whole)
    assert_ok(stopped)
    assert "checkpoint: step 3 " in stopped.stdout and "checkpoint: step 5 " in stopped.stdout
    assert "model.pt holds each fragment's shared weights of the last sync (step 4)" in stopped.stdout
    resumed = run(torchrun + ["--resume", "--out", str(tmp_path / "parts")])
    assert_ok(resumed)
    assert "batch 5/6, step 5" in resumed.stdout
    assert_same_weights(load_model(tmp_path / "parts"), load_model(tmp_path / "whole"), tol=0)
    assert metrics(tmp_path / "parts")["epochs"] == [
        {**e, "seconds": p["seconds"], "samples_per_s": p["samples_per_s"]}
        for e, p in zip(metrics(tmp_path / "whole")["epochs"], metrics(tmp_path / "parts")["epochs"])]


@pytest.mark.parametrize("flags, why", [
    (["--local-steps", "10", "--fragments", "4"], "--fragments 4 does not divide --local-steps 10"),
    (["--local-steps", "8", "--fragments", "4", "--sync-delay", "2"], "--sync-delay 2 is not under"),
    (["--fragment-alpha", "1.5"], "--fragment-alpha 1.5 is not from 0 to 1")])
def test_streaming_flags_that_cannot_work_are_refused_at_parse_time(flags, why):
    with pytest.raises(SystemExit) as refused:
        diloco_resnet.parse_args(flags)
    assert str(refused.value).startswith(f"error: {why}") and "\n" not in str(refused.value)


def test_fragments_cut_the_model_in_order_into_runs_of_about_equal_bytes_or_an_empty_one_is_refused(
        monkeypatch, tmp_path):
    """ResNet-18's parameters in 4 runs: consecutive, each once, none over twice the mean (its
    largest tensor is 21% of the bytes); 64 fragments leave one empty, and a fragments() of yours
    that leaves out a parameter would never sync it: each refused in one line before training."""
    net = fashion_resnet(0)
    params = list(net.parameters())
    runs = diloco_resnet.fragments(net, 4)
    assert [id(p) for run in runs for p in run] == [id(p) for p in params] and all(runs)
    assert max(4 * sum(p.numel() for p in run) for run in runs) <= 2 * 4 * sum(p.numel() for p in params) / 4
    result = run(["python", "diloco_resnet.py", "--local-steps", "64", "--fragments", "64", "--out", str(tmp_path)]
                 + RESNET)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: fragments() must cut the parameters that train into --fragments 64 runs, none empty, each parameter "
        "in one: fewer fragments, or cut them your way there")
    monkeypatch.setattr(diloco_resnet, "fragments", lambda raw_model, count: [list(raw_model.parameters())[:-1]])
    with pytest.raises(SystemExit, match=r"^error: fragments\(\) must cut the parameters that train into --fragments 1"):
        diloco_resnet.main(RESNET + ["--out", str(tmp_path / "yours")])


@pytest.mark.parametrize("hook, nproc", [("bf16", 2), ("fp16", 1)])
def test_16_bit_comm_hooks_step_the_fp32_way(hook, nproc, tmp_path):
    """PyTorch's bf16/fp16 compression hooks: the reference step up to gradients rounded to 16
    bits (not exactly it: the hook is in use). ddp_resnet.py's bytes per step (its parameters'
    bytes, halved) are those the hook handed torch.distributed's all_reduce, counted there
    (tests/torchrun_checks.py hook-sent): every gradient in 2 bytes; a group of one sends
    nothing over a link, and the script reports nothing."""
    result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "tests/torchrun_checks.py", "hook-sent",
                  "ddp_resnet"] + RESNET + ["--comm-hook", hook, "--max-steps", "1", "--out", str(tmp_path)])
    assert_ok(result)
    step_fp32, step_16 = resnet_step(resnet_reference(nproc, steps=1)), resnet_step(load_model(tmp_path))
    assert 0 < (step_16 - step_fp32).norm() / step_fp32.norm() < 0.02
    handed = [int(n) for n in re.findall(r"rank \d+ handed all_reduce (\d+) bytes in 16 bits", result.stdout)]
    assert handed == [RESNET_BYTES // 2] * nproc, result.stdout[-2000:]   # each rank, in its one step
    assert metrics(tmp_path)["sent_bytes_by_collective"] == ({f"all_reduce ({nproc} ranks)": handed[0]}
                                                             if nproc > 1 else {})


def test_powersgd_compresses_after_plain_steps_and_a_resume_starts_it_afresh(resnet_tolerance, tmp_path):
    """--powersgd-start 2: two plain allreduce steps (the reference's), then rank-1 factors
    (another step). A resume at step 2 starts PowerSGD afresh, says so, and its next two steps
    are plain again: the reference's 4 steps."""
    torchrun = ["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--comm-hook", "powersgd",
                "--powersgd-rank", "1", "--powersgd-start", "2"] + RESNET
    whole = run(torchrun + ["--max-steps", "4", "--out", str(tmp_path / "whole")])
    stopped = run(torchrun + ["--max-steps", "2", "--out", str(tmp_path / "parts")])
    assert_ok(whole)
    assert_ok(stopped)
    assert_same_weights(load_model(tmp_path / "parts"), resnet_reference(2, steps=2), tol=resnet_tolerance)
    resumed = run(torchrun + ["--max-steps", "4", "--resume", "--out", str(tmp_path / "parts")])
    assert_ok(resumed)
    assert "note: PowerSGD starts afresh after a resume: plain allreduce for 2 steps" in resumed.stdout
    plain = resnet_reference(2, steps=4)
    assert_same_weights(load_model(tmp_path / "parts"), plain, tol=resnet_tolerance)
    compressed = resnet_step(load_model(tmp_path / "whole")) - resnet_step(plain)
    assert compressed.norm() > 1e-3 * resnet_step(plain).norm()   # steps 3 and 4 were compressed
    # 2 plain steps of every gradient, then 2 of rank-1 factors and the 1-D tensors (PowerSGD's own
    # count of the elements it sends): a little over half the plain bytes per step; the resumed
    # run's two steps were plain
    sent = metrics(tmp_path / "whole")["sent_bytes_per_step"]
    assert RESNET_BYTES / 2 < sent < 0.55 * RESNET_BYTES, sent
    assert metrics(tmp_path / "parts")["sent_bytes_per_step"] == RESNET_BYTES


@pytest.mark.parametrize("nproc, mesh", [(2, "flat"), (3, "flat"), (4, "hsdp")])
def test_fsdp_bytes_computed_from_the_shards_are_what_torch_distributed_is_handed(nproc, mesh):
    """fsdp_resnet.py counts what FSDP2 sends from the shards' sizes (public APIs only); one
    step's all-gathers, reduce-scatters and (HSDP, 2 x 2) all-reduces, counted where
    torch.distributed is called, are those bytes exactly, in fp32 and with --amp."""
    result = run(["torchrun", "--standalone", f"--nproc_per_node={nproc}", "tests/torchrun_checks.py", "fsdp-sent",
                  mesh])
    assert_ok(result)
    assert "fsdp sent ok" in result.stdout
