"""ft_ddp_resnet.py: training that goes on when a member dies, hangs or comes back, and a control
plane that survives strangers, a hung coordinator and restarts. Three members and a coordinator on
this machine, ResNet-18 on a tiny subset. The gradients are summed exactly, so every run ends with
the weights of an uninterrupted run, bit for bit, whoever computed which micro-batch."""
import datetime, json, os, re, signal, socket, subprocess, sys, threading, time
import pytest
import torch
import torch.distributed as dist
import common
from helpers import DATA, HERE, RESNET_LR, free_port, load_model, max_difference, once, resnet_reference, wait_for

FT = ["--train-samples", "96", "--test-samples", "50", "--batch-size", "16", "--micro-batch", "4", "--epochs", "1",
      "--lr", str(RESNET_LR), "--data-dir", DATA, "--init-timeout", "30"]   # 6 steps
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "FT_SECRET": "test-secret"}
# The README's supervisor loop, for any command, ending with the member's own exit status (bash's `until` ends
# with 0 after a member's failure: the test would take a member that failed for one that finished)
SUPERVISED = 'until "$@"; status=$?; [ $status -le 2 ]; do sleep 1; done; exit $status'


class Run:
    """A coordinator on free ports (--member-timeout 4 unless `flags` say otherwise) and members started and
    stopped at will; every process (and what it started) is ended at the end."""
    def __init__(self, tmp_path, *flags):
        self.tmp, self.members, self.store_port = tmp_path, {}, str(free_port())
        self.address = f"127.0.0.1:{free_port()}"
        self.coordinator = self.serve(*flags)

    def serve(self, *flags):
        self.coordinator = self.start("coordinator", ["ft_ddp_resnet.py", "--serve", self.address,
                                                      "--store-port", self.store_port, "--member-timeout", "4", *flags])
        return self.coordinator

    def start(self, name, command, env=None, supervised=False):
        log = open(self.tmp / f"{name}.log", "a")
        command = [sys.executable] + command
        if supervised:
            command = ["bash", "-c", SUPERVISED, "supervisor"] + command
        return subprocess.Popen(command, cwd=HERE, env=env or ENV, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def member(self, name, *flags, dies=None, env=None, supervised=False):
        """Member `name` writes to tmp/name; `dies`: (where, step) for tests/ft_member.py."""
        script = ["tests/ft_member.py", dies[0], str(dies[1])] if dies else ["ft_ddp_resnet.py"]
        self.members[name] = self.start(name, script + ["--join", self.address, "--out", str(self.tmp / name)] + FT
                                        + list(flags), env, supervised)
        return self.members[name]

    def log(self, name):
        return (self.tmp / f"{name}.log").read_text()

    def said(self, name):   # its lines but the one that names where the data were read
        return [line for line in self.log(name).strip().splitlines() if not line.startswith("data: ")]

    def wait(self, *names, timeout=240):
        for name in names:
            process = self.coordinator if name == "coordinator" else self.members[name]
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not end in {timeout} s:\n" + self.log(name)[-3000:])
        return [(self.coordinator if n == "coordinator" else self.members[n]).returncode for n in names]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for process in [*self.members.values(), self.coordinator]:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGCONT)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def finished(run, *names):
    """Each member ended with 0 and wrote its outputs; their weights are equal, bit for bit."""
    codes = run.wait(*names)
    assert codes == [0] * len(names), "\n".join(run.log(n)[-2000:] for n in names)
    weights = [load_model(run.tmp / n) for n in names]
    for w in weights[1:]:
        assert max_difference(w, weights[0]) == 0
    assert "Traceback" not in run.log("coordinator"), run.log("coordinator")
    return weights[0]


@pytest.fixture(scope="session")
@once
def uninterrupted_run(tmp_path_factory):
    """3 members, and 2, without failures: the same weights, bit for bit (float64 sums do not depend
    on who computed which micro-batch), which every test below ends with; and so the same test loss
    in every member's metrics.json (each evaluates the whole test set alone). Returns the weights, and
    the epochs in a metrics.json of the run of 3."""
    weights, test_losses, records = {}, set(), None
    for n in (3, 2):
        with Run(tmp_path_factory.mktemp(f"ft{n}")) as run:
            names = [f"m{i}" for i in range(n)]
            for name in names:
                run.member(name, "--min-members", str(n))
            weights[n] = finished(run, *names)
            assert json.load(open(run.tmp / "m0" / "metrics.json"))["steps"] == 6
            for name in names:
                epochs = json.load(open(run.tmp / name / "metrics.json"))["epochs"]
                test_losses |= {epoch["test_loss"] for epoch in epochs}
                assert f"test loss {epochs[-1]['test_loss']:.4f}  test acc" in run.log(name)
            if n == 3:
                records = epochs
    assert max_difference(weights[3], weights[2]) == 0
    assert len(test_losses) == 1 and 0 < test_losses.pop() < 10, test_losses
    return {"weights": weights[3], "epochs": records}


