"""Horovod-compatible namespace: change `import horovod.torch as hvd` to
`import mpidist.torch as hvd` and a Horovod PyTorch script runs on mpidist's collectives.

Differences from Horovod are listed in README.md ("Horovod compatibility"); features that are
not offered (Adasum, elastic, join, process sets) raise a clear error instead of misbehaving.
"""
from __future__ import annotations

import contextlib
import json

import numpy as np
import torch

from . import comm as _comm
from .errors import InvalidArgumentError, MpidistError
from .parallel.data import GradientBuckets, broadcast_in_place, register_gradient_hooks, trainable_parameters


class NotOfferedError(MpidistError):
    """A Horovod feature mpidist does not offer."""


# ---- reduction ops (Horovod's constants) -----------------------------------------------------
Average, Sum, Min, Max, Product = "avg", "sum", "min", "max", "prod"
Adasum = "adasum"


def _op(op, average=None):
    if op is None:
        return Average if average is None or average else Sum
    if op == Adasum:
        raise NotOfferedError("Adasum is not offered by mpidist; use op=hvd.Average or hvd.Sum")
    if op not in (Average, Sum, Min, Max, Product):
        raise InvalidArgumentError(f"unknown op {op!r}; use hvd.Average, Sum, Min, Max or Product")
    return op


def _no_process_sets(process_set):
    if process_set is not None:
        raise NotOfferedError("process sets are not offered; build an mpidist.Communicator on a "
                              "sub-communicator instead")


class Compression:
    """Gradient compression for DistributedOptimizer and allreduce (Horovod's classes)."""

    class none:  # noqa: N801 - Horovod's names
        wire = None

    class fp16:  # noqa: N801
        wire = "fp16"

    class bf16:  # noqa: N801
        wire = "bf16"


# ---- process information ---------------------------------------------------------------------

def init(comm=None):
    """Initialize (idempotent). `comm` may be an mpi4py communicator, as in Horovod."""
    return _comm.init(comm)


def shutdown():
    pass  # MPI is finalized at exit by mpi4py


def is_initialized() -> bool:
    return _comm.is_initialized()


def size() -> int:
    return _comm.world().size


def rank() -> int:
    return _comm.world().rank


def local_size() -> int:
    return _comm.world().local_size


def local_rank() -> int:
    return _comm.world().local_rank


def cross_size() -> int:
    return _comm.world().num_nodes


def cross_rank() -> int:
    return _comm.world().node_rank


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def mpi_threads_supported() -> bool:
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def cuda_built() -> bool:
    import mpidist._C as ext
    return bool(ext.built_with_cuda)


def join(device=-1):
    raise NotOfferedError("hvd.join() is not offered: give every rank the same number of batches "
                          "(mpidist.data.ShardedSampler pads or drops to even shards)")


class _Elastic:
    def __getattr__(self, name):
        raise NotOfferedError("Horovod elastic training is not offered by mpidist")


elastic = _Elastic()


# ---- collectives -----------------------------------------------------------------------------

def _scaled(tensor, factor):
    if factor != 1.0:
        tensor.mul_(factor)


def _allreduce_into(tensor, op, compression, prescale_factor, postscale_factor):
    _scaled(tensor, prescale_factor)
    wire_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(getattr(compression, "wire", None))
    if wire_dtype is not None and tensor.is_floating_point() and tensor.dtype != wire_dtype:
        wire = tensor.to(wire_dtype)
        _comm.world().allreduce(wire, op=op)
        tensor.copy_(wire)
    else:
        _comm.world().allreduce(tensor, op=op)
    _scaled(tensor, postscale_factor)
    return tensor


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=None, compression=Compression.none):
    _no_process_sets(process_set)
    return _allreduce_into(tensor, _op(op, average), compression, prescale_factor, postscale_factor)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """A new tensor holding the reduction of `tensor` over all ranks (average by default)."""
    _no_process_sets(process_set)
    return _allreduce_into(tensor.detach().clone().contiguous(), _op(op, average), compression,
                           prescale_factor, postscale_factor)


class _Handle:
    def __init__(self, handle, result, finish=None):
        self.handle, self.result, self.finish = handle, result, finish


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None):
    _no_process_sets(process_set)
    _scaled(tensor, prescale_factor)
    handle = _comm.world().allreduce_async(tensor, op=_op(op, average))
    return _Handle(handle, tensor, lambda t: _scaled(t, postscale_factor))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None):
    return allreduce_async_(tensor.detach().clone().contiguous(), average, name, op, prescale_factor,
                            postscale_factor, process_set)


def poll(handle) -> bool:
    return handle.handle.done()


def synchronize(handle):
    """Wait for an asynchronous operation; returns its result tensor."""
    handle.handle.wait()
    if handle.finish is not None:
        handle.finish(handle.result)
    return handle.result


def broadcast_(tensor, root_rank, name=None, process_set=None):
    _no_process_sets(process_set)
    return _comm.world().broadcast(tensor, root=root_rank)


def broadcast(tensor, root_rank, name=None, process_set=None):
    return broadcast_(tensor.detach().clone().contiguous(), root_rank, name, process_set)


class _DoneHandle:
    """Broadcast and allgather complete before returning; the handle only carries the result."""

    def __init__(self, result):
        self.result = result

    def done(self):
        return True

    def wait(self):
        return self.result


def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    return _Handle(_DoneHandle(broadcast_(tensor, root_rank, name, process_set)), tensor)


