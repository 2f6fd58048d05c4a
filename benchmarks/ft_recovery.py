"""What a failure costs: ft_ddp_resnet.py's members going on, against the restart path (torchrun
--max-restarts of ddp_resnet.py resuming from a --checkpoint-every checkpoint) and against torchft
(PyTorch's fault-tolerance library, if installed: `pip install torchft==0.2.0`); and what the quorum
and the commit cost per step when nothing fails, against ddp_resnet.py at the same global batch.

    python benchmarks/ft_recovery.py [--steps 24] [--kill-at 10]

Three processes on this machine (one thread each), ResNet-18 for 28x28 images, 8 images each per
step. Every step's end is stamped with the time (a wrapper around each script, in this file: the
scripts print no line per step). A kill lands in the middle of a step (half a normal step after
the kill_at-th is stamped). Time lost per failure: from the SIGKILL of one process to the next
step any survivor commits, minus one normal step (the median of the steps before the kill). A hang
is a SIGSTOP at the same point, with the collectives' timeout at 3 s (ft_ddp_resnet.py's
--member-timeout, torchft's Manager timeout). torchft's lighthouse waits up to its join timeout (1 s)
for a replica whose heartbeat is fresh before a quorum without it: it runs with the heartbeat timeout
at its default 5 s and at 0.5 s (replicas beat every 0.1 s). A join timeout of 0.1 s was tried: on 2
shared cores the live replicas did not all ask within it, and the quorums churned.
"""
import argparse, importlib.util, json, os, re, signal, socket, statistics, subprocess, sys, tempfile, time
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def free_port():   # port 0: the OS picks one no one listens on now
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def stamped(kind):
    """Run as a wrapper: the script, with a line `stamp STEP TIME` at each committed step's end."""
    if kind == "ft":
        import ft_ddp_resnet
        ask = ft_ddp_resnet.CoordinatorLink.ask
        def stamping(self, message):
            answer = ask(self, message)
            if message["op"] == "vote" and answer.get("commit"):
                print(f"stamp {message['step'] + 1} {time.time():.4f}", flush=True)
            return answer
        ft_ddp_resnet.CoordinatorLink.ask = stamping
        module = ft_ddp_resnet
    else:
        import torch, ddp_resnet
        step = torch.optim.lr_scheduler.LRScheduler.step   # once after every optimizer step (and once when made)
        def stamping(self, *args):
            step(self, *args)
            if os.environ.get("RANK") == "0" and self.last_epoch > 0:
                print(f"stamp {self.last_epoch} {time.time():.4f}", flush=True)
        torch.optim.lr_scheduler.LRScheduler.step = stamping
        module = ddp_resnet
    sys.argv = [module.__file__] + sys.argv[3:]
    module.main()

def torchft_member(lighthouse, replica, steps, timeout_s, host="127.0.0.1", batch=24):
    """Run as a wrapper: one torchft replica group of one process, the same model, batch and rate as
    the others here: torchft's Manager over its ProcessGroupGloo, a quorum started before each
    step, the gradients averaged in one allreduce (torchft's DDP wrapper did not survive a kill on
    CPU), the optimizer stepped only if should_commit() agrees. A `stamp` line per committed step.
    `host`: the address its peers reach it at (its store, its checkpoint server), `batch`: the global batch,
    a third of it on each replica (a replica that is out leaves its third out of the step, as torchft does)."""
    import datetime
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torchft import Manager, ProcessGroupGloo
    import common, ft_ddp_resnet
    torch.set_num_threads(1)
    import socket
    socket.gethostname = lambda: host   # torchft's checkpoint server gives its address by the host's name
    X, y = common.fashion_mnist(os.path.join(ROOT, "data"), batch * steps, 10)[0].tensors
    torch.manual_seed(0)
    net = common.classifier("resnet18", 10, channels=1, image_size=28)
    flags = argparse.Namespace(lr=0.002, batch_size=batch, weight_decay=5e-4, epochs=1)
    optimizer, _ = ft_ddp_resnet.make_optimizer(net, flags, steps)   # at a constant rate
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)   # this replica group's own
    timeout = datetime.timedelta(seconds=timeout_s)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=2, timeout=timeout,
                      load_state_dict=lambda s: (net.load_state_dict(s["model"]),
                                                 optimizer.load_state_dict(s["optim"])),
                      state_dict=lambda: {"model": net.state_dict(), "optim": optimizer.state_dict()},
                      replica_id=f"replica{replica}", lighthouse_addr=lighthouse, rank=0, world_size=1,
                      store_addr=host, store_port=store.port, hostname=host)
    while manager.current_step() < steps:
        step = manager.current_step()
        manager.start_quorum()
        optimizer.zero_grad()
        share = batch // 3
        idx = ft_ddp_resnet.epoch_order(len(y), 0, 1)[step * batch:][:batch][share * replica:share * (replica + 1)]
        F.cross_entropy(net(X[idx]), y[idx]).backward()
        params = list(net.parameters())
        flat = torch.cat([p.grad.flatten() for p in params])
        manager.allreduce(flat).wait()   # averaged over the participants
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        if manager.should_commit():
            optimizer.step()
            print(f"stamp {step + 1} {time.time():.4f} {manager.num_participants()}", flush=True)   # and how many
    print(f"done: {steps} steps", flush=True)
    manager.shutdown(wait=False)