@pytest.fixture(scope="session")
def uninterrupted(uninterrupted_run):
    return uninterrupted_run["weights"]


def test_three_members_and_two_end_bit_equal_with_the_weights_of_the_reference(uninterrupted, resnet_tolerance):
    """The fixture asserts the first (computed once, for every test of this file). Then the weights are the
    reference's (tests/helpers.py: what a DDP step is proven to compute, by hand in one process) with BatchNorm over
    each of the 4 micro-batches of 4 images, micro-batch 0's running statistics, the cosine over the run's 6 steps
    and the gradients' mean exact (float64 sums): members that all share a wrong step (the mean's divisor, the
    statistics, the schedule) are equal, not right. Within the ResNet comparisons' tolerance (0 measured here)."""
    reference = resnet_reference(4, steps=6, samples=96, total_steps=6, consecutive=True, exact_mean=True)
    assert max_difference(uninterrupted, reference) <= resnet_tolerance


PATIENT = ("--member-timeout", "60")   # the coordinator's


@pytest.mark.parametrize("where", ["backward", "allreduce"])
def test_a_member_killed_mid_step_leaves_the_others_the_same_training(where, uninterrupted, tmp_path):
    """Started again only after the others finished (a loop's restart on a slow machine), the killed
    member is told the run is over: the coordinator waits 10 x --member-timeout for a member that left
    mid-run, lest it meet no coordinator and end its loop with 1."""
    with Run(tmp_path, *PATIENT) as run:
        for name in ("m0", "m1"):
            run.member(name, "--min-members", "3")
        run.member("m2", "--min-members", "3", dies=(where, 2))
        assert run.wait("m2") == [-signal.SIGKILL]
        assert max_difference(finished(run, "m0", "m1"), uninterrupted) == 0
        assert re.search(r"generation 2: 2 member\(s\) from step 2", run.log("m0")), run.log("m0")
        metrics = json.load(open(tmp_path / "m0" / "metrics.json"))
        assert metrics["steps"] == 6 and metrics["generations"] == 2
        run.member("m2", "--resume")
        assert run.wait("m2") == [0], run.log("m2")
        assert run.said("m2")[-1] == ("this member: the run is over: its members finished step 6; nothing is left "
                                      "to train"), run.log("m2")


PROGRESS = re.compile(r"^  step +(\d+)/(\d+)  epoch (\d+)  loss (\d\.\d{4})  acc (\d\.\d{4})  lr \S+  [\d,]+ "
                      r"samples/s  \d+:\d\d spent, \d+:\d\d left$", re.M)


def test_each_member_prints_progress_at_the_steps_asked_and_a_killed_one_keeps_its_history(tmp_path):
    """2 members, 2 epochs of 6 steps, --print-every 2; m1 killed in backward at step 8 (its 9th).
    Each member prints its own lines after steps 2, 4, 6 and 8 (m0 also after 10; 12, the last,
    ends with its epoch line), each once, with the epoch's loss and accuracy so far over both
    members: the same in both (each computed other micro-batches), and at step 6 those of epoch 1's
    record. m1's metrics.json and curves.png, written after epoch 1's evaluation, hold epoch 1: its
    record is m0's but for the times."""
    with Run(tmp_path, *PATIENT) as run:
        flags = ("--min-members", "2", "--epochs", "2", "--print-every", "2")
        run.member("m0", *flags)
        run.member("m1", *flags, dies=("backward", 8))
        assert run.wait("m1") == [-signal.SIGKILL]
        finished(run, "m0")
        lines = {name: PROGRESS.findall(run.log(name)) for name in ("m0", "m1")}
        assert [line[:3] for line in lines["m0"]] == [
            ("2", "12", "1"), ("4", "12", "1"), ("6", "12", "1"), ("8", "12", "2"), ("10", "12", "2")], run.log("m0")
        assert lines["m1"] == lines["m0"][:4], run.log("m0") + run.log("m1")
        m0, m1 = (json.load(open(tmp_path / name / "metrics.json"))["epochs"] for name in ("m0", "m1"))
        assert lines["m0"][2][3:] == (f"{m0[0]['train_loss']:.4f}", f"{m0[0]['train_acc']:.4f}"), lines
        times = ("seconds", "samples_per_s")
        assert [e["epoch"] for e in m1] == [1] and (tmp_path / "m1" / "curves.png").exists(), m1
        assert {k: v for k, v in m1[0].items() if k not in times} == {
            k: v for k, v in m0[0].items() if k not in times}, (m0, m1)
        assert not (tmp_path / "m1" / "model.pt").exists()


