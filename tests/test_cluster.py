"""Several machines: the simulated cluster (network namespaces, each node with its own address)
and a real SLURM on this host. Both need root; without it they are skipped with the reason."""
import json, os, re, shutil, socket, subprocess, sys, time
import pytest
import torch.distributed.run
import common
import local_slurm
import simulated_cluster
from helpers import (HERE, NO_CLUSTER, NO_SLURM, PREEMPTIBLE, RESNET, SMALL, TOY, assert_ok, assert_same_weights,
                     fashion_resnet, free_port, load_model, max_difference, read, resnet_reference, run, running, wait_for)

# One at a time, on one pytest-xdist worker: two local SLURMs would share one munged (the first to
# end stops it).
pytestmark = pytest.mark.xdist_group("machines")
RESNET_BYTES = 4 * sum(p.numel() for p in fashion_resnet(0).parameters())   # 44,691,240
# The sbatch file needs a torchrun that forwards SIGUSR1 (--signals-to-handle, torch 2.10 and later); with an older
# one it refuses in this line, before any training.
SIGNALS_FORWARDED = "--signals-to-handle" in torch.distributed.run.get_args_parser().format_help()
REFUSED = "torchrun has no --signals-to-handle: without it SIGUSR1 kills torchrun"

# ---------------------------------------------------------------- the simulated cluster
@pytest.mark.skipif(NO_CLUSTER is not None, reason=str(NO_CLUSTER))
def test_ddp_toy_on_two_simulated_nodes_trains_like_one_rank(toy_one_rank, tmp_path):
    """The command line of simulated_cluster.py: two nodes with their own addresses and 1 Gbit/s
    links, one torchrun per node, rendezvous at node 0's address."""
    torchrun = f"{sys.executable} -m torch.distributed.run"
    result = run(["python", "examples/simulated_cluster.py", "--nodes", "2", "--rate-mbit", "1000", "--"]
                 + torchrun.split() + ["--nnodes=2", "--nproc_per_node=1", "--node-rank={node}", "--master-addr={head}",
                  f"--master-port={free_port()}", "ddp_toy.py", "--out", str(tmp_path / "node{node}")] + TOY)
    assert_ok(result)
    assert_same_weights(load_model(tmp_path / "node0"), toy_one_rank)
    assert not (tmp_path / "node1").exists()   # rank 0 alone writes


@pytest.mark.skipif(NO_CLUSTER is not None, reason=str(NO_CLUSTER))
def test_scratch_hierarchical_on_two_simulated_nodes_trains_like_one_device(scratch_one_replica, tmp_path):
    port = free_port()
    with simulated_cluster.SimulatedCluster(2, rate_mbit=300) as cluster:
        jobs = [cluster.popen(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                                  f"--node-rank={i}", f"--master-addr={cluster.addresses[0]}", f"--master-port={port}",
                                  "scratch_ring.py", "--devices", "2", "--overlap", "--out", str(tmp_path)] + SMALL +
                              ["--max-steps", "6", "--batch-size", "96"],
                              cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i in range(2)]
        for job in jobs:
            _, err = job.communicate(timeout=300)
            assert job.returncode == 0, err[-3000:]
    assert_same_weights(load_model(tmp_path), scratch_one_replica, tol=1e-6)
    assert json.load(open(tmp_path / "metrics.json"))["layout"] == "2 processes x 2 replicas"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in namespaces for name in cluster.names + [cluster.switch])   # all deleted


