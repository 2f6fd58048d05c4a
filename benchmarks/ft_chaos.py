"""ft_ddp_resnet.py under chaos: 3 members, each on a simulated machine of its own under the
README's supervisor loop, the coordinator on a fourth; a fault every ~20 s, drawn from a SIGKILL of
a member, a member stopped (SIGSTOP) for 10 s, a member's link down for 10 s (a partition), and
once the coordinator killed and served again. Against the same run without faults, same machine,
same session: goodput, the time each fault cost, and every member's final weights.

    python benchmarks/ft_chaos.py [--minutes 5] [--member-timeout 3]     # as root (network namespaces)
    python benchmarks/ft_chaos.py --torchft [--join-ms 1000] [--heartbeat-ms 500]

With --torchft, the same faults (the same seed draws the same plan) hit torchft 0.2 instead: three
replica groups of one process (benchmarks/ft_recovery.py's, which train the same model on the same
batches, a third each) under the same loop, its lighthouse in the coordinator's place. A replica
that comes back takes the state from a peer (torchft's own recovery); none keeps a checkpoint on
disk, so the lighthouse is not killed in such a run, and a replica's third of a batch is left out
while it is away (torchft's way), so its weights are not compared.

Members print a `stamp STEP TIME` line at each committed step (benchmarks/ft_recovery.py's wrapper
around the script's Coordinator.ask; the script prints no line per step). A fault's cost, two ways: at once
(the gap from the last commit before the fault to the first after it, less one normal step: the
median gap of the run without faults), and in all (every gap's excess over a normal step from the
fault until the next one: also the restarted member's start-up, which competes for this machine's
cores, and its return). The faults' times are kept in OUT/chaos/faults.json.
The machine's pace drifts between two runs of minutes, so the goodput is also given at one pace:
the plain ratio times the ratio of the two runs' median steps with all 3 members.
"""
import argparse, json, os, random, re, shlex, signal, statistics, subprocess, sys, time
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
from simulated_cluster import SimulatedCluster, unavailable

PORT = 29600


def pid_of_member(cluster, node):
    """The pid of the python process in `node` that runs the member (not its supervisor)."""
    listed = subprocess.run(["ip", "netns", "pids", cluster.names[node]], capture_output=True, text=True)
    for pid in map(int, listed.stdout.split()):
        try:
            if b"stamped" in open(f"/proc/{pid}/cmdline", "rb").read() and b"bash" not in open(
                    f"/proc/{pid}/comm", "rb").read():
                return pid
        except OSError:
            pass
    return None


