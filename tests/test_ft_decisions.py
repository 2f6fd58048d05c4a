"""ft_ddp_resnet.py's coordinator decides in pure functions of its state (who stalled, commit or not, the next
quorum, who joins, when the run is over), each returning its decision and why: these tests start no process.
Beside them, what a CPU sees of the defects its step had: BatchNorm's momentum left at 0, an epoch's order drawn
again at every step; and the store's signed values, the wire's refusals, the coordinator's own flags."""
import pytest
import torch
from helpers import epoch_batches
import ft_ddp_resnet as ft

# ---------------------------------------------------------------- ft_ddp_resnet.py: the coordinator's decisions
def member(i, since=0.0, request=None):   # a connection that joined
    return ft.Connection(i, f"127.0.0.1:{5000 + i}", since, "", joined=True, request=request)


def vote(step, ok=True, waited=0.0, error=""):
    return {"op": "vote", "step": step, "ok": ok, "next": True, "waited": waited, "error": error}


def ready(step):
    return {"op": "ready", "step": step}


def live(*connections):
    return {c.id: c for c in connections}


def test_a_member_that_holds_the_others_up_past_the_timeout_is_stalled_and_only_then():
    run = ft.Run(members=[0, 1])
    waiting = live(member(0, since=10.0, request=vote(3)), member(1, since=9.0))
    assert ft.stalled(13.9, waiting, run, timeout=4) == {}
    assert ft.stalled(14.1, waiting, run, timeout=4) == {1: "no vote and no request for 4 s while the others waited"}
    assert ft.stalled(100.0, live(member(0, since=1.0), member(1, since=1.0)), run, timeout=4) == {}   # none waits
    later = live(member(0, since=10.0, request=vote(3)), member(1, since=12.0))   # it asked after they began to wait
    assert ft.stalled(15.0, later, run, timeout=4) == {}


def test_a_member_its_peers_collective_gave_up_on_is_stalled_once_they_voted():
    gave_up = vote(3, ok=False, waited=3.9, error="Connection closed by peer")
    run = ft.Run(members=[0, 1, 2])
    peers = live(member(0, since=10.0, request=gave_up), member(1, since=10.0, request=gave_up), member(2, since=6.0))
    assert ft.stalled(10.2, peers, run, timeout=4) == {}   # those whose collective failed with it vote soon
    assert ft.stalled(10.3, peers, run, timeout=4) == {2: "its peers' collective waited 4 s for it"}
    quick = vote(3, ok=False, waited=0.1, error="Connection reset by peer")   # a death: no one waited for it
    assert ft.stalled(10.3, live(member(0, since=10.0, request=quick), member(2, since=6.0)), run, timeout=4) == {}
    other = ft.Run(members=[0, 1])   # not of the generation: not held to its vote
    assert ft.stalled(10.3, live(member(0, since=10.0, request=gave_up), member(2, since=9.0)), other, 4) == {}


def test_a_step_is_committed_when_all_its_members_voted_yes_for_it_and_by_none_otherwise():
    run = ft.Run(members=[0, 1, 2])
    assert ft.commit_or_not(live(member(0, request=vote(5)), member(1, request=vote(5)), member(2)), run) == (
        None, "waiting for the votes of members [2]")
    assert ft.commit_or_not(live(*[member(i, request=vote(5)) for i in range(3)]), run) == (
        True, "members [0, 1, 2] voted yes for step 5")
    broken = vote(5, ok=False, error="Connection reset by peer")
    assert ft.commit_or_not(live(member(0, request=vote(5)), member(1, request=broken), member(2, request=vote(5))),
                            run) == (False, "member 1: Connection reset by peer")
    assert ft.commit_or_not(live(member(0, request=vote(5)), member(1, request=vote(5))), run) == (
        False, "member 2 is gone")
    assert ft.commit_or_not(live(member(0, request=vote(5)), member(1, request=vote(5)), member(2, request=vote(4))),
                            run) == (False, "votes for steps [4, 5]")
    asked = live(*[member(i, request=ready(6)) for i in range(3)])   # the verdict was given: they ask for the next
    assert ft.commit_or_not(asked, run)[0] is None