def member_ids(run, name):
    """The ids the coordinator gave `name` at its joins, in order."""
    return re.findall(r"member (\d+): joined run", run.log(name))


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


def test_a_killed_member_restarted_recovers_live_and_all_end_equal(uninterrupted, tmp_path):
    with Run(tmp_path, *PATIENT) as run:
        for name in ("m0", "m1"):
            run.member(name, "--min-members", "3")
        run.member("m2", "--min-members", "3", dies=("backward", 1))
        run.wait("m2")
        run.member("m2")   # the supervisor's restart: the same command
        paused(run, ["m0", "m1"], lambda: run.log("m2").count("joined run") == 2, "m2 to join")
        assert max_difference(finished(run, "m0", "m1", "m2"), uninterrupted) == 0
        assert re.search(r"recovered live at step [1-5]", run.log("m2")), run.log("m2")
        assert "Warning" not in run.log("m2"), run.log("m2")
        assert json.load(open(tmp_path / "m2" / "metrics.json"))["steps"] == 6


def test_a_model_with_dropout_ends_bit_equal_to_its_own_run_without_faults_after_a_kill_and_a_join(uninterrupted,
                                                                                                      tmp_path):
    """make_model() with Dropout(0.5) before the last layer, in every member: 2 members without faults; then 2 of
    which one is killed in backward at step 2 and started again, joins and recovers live. Both runs end with the
    same weights, bit for bit (each micro-batch draws from (seed, step, micro-batch), whoever computes it; before,
    each member drew from its own generator, whose state a restart loses), and not with the run without dropout's."""
    dropout = {**ENV, "FT_MEMBER_DROPOUT": "0.5"}
    (tmp_path / "whole").mkdir()
    with Run(tmp_path / "whole", *PATIENT) as run:
        for name in ("m0", "m1"):
            run.member(name, "--min-members", "2", dies=("none", 0), env=dropout)
        whole = finished(run, "m0", "m1")
    with Run(tmp_path, *PATIENT) as run:
        run.member("m0", "--min-members", "2", dies=("none", 0), env=dropout)
        run.member("m1", "--min-members", "2", dies=("backward", 2), env=dropout)
        assert run.wait("m1") == [-signal.SIGKILL]
        run.member("m1", dies=("none", 0), env=dropout)   # the supervisor's restart
        paused(run, ["m0"], lambda: run.log("m1").count("joined run") == 2, "m1 to join")
        assert max_difference(finished(run, "m0", "m1"), whole) == 0
        assert re.search(r"recovered live at step [2-5]", run.log("m1")), run.log("m1")
    assert not torch.equal(whole["conv1.weight"], uninterrupted["conv1.weight"])


def test_two_failures_in_a_row_a_failure_in_recovery_and_a_death_before_the_vote(uninterrupted, tmp_path):
    """m1 dies between its allreduce and its vote at step 1, m2 in backward at step 2; m1 restarted
    dies while receiving the state; restarted again it recovers. m0 went on throughout."""
    with Run(tmp_path, *PATIENT) as run:
        run.member("m0", "--min-members", "3")
        run.member("m1", "--min-members", "3", dies=("before-vote", 1))
        run.member("m2", "--min-members", "3", dies=("backward", 2))
        run.wait("m1", "m2")
        run.member("m1", dies=("recovery", 0))
        paused(run, ["m0"], lambda: run.log("m1").count("joined run") == 2, "m1 to join")
        assert run.wait("m1") == [-signal.SIGKILL]
        run.member("m1")
        paused(run, ["m0"], lambda: run.log("m1").count("joined run") == 3, "m1 to join again")
        assert max_difference(finished(run, "m0", "m1"), uninterrupted) == 0
        assert "recovered live at step" in run.log("m1")


