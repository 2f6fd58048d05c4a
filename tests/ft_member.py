"""A member of ft_ddp_resnet.py that dies on purpose at a chosen point, for the tests:

    python tests/ft_member.py WHERE STEP ft_ddp_resnet.py's flags...

WHERE: `backward` (SIGKILL from a gradient hook in the middle of backward), `allreduce` (SIGKILL
20 ms into the gradients' allreduce), `before-vote` (the allreduce done, the vote not sent: between
allreduce and optimizer step), `recovery` (SIGKILL 20 ms into receiving a peer's state), `broken`
(from its STEP-th attempt on, its allreduce fails at once, as over a broken link: it leaves the
group and votes no), `handshake` (SIGSTOP once its address is in the store while its first group
is made: its peers connect to a process that does not answer), `coordinator-stops` (SIGSTOP to the
coordinator, whose pid is in FT_COORDINATOR_PID, as it answers this member's join), `none` (it does
not die). STEP: the member's STEP-th attempt at a step (0-based), or its first recovery. With
FT_MEMBER_DROPOUT=P in its environment, its model (make_model()'s) has Dropout(P) before its last
layer. This file patches the script's functions in its own process only."""
import os, signal, sys, threading, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import ft_ddp_resnet

if "FT_MEMBER_DROPOUT" in os.environ:   # a model that draws in its step
    make_model = ft_ddp_resnet.make_model

    def make_model_with_dropout(*args):
        net = make_model(*args)
        net.fc = torch.nn.Sequential(torch.nn.Dropout(float(os.environ["FT_MEMBER_DROPOUT"])), net.fc)
        return net
    ft_ddp_resnet.make_model = make_model_with_dropout

where, at, attempts = sys.argv[1], int(sys.argv[2]), [0]

def die(after=0.0):
    if after:
        threading.Timer(after, os.kill, (os.getpid(), signal.SIGKILL)).start()
    else:
        os.kill(os.getpid(), signal.SIGKILL)

compute, exchange, recover, ask = (ft_ddp_resnet.compute, ft_ddp_resnet.exchange, ft_ddp_resnet.recover,
                                   ft_ddp_resnet.CoordinatorLink.ask)

def compute_then_maybe_die(net, *args, **kwargs):
    if where == "backward" and attempts[0] == at:
        net.layer2[0].conv1.weight.register_hook(lambda grad: die())   # reached halfway through backward
    return compute(net, *args, **kwargs)

def exchange_then_maybe_die(*args, **kwargs):
    if where == "allreduce" and attempts[0] == at:
        die(after=0.02)
    attempts[0] += 1
    if where == "broken" and attempts[0] > at:
        ft_ddp_resnet.dist.destroy_process_group()
        return None, ft_ddp_resnet.failure(RuntimeError("Connection reset by peer (a broken link)"), time.monotonic())
    return exchange(*args, **kwargs)

def recover_then_maybe_die(*args, **kwargs):
    if where == "recovery":
        die(after=0.02)
    return recover(*args, **kwargs)

def ask_then_maybe_die(self, message):
    if where == "before-vote" and message["op"] == "vote" and attempts[0] - 1 == at:
        die()
    return ask(self, message)

stopped = []

class StopAfterSet(ft_ddp_resnet.dist.Store):   # the first group's store, as the member's gloo sees it
    def __init__(self, store):
        super().__init__()
        self.store = store

    def set(self, key, value):
        self.store.set(key, value)
        if not stopped:   # once
            stopped.append(True)
            os.kill(os.getpid(), signal.SIGSTOP)

    def get(self, key):
        return self.store.get(key)

    def wait(self, keys, *timeout):
        return self.store.wait(keys, *timeout)

    def add(self, key, value):
        return self.store.add(key, value)

    def check(self, keys):
        return self.store.check(keys)

heed = ft_ddp_resnet.Member.heed

def heed_then_maybe_stop_the_coordinator(self, answer):
    if where == "coordinator-stops" and "store" in answer:   # the answer to its join
        os.kill(int(os.environ["FT_COORDINATOR_PID"]), signal.SIGSTOP)
    return heed(self, answer)

init_process_group = ft_ddp_resnet.dist.init_process_group

def init_then_maybe_hang(*args, store, **kwargs):
    return init_process_group(*args, store=StopAfterSet(store) if where == "handshake" else store, **kwargs)

ft_ddp_resnet.dist.init_process_group = init_then_maybe_hang
ft_ddp_resnet.Member.heed = heed_then_maybe_stop_the_coordinator
ft_ddp_resnet.compute, ft_ddp_resnet.exchange = compute_then_maybe_die, exchange_then_maybe_die
ft_ddp_resnet.recover, ft_ddp_resnet.CoordinatorLink.ask = recover_then_maybe_die, ask_then_maybe_die
sys.argv = [ft_ddp_resnet.__file__] + sys.argv[3:]
ft_ddp_resnet.main()