@pytest.mark.skipif(NO_CLUSTER is not None, reason=str(NO_CLUSTER))
def test_hsdp_on_two_simulated_nodes_trains_like_flat_fsdp_and_sends_only_an_all_reduce_across(resnet_tolerance,
                                                                                              tmp_path):
    """fsdp_resnet.py --hsdp on 2 nodes x 2 processes: shards within a node, replicas across. Flat
    FSDP on the same 4 processes and HSDP each take the reference's step (what DDP is proven to
    compute), within its tolerance; HSDP is nearer still to flat FSDP, within 10 times the
    difference flat FSDP and the reference make (measured in the same run, and itself held within
    the reference's tolerance: a flat-FSDP bug fails, not widens it). Counted: the all-gathers and
    reduce-scatters stay in the node's shard group; across the nodes goes one all-reduce of each
    rank's half of the gradients."""
    flags = RESNET + ["--batch-size", "16"]   # RESNET's rate: one at which rounding is not amplified
    flat = run(["torchrun", "--standalone", "--nproc_per_node=4", "fsdp_resnet.py", "--out", str(tmp_path / "flat")] +
               flags)
    assert_ok(flat)
    # The floor: the reference and flat FSDP on 4 ranks are the same sums in another order
    # (allreduce against reduce-scatter); HSDP's order is a third. Measured here, on this CPU.
    reference = resnet_reference(4)
    floor = max_difference(reference, load_model(tmp_path / "flat"))
    assert floor <= resnet_tolerance
    port = free_port()
    with simulated_cluster.SimulatedCluster(2, rate_mbit=1000) as cluster:
        jobs = [cluster.popen(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
                                  f"--node-rank={i}", f"--master-addr={cluster.addresses[0]}", f"--master-port={port}",
                                  "fsdp_resnet.py", "--hsdp", "--out", str(tmp_path / "hsdp")] + flags,
                              cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=cluster.env())
                for i in range(2)]
        outputs = [job.communicate(timeout=300) for job in jobs]
        for job, (_, err) in zip(jobs, outputs):
            assert job.returncode == 0, err[-3000:]
    assert "parameters sharded 2 ways in each of 2 replicas (HSDP)" in outputs[0][0] + outputs[1][0]
    assert max_difference(load_model(tmp_path / "hsdp"), reference) <= resnet_tolerance
    assert max_difference(load_model(tmp_path / "hsdp"), load_model(tmp_path / "flat")) <= 10 * max(floor, 1e-7), floor
    sent = json.load(open(tmp_path / "hsdp" / "metrics.json"))["sent_bytes_by_collective"]
    assert set(sent) == {"all_gather (shard group of 2)", "reduce_scatter (shard group of 2)",
                         "all_reduce (replicate group of 2)"}
    assert sent["all_reduce (replicate group of 2)"] == RESNET_BYTES / 2   # this rank's shard of every gradient


@pytest.mark.skipif(NO_CLUSTER is not None, reason=str(NO_CLUSTER))
def test_simulated_cluster_is_deleted_after_an_error():
    with pytest.raises(RuntimeError):
        with simulated_cluster.SimulatedCluster(2) as cluster:
            sleeper = cluster.popen(1, ["sleep", "600"])
            raise RuntimeError("a failing run")
    assert sleeper.poll() is not None   # what it started was stopped
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in namespaces for name in cluster.names + [cluster.switch])


@pytest.mark.skipif(NO_CLUSTER is not None, reason=str(NO_CLUSTER))
def test_simulated_cluster_killed_with_sigterm_deletes_its_nodes_and_their_processes(tmp_path):
    """A command whose node runs a process that starts a child in a session of its own, as
    torchrun starts its workers."""
    child_pid = tmp_path / "child.pid"
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '600'], start_new_session=True); "
              f"open({str(child_pid)!r}, 'w').write(str(p.pid)); time.sleep(600)")
    job = subprocess.Popen([sys.executable, "examples/simulated_cluster.py", "--nodes", "2", "--",
                            sys.executable, "-c", script],
                           cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not child_pid.exists() and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mine = [line.split()[0] for line in names.splitlines() if line.startswith(f"dpc{job.pid}-")]
    assert len(mine) == 3, names   # two nodes and the switch
    job.terminate()
    assert job.wait(timeout=30) == 143
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in names for name in mine)
    assert not running(int(child_pid.read_text()))   # the child was stopped too


def test_simulated_cluster_without_root_says_why_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    reason = "simulated cluster: needs root (or CAP_NET_ADMIN) to create network namespaces"
    assert simulated_cluster.unavailable() == reason
    with pytest.raises(SystemExit) as exit_info:
        simulated_cluster.main(["--nodes", "2", "--", "true"])
    assert exit_info.value.code == reason   # printed to stderr, exit status 1