def test_a_hung_member_is_dropped_after_the_timeout_and_rejoins_when_it_wakes(uninterrupted, tmp_path):
    """Dropped, the member leaves when it wakes, with its checkpoint and exit 75 (its one way back); the
    README's loop starts it again with --resume, and it rejoins. Every member runs under that loop, as the
    README has it: on a busy machine a peer whose own timeout fires 0.25 s after the other's is dropped
    too, and comes back the same way; if the others finished the run meanwhile, the coordinator, still
    there, tells it the run is over, and it ends with 0 and no model of its own."""
    with Run(tmp_path) as run:
        for name in ("m0", "m1", "m2"):
            run.member(name, "--min-members", "3", "--resume", supervised=True)
        wait_for(lambda: "generation 1" in run.log("m2"), 60, "the first generation")
        time.sleep(1.0)
        os.killpg(run.members["m2"].pid, signal.SIGSTOP)   # the member and its loop
        # On a busy machine a peer may be dropped first (its loop brings it back): wait for m2's own.
        dropped = rf"member {member_ids(run, 'm2')[-1]} dropped"
        wait_for(lambda: re.search(dropped, run.log("coordinator")), 60, "m2 dropped")
        # The others are held while it wakes and rejoins: on a busy machine they could finish the
        # run first (that case has its own test below).
        for name in ("m0", "m1"):
            os.killpg(run.members[name].pid, signal.SIGSTOP)
        os.killpg(run.members["m2"].pid, signal.SIGCONT)
        wait_for(lambda: run.log("m2").count("joined run") == 2, 60, "m2 to rejoin")
        for name in ("m0", "m1"):
            os.killpg(run.members[name].pid, signal.SIGCONT)
        assert run.wait("m0", "m1") == [0, 0], run.log("m0") + run.log("m1")
        # One told the run is over had been dropped while it was held: told so when it woke, or, if the
        # others finished first, told the run is over instead.
        late = [name for name in ("m0", "m1") if "the run is over" in run.log(name)]
        assert all(any(re.search(rf"member {i} dropped", run.log("coordinator")) for i in member_ids(run, name))
                   for name in late), run.log("coordinator")
        assert not any((tmp_path / name / "model.pt").exists() for name in late)
        trained = [name for name in ("m0", "m1", "m2") if name not in late]
        assert max_difference(finished(run, *trained), uninterrupted) == 0
        log = run.log("m2")
        assert re.search(r"at step (\d+): dropped by the coordinator .*; exit status 75\n(data: .*\n)?resumed from "
                         r"\S+ \(run \w+\): step \1\n", log) and log.count("joined run") == 2, log
        # Back, it rejoins at the step of its checkpoint; if the others' failed step was not yet retried, the
        # new generation starts there and nothing needs recovering; if they had gone on, it recovers.
        rejoined = re.search(r"joined run \S+ at \S+, at step (\d+)\n"
                             r".*generation \d+: \d+ member\(s\) from step (\d+)",
                             log.split("dropped by the coordinator")[1])
        assert rejoined, log
        assert ("recovered live at step" in log) == (int(rejoined[1]) < int(rejoined[2])), log


def test_a_member_stopped_while_its_group_is_made_is_voted_out_and_the_other_goes_on(uninterrupted, tmp_path):
    """Stopped once its address is in the store, it leaves its peer's gloo connecting to a process
    that does not answer (~5 x --member-timeout): the peer's group fails, it is voted out, and the
    peer trains on alone, not ended by the 6 x --member-timeout that guards group-making against a
    hung store. Woken after the end, the stopped one does not take the time it was stopped for the
    store's: its group fails, and it is told the run is over. On a busy machine gloo itself may abort
    the woken one as its connection fails (an `ex_ == nullptr` check in gloo's device thread): it runs
    under the README's loop, which starts it again, and then it is told the same at its join."""
    with Run(tmp_path) as run:
        run.member("m0", "--min-members", "2")
        run.member("m1", "--min-members", "2", dies=("handshake", 0), supervised=True)
        assert max_difference(finished(run, "m0"), uninterrupted) == 0
        assert re.search(r"member \d+ dropped", run.log("coordinator")), run.log("coordinator")
        assert "generation 2: 1 member(s) from step 0" in run.log("m0"), run.log("m0")
        time.sleep(max(0.0, 4 * 6 + 2 - (time.time() - os.stat(run.tmp / "m1.log").st_mtime)))   # past 6 x 4 s
        os.killpg(run.members["m1"].pid, signal.SIGCONT)   # the member and its loop
        assert run.wait("m1") == [0], run.log("m1")
        assert "the run is over" in run.log("m1") and "store did not answer" not in run.log("m1"), run.log("m1")


