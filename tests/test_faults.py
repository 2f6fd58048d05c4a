"""Faults, preemption and bad input: checkpoints and resuming (mid-epoch, other world sizes, a
rank that alone sees the file, crashes mid-write), signals, killed workers, timeouts, ports,
unusable folders and numbers. Run by `bash run_all.sh test`."""
import functools, gzip, http.server, json, os, re, shutil, signal, socket, subprocess, sys, threading, time
import pytest
import torch
import common
from write_images import write_images
import ddp_resnet
import ddp_toy
import diloco_resnet
import fsdp_resnet
from helpers import (DATA, FILES, HERE, OFFLINE, PREEMPTIBLE, RESNET, assert_ok, assert_same_weights, children_of,
                     copy_fashion_mnist, fashion_resnet, folder_datasets, free_port, kill_tree, load_model, read, run,
                     wait_for)

# ---------------------------------------------------------------- preemption and resuming
@pytest.mark.parametrize("script", ["ddp_resnet.py", "fsdp_resnet.py"])
def test_sigterm_mid_epoch_checkpoints_and_exits_75_then_resume_finishes_the_same(
        script, resnet_uninterrupted, tmp_path):
    """SIGTERM to rank 1 alone: the handler only notes the signal; the ranks agree at a step
    boundary (so rank 0 is not left waiting), the checkpoint is written, all exit with status 75.
    FSDP's uninterrupted weights are DDP's (test_scripts.py). SIGTERM to every rank and worker at
    once: test_data.py. DDP's rank 0 writes the stop's checkpoint 3 s late here (a slow disk): rank 1
    leaves only once it is on disk (had it left at once, torchrun would stop rank 0 mid-write)."""
    log = tmp_path / "log"
    slow = ["tests/torchrun_checks.py", "slow-checkpoint", "ddp_resnet"] if script == "ddp_resnet.py" else [script]
    with open(log, "w") as f:
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
                               + slow + ["--out", str(tmp_path)] + PREEMPTIBLE, cwd=HERE, stdout=f,
                               stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_for(lambda: "checkpoint: step 2 " in read(log), 240, "the first checkpoint")
        workers = sorted(children_of(job.pid))
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGTERM)
        job.wait(timeout=120)
    text = read(log)
    assert "stopped by SIGTERM at step" in text and "exitcode  : 75" in text, text[-3000:]
    stopped_at = int(text.split("stopped by SIGTERM at step ")[1].split(",")[0])
    assert 2 <= stopped_at < 6   # inside the first epoch
    if script == "ddp_resnet.py":
        assert f"rank 1 leaves: checkpoint of step {stopped_at} on disk" in text, text[-3000:]
    resumed = run(["torchrun", "--standalone", "--nproc_per_node=2", script, "--resume", "--out",
                   str(tmp_path)] + PREEMPTIBLE)
    assert_ok(resumed)
    assert f"epoch 1 at batch {stopped_at}/6, step {stopped_at}" in resumed.stdout
    assert_same_weights(load_model(tmp_path), resnet_uninterrupted, tol=1e-6)
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert [e["samples"] for e in metrics["epochs"]] == [96, 96]   # the interrupted epoch counted once


def test_no_diloco_rank_leaves_a_stop_before_the_checkpoint_is_on_disk(tmp_path):
    """Rank 0 writes the stop's checkpoint (3 s late here, as on a slow disk); rank 1 leaves only once it is
    on disk. Had rank 1 left at once, torchrun would stop rank 0 and kill it 30 s later, mid-write. (DDP's:
    test_sigterm_mid_epoch_checkpoints_and_exits_75_then_resume_finishes_the_same.)"""
    script = "diloco_resnet"
    log = tmp_path / "log"
    with open(log, "w") as f:
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                "tests/torchrun_checks.py", "slow-checkpoint", script, "--out", str(tmp_path)] +
                               PREEMPTIBLE, cwd=HERE, stdout=f, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_for(lambda: "checkpoint: step 2 " in read(log), 240, "the first checkpoint")
        for pid in children_of(job.pid):   # both ranks, as a scheduler signals a job
            os.kill(pid, signal.SIGTERM)
        job.wait(timeout=120)
    text = read(log)
    stopped_at = int(text.split("stopped by SIGTERM at step ")[1].split(",")[0])
    assert stopped_at > 2 and f"rank 1 leaves: checkpoint of step {stopped_at} on disk" in text, text[-3000:]