def broadcast_async(tensor, root_rank, name=None, process_set=None):
    result = broadcast(tensor, root_rank, name, process_set)
    return _Handle(_DoneHandle(result), result)


def allgather(tensor, name=None, process_set=None):
    _no_process_sets(process_set)
    return _comm.world().allgather(tensor.detach().contiguous())


def allgather_async(tensor, name=None, process_set=None):
    result = allgather(tensor, name, process_set)
    return _Handle(_DoneHandle(result), result)


def reducescatter(tensor, name=None, op=Average, process_set=None):
    _no_process_sets(process_set)
    return _comm.world().reduce_scatter(tensor.detach().contiguous(), op=_op(op))


def broadcast_parameters(params, root_rank=0):
    """Broadcast a state_dict or an iterable of (name, tensor) from `root_rank`, in place."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    with torch.no_grad():
        for _, tensor in items:
            if isinstance(tensor, torch.Tensor):
                broadcast_in_place(_comm.world(), tensor.data, root_rank)


def broadcast_optimizer_state(optimizer, root_rank=0):
    """Broadcast the optimizer's state tensors and hyperparameters from `root_rank`.

    Ranks that have no state yet (no step taken) get zero-initialized state of the root's
    layout; hyperparameters travel as JSON, never pickled.
    """
    state = optimizer.state_dict()
    groups = broadcast_object([{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
                              root_rank)
    layout = broadcast_object({str(index): {name: [list(value.shape), str(value.dtype).replace("torch.", "")]
                                            for name, value in entries.items() if isinstance(value, torch.Tensor)}
                               for index, entries in state["state"].items()}, root_rank)
    scalars = broadcast_object({str(index): {name: value for name, value in entries.items()
                                             if not isinstance(value, torch.Tensor)}
                                for index, entries in state["state"].items()}, root_rank)
    new_state = {}
    for index, tensors in layout.items():
        entries = dict(scalars.get(index, {}))
        current = state["state"].get(int(index), {})
        for name, (shape, dtype) in tensors.items():
            tensor = current.get(name)
            if tensor is None or list(tensor.shape) != shape:
                tensor = torch.zeros(shape, dtype=getattr(torch, dtype))
            entries[name] = broadcast_(tensor.contiguous(), root_rank)
        new_state[int(index)] = entries
    for group, settings in zip(state["param_groups"], groups):
        group.update(settings)
    state["state"] = new_state
    optimizer.load_state_dict(state)


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Broadcast a JSON-serializable object (mpidist never unpickles received data)."""
    _no_process_sets(process_set)
    world = _comm.world()
    if world.rank == root_rank:
        try:
            payload = json.dumps(obj).encode()
        except TypeError as exc:
            raise InvalidArgumentError(f"broadcast_object sends JSON only (no pickle): {exc}") from exc
        data = np.frombuffer(payload, dtype=np.uint8).copy()
        length = np.array([len(data)], dtype=np.int64)
    else:
        length = np.zeros(1, dtype=np.int64)
    world.broadcast(length, root=root_rank)
    if world.rank != root_rank:
        data = np.empty(int(length[0]), dtype=np.uint8)
    world.broadcast(data, root=root_rank)
    return json.loads(data.tobytes().decode())


# ---- DistributedOptimizer --------------------------------------------------------------------

class _DistributedOptimizer:
    """Mixed into the wrapped optimizer's class: gradients are all-reduced in buckets during
    backward (after `backward_passes_per_step` passes) and waited for in step()/synchronize()."""

    def _setup_distributed(self, named_parameters, compression, backward_passes_per_step, op,
                           gradient_predivide_factor):
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            names = [n for n, _ in named]
            if len(set(names)) != len(names):
                raise InvalidArgumentError("named_parameters contains duplicate names")
            known = {id(p) for _, p in named}
            missing = [i for i, p in enumerate(params) if id(p) not in known]
            if missing:
                raise InvalidArgumentError(f"named_parameters does not name optimizer parameters {missing}")
        op = _op(op)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise InvalidArgumentError("gradient_predivide_factor needs op=hvd.Average")
        self._buckets = GradientBuckets(trainable_parameters(params), _comm.world(),
                                        compression=getattr(compression, "wire", None), op=op,
                                        predivide=gradient_predivide_factor,
                                        passes_per_step=backward_passes_per_step)
        self._skip_sync = False
        register_gradient_hooks(self._buckets, "gradient_ready", trainable_parameters(params))

    def synchronize(self):
        """Wait for the gradients' all-reduces (call before clipping gradients, then step()
        inside skip_synchronize())."""
        self._buckets.wait()

    @contextlib.contextmanager
    def skip_synchronize(self):
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure=None):
        if not self._skip_sync:
            self.synchronize()
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._buckets.active:
            raise MpidistError("zero_grad() called while gradients are being all-reduced; call "
                               "step() or synchronize() first")
        return super().zero_grad(set_to_none=set_to_none)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None):
    """Wrap a torch optimizer the way horovod.torch.DistributedOptimizer does."""
    _no_process_sets(process_set)
    if num_groups or groups:
        raise NotOfferedError("grouped all-reduce (num_groups/groups) is not offered; mpidist buckets "
                              "gradients automatically")
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    distributed = cls.__new__(cls)
    distributed.__dict__.update(optimizer.__dict__)
    distributed._setup_distributed(named_parameters, compression, backward_passes_per_step, op,
                                   gradient_predivide_factor)
    return distributed
