"""ft_ddp_resnet.py: training that goes on when a member dies, hangs or comes back, with three members
and a coordinator on this machine, ResNet-18 on a tiny subset. A run with failures ends with the
weights of a run without them, within a bound measured in the same session: 2 members against 3
(the same steps, only the order of float sums differs)."""
import json, os, re, signal, subprocess, sys, time
import pytest
import torch
import common
from helpers import DATA, HERE, RESNET_LR, load_model, max_difference, once, wait_for

FT = ["--train-samples", "96", "--test-samples", "50", "--batch-size", "16", "--micro-batch", "4", "--epochs", "1",
      "--lr", str(RESNET_LR), "--data-dir", DATA, "--member-timeout", "4", "--init-timeout", "30"]   # 6 steps
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Run:
    """A coordinator on a free port and members started and stopped at will; every process is ended
    at the end (by its pid)."""
    def __init__(self, tmp_path):
        self.tmp, self.address, self.members = tmp_path, f"127.0.0.1:{common.free_port()}", {}
        self.coordinator = self.start("coordinator", ["ft_ddp_resnet.py", "--serve", self.address])

    def start(self, name, command):
        log = open(self.tmp / f"{name}.log", "a")
        return subprocess.Popen([sys.executable] + command, cwd=HERE, env=ENV, stdout=log, stderr=subprocess.STDOUT)

    def member(self, name, *flags, dies=None):
        """Member `name` writes to tmp/name; `dies`: (where, step) for tests/ft_member.py."""
        script = ["tests/ft_member.py", dies[0], str(dies[1])] if dies else ["ft_ddp_resnet.py"]
        self.members[name] = self.start(name, script + ["--join", self.address, "--out", str(self.tmp / name)] +
                                        FT + list(flags))
        return self.members[name]

    def log(self, name):
        return (self.tmp / f"{name}.log").read_text()

    def wait(self, *names, timeout=240):
        for name in names:
            try:
                self.members[name].wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not end in {timeout} s:\n" + self.log(name)[-3000:])
        return [self.members[name].returncode for name in names]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for process in [*self.members.values(), self.coordinator]:
            if process.poll() is None:
                process.kill()
                process.wait()


def model(run, name):
    return load_model(run.tmp / name)


def finished(run, *names):
    """Each member ended with 0 and wrote its outputs; their weights are equal, bit for bit."""
    codes = run.wait(*names)
    assert codes == [0] * len(names), "\n".join(run.log(n)[-2000:] for n in names)
    weights = [model(run, n) for n in names]
    for w in weights[1:]:
        assert max_difference(w, weights[0]) == 0
    return weights[0]


@pytest.fixture(scope="session")
@once
def uninterrupted(tmp_path_factory):
    """3 members, and 2, without failures: the reference, the bound (10 x how far 2 members are
    from 3, never below one float32 step of the largest weight), and the 2 members' weights."""
    weights = {}
    for n in (3, 2):
        with Run(tmp_path_factory.mktemp(f"ft{n}")) as run:
            names = [f"m{i}" for i in range(n)]
            for name in names:
                run.member(name, "--min-members", str(n))
            weights[n] = finished(run, *names)
            assert json.load(open(run.tmp / "m0" / "metrics.json"))["steps"] == 6
    largest = max(t.abs().max().item() for t in weights[3].values() if t.is_floating_point())
    bound = 10 * max(max_difference(weights[3], weights[2]), torch.finfo(torch.float32).eps * largest)
    return weights[3], bound, weights[2]


@pytest.mark.parametrize("where", ["backward", "allreduce"])
def test_a_member_killed_mid_step_leaves_the_others_the_same_training(where, uninterrupted, tmp_path):
    reference, bound, _ = uninterrupted
    with Run(tmp_path) as run:
        for name in ("m0", "m1"):
            run.member(name, "--min-members", "3")
        run.member("m2", "--min-members", "3", dies=(where, 2))
        assert run.wait("m2") == [-signal.SIGKILL]
        weights = finished(run, "m0", "m1")
        assert max_difference(weights, reference) <= bound
        log = run.log("m0")
        assert re.search(r"generation 2: members \[\d+, \d+\] \(2\), from step 2", log), log
        metrics = json.load(open(tmp_path / "m0" / "metrics.json"))
        assert metrics["steps"] == 6 and metrics["generations"] == 2


