"""Checks that the tests start under torchrun, one per command:
`torchrun --nproc_per_node=2 tests/torchrun_checks.py ring-check` (or overlap-order, fsdp-load
CHECKPOINT OUT, fsdp-sent flat|hsdp, threads-left SCRIPT ARGS..., hook-sent SCRIPT ARGS...,
slow-checkpoint SCRIPT ARGS..., shared-gpu SCRIPT ARGS..., slow-load), from the repo root."""
import atexit, datetime, gc, os, sys, time, types
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root: the scripts
import torch
import torch.distributed as dist
import common   # the scripts themselves are imported where used: threads-left sees a script's own import order


def ring_check():
    """Under torchrun: the hand-written ring equals dist.all_reduce, for lengths that don't divide."""
    import scratch_ring
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    for shapes in ([(1,)], [(2,)], [(7,)], [(5, 3), (11,), (2, 2, 2)], [(1001,)]):
        mine = [torch.randn(s) for s in shapes]
        expected = [t.clone() for t in mine]
        for t in expected:
            dist.all_reduce(t)
        scratch_ring.ring_allreduce(mine, rank, world_size)
        for a, b in zip(mine, expected):
            assert torch.allclose(a, b, atol=1e-5), (shapes, a, b)
        # The first half alone leaves this process the full sum of the chunk it owns.
        chunks = list(torch.randn(sum(torch.Size(s).numel() for s in shapes)).tensor_split(world_size))
        total = torch.cat(chunks).clone()
        dist.all_reduce(total)
        scratch_ring.ring_reduce_scatter(chunks, rank, world_size)
        mine = scratch_ring.owned_chunk(rank, world_size)
        assert torch.allclose(chunks[mine], total.tensor_split(world_size)[mine], atol=1e-5)
    print("ring ok", flush=True)
    dist.destroy_process_group()


def overlap_order():
    """Under torchrun: with --overlap a bucket's ring allreduce starts before backward has produced
    the last gradient (the first layer's)."""
    import scratch_lenet, scratch_ring
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    events, ring = [], scratch_ring.ring_allreduce
    def recorded_ring(tensors, *args):
        events.append("send")
        ring(tensors, *args)
    scratch_ring.ring_allreduce = recorded_ring
    replicas = [scratch_lenet.get_params(scratch_lenet.init_params(0), "cpu")]
    overlap = scratch_ring.OverlappedAllreduce(replicas, rank, world_size, 1024, torch.device("cpu"))
    for p in replicas[0]:   # registered after the class's own hook, so it runs after it
        p.register_post_accumulate_grad_hook(lambda p: events.append("grad"))
    X, y = torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,))
    velocities = [[torch.zeros_like(p) for p in replicas[0]]]
    scratch_ring.train_batch(X, y, replicas, velocities, ["cpu"], 0.1, 256, rank, world_size, overlap=overlap)
    last_grad = len(events) - 1 - events[::-1].index("grad")
    assert events.count("send") == 4 and events.index("send") < last_grad, events
    print("overlap ok", events, flush=True)
    dist.destroy_process_group()


def join():
    """This process's place in the CPU (gloo) group that torchrun describes."""
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def fsdp_load(checkpoint, out):
    """Under torchrun: shard a fresh model over this world size, load the checkpoint into it, and
    write the whole model it then holds."""
    import fsdp_resnet
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    rank, world_size = join()
    device = torch.device("cpu")
    mesh = fsdp_resnet.device_mesh(device, world_size, world_size, hsdp=False)
    torch.manual_seed(1)
    other = common.classifier("resnet18", 10, channels=1, image_size=28)   # other weights than those saved
    model = fsdp_resnet.shard(other, mesh, amp=False)
    args = fsdp_resnet.parse_args(["--checkpoint", checkpoint])
    optimizer, scheduler = fsdp_resnet.make_optimizer(model, args, steps_per_epoch=1)
    things = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    saved = fsdp_resnet.Checkpoint(args, things, None, None, steps_per_epoch=1)
    assert saved.load_shards(fsdp_resnet.newest_checkpoint(checkpoint)) is None
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(state, out)
    torch.distributed.destroy_process_group()