def test_the_next_quorum_waits_for_every_live_member_and_the_first_for_min_members():
    first = ft.Run(flags={"min_members": 3})
    two = live(member(0, request=ready(0)), member(1, request=ready(0)))
    assert ft.next_quorum(two, first) == (None, "members [0, 1] asked; waiting for all 3")
    three = live(member(0, request=ready(0)), member(1, request=ready(0)), member(2))
    assert ft.next_quorum(three, first) == (None, "members [0, 1] asked; waiting for all 3")
    three[2].request = ready(0)
    assert ft.next_quorum(three, first) == ({"gen": 1, "members": [0, 1, 2], "step": 0, "src": None},
                                            "generation 1: members [0, 1, 2]")
    assert ft.next_quorum(live(member(0)), first) == (None, "no member asks")


def test_a_new_generation_comes_with_other_members_or_after_a_failed_step_and_the_member_ahead_sends():
    run = ft.Run(flags={"min_members": 2}, gen=4, members=[0, 2])
    same = live(member(0, request=ready(7)), member(2, request=ready(7)))
    assert ft.next_quorum(same, run)[0] == {"gen": 4, "members": [0, 2], "step": 7, "src": None}
    back = live(member(0, request=ready(7)), member(2, request=ready(7)), member(5, request=ready(3)))
    assert ft.next_quorum(back, run)[0] == {"gen": 5, "members": [0, 2, 5], "step": 7, "src": 0}
    behind = live(member(0, request=ready(3)), member(2, request=ready(7)))
    assert ft.next_quorum(behind, run)[0] == {"gen": 4, "members": [0, 2], "step": 7, "src": 1}
    failed = ft.Run(flags={"min_members": 2}, gen=4, members=[])   # its members left their group
    assert ft.next_quorum(same, failed)[0]["gen"] == 5
    over = ft.Run(flags={"min_members": 2}, gen=4, members=[0, 2], finished=1.0)
    assert ft.next_quorum(same, over) == (None, "the run is over")


FLAGS = {"batch_size": 16, "seed": 0, "final_step": 6, "min_members": 2, "torch": "2.14.1", "threads": 1,
         "data": "labels crc 1"}


def test_a_member_joins_with_the_runs_flags_and_is_told_what_to_match_otherwise():
    run = ft.Run(flags=FLAGS)
    assert ft.admit(run, "r1", {**FLAGS, "min_members": 3}, None) == ("joined", None)   # (the first quorum's)
    assert ft.admit(run, "r1", FLAGS, "r1") == ("joined", None)
    assert ft.admit(run, "r1", {**FLAGS, "batch_size": 32}, None) == (
        "refused", "error: this member differs from the run (batch_size 32 here, 16 in the run): start it with the "
                   "run's training flags")
    verdict, why = ft.admit(run, "r1", {**FLAGS, "threads": 2, "torch": "2.9.0"}, None)
    assert verdict == "refused" and "flags" not in why, why   # neither is a flag: it names what to set
    assert why.endswith("start it with the run's OMP_NUM_THREADS and torch version"), why
    verdict, why = ft.admit(run, "r1", FLAGS, "r0")
    assert verdict == "refused" and why.startswith("error: its checkpoint is of run r0, and this coordinator serves "
                                                   "run r1"), why
    assert ft.admit(ft.Run(flags=FLAGS, step=6, finished=1.0), "r1", FLAGS, None) == (
        "over", "the run is over: its members finished step 6")


def test_the_coordinator_ends_once_the_run_is_over_and_waits_for_a_dropped_member_to_be_told():
    run = ft.Run(step=6, finished=100.0)
    assert ft.run_over(101.0, ft.Run(), [], timeout=4)[0] is False   # not finished: members may still come
    assert ft.run_over(101.0, run, [member(0)], timeout=4) == (False, "the run goes on")
    assert ft.run_over(101.0, run, [], timeout=4) == (True, "the run is over (step 6)")
    dropped = member(1)
    dropped.dropped = "no vote and no request for 4 s while the others waited"
    assert ft.run_over(139.0, run, [dropped], timeout=4) == (False, "a dropped member may still wake up")
    assert ft.run_over(141.0, run, [dropped], timeout=4)[0] is True