def test_sigterm_in_an_epochs_last_step_stops_before_its_evaluation(tmp_path):
    """The stop is agreed at the epoch's end, before its evaluation (which can outlast the watchdog's
    grace): SIGTERM during step 6 of 6 (each ~0.8 s) stops with a checkpoint at step 6, status 75, and
    no epoch line (agreed a step later, it would stop at step 7, after the evaluation); --resume
    evaluates epoch 1, then goes on."""
    flags = ["--train-samples", "288", "--batch-size", "48", "--test-samples", "50", "--epochs", "2",
             "--checkpoint-every", "5", "--data-dir", DATA, "--out", str(tmp_path)]
    log = tmp_path / "log"
    with open(log, "w") as f:
        job = subprocess.Popen([sys.executable, "ddp_resnet.py"] + flags, cwd=HERE, stdout=f, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_for(lambda: "checkpoint: step 5 " in read(log), 240, "the checkpoint before the epoch's last step")
        job.send_signal(signal.SIGTERM)   # in step 6, the epoch's last
        assert job.wait(timeout=120) == 75, read(log)[-3000:]
    text = read(log)
    assert "stopped by SIGTERM at step 6" in text and "epoch   1" not in text, text[-3000:]
    resumed = run(["python", "ddp_resnet.py", "--resume", "--max-steps", "7"] + flags)
    assert_ok(resumed)
    assert "epoch 1 at batch 6/6, step 6" in resumed.stdout and "epoch   1" in resumed.stdout
    assert "done: 7 steps" in resumed.stdout


def test_a_run_stopped_in_epoch_2_keeps_the_history_of_epoch_1(tmp_path):
    """metrics.json and curves.png are written after every evaluated epoch: SIGTERM in epoch 2 leaves epoch 1's
    row and its curves (and no model.pt, which is the end's); the resumed run goes on in the same files."""
    log = tmp_path / "log"
    flags = PREEMPTIBLE + ["--out", str(tmp_path)]
    with open(log, "w") as f:
        job = subprocess.Popen([sys.executable, "ddp_resnet.py"] + flags, cwd=HERE, stdout=f,
                               stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_for(lambda: "checkpoint: step 8 " in read(log), 240, "a checkpoint inside epoch 2")
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 75, read(log)[-3000:]
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert [e["epoch"] for e in metrics["epochs"]] == [1] and "test_loss" in metrics["epochs"][0]
    assert (tmp_path / "curves.png").stat().st_size > 0 and not (tmp_path / "model.pt").exists()
    assert_ok(run(["python", "ddp_resnet.py", "--resume"] + flags))
    assert [e["epoch"] for e in json.load(open(tmp_path / "metrics.json"))["epochs"]] == [1, 2]


PROGRESS = re.compile(r"^  step +(\d+)/12  epoch (\d+)  loss (\d\.\d{4})  acc (\d\.\d{4})  lr (\S+)  ", re.M)


def test_max_steps_leaves_a_checkpoint_and_resume_ends_like_one_run(resnet_uninterrupted_run, tmp_path):
    """--resume with no checkpoint yet says so once and starts at step 0; --max-steps 3 stops
    inside epoch 1 and leaves a checkpoint of step 3; a cap at or below it stops at once;
    --resume --max-steps 12 (the last step of epoch 2) ends with the weights of one run. FSDP's
    checkpoint folder is tested the same way from an image folder, in test_data.py. The resumed
    run's progress lines (one after every step) are the uninterrupted run's from step 4 on: the
    epoch's loss and accuracy so far over all ranks, the steps before the stop included (rank 0
    carries them in the checkpoint), and the learning rate."""
    torchrun = ["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--out", str(tmp_path)] + PREEMPTIBLE
    first = run(torchrun + ["--resume", "--max-steps", "3"])
    assert_ok(first)
    said = f"no checkpoint at {tmp_path / 'checkpoint.pt'}: training starts from step 0"
    assert first.stdout.count(said) == 1, first.stdout   # rank 0 alone says it
    assert "checkpoint: step 3 (epoch 1 at batch 3/6)" in first.stdout
    capped = run(torchrun + ["--resume", "--max-steps", "2"])
    assert_ok(capped)
    assert "nothing to train" in capped.stdout and "at step 3, and this run ends at step 2" in capped.stdout
    assert "done:" not in capped.stdout
    resumed = run(torchrun + ["--resume", "--max-steps", "12", "--print-every", "1"])
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout and "epoch 1 at batch 3/6, step 3" in resumed.stdout
    assert "done: 12 steps" in resumed.stdout
    assert_same_weights(load_model(tmp_path), resnet_uninterrupted_run["weights"], tol=1e-6)
    lines = {int(line[0]): line for line in PROGRESS.findall(resnet_uninterrupted_run["stdout"])}
    again = {int(line[0]): line for line in PROGRESS.findall(resumed.stdout)}
    assert sorted(lines) == list(range(1, 12)) and sorted(again) == list(range(4, 12)), resumed.stdout
    assert [again[step] for step in range(4, 12)] == [lines[step] for step in range(4, 12)]
    assert [e["samples"] for e in json.load(open(tmp_path / "metrics.json"))["epochs"]] == [96, 96]


def test_killed_worker_restarts_mid_epoch_and_ends_with_uninterrupted_weights(resnet_uninterrupted, tmp_path):
    """SIGKILL (no handler can run) mid-epoch under torchrun --max-restarts=1: the workers restart
    from the last --checkpoint-every checkpoint, inside the epoch, recomputing fewer than K steps."""
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "--max-restarts=1", "ddp_resnet.py", "--resume", "--out", str(tmp_path)] + PREEMPTIBLE,
                           cwd=HERE, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    # A hung job fails the test instead of CI: torchrun and its ranks are killed (the ranks of a restart
    # would hold the pipe open after torchrun is gone).
    watchdog = threading.Timer(240, kill_tree, (job.pid,))
    watchdog.start()
    lines = []
    try:
        for line in job.stdout:   # --checkpoint-every 2: steps 2 and 4 are checkpointed inside epoch 1
            lines.append(line)
            if line.startswith("  checkpoint: step 4 "):
                break
        workers = children_of(job.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        lines += job.stdout.readlines()
        assert job.wait(timeout=300) == 0, "".join(lines)[-3000:]
    finally:
        watchdog.cancel()
        if job.poll() is None:   # a failure above: the job goes with the test
            kill_tree(job.pid)
    log = "".join(lines)
    assert "resumed from" in log and "epoch 1 at batch 4/6, step 4" in log, log[-3000:]   # 4 = the last checkpoint
    assert_same_weights(load_model(tmp_path), resnet_uninterrupted, tol=1e-6)
    assert [e["samples"] for e in json.load(open(tmp_path / "metrics.json"))["epochs"]] == [96, 96]


# ---------------------------------------------------------------- a rank fails: torchrun's conventions
@pytest.mark.parametrize("script, flags, batch", [
    ("ddp_resnet.py", [], 0), ("fsdp_resnet.py", [], 0), ("diloco_resnet.py", [], 0),
    ("diloco_resnet.py", ["--local-steps", "4", "--fragments", "2", "--sync-delay", "1"], 1)])
def test_a_failed_ranks_reason_reaches_torchruns_summary_and_its_peer_ends_at_once(script, flags, batch, tmp_path):
    """Rank 1's first batch holds a truncated image, read by a DataLoader worker. Rank 1's error, which names
    the file, reaches torchrun's summary through its error file (@record on main); rank 0, waiting in a
    collective, ends at once with what torch says (gloo sees the connection close), and no rank aborts.
    Streaming DiLoCo: rank 1's second batch, read with a fragment's sync on its way (sent after step 1)."""
    folder = tmp_path / "images"
    write_images(DATA, str(folder), 32, 20)
    train, _, _ = folder_datasets(folder, augment=True)
    sampler = common.ResumableSampler(common.Seeded(train, 0), 4, rank=1, world_size=2, seed=0)
    sampler.set_epoch(1)
    first = list(sampler)[4 * batch]
    assert first != 0   # image 0 is opened by both ranks before training, to see its mode
    bad = train.samples[first][0]   # the first image of rank 1's batch `batch`
    with open(bad, "r+b") as f:
        f.truncate(60)
    started = time.time()
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", script, "--data-dir", str(folder), "--image-size",
                  "28", "--workers", "1", "--batch-size", "8", "--max-steps", "2", "--out", str(tmp_path / "out")] + flags,
                 timeout=120)
    assert result.returncode != 0 and time.time() - started < 60
    summary = result.stderr.split("ChildFailedError")[-1]   # torchrun's
    assert f"error: cannot read {bad}" in summary and "rank      : 1 (local_rank: 1)" in summary, summary[-4000:]
    for abort in ("SIGABRT", "terminate called"):
        assert abort not in result.stdout + result.stderr, result.stderr[-4000:]