def test_a_member_woken_after_its_run_ended_says_so_and_ends_cleanly(uninterrupted, tmp_path):
    """The coordinator waits for a dropped member still connected, 10 x --member-timeout after the end:
    a member after the end is told the run is over, and so is the dropped one when it wakes. Then the
    coordinator ends by itself: no member left mid-run, none may come back."""
    with Run(tmp_path) as run:
        for name in ("m0", "m1"):
            run.member(name, "--min-members", "2")
        wait_for(lambda: "generation 1" in run.log("m1"), 60, "the first generation")
        run.members["m1"].send_signal(signal.SIGSTOP)
        assert max_difference(finished(run, "m0"), uninterrupted) == 0
        run.member("late", "--min-members", "2")   # the coordinator is still there (for m1): a member after the end
        assert run.wait("late") == [0]
        assert "the run is over: its members finished step 6" in run.log("late")
        assert not (tmp_path / "late" / "model.pt").exists()
        run.members["m1"].send_signal(signal.SIGCONT)
        assert run.wait("m1") == [0], run.log("m1")
        assert "the run is over" in run.log("m1") and "Traceback" not in run.log("m1")
        assert run.wait("coordinator", timeout=30) == [0]
        assert run.log("coordinator").endswith("coordinator: the run is over (step 6)\n"), run.log("coordinator")


def test_a_whole_job_stopped_by_sigterm_resumes_from_the_checkpoints_like_a_run_never_stopped(uninterrupted, tmp_path):
    """The whole-job restarts that remain: every member SIGTERMed writes its checkpoint and exits 75;
    started again with --resume, under a coordinator serving the same run, they end bit-equal to a
    run never stopped. A checkpoint of another run, or one that would draw other batches, is
    refused in one line."""
    with Run(tmp_path) as run:
        for name in ("m0", "m1"):
            run.member(name, "--min-members", "2", "--checkpoint-every", "1")
        wait_for(lambda: (tmp_path / "m0" / "checkpoint.pt").exists(), 90, "the first checkpoint")
        for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGCONT):   # both told at once, as a scheduler does
            for name in ("m0", "m1"):
                run.members[name].send_signal(sig)
        assert run.wait("m0", "m1") == [75, 75], run.log("m0") + run.log("m1")
        saved = [torch.load(tmp_path / name / "checkpoint.pt") for name in ("m0", "m1")]
        assert saved[0]["progress"]["step"] == saved[1]["progress"]["step"] < 6, [s["progress"]["step"] for s in saved]
        assert all(f"at step {saved[0]['progress']['step']}: stopped by SIGTERM" in run.log(name)
                   for name in ("m0", "m1"))
        run_id = saved[0]["run"]
        assert f"coordinator: run {run_id}:" in run.log("coordinator")
    checkpoint = str(tmp_path / "m0" / "checkpoint.pt")
    with Run(tmp_path) as run:   # a new run: the checkpoints of the last one are refused
        run.member("stale", "--resume", "--checkpoint", checkpoint)
        assert run.wait("stale") == [1]
        assert re.fullmatch(rf"resumed from \S+ \(run {run_id}\): step \d\nerror: its checkpoint is of run {run_id}, "
                            rf"and this coordinator serves run \w+: start it without --resume, or serve that run "
                            rf"\(--run-id {run_id}\)", "\n".join(run.said("stale"))), run.log("stale")
    with Run(tmp_path, "--run-id", run_id) as run:
        run.member("wrong", "--resume", "--checkpoint", checkpoint, "--batch-size", "32")
        assert run.wait("wrong") == [1]
        assert run.said("wrong") == [
            f"error: cannot resume from {checkpoint}: it was written with other training flags (batch_size 16 "
            f"there, 32 here); use the same, or start without --resume"], run.log("wrong")
        for name in ("m0", "m1"):
            run.member(name, "--min-members", "2", "--resume")
        assert max_difference(finished(run, "m0", "m1"), uninterrupted) == 0
    assert json.load(open(tmp_path / "m0" / "metrics.json"))["steps"] == 6