def run(args, out, faults):
    """One run; returns (seconds, the stamps as (time, step), the faults as (time, kind), logs)."""
    os.makedirs(out, exist_ok=True)
    head = "10.99.0.1"
    flags = ["--train-samples", str(args.batch_size * 400), "--test-samples", "100", "--batch-size",
             str(args.batch_size), "--micro-batch", str(args.batch_size // 3), "--epochs", "100", "--max-steps",
             str(args.steps), "--lr", "0.02", "--data-dir", os.path.join(ROOT, "data"), "--min-members", "3",
             "--init-timeout", "600"]
    env = {"OMP_NUM_THREADS": "1", "FT_SECRET": "chaos-benchmark", "PYTHONUNBUFFERED": "1"}
    serve = [sys.executable, os.path.join(ROOT, "ft_ddp_resnet.py"), "--serve", f"{head}:{PORT}", "--run-id", "chaos",
             "--member-timeout", str(args.member_timeout)]
    if args.torchft:   # its lighthouse in the coordinator's place, at the settings stated in --help
        serve = [sys.executable, "-c", "import time; from torchft.coordination import LighthouseServer; "
                 f"server = LighthouseServer(bind='0.0.0.0:{PORT}', min_replicas=2, join_timeout_ms={args.join_ms}, "
                 f"heartbeat_timeout_ms={args.heartbeat_ms}); time.sleep(10 ** 6)"]
    with SimulatedCluster(4) as cluster:
        logs = [open(os.path.join(out, f"{name}.log"), "w") for name in ("coordinator", "m1", "m2", "m3")]
        coordinator = cluster.popen(0, serve, env=cluster.env(**env), stdout=logs[0], stderr=subprocess.STDOUT,
                                    cwd=ROOT)
        for node in (1, 2, 3):
            member = [sys.executable, os.path.join(ROOT, "benchmarks", "ft_recovery.py"), "stamped", "ft",   # stamps
                      "--join", f"{head}:{PORT}",
                      "--out", os.path.join(out, f"m{node}"), "--resume", *flags]
            if args.torchft:   # ft_recovery.py's torchft replica; "stamped" in its command names it for the faults
                member = [sys.executable, os.path.join(ROOT, "benchmarks", "ft_recovery.py"), "torchft",
                          f"http://{head}:{PORT}", str(node - 1), str(args.steps), str(args.member_timeout),
                          cluster.addresses[node], str(args.batch_size), "stamped"]
            loop = f"until {shlex.join(member)}; [ $? -le 1 ]; do sleep 1; done"
            cluster.popen(node, ["bash", "-c", loop], env=cluster.env(**env), stdout=logs[node],
                          stderr=subprocess.STDOUT, cwd=ROOT)
        start, happened = time.time(), []
        read = lambda node: open(os.path.join(out, f"m{node}.log")).read()
        finished = lambda node: "done:" in read(node) or "nothing is left to train" in read(node)
        # torchft: its quorum needs two replicas, so a replica back after two have finished waits for ever
        while sum(map(finished, (1, 2, 3))) < (2 if args.torchft else 3):
            time.sleep(0.5)
            if time.time() - start > 3600:
                raise SystemExit("the run did not end within an hour")
            if not faults or not re.search(r"stamp 5 ", read(1)):
                continue
            kind = faults[0][1] if time.time() - start > faults[0][0] else None
            if kind is None:
                continue
            when, _ = faults.pop(0)
            node = random.choice((1, 2, 3))
            pid = pid_of_member(cluster, node)
            if kind == "coordinator" and args.torchft:   # not done: its replicas keep no checkpoint to come back to
                print(f"  {time.time() - start:6.1f} s: (the lighthouse is not killed in a torchft run)", flush=True)
                continue
            if kind != "coordinator" and pid is None:
                faults.insert(0, (when + 2, kind))   # that member is restarting: try again soon
                continue
            happened.append((time.time(), kind if kind == "coordinator" else f"{kind} m{node}"))
            print(f"  {time.time() - start:6.1f} s: {happened[-1][1]}", flush=True)
            if kind == "kill":
                os.kill(pid, signal.SIGKILL)
            elif kind == "hang":
                os.kill(pid, signal.SIGSTOP)
                time.sleep(10)
                os.kill(pid, signal.SIGCONT)
            elif kind == "partition":
                cluster.run(node, ["ip", "link", "set", "eth0", "down"])
                time.sleep(10)
                cluster.run(node, ["ip", "link", "set", "eth0", "up"])
            else:
                coordinator.kill()
                coordinator.wait()
                time.sleep(1)
                coordinator = cluster.popen(0, serve, env=cluster.env(**env), stdout=logs[0],
                                            stderr=subprocess.STDOUT, cwd=ROOT)
        seconds = time.time() - start
    json.dump(happened, open(os.path.join(out, "faults.json"), "w"))
    stamps = sorted((float(t), int(s), int(n) if n else None) for node in (1, 2, 3)
                    for s, t, n in re.findall(r"stamp (\d+) (\S+) ?(\d*)", read(node)))
    first, members = {}, {}
    for t, s, n in stamps:   # the first member to commit a step commits it for all
        first.setdefault(s, t)
        members[s] = n or members.get(s, 0) + 1   # torchft stamps how many took part; else who stamped it
    return seconds, sorted((t, s, members[s]) for s, t in first.items()), happened, [read(node) for node in (1, 2, 3)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0, help="how long the faults go on")
    p.add_argument("--every", type=float, default=20.0, help="seconds between faults, on average")
    p.add_argument("--member-timeout", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=12, help="global batch (3 micro-batches, one per member)")
    p.add_argument("--steps", type=int, help="steps of each run (default: enough to outlast the faults)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/ft_chaos")
    p.add_argument("--torchft", action="store_true", help="torchft 0.2 replicas (benchmarks/ft_recovery.py's) and "
                   "its lighthouse instead, the Manager's timeout at --member-timeout; the lighthouse is not killed")
    p.add_argument("--join-ms", type=int, default=1000, help="torchft: the lighthouse's join timeout")
    p.add_argument("--heartbeat-ms", type=int, default=500, help="torchft: the lighthouse's heartbeat timeout")
    args = p.parse_args()
    if unavailable():
        raise SystemExit(unavailable())
    random.seed(args.seed)
    print("the run without faults:", flush=True)
    args.steps = args.steps or 10 ** 9
    if args.steps == 10 ** 9:   # first measure the step, then size both runs to outlast the faults
        args.steps = 30
        seconds, stamps, _, _ = run(args, os.path.join(args.out, "probe"), [])
        step = statistics.median(b[0] - a[0] for a, b in zip(stamps[5:], stamps[6:]))
        args.steps = int(args.minutes * 60 * 1.3 / step)
        print(f"  probe: a step takes {step:.3f} s; both runs train {args.steps} steps", flush=True)
    base_seconds, base, _, _ = run(args, os.path.join(args.out, "clean"), [])
    normal = statistics.median(b[0] - a[0] for a, b in zip(base, base[1:]))
    kinds = ["kill", "hang", "partition"]
    times = [args.every * (i + 1) + random.uniform(-3, 3) for i in range(int(args.minutes * 60 / args.every))]
    plan = [(t, random.choice(kinds)) for t in times]
    plan[len(plan) // 2] = (plan[len(plan) // 2][0], "coordinator")
    print(f"the run with faults ({len(plan)} planned):", flush=True)
    chaos_seconds, chaos, happened, logs = run(args, os.path.join(args.out, "chaos"), plan)
    at_once, lost = {}, {}
    for (when, kind), until in zip(happened, [t for t, _ in happened[1:]] + [float("inf")]):
        gaps = [b[0] - a[0] for a, b in zip(chaos, chaos[1:]) if when <= b[0] < until]
        at_once.setdefault(kind.split()[0], []).append(max(0.0, gaps[0] - normal) if gaps else float("nan"))
        lost.setdefault(kind.split()[0], []).append(sum(max(0.0, g - normal) for g in gaps))
    commits_clean, commits_chaos = len(base) / (base[-1][0] - base[0][0]), len(chaos) / (chaos[-1][0] - chaos[0][0])
    system = (f"torchft, join timeout {args.join_ms} ms, heartbeat timeout {args.heartbeat_ms} ms, timeout"
              if args.torchft else "ft_ddp_resnet.py, --member-timeout")
    print(f"\n{system} {args.member_timeout:g} s: steps {args.steps}, a normal step {normal:.3f} s")
    print(f"without faults: {base_seconds:.0f} s, {commits_clean:.3f} committed steps/s")
    print(f"with faults:    {chaos_seconds:.0f} s, {commits_chaos:.3f} committed steps/s: goodput "
          f"{commits_chaos / commits_clean:.1%}")
    # The machine's pace drifts between two runs of minutes: the typical (median) step with all 3 members of
    # each run says by how much, and the goodput at one pace counts only what the faults cost. torchft's in
    # samples (a step without a replica trains on a third fewer); ours trains every step whole.
    typical = lambda stamps: statistics.median(b[0] - a[0] for a, b in zip(stamps, stamps[1:]) if b[2] == 3)
    steps_done = lambda stamps: sum(n for _, _, n in stamps[1:]) / 3 if args.torchft else len(stamps) - 1
    rate = lambda stamps: steps_done(stamps) / (stamps[-1][0] - stamps[0][0])
    same_pace = rate(chaos) / rate(base) * typical(chaos) / typical(base)
    print(f"                a typical step with all 3 members: {typical(chaos):.3f} s, {typical(base):.3f} s without "
          f"faults; at one pace: goodput {same_pace:.1%}{' of the samples' if args.torchft else ''}")
    if args.torchft:
        print(f"                samples trained per second: {rate(chaos) / rate(base):.1%} of the run without "
              f"faults ({sum(n < 3 for _, _, n in chaos)} of {len(chaos)} steps without a third of their batch)")
    for kind, values in lost.items():
        print(f"  lost per {kind:11s} at once: median {statistics.median(at_once[kind]):.2f} s "
              f"({' '.join(f'{v:.2f}' for v in at_once[kind])}); in all: median {statistics.median(values):.2f} s "
              f"({' '.join(f'{v:.2f}' for v in values)})")
    if args.torchft:
        return   # its replicas save no weights: torchft averages in float32, not meant to be bit-equal
    import torch
    reference = torch.load(os.path.join(args.out, "clean", "m1", "model.pt"))
    for node in (1, 2, 3):
        path = os.path.join(args.out, "chaos", f"m{node}", "model.pt")
        if not os.path.exists(path) or os.path.getmtime(path) < time.time() - chaos_seconds:
            print(f"  m{node}: no final weights (it came back after the run was over)")
            continue
        weights = torch.load(path)
        worst = max((weights[k].double() - v.double()).abs().max().item() for k, v in reference.items())
        print(f"  m{node}: final weights differ from the run without faults by at most {worst:.1e}")


if __name__ == "__main__":
    main()