def rank_pids(job):
    """{rank: pid} of a torchrun's workers, from their environment (never by name)."""
    ranks = {}
    for pid in children_of(job.pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        ranks[int(env[b"RANK"])] = pid
    return ranks


def test_a_killed_rank_leaves_its_peer_to_end_at_once(tmp_path):
    """kill -9 of rank 1 mid-run: rank 0's next collective fails at once (gloo sees the connection close), and
    it ends with what torch says; torchrun names the killed rank; no rank aborts, nothing waits for a timeout."""
    log = tmp_path / "log"
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "ddp_resnet.py", "--train-samples", "512", "--batch-size", "16", "--test-samples", "50",
                            "--checkpoint-every", "2", "--data-dir", DATA, "--out", str(tmp_path)], cwd=HERE,
                           stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_for(lambda: "checkpoint: step 2 " in read(log), 240, "the first checkpoint")
    os.kill(rank_pids(job)[1], signal.SIGKILL)
    started = time.time()
    assert job.wait(timeout=60) != 0
    assert time.time() - started < 30   # torchrun's own grace before it kills a rank is 30 s
    text = read(log)
    assert "exitcode  : -9" in text and "SIGKILL" in text, text[-4000:]
    for abort in ("SIGABRT", "terminate called"):
        assert abort not in text, text[-4000:]


# ---------------------------------------------------------------- several nodes, each with its own disk
def two_nodes(folders, flags, timeout=120):
    """Two torchrun "nodes" of one process each, each started in its own folder (a disk of its own)."""
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node_rank={i}", "--master_addr=127.0.0.1", f"--master_port={port}",
                               os.path.join(HERE, "ddp_resnet.py")] + flags,
                              cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **OFFLINE})
             for i, folder in enumerate(folders)]
    outputs = [node.communicate(timeout=timeout) for node in nodes]
    return [(node.returncode, *output) for node, output in zip(nodes, outputs)]