def paused(run, names, until, what):
    """The named members stopped (SIGSTOP) until `until()` holds: a restarted member needs seconds to
    start, and the tiny run would be over before it joins. --member-timeout 60 keeps them members."""
    for name in names:
        run.members[name].send_signal(signal.SIGSTOP)
    try:
        wait_for(until, 90, what)
    finally:
        for name in names:
            run.members[name].send_signal(signal.SIGCONT)


PATIENT = ("--member-timeout", "60")


def test_a_killed_member_restarted_recovers_live_and_all_end_equal(uninterrupted, tmp_path):
    reference, bound, _ = uninterrupted
    with Run(tmp_path) as run:
        for name in ("m0", "m1"):
            run.member(name, "--min-members", "3", *PATIENT)
        run.member("m2", "--min-members", "3", *PATIENT, dies=("backward", 1))
        run.wait("m2")
        run.member("m2", *PATIENT)   # the supervisor's restart: the same command
        paused(run, ["m0", "m1"], lambda: run.log("m2").count("joined the run") == 2, "m2 to join")
        weights = finished(run, "m0", "m1", "m2")
        assert max_difference(weights, reference) <= bound
        assert re.search(r"recovered live from member \d+ at step [1-5]", run.log("m2")), run.log("m2")
        assert json.load(open(tmp_path / "m2" / "metrics.json"))["steps"] == 6


def test_two_failures_in_a_row_a_failure_in_recovery_and_a_death_before_the_vote(uninterrupted, tmp_path):
    """m1 dies between its allreduce and its vote at step 1, m2 in backward at step 2; m1 restarted
    dies while receiving the state; restarted again it recovers. m0 went on throughout."""
    reference, bound, _ = uninterrupted
    with Run(tmp_path) as run:
        run.member("m0", "--min-members", "3", *PATIENT)
        run.member("m1", "--min-members", "3", *PATIENT, dies=("before-vote", 1))
        run.member("m2", "--min-members", "3", *PATIENT, dies=("backward", 2))
        run.wait("m1", "m2")
        run.member("m1", *PATIENT, dies=("recovery", 0))
        paused(run, ["m0"], lambda: run.log("m1").count("joined the run") == 2, "m1 to join")
        assert run.wait("m1") == [-signal.SIGKILL]
        run.member("m1", *PATIENT)
        paused(run, ["m0"], lambda: run.log("m1").count("joined the run") == 3, "m1 to join again")
        weights = finished(run, "m0", "m1")
        assert max_difference(weights, reference) <= bound
        assert "recovered live from member" in run.log("m1")


def test_a_hung_member_is_dropped_after_the_timeout_and_rejoins_when_it_wakes(uninterrupted, tmp_path):
    reference, bound, _ = uninterrupted
    with Run(tmp_path) as run:
        for name in ("m0", "m1", "m2"):
            run.member(name, "--min-members", "3")
        wait_for(lambda: "generation 1" in run.log("m2"), 60, "the first generation")
        time.sleep(1.0)
        run.members["m2"].send_signal(signal.SIGSTOP)
        wait_for(lambda: "dropped: no answer for 4 s" in run.log("coordinator"), 30, "m2 dropped")
        run.members["m2"].send_signal(signal.SIGCONT)
        weights = finished(run, "m0", "m1", "m2")
        assert max_difference(weights, reference) <= bound
        log = run.log("m2")
        assert "dropped by the coordinator" in log and log.count("joined the run") == 2, log
        # Woken, it rejoins at the step it had; if the others' failed step was not yet retried, the
        # new generation starts there and nothing needs recovering; if they had gone on, it recovers.
        rejoined = re.search(r"joined the run at \S+, at step (\d+)\n.*generation \d+: .* from step (\d+)",
                             log.split("dropped by the coordinator")[1])
        assert rejoined, log
        behind = int(rejoined[1]) < int(rejoined[2])
        assert ("recovered live from member" in log) == behind, log