def stamps(text):
    return [(int(s), float(t)) for s, t, _ in re.findall(r"^stamp (\d+) ([\d.]+)( \d+)?$", text, re.M)]

def mid_step(log, kill_at):
    """Once kill_at steps are stamped in the log: the time half a normal step after the last stamp
    (a failure lands anywhere in a step; the middle is its average), else None."""
    marks = stamps(open(log.name).read())
    if len(marks) < kill_at:
        return None
    times = [t for _, t in marks]
    return times[-1] + statistics.median(b - a for a, b in zip(times[1:], times[2:])) / 2

def until_two_finish(members, log, kill_at, how="kill"):
    """Wait for the first two members to end; with kill_at, SIGKILL the third (`how`: or SIGSTOP it, a
    hang) in the middle of the step after the first has committed kill_at steps. Returns the first's
    stamps and the time of the fault."""
    killed, at = None, None
    while any(m.poll() is None for m in members[:2]):
        time.sleep(0.005)
        at = at or (kill_at and mid_step(log, kill_at))
        if at and killed is None and time.time() >= at:
            members[2].send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            killed = time.time()
    members[2].send_signal(signal.SIGCONT)
    members[2].kill()
    return stamps(open(log.name).read()), killed

def run_ft(out, steps, kill_at, how="kill", timeout_s=10, sums="float64"):
    """3 members; with kill_at, one of them is SIGKILLed (or stopped) once the run has committed kill_at steps."""
    address, store = f"127.0.0.1:{free_port()}", ["--store-port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = ["--train-samples", str(24 * steps), "--test-samples", "10", "--batch-size", "24", "--micro-batch", "8",
             "--epochs", "1", "--lr", "0.002", "--min-members", "3", "--sums", sums]
    coordinator = subprocess.Popen([sys.executable, "ft_ddp_resnet.py", "--serve", address, *store, "--member-timeout",
                                    str(timeout_s)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    logs = [open(os.path.join(out, f"m{i}.log"), "w+") for i in range(3)]
    members = [subprocess.Popen([sys.executable, __file__, "stamped", "ft", "--join", address,
                                 "--out", os.path.join(out, f"m{i}")] + flags, cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT) for i, log in enumerate(logs)]
    marks, killed = until_two_finish(members, logs[0], kill_at, how)
    coordinator.kill()
    return marks, killed

def run_restart(out, steps, kill_at):
    """ddp_resnet.py, 3 ranks under torchrun --max-restarts=1, a checkpoint every 4 steps; with kill_at,
    rank 2 is SIGKILLed in the middle of the step after kill_at, and the job restarts from the checkpoint."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(os.path.join(out, "ddp.log"), "w+")
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                            "--max-restarts=1", __file__, "stamped", "ddp", "--train-samples", str(24 * steps),
                            "--test-samples", "10", "--batch-size", "24", "--epochs", "1", "--lr", "0.002",
                            "--checkpoint-every", "4", "--resume", "--out", out], cwd=ROOT, env=env, stdout=log,
                           stderr=subprocess.STDOUT)
    killed, at = None, None
    while job.poll() is None:
        time.sleep(0.005)
        at = at or (kill_at and mid_step(log, kill_at))
        if at and killed is None and time.time() >= at:
            workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == job.pid]
            os.kill(max(workers), signal.SIGKILL)   # the last worker started: rank 2
            killed = time.time()
    return stamps(open(log.name).read()), killed

def run_torchft(out, steps, kill_at, how="kill", join_ms=1000, heartbeat_ms=5000, timeout_s=10):
    """3 torchft replica groups of one process and a lighthouse (join timeout join_ms, heartbeat timeout
    heartbeat_ms, the Manager's timeout timeout_s); with kill_at, the third is SIGKILLed (or stopped) in
    the middle of the step after the first's kill_at-th."""
    from torchft.coordination import LighthouseServer
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=join_ms,
                                  heartbeat_timeout_ms=heartbeat_ms)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [open(os.path.join(out, f"r{i}.log"), "w+") for i in range(3)]
    members = [subprocess.Popen([sys.executable, __file__, "torchft", lighthouse.address(), str(i), str(steps),
                                 str(timeout_s)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
               for i, log in enumerate(logs)]
    marks, killed = until_two_finish(members, logs[0], kill_at, how)
    lighthouse.shutdown()
    return marks, killed

def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None

def summary(name, marks, killed, kill_at):
    times = [t for _, t in marks]
    normal = statistics.median(b - a for a, b in zip(times[1:kill_at], times[2:kill_at + 1]))
    result = {"normal step s": round(normal, 3)}
    if killed:   # the first step past the last one done before the kill (a restart recomputes some first)
        done = max(s for s, t in marks if t <= killed)
        after = min(t for s, t in marks if t > killed and s > done)
        result.update(next_commit_after_kill_s=round(after - killed, 3), lost_s=round(after - killed - normal, 3))
    print(f"  {name:44} " + ", ".join(f"{k} {v}" for k, v in result.items()), flush=True)
    return result

def main():
    if len(sys.argv) > 2 and sys.argv[1] == "stamped":
        return stamped(sys.argv[2])
    if len(sys.argv) > 2 and sys.argv[1] == "torchft":
        return torchft_member(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), *sys.argv[6:7],
                              *map(int, sys.argv[7:8]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--kill-at", type=int, default=10)
    args = p.parse_args()
    import torch
    print(f"torch {torch.__version__}, {len(os.sched_getaffinity(0))} cores, {time.strftime('%Y-%m-%d')}: 3 processes, "
          f"ResNet-18 28x28, global batch 24, {args.steps} steps, a kill in the middle of step {args.kill_at + 1}",
          flush=True)
    float32 = lambda out, steps, kill_at: run_ft(out, steps, kill_at, sums="float32")
    results, runs = {}, [("ft_ddp_resnet.py, nothing fails", run_ft, 0),
                         ("ft_ddp_resnet.py --sums float32, nothing fails", float32, 0),
                         ("ddp_resnet.py, nothing fails", run_restart, 0),
                         ("ft_ddp_resnet.py, one member SIGKILLed", run_ft, args.kill_at),
                         ("ddp_resnet.py, one rank SIGKILLed, restart", run_restart, args.kill_at)]
    hang = lambda out, steps, kill_at: run_ft(out, steps, kill_at, how="hang", timeout_s=3)
    runs += [("ft_ddp_resnet.py, one member hung (SIGSTOP), --member-timeout 3", hang, args.kill_at)]
    if importlib.util.find_spec("torchft"):
        quick = lambda out, steps, kill_at: run_torchft(out, steps, kill_at, heartbeat_ms=500)
        hung = lambda out, steps, kill_at: run_torchft(out, steps, kill_at, how="hang", heartbeat_ms=500, timeout_s=3)
        runs += [("torchft 0.2.0, nothing fails", run_torchft, 0),
                 ("torchft 0.2.0, one replica SIGKILLed", run_torchft, args.kill_at),
                 ("torchft 0.2.0, heartbeat timeout 0.5 s, one replica SIGKILLed", quick, args.kill_at),
                 ("torchft 0.2.0, heartbeat timeout 0.5 s, timeout 3 s, one replica hung", hung, args.kill_at)]
    else:
        print("torchft is not installed (pip install torchft==0.2.0): its rows are left out", flush=True)
    with tempfile.TemporaryDirectory() as out:
        for name, run, kill in runs:
            folder = tempfile.mkdtemp(dir=out)
            marks, killed = run(folder, args.steps, kill)
            results[name] = summary(name, marks, killed, args.kill_at)
    ft, ddp = results["ft_ddp_resnet.py, nothing fails"], results["ddp_resnet.py, nothing fails"]
    print(f"per step, nothing failing: ft {ft['normal step s']} s, ddp {ddp['normal step s']} s: "
          f"{ft['normal step s'] / ddp['normal step s']:.2f}x", flush=True)
    ft32 = results["ft_ddp_resnet.py --sums float32, nothing fails"]["normal step s"]
    print(f"exact (float64) sums: a step {ft['normal step s']} s against float32's {ft32} s: "
          f"{ft['normal step s'] / ft32:.2f}x", flush=True)
    lost_ft = results["ft_ddp_resnet.py, one member SIGKILLed"]["lost_s"]
    lost_ddp = results["ddp_resnet.py, one rank SIGKILLed, restart"]["lost_s"]
    print(f"time lost per failure: ft {lost_ft} s, restart path {lost_ddp} s: "
          f"{lost_ddp / max(lost_ft, 1e-3):.1f}x less", flush=True)
    if "torchft 0.2.0, one replica SIGKILLed" in results:
        lost_torchft = results["torchft 0.2.0, one replica SIGKILLed"]["lost_s"]
        print(f"time lost per failure: ft {lost_ft} s, torchft {lost_torchft} s; "
              f"per step: torchft {results['torchft 0.2.0, nothing fails']['normal step s']} s", flush=True)
    print(json.dumps(results))

if __name__ == "__main__":
    main()