@pytest.mark.parametrize("node_1_has", ["its own copy", "a truncated file", "a file as --data-dir"])
def test_each_node_reads_its_own_disk_and_a_problem_one_node_has_ends_both(node_1_has, tmp_path):
    """The README's several-machines command, each node in a folder of its own with --data-dir data: both train
    on their own copies. A problem only node 1 has (a truncated file; a file where the folder should be) is
    said by node 1, and node 0 stops with one line at once, not at a timeout."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    copy_fashion_mnist(folders[0] / "data")
    folders[1].mkdir()
    if node_1_has == "a file as --data-dir":   # not a folder: it must not fall back on another copy
        (folders[1] / "data").write_text("not a folder")
    else:
        copy_fashion_mnist(folders[1] / "data")
    if node_1_has == "a truncated file":
        labels = folders[1] / "data" / "FashionMNIST" / "raw" / "train-labels-idx1-ubyte"
        labels.write_bytes(labels.read_bytes()[:100])
    started = time.time()
    (code0, out0, err0), (code1, out1, err1) = two_nodes(
        folders, ["--data-dir", "data", "--train-samples", "32", "--test-samples", "20", "--batch-size", "16",
                  "--max-steps", "1"])
    if node_1_has == "its own copy":
        assert code0 == 0 and code1 == 0, (err0 + err1)[-3000:]
        assert "done: 1 steps" in out0
        return
    assert code0 != 0 and code1 != 0
    assert time.time() - started < 60   # both stopped at once
    if node_1_has == "a truncated file":   # node 1 names the folder; node 0 says why it stops
        said = f"error: cannot read Fashion-MNIST in {folders[1]}/data/FashionMNIST/raw ("
        assert said in err1 and len(err1.split(said)[0].strip().splitlines()) <= 1, err1[-3000:]
    else:
        assert "error: --data-dir data is not a folder" in err1, err1[-3000:]
    assert "stopping: rank 1 cannot go on (its line says why)" in err0, err0[-3000:]
    ours = re.compile(r'File "' + re.escape(HERE) + r'/[^/"]+\.py"')   # a frame of a script or common.py
    assert not ours.search(err0 + err1), (err0 + err1)[-3000:]   # refusals: torchrun's own report, no traceback of ours
    for said in ("terminate called", "SIGABRT"):
        assert said not in err0 + err1, (err0 + err1)[-3000:]


def test_checkpoint_only_rank_0_sees_is_resumed_by_every_rank(
        mid_epoch_checkpoint_of_2_ranks, resnet_uninterrupted, tmp_path):
    """Node-local disks: two torchrun "nodes" in folders of their own, the checkpoint (a relative
    path) only in node 0's. Rank 0 reads it and sends it on; both ranks go on from step 2."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for folder in folders:
        (folder / "out").mkdir(parents=True)
    shutil.copy(mid_epoch_checkpoint_of_2_ranks, folders[0] / "out" / "checkpoint.pt")
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node_rank={i}", "--master_addr=127.0.0.1", f"--master_port={port}",
                               os.path.join(HERE, "ddp_resnet.py"), "--resume", "--out", "out"] + PREEMPTIBLE,
                              cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=os.environ)
             for i, folder in enumerate(folders)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    assert "resumed from out/checkpoint.pt: epoch 1 at batch 2/6, step 2" in outputs[0][0]
    assert_same_weights(load_model(folders[0] / "out"), resnet_uninterrupted, tol=1e-6)


@pytest.mark.parametrize("flags, differs", [(["--batch-size", "32"], "batch_size 16 there, 32 here"),
                                            (["--seed", "1"], "seed 0 there, 1 here"),
                                            (["--train-samples", "128"], "train_set_size 96 there, 128 here"),
                                            (["--lr", "0.1"], "lr 0.05 there, 0.1 here")])
def test_mid_epoch_checkpoint_of_other_batches_is_refused(flags, differs, mid_epoch_checkpoint_of_2_ranks, tmp_path):
    result = run(["python", "ddp_resnet.py", "--resume", "--checkpoint", str(mid_epoch_checkpoint_of_2_ranks),
                  "--out", str(tmp_path)] + PREEMPTIBLE + flags)
    assert result.returncode != 0
    assert "it was written with other training flags" in result.stderr
    assert differs in result.stderr and "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("script", ["ddp_resnet.py", "fsdp_resnet.py", "diloco_resnet.py"])
def test_resume_with_other_training_flags_is_refused_and_overwrites_nothing(script, tmp_path):
    """One epoch, then --resume with another --batch-size and --lr: refused in one line naming both
    (the checkpoint's batches, schedule and optimizer state are those of its own flags); the
    checkpoint and metrics.json stay as they were. A longer --max-steps is no other training."""
    flags = ["--train-samples", "64", "--test-samples", "10", "--data-dir", DATA, "--out", str(tmp_path)]
    assert_ok(run(["python", script, "--batch-size", "16", "--epochs", "2", "--max-steps", "4"] + flags))
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    refused = run(["python", script, "--batch-size", "32", "--epochs", "2", "--lr", "0.1", "--resume"] + flags)
    assert refused.returncode == 1 and len(refused.stderr.splitlines()) == 1, refused.stderr[-2000:]
    assert "batch_size 16 there, 32 here" in refused.stderr and "lr 0.05 there, 0.1 here" in refused.stderr
    # Another model: the flag named, before any weights are loaded (no load_state_dict's list of keys).
    refused = run(["python", script, "--batch-size", "16", "--epochs", "2", "--arch", "resnet34", "--resume"] + flags)
    assert refused.returncode == 1 and refused.stderr.strip() == (
        f"error: cannot resume from {tmp_path}/{'checkpoint' if 'fsdp' in script else 'checkpoint.pt'}: it was "
        f"written with other training flags (arch resnet18 there, resnet34 here); use the same, or start without "
        f"--resume"), refused.stderr[-2000:]
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    if script == "ddp_resnet.py":   # (the others' resumes are tested above and in test_slow_links.py)
        resumed = run(["python", script, "--batch-size", "16", "--epochs", "2", "--max-steps", "6", "--resume"] + flags)
        assert_ok(resumed)
        assert "epoch 1 done, step 4" in resumed.stdout and "done: 6 steps" in resumed.stdout