def test_a_run_ended_by_max_steps_inside_an_epoch_resumes_and_records_that_epoch_once(uninterrupted_run, tmp_path):
    """One member, --max-steps 3 of the epoch's 6, --checkpoint-every 3: it records the epoch so far
    in metrics.json, writes model.pt, and leaves a checkpoint of the epoch's sums, not its record.
    Resumed with no cap, under a coordinator serving that run, it records epoch 1 once, over all its
    96 samples: the record of a run never stopped but for the times, and its weights, bit for bit.
    Resumed with the same cap, it has nothing to train and writes nothing."""
    checkpoint = tmp_path / "m0" / "checkpoint.pt"
    with Run(tmp_path) as run:
        run.member("m0", "--max-steps", "3", "--checkpoint-every", "3")
        finished(run, "m0")
    stopped = json.load(open(tmp_path / "m0" / "metrics.json"))["epochs"]
    saved = torch.load(checkpoint)
    with Run(tmp_path, "--run-id", saved["run"]) as run:
        run.member("m0", "--resume")
        assert max_difference(finished(run, "m0"), uninterrupted_run["weights"]) == 0
    times = ("seconds", "samples_per_s")
    epochs = [{k: v for k, v in e.items() if k not in times}
              for e in json.load(open(tmp_path / "m0" / "metrics.json"))["epochs"]]
    expected = [{k: v for k, v in e.items() if k not in times} for e in uninterrupted_run["epochs"]]
    assert epochs == expected and epochs[0]["samples"] == 96, (epochs, expected)
    assert [(e["epoch"], e["samples"]) for e in stopped] == [(1, 48)], stopped
    assert saved["progress"]["step"] == 3 and saved["progress"]["history"] == [], saved["progress"]
    assert saved["progress"]["sums"]["samples"] == 48 and saved["progress"]["seconds"] > 0, saved["progress"]
    again = [sys.executable, "ft_ddp_resnet.py", "--join", f"127.0.0.1:{free_port()}", "--out", str(tmp_path / "again"),
             *FT, "--max-steps", "3", "--resume", "--checkpoint", str(checkpoint)]   # no coordinator: none is asked
    result = subprocess.run(again, cwd=HERE, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.endswith(
        f"nothing to train: {checkpoint} is at step 3, and this run ends at step 3\n"), result.stdout + result.stderr
    assert not any((tmp_path / "again").iterdir())


def test_the_readme_supervisor_loop_continues_the_run_after_the_coordinator_is_killed(uninterrupted, tmp_path):
    """The coordinator SIGKILLed mid-run: each member writes the last committed step's state and exits
    75, its supervisor restarts it with --resume, and the coordinator served again with the run's
    id: the run goes on where it was and ends bit-equal."""
    with Run(tmp_path, "--run-id", "r1") as run:
        for name in ("m0", "m1"):
            run.member(name, "--min-members", "2", "--resume", "--checkpoint-every", "1", supervised=True)
        wait_for(lambda: (tmp_path / "m0" / "checkpoint.pt").exists(), 90, "the first checkpoint")
        run.coordinator.kill()
        wait_for(lambda: all("lost the coordinator" in run.log(n) for n in ("m0", "m1")), 30, "both to lose it")
        assert all("Traceback" not in run.log(n) for n in ("m0", "m1"))
        run.serve("--run-id", "r1")
        assert max_difference(finished(run, "m0", "m1"), uninterrupted) == 0
        resumed = re.findall(r"resumed from \S+ \(run r1\): step (\d+)", run.log("m0"))
        assert resumed and int(resumed[-1]) > 0, run.log("m0")
        assert json.load(open(tmp_path / "m0" / "metrics.json"))["steps"] == 6


def test_strangers_bytes_and_floods_end_only_their_own_connections(uninterrupted, tmp_path):
    """A health check, a port scan's bytes, JSON of no use, an unproven `done`, a joiner claiming step
    10^9 without the secret, a line with no end, a member with another FT_SECRET and 100 idle
    connections: each refused in one line. The coordinator and its store are out of reach of another
    address; a stranger writing into the store all the while (the keys of each generation as they were
    named before, gen1/..., which gloo reads the members' addresses from) reaches no group. The run goes
    on, bit-equal."""
    host, port = None, None
    with Run(tmp_path) as run:
        host, port = run.address.split(":")
        wait_for(lambda: "members join at" in run.log("coordinator"), 30, "the coordinator")
        for other in (("127.0.0.2", int(port)), ("127.0.0.2", int(run.store_port))):   # bound to 127.0.0.1 alone
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(other, timeout=10)
        stranger = dist.TCPStore(host, int(run.store_port), timeout=datetime.timedelta(seconds=30))
        guesses = [f"{prefix}{gen}/0//cpu//0/{rank}" for prefix in ("gen", "") for gen in (1, 2, 3) for rank in (0, 1)]
        done = threading.Event()

        def write_all_the_while():   # until the run ends (and its store with it)
            while not done.wait(0.02):
                for key in guesses:
                    stranger.set(key, "127.0.0.1:9 from a stranger")
        writer = threading.Thread(target=write_all_the_while, daemon=True)
        writer.start()
        strays = [b"GET / HTTP/1.0\r\n\r\n", b"x\n", b"[]\n", b"{}\n", b'{"op": "done"}\n', b"\xff\xfe\n",
                  b'{"op": "join", "proof": "00", "challenge": "a", "flags": {}, "step": 1000000000, "run": null}\n',
                  b"[" * 70000]
        for stray in strays:
            with socket.create_connection((host, int(port))) as s:
                s.sendall(stray)
                s.recv(1000)   # the challenge; then the coordinator closes it
        run.member("intruder", env={**ENV, "FT_SECRET": "another"})
        assert run.wait("intruder") == [1]
        assert run.said("intruder") == [
            f"error: {run.address} refused this member or does not know FT_SECRET: give the coordinator and every "
            f"member the same FT_SECRET"], run.log("intruder")
        idle = [socket.create_connection((host, int(port))) for _ in range(100)]   # 64 wait, 36 are refused
        for name in ("m0", "m1"):
            run.member(name, "--min-members", "2")
        members_keys = lambda: set(stranger.list_keys()) - set(guesses)
        wait_for(members_keys, 120, "the members' keys in the store")
        assert all(re.fullmatch(r"[0-9a-f]{32}/.+", key) for key in members_keys()), members_keys()   # no guess
        done.set()
        weights = finished(run, "m0", "m1")
        for s in idle:
            s.close()
    assert max_difference(weights, uninterrupted) == 0
    log = run.log("coordinator")
    refused = re.findall(r"coordinator: the connection from \S+ refused: (.*)", log)
    for why in ("not a line of JSON", "not a message of this protocol", "it does not know FT_SECRET",
                "a line longer than 65536 bytes", "more than 64 connections at once have not joined",
                "it did not prove it knows FT_SECRET within 5 s"):
        assert any(why in r for r in refused), (why, log)
    assert len(refused) == len(strays) + 1 + 100, log
    assert "the run is over" in log and "Traceback" not in log


def test_a_hung_coordinator_and_a_sigterm_while_waiting_each_end_a_member_with_its_checkpoint(tmp_path):
    with Run(tmp_path) as run:
        run.member("alone", "--min-members", "2")   # waits for a quorum that does not come
        wait_for(lambda: "joined run" in run.log("alone"), 60, "it to join")
        time.sleep(1.0)
        signalled = time.monotonic()
        run.members["alone"].send_signal(signal.SIGTERM)
        assert run.wait("alone") == [75]
        assert time.monotonic() - signalled < 15   # (unsignalled, it would wait for its quorum for ever)
        assert "at step 0: stopped by SIGTERM" in run.log("alone")
        assert (tmp_path / "alone" / "checkpoint.pt").exists()
        for name in ("m0", "m1"):
            run.member(name, "--min-members", "2")
        wait_for(lambda: "generation 1" in run.log("m1"), 60, "the first generation")
        run.coordinator.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert run.wait("m0", "m1") == [75, 75]
        waited = time.monotonic() - stopped
        for name in ("m0", "m1"):   # it waited on the coordinator: --member-timeout 4, and a step; or, stopped while
            assert "lost the coordinator at" in run.log(name)   # making its group, on its store: 6 x 4 s
            if "not a word from it for 4 s" not in run.log(name):
                assert "its store did not answer for 24 s" in run.log(name) and waited < 24 + 4, run.log(name)
            assert "Traceback" not in run.log(name)
            assert (tmp_path / name / "checkpoint.pt").exists()
        assert waited < 4 + 10 or "its store did not answer" in run.log("m0") + run.log("m1")


def test_a_coordinator_that_hangs_as_it_admits_a_member_leaves_that_member_its_checkpoint(tmp_path):
    """The coordinator stopped (SIGSTOP) just as it answers a member's join: the member hears nothing for
    --member-timeout and leaves with its checkpoint, exit 75. (It once connected to the coordinator's store right
    there, and torch's TCPStore client waits for ever on a stopped store, whatever its timeout.)"""
    with Run(tmp_path) as run:
        env = {**ENV, "FT_COORDINATOR_PID": str(run.coordinator.pid)}
        run.member("m0", "--min-members", "2", dies=("coordinator-stops", 0), env=env)
        assert run.wait("m0", timeout=60) == [75], run.log("m0")
        assert "lost the coordinator at" in run.log("m0") and "Traceback" not in run.log("m0")
        assert (tmp_path / "m0" / "checkpoint.pt").exists()


def test_a_step_that_fails_again_and_again_ends_the_run_with_one_line_naming_it(tmp_path):
    with Run(tmp_path) as run:
        run.member("m0", "--min-members", "2")
        run.member("m1", "--min-members", "2", dies=("broken", 1))
        assert run.wait("m0", "m1", "coordinator") == [1, 1, 1]
        line = re.search(r"coordinator: (error: step 1 failed 3 times in a row with members \[\d+, \d+\] \(.*"
                         r"a broken link.*\): the run ends here.*)", run.log("coordinator"))
        assert line, run.log("coordinator")
        for name in ("m0", "m1"):
            assert line[1] in run.log(name) and "Traceback" not in run.log(name)


def test_bad_inputs_each_end_with_one_line(tmp_path):
    """Other training flags, or other threads (not a flag: the line says what to set); no coordinator; serving
    0.0.0.0 without FT_SECRET; a store port in use; training flags given to the coordinator."""
    with Run(tmp_path) as run:
        run.member("m0", "--min-members", "2")
        wait_for(lambda: "joined run" in run.log("m0"), 60, "m0 to join")   # its flags are the run's
        run.member("other", "--batch-size", "32", "--min-members", "2")
        assert run.wait("other") == [1]
        assert "error: this member differs from the run (batch_size 32 here, 16 in the run; final_step 3 here, 6 in " \
               "the run): start it with the run's training flags" in run.log("other"), run.log("other")
        run.member("threads", "--min-members", "2", env={**ENV, "OMP_NUM_THREADS": "2"})
        assert run.wait("threads") == [1]
        assert "error: this member differs from the run (threads 2 here, 1 in the run): start it with the run's " \
               "OMP_NUM_THREADS" in run.log("threads"), run.log("threads")
        run.members["m0"].send_signal(signal.SIGTERM)
        assert run.wait("m0") == [75]
        run.member("new", "--batch-size", "32", "--min-members", "2")   # no live member left: its flags are the run's
        wait_for(lambda: "joined run" in run.log("new"), 60, "a member with other flags to join")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = str(taken.getsockname()[1])
        for command, code, line in (
                (["--join", f"127.0.0.1:{free_port()}", "--init-timeout", "1", "--data-dir", DATA, "--out",
                  str(tmp_path / "x")], 1, "error: no coordinator at 127.0.0.1:"),
                (["--serve", f"0.0.0.0:{free_port()}"], 1, "error: 0.0.0.0 can be reached from other machines, and "
                                                            "FT_SECRET is not set"),
                (["--serve", f"127.0.0.1:{free_port()}", "--store-port", busy], 1,
                 f"error: cannot listen at 127.0.0.1:{busy} (--store-port): Address already in use"),
                (["--serve", f"127.0.0.1:{free_port()}", "--batch-size", "32"], 2, "usage:")):
            result = subprocess.run([sys.executable, "ft_ddp_resnet.py", *command], cwd=HERE, capture_output=True,
                                    text=True, timeout=120, env={k: v for k, v in ENV.items() if k != "FT_SECRET"})
            assert result.returncode == code and result.stderr.startswith(line), result.stderr
            assert len(result.stderr.strip().splitlines()) == 1 or code == 2, result.stderr
    assert "unrecognized arguments: --batch-size 32" in result.stderr, result.stderr


def test_a_link_lost_or_a_sigterm_in_the_handshake_ends_a_member_with_75(tmp_path):
    """Its connection closed before the coordinator answers, or a SIGTERM while it waits for the answer: the
    member writes its checkpoint and exits 75, which the README's loop tries again (a wrong FT_SECRET is 1)."""
    with socket.create_server(("127.0.0.1", 0)) as fake:
        fake.settimeout(120)
        address = f"127.0.0.1:{fake.getsockname()[1]}"
        for name in ("closed", "sigterm"):
            member = subprocess.Popen([sys.executable, "ft_ddp_resnet.py", "--join", address, "--out",
                                       str(tmp_path / name)] + FT, cwd=HERE, env=ENV, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
            connection, _ = fake.accept()
            connection.sendall(b'{"challenge": "c"}\n')
            connection.recv(65536)   # its join, with its proof
            if name == "closed":
                connection.close()
            else:
                member.send_signal(signal.SIGTERM)
            out = member.communicate(timeout=60)[0]
            connection.close()
            assert member.returncode == 75, out
            why = "lost the coordinator at" if name == "closed" else "stopped by SIGTERM"
            assert f"this member at step 0: {why}" in out and "Traceback" not in out and "FT_SECRET" not in out, out
            assert (tmp_path / name / "checkpoint.pt").exists()
