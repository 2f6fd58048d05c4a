"""A page's own main() run as on a machine with GPUs, on a CPU: each "GPU" is the meta device, and an op that meets
tensors on two devices is refused, as CUDA refuses it.

What a run under `as_on_a_gpu` sees:
- torch.cuda says there are `gpus` GPUs, each with its UUID; `torch.device("cuda", i)` is `meta:i`, so a page that counts its GPUs, or
  common.pick_device, hands out meta devices, and every tensor the page puts "on the GPU" is a meta tensor;
- an aten op whose tensors sit on two devices fails with "Expected all tensors to be on the same device" (a 0-dim CPU
  tensor beside others is allowed, as CUDA allows it; so are copies between devices, and indexing a tensor with CPU
  indices), in the threads the pages compute in: their own, a ThreadPoolExecutor's (scratch_lenet.py's replicas,
  scratch_ring.py's communication thread) and DataParallel's replicas;
- the wrappers do to devices what they do on GPUs and nothing else: DDP and FSDP2 take a module on the GPU (DDP
  refuses one elsewhere, FSDP2's mesh must be the GPU's) and move the forward's inputs to it, as DDP given device_ids
  and FSDP2's root do; DataParallel checks the module is on its first device, splits the batch over its devices, runs
  a replica per device in threads, and gathers the outputs on the first;
- a collective the page calls on the default group (NCCL on GPUs: all_reduce, broadcast) must be handed device
  tensors, as NCCL needs, and then does nothing (one process: the sum is the tensor itself), as must one on a group
  made with the default backend (DiLoCo's syncs); the stop vote's gloo
  group, whose tensors are on the CPU by design, runs for real. The group itself is gloo's, one process;
- autocast for meta is the CPU's.
Nothing can be read back from meta: a page whose every training step of its first epoch and every evaluation forward
ran "on the GPU" fails first where it reads the evaluation's sums: the page's evaluate() calling common.Sums.total(),
whose `values.tolist()` is the first read-back. That is the pass.

What it cannot see: one meta device stands for all GPUs (a cuda:0/cuda:1 mix-up passes); the page's branches on
`device.type == "cuda"` (pinned memory, DDP's device_ids, SyncBatchNorm, the timer's synchronize) take their CPU side;
CUDA's own autocast rules and dtypes; one process only, so neither scratch_ring.py's send/recv nor any path under
`world_size > 1` runs; DDP's communication hooks (its fake runs none); what comes after the first evaluation's count
(checkpoints, --resume, later epochs, the outputs); a thread the page would start itself; ft_ddp_resnet.py, which
trains on CPUs by design."""
import concurrent.futures, contextlib, functools, os, signal, sys, threading, types
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as real_fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the pages

REAL_DEVICE, REAL_AUTOCAST = torch.device, torch.autocast
# ops that may take tensors on two devices on CUDA too: copies between them; indexing, whose indices may be the CPU's
MOVES = {"aten._to_copy.default", "aten.copy_.default", "aten._copy_from.default", "aten._copy_from_and_resize.default"}
INDEXING = {"aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default", "aten._index_put_impl_.default"}
READ_BACK = "cannot be called on meta tensors|Cannot copy out of meta tensor"


class _DeviceType(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, REAL_DEVICE)

    def __call__(cls, *args, **kwargs):
        device = REAL_DEVICE(*args, **kwargs)
        return REAL_DEVICE("meta", device.index) if device.type == "cuda" else device


class CudaIsMeta(metaclass=_DeviceType):
    """torch.device as the page sees it: a CUDA device is the meta device of that number."""