def test_mid_epoch_checkpoint_resumes_at_another_world_size(
        mid_epoch_checkpoint_of_2_ranks, resnet_uninterrupted, tmp_path):
    """Same global batch, same batches: 1 process with 2 micro-batches (the per-rank BatchNorm of
    2 ranks) goes on from the 2 ranks' checkpoint and ends with their uninterrupted weights, and
    with their BatchNorm statistics (rank 0's: micro-batch 0 alone moves them here; both did once,
    0.43 apart after the 4 steps left, their count 6 against 4). Without --accum-steps 2 its
    BatchNorm would normalise 16 images at a time, not 8: it goes on, saying so."""
    for out in ("same", "other"):
        (tmp_path / out).mkdir()
        shutil.copy(mid_epoch_checkpoint_of_2_ranks, tmp_path / out / "checkpoint.pt")
    result = run(["python", "ddp_resnet.py", "--resume", "--accum-steps", "2", "--out", str(tmp_path / "same")] +
                 PREEMPTIBLE)
    assert_ok(result)
    assert "epoch 1 at batch 2/6, step 2" in result.stdout and "note:" not in result.stdout
    assert_same_weights(load_model(tmp_path / "same"), resnet_uninterrupted)
    other = run(["python", "ddp_resnet.py", "--resume", "--max-steps", "3", "--out", str(tmp_path / "other")] +
                PREEMPTIBLE)
    assert_ok(other)
    assert ("note: each global batch is now cut into 1 micro-batch(es), 2 before: BatchNorm's "
            "statistics and what the step draws (dropout, ...) go on close to, not the same as") in other.stdout


def test_fsdp_checkpoint_saved_by_2_ranks_loads_on_1_and_3(tmp_path):
    """Each rank writes its own shard; 1 rank reads them back into its own shards (DCP reshards),
    and the whole model it then holds is the one the 2 ranks saved; 3 ranks go on from them."""
    flags = ["--train-samples", "48", "--batch-size", "12", "--test-samples", "50", "--data-dir", DATA]
    flags += ["--epochs", "2"]   # the first run stops at the end of epoch 1
    saved = run(["torchrun", "--standalone", "--nproc_per_node=2", "fsdp_resnet.py", "--max-steps", "4", "--out",
                 str(tmp_path)] + flags)
    assert_ok(saved)
    newest = fsdp_resnet.newest_checkpoint(str(tmp_path / "checkpoint"))
    assert newest.endswith("step-00000004"), newest   # 48 samples, 12 a step: 4 steps
    shards = sorted(p.name for p in (tmp_path / "checkpoint" / newest).iterdir() if p.suffix == ".distcp")
    assert len(shards) == 2, shards   # one file per rank
    loaded = tmp_path / "loaded.pt"
    result = run(["torchrun", "--standalone", "--nproc_per_node=1", "tests/torchrun_checks.py", "fsdp-load",
                  str(tmp_path / "checkpoint"), str(loaded)])
    assert_ok(result)
    assert_same_weights(torch.load(loaded), load_model(tmp_path), tol=0)
    resumed = run(["torchrun", "--standalone", "--nproc_per_node=3", "fsdp_resnet.py", "--resume"] +
                  flags + ["--out", str(tmp_path)])
    assert_ok(resumed)
    assert "epoch 1 done, step 4" in resumed.stdout
    assert [e["epoch"] for e in json.load(open(tmp_path / "metrics.json"))["epochs"]] == [1, 2]


def test_writes_reach_the_disk_before_the_rename(tmp_path, monkeypatch):
    """save_atomically syncs the new file, renames, then syncs the folder (the rename itself is
    durable only then)."""
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))
    target = tmp_path / "checkpoint.pt"
    common.save_atomically(lambda tmp: torch.save({"step": 1}, tmp), str(target))
    assert synced == [f"{target}.tmp{os.getpid()}", str(tmp_path)] and torch.load(target) == {"step": 1}