def fsdp_sent(hsdp):
    """Under torchrun: count what one training step of fsdp_resnet's sharded ResNet hands to
    torch.distributed's all-gather, reduce-scatter and all-reduce (patched here, in this test
    process only), and print it beside what fsdp_resnet.bytes_sent_per_step computes from the shards' sizes."""
    import fsdp_resnet
    rank, world_size = join()
    counted = {}
    def counting(name, collective):
        def call(*args, **kwargs):
            # all_reduce's tensor; the others' input
            handed = [*args, *kwargs.values()][0 if name == "all_reduce" else 1]
            counted[name] = counted.get(name, 0) + handed.numel() * handed.element_size()
            return collective(*args, **kwargs)
        return call
    for name, function in (("all_gather", "all_gather_into_tensor"), ("all_gather", "all_gather_single"),
                           ("reduce_scatter", "reduce_scatter_tensor"), ("reduce_scatter", "reduce_scatter_single"),
                           ("all_reduce", "all_reduce")):   # FSDP2 calls the first ones up to torch 2.13
        if hasattr(dist, function):
            setattr(dist, function, counting(name, getattr(dist, function)))
    device = torch.device("cpu")
    shard_size = world_size // 2 if hsdp == "hsdp" else world_size
    mesh = fsdp_resnet.device_mesh(device, world_size, shard_size, hsdp == "hsdp")
    def one_step(amp, fine_tuned):   # the sharded model lives only in here: freed before the group goes
        counted.clear()
        torch.manual_seed(0)
        net = common.classifier("resnet18", 10, channels=1, image_size=28)
        if fine_tuned:   # the stem and first stage frozen, a BatchNorm1d head
            torch.nn.ModuleList([net.conv1, net.bn1, net.layer1]).requires_grad_(False).eval()
            net.fc = torch.nn.Sequential(torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 10))
        model = fsdp_resnet.shard(net, mesh, amp)
        computed = fsdp_resnet.bytes_sent_per_step(model, mesh, amp)
        X, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
        torch.nn.functional.cross_entropy(model(X).float(), y).backward()
        assert counted == {k.split(" ")[0]: v for k, v in computed.items()}, (amp, fine_tuned, counted, computed)
        return computed
    for amp in (False, True):
        for fine_tuned in (False, True):
            computed = one_step(amp, fine_tuned)
    print("fsdp sent ok", computed, flush=True)
    del mesh
    gc.collect()
    dist.destroy_process_group()


def threads_left(script, *argv):
    """Run one rank of `script` in this process; print the names of its threads just before it
    destroys the process group, and after the script has returned."""
    def thread_names():
        return " ".join(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
    gc.disable()   # a group only a collection would free is then found every time, not when gc happens not to run
    destroy = dist.destroy_process_group
    def destroy_and_report(*args, **kwargs):
        print("threads before destroy:", thread_names(), flush=True)
        destroy(*args, **kwargs)
    dist.destroy_process_group = destroy_and_report
    try:
        __import__(script).main(list(argv))
    finally:   # a refusal too
        print("threads left:", thread_names(), flush=True)


def hook_sent(script, *argv):
    """Run this rank of `script` with torch.distributed's all_reduce counting the 16-bit tensors it is handed (what
    a bf16 or fp16 compression hook sends: patched here, in this test process only); at exit, print their bytes."""
    handed, all_reduce = [0], dist.all_reduce
    def counting(tensor, *args, **kwargs):
        if tensor.dtype in (torch.bfloat16, torch.float16):
            handed[0] += tensor.numel() * tensor.element_size()
        return all_reduce(tensor, *args, **kwargs)
    dist.all_reduce = counting
    atexit.register(lambda: print(f"rank {os.environ['RANK']} handed all_reduce {handed[0]} bytes in 16 bits",
                                  flush=True))
    __import__(script).main(list(argv))


def slow_checkpoint(script, *argv):
    """Run this rank of `script`, the stop's checkpoint file written 3 s late (on a slow disk); at exit, print
    the step of the checkpoint on disk."""
    write = common.save_atomically
    def slowly(write_file, path):
        if path.endswith("checkpoint.pt") and common.StopSignal.noted:
            time.sleep(3)
        write(write_file, path)
    common.save_atomically = slowly
    module = __import__(script)
    checkpoint = module.parse_args(list(argv)).checkpoint
    def report():
        saved = torch.load(checkpoint, weights_only=False) if os.path.exists(checkpoint) else None
        step = saved["position"]["step"] if saved else None
        print(f"rank {os.environ['RANK']} leaves: checkpoint of step {step} on disk", flush=True)
    atexit.register(report)
    module.main(list(argv))


def shared_gpu(script, *argv):
    """Run this rank of `script` as on a node whose launcher showed every process the same GPU
    (CUDA_VISIBLE_DEVICES=0 for all): torch sees one GPU, of one UUID; NCCL's group is made of gloo,
    where nothing would stop two ranks on one GPU."""
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(uuid="GPU-8b3c", name="fake")
    dist.is_nccl_available = lambda: True
    init_process_group = dist.init_process_group
    dist.init_process_group = lambda backend, **options: init_process_group("gloo", **options)
    __import__(script).main(list(argv))


def slow_load():
    """Under torchrun: common.load_on_every_rank with a load of 4 s on every rank, in turn (the
    node's first rank, then the others), on a default group whose waits time out after 2 s: each
    rank says what it loaded."""
    rank, world_size = join()
    # Set once both are here: a start slower than 2 s is not what is tested.
    dist.barrier()
    dist.set_timeout(datetime.timedelta(seconds=2))
    def load():
        time.sleep(4)
        return f"loaded by rank {rank}"
    print(f"rank {rank}: {common.load_on_every_rank(load, world_size)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    checks = {"ring-check": ring_check, "overlap-order": overlap_order, "fsdp-load": fsdp_load,
              "threads-left": threads_left, "fsdp-sent": fsdp_sent, "hook-sent": hook_sent,
              "slow-checkpoint": slow_checkpoint, "shared-gpu": shared_gpu,
              "slow-load": slow_load}
    checks[sys.argv[1]](*sys.argv[2:])