# ---------------------------------------------------------------- a real SLURM
@pytest.mark.skipif(NO_SLURM is not None or NO_CLUSTER is not None, reason=str(NO_SLURM or NO_CLUSTER))
def test_slurm_job_stopped_twice_requeues_resumes_and_ends_with_uninterrupted_weights(resnet_uninterrupted, tmp_path):
    """examples/slurm_ddp_resnet.sbatch as submitted on a cluster: two nodes with their own
    addresses (each slurmd in a node of a simulated cluster) whose hostname resolves elsewhere
    (a loopback address here), one torchrun each, c10d rendezvous on the first. Stopped twice:
    by `scontrol requeue` (what preemption with requeue does: SIGTERM to every process, and SLURM
    requeues), then by the signal sent ahead of the time limit (--signal=B:USR1@90: the batch
    script requeues). Each time: a checkpoint, a restart, a resume. With a torch before 2.10 the
    file refuses in one line instead, and nothing trains."""
    out, log = tmp_path / "out", tmp_path / "job.out"
    with simulated_cluster.SimulatedCluster(2) as cluster, local_slurm.LocalSlurm(cluster=cluster) as slurm:
        resolved = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
        assert not resolved & set(cluster.addresses), resolved   # torchrun's own guess cannot work
        submitted = slurm.run("sbatch", f"--output={log}", "--gpus-per-node=0", "--cpus-per-task=1",
                              f"--export=ALL,PYTHON={sys.executable},OUT={out},RDZV_PORT={free_port()},"
                              f"GLOO_SOCKET_IFNAME=eth0,PYTHONUNBUFFERED=1",
                              "examples/slurm_ddp_resnet.sbatch", *PREEMPTIBLE, cwd=HERE)
        job = submitted.stdout.split()[-1]
        if not SIGNALS_FORWARDED:
            wait_for(lambda: slurm.job(job)["JobState"] == "FAILED", 120, f"the refusal:\n{read(log)[-3000:]}")
            assert REFUSED in read(log) and "ddp_resnet:" not in read(log), read(log)[-3000:]
            return
        stops = [["scontrol", "requeue", job], ["scancel", "--batch", "--signal=USR1", job]]
        for restart, stop in enumerate(stops):
            started = f"restart {restart} of job" if restart else f"job {job}: "   # the batch script's first line
            wait_for(lambda: started in read(log) and "checkpoint: step " in read(log).split(started)[-1], 240,
                     f"a checkpoint after '{started}':\n{read(log)[-3000:]}")
            slurm.run(*stop)
            wait_for(lambda: slurm.job(job)["JobState"] == "PENDING", 120, f"the requeue:\n{read(log)[-3000:]}")
            # SLURM would start it again after about 90 s; here at once, once the run is gone and a
            # second has passed: slurmd refuses a job whose credential was revoked (by the requeue)
            # in the second the new one is made ("Job credential revoked").
            wait_for(slurm.idle, 120, "the stopped run's end")
            time.sleep(2)
            slurm.run("scontrol", "update", f"jobid={job}", "StartTime=now")
        wait_for(lambda: slurm.job(job)["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"),
                 300, "the restarted job")
        info = slurm.job(job)
    text = read(log)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", (info, text[-3000:])
    first, second, third = re.split(r"restart [12] of job", text)
    assert "stopped by SIGTERM at step" in first and "stopped by SIGUSR1 at step" in second, text[-3000:]
    assert text.count("requeueing job") == 1 and "requeueing job" in second   # the script's, for the signal alone
    assert "resumed from" in second and "resumed from" in third
    assert_same_weights(load_model(out), resnet_uninterrupted, tol=1e-6)


@pytest.mark.skipif(NO_SLURM is not None, reason=str(NO_SLURM))
def test_slurm_job_that_asked_for_gpus_and_sees_none_stops_saying_so(tmp_path):
    """SLURM gives the job 2 GPUs per node (by count, with no devices behind them): the batch
    script stops before any training instead of going on with gloo on CPU (with a torch before 2.10,
    at its refusal of that torchrun, which comes first)."""
    log = tmp_path / "job.out"
    with local_slurm.LocalSlurm(gpus_per_node=2) as slurm:
        submitted = slurm.run("sbatch", f"--output={log}", "--gpus-per-node=2", "--cpus-per-task=1",
                              f"--export=ALL,PYTHON={sys.executable},OUT={tmp_path / 'out'}",
                              "examples/slurm_ddp_resnet.sbatch", *PREEMPTIBLE, cwd=HERE)
        job = submitted.stdout.split()[-1]
        wait_for(lambda: slurm.job(job)["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"),
                 120, "the job's end")
        info = slurm.job(job)
    assert info["JobState"] == "FAILED", (info, read(log))
    assert ("the job has 2 GPU(s) per node from SLURM, but torch sees 0" if SIGNALS_FORWARDED else REFUSED) in read(log)
    assert "ddp_resnet:" not in read(log) and not (tmp_path / "out").exists()