class OneDevice(TorchDispatchMode):
    """Refuses an op whose tensors are on two devices, as CUDA's kernels do."""
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        checked = (args, kwargs)
        if str(func) in INDEXING:   # (self, indices, ...): indices on self's device or the CPU, the rest on self's
            indices = [t for t in tree_flatten(args[1])[0] if torch.is_tensor(t) and t.device.type != "cpu"]
            checked = (args[0], indices, args[2:], kwargs)
        if str(func) not in MOVES:
            tensors = [t for t in tree_flatten(checked)[0] if isinstance(t, torch.Tensor)]
            devices = {str(t.device) for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
            if len(devices) > 1:
                raise RuntimeError(f"Expected all tensors to be on the same device, but {func} got tensors on "
                                   f"{' and '.join(sorted(devices))}")
        return func(*args, **kwargs)


def on_one_device(fn):   # fn, run in another thread with the refusal there too (a dispatch mode is per thread)
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with OneDevice():
            return fn(*args, **kwargs)
    return run


def to_device(inputs, device):
    return tuple(x.to(device, non_blocking=True) if torch.is_tensor(x) else x for x in inputs)


def device_of(module):
    return next(module.parameters()).device


def on_the_gpu(module, what):   # a wrapper's module must be on the "GPU" already (DDP refuses others; FSDP2 moves it)
    found = {t.device.type for t in [*module.parameters(), *module.buffers()]}
    if found != {"meta"}:
        raise RuntimeError(f"{what} was handed a module on {found}, not on the GPU")


class DistributedDataParallel(nn.Module):
    """What DDP does to devices, given device_ids on a GPU: it takes a module on that GPU, and moves the forward's
    inputs there. Its buckets and communication hooks do not run."""
    def __init__(self, module, device_ids=None, **options):
        super().__init__()
        on_the_gpu(module, "DistributedDataParallel")
        self.module = module

    def forward(self, *inputs):
        return self.module(*to_device(inputs, device_of(self.module)))

    def no_sync(self):
        return contextlib.nullcontext()

    def register_comm_hook(self, state, hook):
        pass


class DataParallel(nn.Module):
    """What DataParallel does to devices: the module must be on the first device; the batch is split over the
    devices, a replica runs on each in a thread of its own, the outputs are gathered on the first device."""
    def __init__(self, module, device_ids=None):
        super().__init__()
        self.module, self.device_ids = module, device_ids

    def forward(self, X):
        if not self.device_ids:   # DataParallel without devices (a CPU) just calls the module
            return self.module(X)
        devices = [torch.device(d) for d in self.device_ids]
        found = {t.device.type for t in [*self.module.parameters(), *self.module.buffers()]}
        if found != {devices[0].type}:
            raise RuntimeError(f"module must have its parameters and buffers on device {devices[0]} (device_ids[0]) "
                               f"but found them on {found}")
        shards = [x.to(d, non_blocking=True) for x, d in zip(X.tensor_split(len(devices)), devices)]
        if len(shards) == 1:
            return self.module(shards[0])
        outputs, failures = [None] * len(shards), []
        def replica(i):
            try:
                outputs[i] = self.module(shards[i])
            except Exception as e:   # raised again here, as DataParallel does
                failures.append(e)
        threads = [threading.Thread(target=on_one_device(replica), args=(i,)) for i in range(len(shards))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        return torch.cat([o.to(devices[0]) for o in outputs])


def fully_shard(module, mesh=None, mp_policy=None, **options):
    """What FSDP2 does to devices: the module's states go to the mesh's device (the "GPU"), and the forward's inputs
    to it (the root does that; inside, they are there already). A list of modules (one unit) is each of them."""
    for each in module if isinstance(module, list) else [module]:
        each.to(torch.device("cuda", 0))
        each.register_forward_pre_hook(lambda m, inputs: to_device(inputs, device_of(m)))
    return module


def device_mesh(device_type, shape, **options):   # FSDP2's mesh must be the GPU's; its group here is the CPU's
    if device_type != "meta":
        raise RuntimeError(f"a device mesh on {device_type!r}, not on the GPU")
    return init_device_mesh("cpu", shape, **options)


class Collectives:
    """dist's collectives as the page calls them: on the default group, or one made with its backend (NCCL on GPUs:
    DiLoCo's syncs), each tensor must be on the "GPU", and then nothing happens (one process; handed async_op, no
    work to wait for); on a gloo group (the stop vote's), the real one."""
    NAMES = ("all_reduce", "broadcast")   # those the pages call themselves (one process: no ring's send/recv runs)

    def __init__(self, monkeypatch):
        self.calls, self.nccl = [], [None, dist.group.WORLD]
        for name in self.NAMES:
            monkeypatch.setattr(dist, name, self.checked(name, getattr(dist, name)))
        real_new_group = dist.new_group
        def new_group(*args, backend=None, **kwargs):
            group = real_new_group(*args, backend=backend, **kwargs)
            if backend is None:   # the default group's backend: NCCL
                self.nccl.append(group)
            return group
        monkeypatch.setattr(dist, "new_group", new_group)

    def checked(self, name, real):
        def collective(*args, group=None, **kwargs):
            if not any(group is nccl for nccl in self.nccl):
                return real(*args, group=group, **kwargs)
            tensors = [t for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)]
            off = [str(t.device) for t in tensors if t.device.type != "meta"]
            if off:
                raise RuntimeError(f"dist.{name} on the default group was handed tensors on {off}: NCCL takes only "
                                   f"the GPU's")
            self.calls.append(name)
            return None
        return collective


@contextlib.contextmanager
def as_on_a_gpu(monkeypatch, gpus=1):
    """Inside: torch sees `gpus` GPUs that are meta, ops on two devices are refused in every thread, and the wrappers
    and collectives act on devices as on GPUs. Yields the collectives' record."""
    monkeypatch.setattr(torch, "device", CudaIsMeta)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for name in ("set_device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(
        name="meta", uuid=f"GPU-meta-{getattr(device, 'index', device) or 0}", total_memory=2**37))
    monkeypatch.setattr(torch, "autocast", lambda device_type, *args, **kwargs: REAL_AUTOCAST(
        "cpu" if device_type == "meta" else device_type, *args, **kwargs))
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    real_init = dist.init_process_group
    def init_process_group(backend, **options):   # NCCL's group, made of gloo: the collectives never run on it
        options.pop("device_id", None)
        return real_init("gloo", **options)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(nn, "DataParallel", DataParallel)
    fakes = {nn.parallel.DistributedDataParallel: DistributedDataParallel, real_fully_shard: fully_shard,
             init_device_mesh: device_mesh}
    for module in list(sys.modules.values()):   # the pages' own names for them (from torch... import ...)
        if os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or "/")) == HERE:
            for name, value in list(vars(module).items()):
                for real, fake in fakes.items():
                    if value is real:
                        monkeypatch.setattr(module, name, fake)
    real_submit = concurrent.futures.ThreadPoolExecutor.submit
    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit",
                        lambda self, fn, *args, **kwargs: real_submit(self, on_one_device(fn), *args, **kwargs))
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        with OneDevice():
            yield Collectives(monkeypatch)
    finally:
        for signum, handler in handlers.items():   # the pages' StopSignal set them in this process
            signal.signal(signum, handler)
        if dist.is_initialized():
            dist.destroy_process_group()