# ---------------------------------------------------------------- ft_ddp_resnet.py: its store, its wire, its flags
def test_a_value_in_the_groups_store_counts_only_if_signed_with_the_secret():
    store = torch.distributed.HashStore()
    prefix = ft.generation_prefix(b"secret", "r1", 2)
    assert prefix != ft.generation_prefix(b"secret", "r1", 3) != ft.generation_prefix(b"other", "r1", 3)
    assert len(prefix) == 33 and prefix.endswith("/") and "r1" not in prefix   # nothing a stranger could guess
    signed = ft.SignedStore(store, b"secret", prefix)
    signed.set("0//cpu//0/0", b"10.0.0.1:4242")
    signed.wait(["0//cpu//0/0"])
    assert signed.get("0//cpu//0/0") == b"10.0.0.1:4242"
    store.set(prefix + "0//cpu//0/1", b"10.6.6.6:1")   # a stranger's, under the right key
    with pytest.raises(RuntimeError, match="is not signed with FT_SECRET"):
        signed.get("0//cpu//0/1")
    ft.SignedStore(store, b"other", prefix).set("0//cpu//0/2", b"10.6.6.6:1")   # signed with another secret
    with pytest.raises(RuntimeError, match="is not signed with FT_SECRET"):
        signed.get("0//cpu//0/2")


def test_the_wire_takes_only_messages_of_its_protocol():
    assert ft.parse(b'{"op": "vote", "step": 3, "ok": true, "next": true, "waited": 0, "error": ""}')["step"] == 3
    for line, why in ((b"GET / HTTP/1.0", "not a line of JSON"), (b"[" * 5000, "not a line of JSON"),
                      (b"[]", "not a message of this protocol"), (b'{"op": "ready", "step": 1}',
                                                                  "not a message of this protocol"),
                      (b'{"op": "vote", "step": "3"}', "vote without a proper step, ok, next, waited, error")):
        with pytest.raises(ValueError, match=why.replace("(", r"\(")):
            ft.parse(line)


def test_the_coordinator_takes_only_its_own_flags_and_a_member_not_the_coordinators(capsys):
    args = ft.parse_args(["--serve", "127.0.0.1:29600", "--member-timeout", "3"])
    assert args.member_timeout == 3 and args.store_port is None and "batch_size" not in args
    for argv, flag in ((["--serve", "127.0.0.1:29600", "--batch-size", "32"], "--batch-size 32"),
                       (["--join", "127.0.0.1:29600", "--member-timeout", "3"], "--member-timeout 3")):
        with pytest.raises(SystemExit) as refused:
            ft.parse_args(argv)
        assert refused.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err


# ---------------------------------------------------------------- ft_ddp_resnet.py: what a CPU sees of its step
def test_a_members_step_leaves_batchnorms_momentum_as_it_found_it():
    """Only micro-batch 0 moves the running statistics (the others run at momentum 0): the net a member returns,
    or evaluates, has torch's 0.1 back whichever micro-batches it computed."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Flatten(),
                              torch.nn.Linear(2 * 4 * 4, 10))
    grads = ft.gradients_of(net)
    message = torch.zeros(len(grads) + 4 + 3, dtype=torch.float64)
    X, y = torch.randn(8, 1, 6, 6), torch.arange(8) % 10
    before = net[1].running_mean.clone()
    ft.compute(net, grads, message, X, y, 4, range(1, 2))   # micro-batch 1 alone: statistics untouched
    assert torch.equal(net[1].running_mean, before) and net[1].momentum == 0.1
    ft.compute(net, grads, message, X, y, 4, range(0, 2))
    assert not torch.equal(net[1].running_mean, before) and net[1].momentum == 0.1


def test_an_epochs_order_is_drawn_once_and_is_the_other_scripts(monkeypatch):
    sampler = torch.utils.data.DistributedSampler
    draw = sampler.__iter__
    drawn = []

    def counted(self):
        drawn.append(self.epoch)
        return draw(self)
    monkeypatch.setattr(sampler, "__iter__", counted)
    ft.epoch_order.cache_clear()
    for epoch in (1, 2):
        batches = epoch_batches(96, 16, seed=0, epoch=epoch)
        drawn.clear()
        for step in range(6):
            assert torch.equal(ft.epoch_order(96, 0, epoch)[step * 16:][:16], batches[step])
        assert drawn == [epoch], drawn   # once for the 6 steps of the epoch (epoch_batches drew before)
