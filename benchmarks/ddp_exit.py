"""Ending a DDP run on gloo: which goes first, the DDP wrap or the process group?

Two processes make a gloo group, wrap a small model in DDP, take one step, all_reduce a tensor made
in Python, and end, again and again. The order of the ending:

  wrap last:  destroy_process_group(), then the DDP wrap is freed: its reducer holds the group's
              last reference, so the group's threads are joined while the main thread holds Python's
              lock, and a thread still freeing the all_reduce's tensor waits for that lock.
  wrap first: the DDP wrap is freed, then destroy_process_group() frees the group (the order
              ddp_toy.py and ddp_resnet.py use).

    python benchmarks/ddp_exit.py [--rounds 200] [--timeout 60]

Prints, for each order, the rounds both processes finished, or that they hung.
"""
import argparse, datetime, os, socket, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def free_port():   # port 0: the OS picks one no one listens on now
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def one_round(store, rank, wrap_first, round_number):
    dist.init_process_group("gloo", store=dist.PrefixStore(f"round{round_number}", store), rank=rank, world_size=2)
    model = DDP(torch.nn.Linear(8, 8))
    model(torch.randn(4, 8)).sum().backward()
    made_in_python = torch.ones(2)
    dist.all_reduce(made_in_python)
    del made_in_python
    if wrap_first:
        del model
        dist.destroy_process_group()
    else:
        dist.destroy_process_group()
        del model


def rank_main(rank, port, wrap_first, rounds, done):
    torch.set_num_threads(1)
    quiet = os.open(os.devnull, os.O_WRONLY)   # torch 2.9's gloo prints a line per group; errors come through join
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    for round_number in range(rounds):
        one_round(store, rank, wrap_first, round_number)
        done[rank] = round_number + 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before the processes count as hung")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {len(os.sched_getaffinity(0))} cores, 2 processes, {args.rounds} rounds")
    for name, wrap_first in (("wrap last", False), ("wrap first", True)):
        done = mp.get_context("spawn").Array("i", 2)
        context = mp.start_processes(rank_main, args=(free_port(), wrap_first, args.rounds, done), nprocs=2,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + args.timeout
        try:
            while not context.join(timeout=1.0) and time.monotonic() < deadline:
                pass   # join returns when any one process ends; wait for both, or the deadline
            finished = all(not process.is_alive() for process in context.processes)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        result = "finished" if finished else f"hung after {args.timeout:g} s"
        print(f"{name:10}: {result}, rounds done {min(done)} of {args.rounds}", flush=True)


if __name__ == "__main__":
    main()