@pytest.mark.skipif(NO_SLURM is not None or NO_CLUSTER is not None, reason=str(NO_SLURM or NO_CLUSTER))
def test_srun_of_several_tasks_trains_one_group(toy_one_rank, resnet_tolerance, tmp_path):
    """`srun -n 2 python ddp_resnet.py` and `srun -n 3 python ddp_toy.py`, no torchrun: the step's tasks are one
    group's ranks, not a training each writing one --out. The nodes have their own addresses and a hostname that
    resolves to a loopback address; ddp_toy.py's 3 tasks span both nodes (2 and 1), so rank 2 reaches rank 0 at its
    node's NodeAddr."""
    srun = ["srun", "--time=5", "--export=ALL,GLOO_SOCKET_IFNAME=eth0"]
    with simulated_cluster.SimulatedCluster(2) as cluster, local_slurm.LocalSlurm(cluster=cluster) as slurm:
        resnet = slurm.run(*srun, "-n", "2", sys.executable, "ddp_resnet.py", "--out", str(tmp_path / "resnet"),
                           *RESNET, check=False, cwd=HERE)
        toy = slurm.run(*srun, "-n", "3", sys.executable, "ddp_toy.py", "--out", str(tmp_path / "toy"), *TOY,
                        check=False, cwd=HERE)
    assert_ok(resnet)
    assert resnet.stdout.count("ddp_resnet: ") == 1 and "2 rank(s)" in resnet.stdout, resnet.stdout[-3000:]
    assert json.load(open(tmp_path / "resnet" / "metrics.json"))["world_size"] == 2
    assert_same_weights(load_model(tmp_path / "resnet"), resnet_reference(2), tol=resnet_tolerance)
    assert_ok(toy)
    assert toy.stdout.count("done: ") == 1 and " on 3 x cpu " in toy.stdout, toy.stdout[-3000:]
    assert_same_weights(load_model(tmp_path / "toy"), toy_one_rank)


def test_srun_tasks_become_torchruns_ranks_and_nothing_else_does(monkeypatch):
    """common.ranks_from_srun, through default_to_one_process: in an srun step of 7 tasks, 2 on each of 3 nodes
    and 1 on a fourth, the task's rank, its node's count and the first node's NodeAddr (from scontrol) with a port
    of the job and step. Left alone: an sbatch or salloc shell (SLURM_NTASKS, no step), a step of one task (a group
    of one), torchrun's processes inside a step (RANK set)."""
    asked = []
    nodes = "NodeName=node3 Arch=x86_64\n   NodeAddr=10.0.0.3 NodeHostName=vm\n\nNodeName=node4\n   NodeAddr=10.0.0.4\n"
    monkeypatch.setattr(subprocess, "check_output", lambda command, **_: asked.append(command) or nodes)
    step = dict(SLURM_NTASKS="7", SLURM_STEP_NUM_TASKS="7", SLURM_STEP_TASKS_PER_NODE="2(x3),1",
                SLURM_STEP_NODELIST="node[3-6]", SLURM_NODEID="2", SLURM_PROCID="5", SLURM_LOCALID="1",
                SLURM_JOB_ID="4321", SLURM_STEP_ID="2")
    one_process = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT="0")
    torchrun = dict(RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.0.0.3",
                    MASTER_PORT="29500")
    cases = [({**step}, dict(RANK="5", LOCAL_RANK="1", WORLD_SIZE="7", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.0.0.3",
                             MASTER_PORT="16321")),   # 10000 + (4321 + 1000 x 2) % 20000
             ({**step, "SLURM_NODEID": "3", "SLURM_PROCID": "6", "SLURM_LOCALID": "0"},
              dict(RANK="6", LOCAL_RANK="0", WORLD_SIZE="7", LOCAL_WORLD_SIZE="1", MASTER_ADDR="10.0.0.3",
                   MASTER_PORT="16321")),
             (dict(SLURM_NTASKS="2", SLURM_PROCID="0", SLURM_JOB_ID="4321"), one_process),
             ({**step, "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"}, one_process),
             ({**step, **torchrun}, torchrun)]
    for variables, expected in cases:
        for name in (*one_process, *step):
            monkeypatch.delenv(name, raising=False)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        common.default_to_one_process()
        assert {name: os.environ[name] for name in one_process} == expected, variables
    assert asked == [["scontrol", "show", "node", "node[3-6]"]] * 2   # the step's nodes, in the step's order


def test_two_nodes_train_like_one_process(resnet_tolerance, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node_rank={i}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                               "--rdzv-id=test", "ddp_resnet.py"] + RESNET + ["--out", str(tmp_path / f"n{i}")],
                              cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=os.environ)
             for i in range(2)]
    for node in nodes:
        out, err = node.communicate(timeout=300)
        assert node.returncode == 0, err[-3000:]
    outs = [p for p in (tmp_path / "n0", tmp_path / "n1") if (p / "model.pt").exists()]
    assert len(outs) == 1   # rank 0 alone writes
    assert_same_weights(load_model(outs[0]), resnet_reference(2), tol=resnet_tolerance)