def test_a_whole_job_stopped_by_sigterm_resumes_from_the_checkpoints_like_a_run_never_stopped(uninterrupted, tmp_path):
    """The whole-job restarts that remain: every member SIGTERMed writes its checkpoint and exits 75;
    started again with --resume (a new coordinator), the two end with the weights of two members
    never stopped, bit for bit (the same steps, the same sums: the schedule taken up where it was).
    A resume that would draw other batches is refused in one line."""
    two = uninterrupted[2]
    with Run(tmp_path) as run:
        for name in ("m0", "m1"):
            run.member(name, "--min-members", "2", "--checkpoint-every", "1")
        wait_for(lambda: (tmp_path / "m0" / "checkpoint.pt").exists(), 90, "the first checkpoint")
        for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGCONT):   # both told at once, as a scheduler does
            for name in ("m0", "m1"):
                run.members[name].send_signal(sig)
        assert run.wait("m0", "m1") == [75, 75], run.log("m0") + run.log("m1")
        stopped = [torch.load(tmp_path / name / "checkpoint.pt")["step"] for name in ("m0", "m1")]
        assert stopped[0] == stopped[1] < 6, stopped
        assert all(f"stopped by SIGTERM at step {stopped[0]}" in run.log(name) for name in ("m0", "m1"))
    with Run(tmp_path) as run:
        checkpoint = str(tmp_path / "m0" / "checkpoint.pt")   # other batches: its step would mean others
        run.member("wrong", "--resume", "--checkpoint", checkpoint, "--batch-size", "32")
        assert run.wait("wrong") == [1]
        assert run.log("wrong").strip().splitlines() == [
            f"error: cannot resume from {checkpoint}: it was written with other training flags (batch_size 16 "
            f"there, 32 here); use the same, or start without --resume"], run.log("wrong")
        for name in ("m0", "m1"):
            run.member(name, "--min-members", "2", "--resume")
        weights = finished(run, "m0", "m1")
    assert max_difference(weights, two) == 0
    assert json.load(open(tmp_path / "m0" / "metrics.json"))["steps"] == 6


def test_bad_inputs_each_end_with_one_line(tmp_path):
    with Run(tmp_path) as run:
        run.member("m0", "--min-members", "2")
        # the first member to reach the coordinator sets the run's flags: m0, before the one that differs
        wait_for(lambda: "joined the run" in run.log("m0"), 60, "m0 to join")
        run.member("other", "--batch-size", "32", "--min-members", "2")
        assert run.wait("other") == [1]
        assert "error: this member's training flags differ from the run's (--batch-size 32 here, 16 in the run" in \
            run.log("other")
        run.member("m1", "--min-members", "2", "--checkpoint-every", "2")
        wait_for(lambda: "generation 1" in run.log("m1"), 60, "the first generation")
        run.coordinator.kill()   # the coordinator lost mid-run: a checkpoint each, and 75
        assert run.wait("m0", "m1") == [75, 75]
        for name in ("m0", "m1"):
            assert "the coordinator at" in run.log(name) and "is gone" in run.log(name)
            assert "Traceback" not in run.log(name)
            assert (tmp_path / name / "checkpoint.pt").exists()
    unreachable = subprocess.run([sys.executable, "ft_ddp_resnet.py", "--join", f"127.0.0.1:{common.free_port()}",
                                  "--init-timeout", "1", "--data-dir", DATA, "--out", str(tmp_path / "x")],
                                 cwd=HERE, env=ENV, capture_output=True, text=True, timeout=120)
    assert unreachable.returncode == 1 and "error: no coordinator at 127.0.0.1:" in unreachable.stderr
    assert len(unreachable.stderr.strip().splitlines()) == 1, unreachable.stderr