def test_a_failed_or_killed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A write that fails (a full disk) removes its temporary file; one killed mid-write leaves it, and the next
    save of the same path removes it first. common.fsync() closes the file even when os.fsync fails."""
    target, killed = tmp_path / "checkpoint.pt", tmp_path / "checkpoint.pt.tmp4242"
    killed.write_bytes(b"half a checkpoint")
    def fails(tmp):
        with open(tmp, "wb") as f:
            f.write(b"the first bytes")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space left"):
        common.save_atomically(fails, str(target))
    assert os.listdir(tmp_path) == []
    common.save_atomically(lambda tmp: torch.save({"step": 1}, tmp), str(target))
    assert os.listdir(tmp_path) == ["checkpoint.pt"]
    def fsync_fails(fd):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(os, "fsync", fsync_fails)
    before = len(os.listdir("/proc/self/fd"))
    common.fsync(str(target))
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("bad", ["not-a-checkpoint", "another-model"])
def test_resume_from_a_wrong_file_says_what_is_wrong_once(bad, tmp_path):
    checkpoint = tmp_path / "checkpoint.pt"
    if bad == "not-a-checkpoint":
        checkpoint.write_bytes(b"these bytes are no checkpoint")
        expected = f"cannot resume from {checkpoint}"
    else:
        torch.save({"arch": "fashion_resnet18", "model": ddp_toy.ToyMLP().state_dict()}, checkpoint)
        expected = "it lacks flags, history, position, state and holds arch, model"
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "ddp_resnet.py", "--resume", "--checkpoint",
                  str(checkpoint), "--out", str(tmp_path)] + RESNET)
    assert result.returncode != 0
    ranks_said, torchrun_said = result.stderr.split("ChildFailedError", 1)
    assert ranks_said.count(expected) == 1, result.stderr[-3000:]   # rank 0 alone says it
    assert not re.search(r"\[rank\d+\]: Traceback", result.stderr)   # torchrun's own report aside, no traceback


def test_a_checkpoint_written_by_another_page_is_refused_naming_that_page(capsys, tmp_path):
    """ddp_resnet.py's checkpoint handed to diloco_resnet.py --resume, and diloco_resnet.py's to ddp_resnet.py (both
    keep a file): refused in one line that names the page that wrote it, before anything is loaded or trained."""
    for writer, reader in ((ddp_resnet, diloco_resnet), (diloco_resnet, ddp_resnet)):
        out = tmp_path / writer.__name__
        writer.main(RESNET + ["--max-steps", "1", "--out", str(out)])
        capsys.readouterr()
        with pytest.raises(SystemExit) as refused:
            reader.main(RESNET + ["--resume", "--checkpoint", str(out / "checkpoint.pt"), "--out", str(tmp_path)])
        assert refused.value.code == (
            f"error: cannot resume from {out}/checkpoint.pt: it was written by {writer.__name__}.py, which keeps other "
            f"state: resume it with {writer.__name__}.py, or start {reader.__name__}.py without --resume")
        assert "step" not in capsys.readouterr().out


def test_a_checkpoint_of_another_optimizer_or_model_is_refused_in_one_line_and_nothing_said_resumed(monkeypatch,
                                                                                                      capsys, tmp_path):
    """ddp_resnet.py's checkpoint of SGD, resumed with make_optimizer() giving AdamW, and AdamW's resumed with SGD (it
    loaded, then crashed in SGD's step: KeyError 'momentum'); one of ResNet-18 resumed with make_model() giving
    EfficientNet-B0 under the same flags: each refused in one line naming the thing, and its kind there and here,
    before "resumed from" is said or a step taken. fsdp_resnet.py's AdamW checkpoint resumed with SGD: DCP's own
    reason, in one line (it was a traceback: DCP's exception is no Exception)."""
    sgd = ddp_resnet.make_optimizer
    def adamw(raw_model, args, steps_per_epoch):
        optimizer = torch.optim.AdamW(raw_model.parameters(), lr=1e-3)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    out = str(tmp_path / "out")
    flags = RESNET + ["--max-steps", "1", "--out", out]
    for written, read, kinds in ((sgd, adamw, "SGD there, AdamW here"), (adamw, sgd, "AdamW there, SGD here")):
        monkeypatch.setattr(ddp_resnet, "make_optimizer", written)
        ddp_resnet.main(flags)
        monkeypatch.setattr(ddp_resnet, "make_optimizer", read)
        capsys.readouterr()
        with pytest.raises(SystemExit) as refused:
            ddp_resnet.main(RESNET + ["--max-steps", "2", "--resume", "--out", out])
        assert refused.value.code == f"error: cannot resume from {out}/checkpoint.pt: its optimizer is not this run's ({kinds})"
        assert "resumed from" not in capsys.readouterr().out
    monkeypatch.setattr(ddp_resnet, "make_optimizer", sgd)
    ddp_resnet.main(flags)
    monkeypatch.setattr(ddp_resnet, "make_model", lambda args, shape, classes: common.classifier(
        "efficientnet_b0", classes, shape[0], shape[-1]))
    with pytest.raises(SystemExit) as refused:
        ddp_resnet.main(RESNET + ["--max-steps", "2", "--resume", "--out", out])
    assert refused.value.code == (f"error: cannot resume from {out}/checkpoint.pt: its model is not this run's "
                                  f"(ResNet there, EfficientNet here)")
    assert "resumed from" not in capsys.readouterr().out
    # fsdp_resnet.py: DCP finds no momentum in AdamW's shards, and its exception (a BaseException) is said in one line.
    fsdp_sgd = fsdp_resnet.make_optimizer
    monkeypatch.setattr(fsdp_resnet, "make_optimizer", adamw)
    fsdp_resnet.main(flags)
    monkeypatch.setattr(fsdp_resnet, "make_optimizer", fsdp_sgd)
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        fsdp_resnet.main(RESNET + ["--max-steps", "2", "--resume", "--out", out])
    assert refused.value.code == (f"error: cannot resume from {out}/checkpoint/step-00000001: Missing key in checkpoint "
                                  f"state_dict: optimizer.state.conv1.weight.momentum_buffer. (rank 0)")
    assert "resumed from" not in capsys.readouterr().out


def test_a_checkpoint_of_the_earlier_layout_is_refused_in_one_line_naming_the_difference(tmp_path):
    """A checkpoint written before its position had a key of its own (epoch, batch_in_epoch, step, the sums as
    "totals" and seconds at its top): refused in one line that names what it lacks and what it holds instead,
    and nothing is trained."""
    flags = ["--out", str(tmp_path)] + RESNET
    assert_ok(run(["python", "ddp_resnet.py"] + flags))
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    state.pop("script")   # which that layout did not write either
    position = state.pop("position")
    state.update(epoch=position["epoch"], batch_in_epoch=position["batch_in_epoch"], step=position["step"],
                 totals=list(position["sums"].values()), seconds=position["seconds"])
    torch.save(state, tmp_path / "checkpoint.pt")
    result = run(["python", "ddp_resnet.py", "--resume"] + flags)
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr[-2000:]
    assert (f"error: cannot resume from {tmp_path}/checkpoint.pt: it lacks position and holds batch_in_epoch, "
            f"epoch, seconds, step, totals: it was written by another script, or by an older version of this one"
            ) == result.stderr.strip()
    assert "ddp_resnet:" not in result.stdout


def test_checkpoint_every_must_be_positive(capsys):
    for value in ("0", "-3"):
        with pytest.raises(SystemExit) as exit_info:
            ddp_resnet.parse_args(["--checkpoint-every", value])
        assert exit_info.value.code == 2
        assert f"argument --checkpoint-every: must be positive, got {value}" in capsys.readouterr().err


@pytest.mark.parametrize("page, keeps", [(ddp_resnet, "a file"), (fsdp_resnet, "a folder"),
                                         (diloco_resnet, "a file")])
def test_a_checkpoint_path_of_the_wrong_kind_is_refused_as_the_flags_are_read(page, keeps, tmp_path):
    """--checkpoint naming a folder where the page keeps a file (one there, or one not there yet, ending in /), or a
    file where FSDP keeps a folder (the DDP habit): the run would say "training starts from step 0", train, and fail
    at its first save. Refused in one line as the flags are read (main's first call), with --resume or without,
    nothing made in --out; a path not there yet is taken (a run from step 0)."""
    wrong, out = tmp_path / "checkpoint", tmp_path / "out"
    if keeps == "a file":
        wrong.mkdir()
    else:
        wrong.write_bytes(b"")
    other = "a folder" if keeps == "a file" else "a file"
    kept = "checkpoint in a file (name one: DIR/checkpoint.pt)" if keeps == "a file" else "checkpoints in a folder"
    wrongs = [str(wrong)] + ([str(tmp_path / "not-yet") + "/"] if keeps == "a file" else [])
    for path in wrongs:
        for resume in ([], ["--resume"]):
            with pytest.raises(SystemExit) as exit_info:
                page.parse_args(resume + ["--checkpoint", path, "--out", str(out)])
            said = f"error: --checkpoint {path} is {other}: {page.__name__}.py keeps its {kept}"
            assert exit_info.value.code == said   # Python prints it alone and exits with 1
    assert not out.exists() and not (tmp_path / "not-yet").exists()
    new = tmp_path / "new"
    assert page.parse_args(["--resume", "--checkpoint", str(new)]).checkpoint == str(new)


# ---------------------------------------------------------------- joining, timeouts, ports, bad input
def test_two_jobs_side_by_side_both_finish(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    commands = [[sys.executable, "ddp_toy.py", "--epochs", "2"],
                [sys.executable, "ddp_toy.py", "--epochs", "2"],
                torchrun + ["ddp_toy.py", "--epochs", "2"],
                torchrun + ["ddp_toy.py", "--epochs", "2"]]
    jobs = [subprocess.Popen(c + ["--out", str(tmp_path / str(i))], cwd=HERE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i, c in enumerate(commands)]
    for job in jobs:
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-3000:]


def test_a_load_longer_than_the_groups_timeout_ends_with_every_rank_loaded():
    """Each node's first rank loads the data while the others wait, then they load while it waits: scanning
    an image folder of a million files on network storage can outlast a group's timeout (NCCL's watchdog: 10
    minutes). Two ranks on a default group whose waits time out after 2 s, each loading for 4 s in its turn:
    both end with what they loaded."""
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "tests/torchrun_checks.py", "slow-load"])
    assert_ok(result)
    assert "rank 0: loaded by rank 0" in result.stdout and "rank 1: loaded by rank 1" in result.stdout

def test_fashion_mnist_is_downloaded_once_per_node(tmp_path):
    """Three ranks of one node with the default --data-dir: the node's first process downloads Fashion-MNIST
    into ./data, then the others read it (all at once, they would write the same files together). torchvision's
    download is pointed at the files served here (no checksum) and counted, in every process the job starts."""
    mirror, hook, node, log = tmp_path / "mirror", tmp_path / "hook", tmp_path / "node", tmp_path / "downloads"
    for folder in (mirror, hook, node):
        folder.mkdir()
    for name in FILES:
        with open(os.path.join(DATA, "FashionMNIST", "raw", name), "rb") as raw:
            with gzip.open(mirror / f"{name}.gz", "wb", compresslevel=1) as packed:
                shutil.copyfileobj(raw, packed)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(mirror)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    (hook / "sitecustomize.py").write_text(f"""import torchvision.datasets.mnist as mnist
mnist.FashionMNIST.mirrors = [{url!r}]
mnist.FashionMNIST.resources = [(name, None) for name, _ in mnist.FashionMNIST.resources]
fetch = mnist.download_and_extract_archive
def counted(url, *args, **kwargs):
    with open({str(log)!r}, "a") as f:
        f.write(url + "\\n")
    return fetch(url, *args, **kwargs)
mnist.download_and_extract_archive = counted
""")
    result = run(["torchrun", "--standalone", "--nproc_per_node=3", os.path.join(HERE, "scratch_ring.py"),
                  "--max-steps", "1", "--train-samples", "300", "--test-samples", "30", "--batch-size", "96",
                  "--out", str(tmp_path / "out")], env={**OFFLINE, "no_proxy": "127.0.0.1", "PYTHONPATH": f"{hook}:{HERE}"},
                 cwd=node)
    server.shutdown()
    assert_ok(result)
    assert sorted(read(log).split()) == sorted(f"{url}{name}.gz" for name in FILES)   # each once
    assert sorted(os.listdir(node / "data" / "FashionMNIST" / "raw")) == sorted(FILES + tuple(f"{n}.gz" for n in FILES))
    assert result.stdout.count("data: Fashion-MNIST from") == 1


def test_a_truncated_data_file_is_said_in_one_line(tmp_path):
    copy_fashion_mnist(tmp_path / "data")
    with open(tmp_path / "data" / "FashionMNIST" / "raw" / "t10k-images-idx3-ubyte", "r+b") as f:
        f.truncate(100_000)
    result = run(["python", "scratch_lenet.py", "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "out")])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"error: cannot read Fashion-MNIST in {tmp_path}/data/FashionMNIST/raw (" in result.stderr.splitlines()[0]


def test_missing_matplotlib_stops_the_run_before_training(tmp_path):
    """curves.png is drawn with matplotlib, which common.py imports only where it draws: without it a run
    stops at once, in one line that says what to install, not after its training."""
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    result = run(["python", "ddp_resnet.py", "--out", str(tmp_path / "out")] + RESNET,
                 env={"PYTHONPATH": str(tmp_path / "hide")})
    assert result.returncode == 1 and result.stderr.strip() == (
        "error: matplotlib is not installed, and curves.png is drawn with it: pip install -r requirements.txt")
    assert "ddp_resnet:" not in result.stdout   # before training


@pytest.mark.parametrize("case", ["data-dir-is-a-file", "out-not-writable"])
def test_unusable_folders_are_named(case, tmp_path):
    """A --data-dir that is a file: refused in one line. An --out that cannot be made: Python's error names it,
    before training."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    flags = (["--data-dir", str(blocker)] if case == "data-dir-is-a-file" else
             ["--data-dir", DATA, "--out", str(blocker / "out")])
    result = run(["python", "ddp_resnet.py", "--max-steps", "1"] + flags, env=OFFLINE)
    assert result.returncode != 0 and "ddp_resnet:" not in result.stdout
    if case == "data-dir-is-a-file":
        assert result.stderr.strip() == f"error: --data-dir {blocker} is not a folder"
    else:
        assert f"NotADirectoryError: [Errno 20] Not a directory: '{blocker}/out'" in result.stderr, result.stderr


def test_batch_not_dividing_by_world_size_is_refused(tmp_path):
    """Another global batch would be another training: refused, said once."""
    result = run(["python", "ddp_toy.py", "--world-size", "3", "--batch-size", "50", "--epochs", "1",
                  "--out", str(tmp_path)])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.count("error: --batch-size 50 does not divide by the 3 ranks") == 1, result.stderr


def test_world_size_larger_than_the_data_is_refused(tmp_path):
    result = run(["python", "ddp_toy.py", "--world-size", "8", "--train-samples", "5", "--batch-size", "8",
                  "--out", str(tmp_path)])
    assert result.returncode != 0
    assert "5 training samples are fewer than --batch-size 8" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("page", ["ddp_resnet", "fsdp_resnet", "diloco_resnet"])
def test_two_ranks_on_one_gpu_are_refused_before_nccl_in_one_line(page, tmp_path):
    """Two processes a launcher showed the same GPU (CUDA_VISIBLE_DEVICES=0 for both, taken at its word): the
    first NCCL call would fail with NCCL's "Duplicate GPU detected"; the ranks compare (host, GPU UUID) over
    gloo first, and one line names the host and the GPU."""
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "tests/torchrun_checks.py", "shared-gpu",
                  page] + RESNET + ["--out", str(tmp_path)], env={"CUDA_VISIBLE_DEVICES": "0"})
    assert result.returncode != 0
    line = f"rank 0: error: ranks 0 and 1 are both on GPU GPU-8b3c of {socket.gethostname()}: start at most one " \
           f"process per GPU, or let them share it: --backend gloo"
    assert result.stderr.count(line) == 1 and "Duplicate GPU" not in result.stderr, result.stderr[-3000:]
    assert f"{page}:" not in result.stdout
