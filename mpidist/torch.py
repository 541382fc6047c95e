"""Horovod-compatible namespace: change `import horovod.torch as hvd` to
`import mpidist.torch as hvd` and a Horovod PyTorch script runs on mpidist's collectives.

Differences from Horovod are listed in README.md ("Horovod compatibility"); features that are
not offered (elastic training) raise NotOfferedError instead of misbehaving.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import gc
import inspect
import json
import os
import threading
import time
import warnings
import weakref

import numpy as np
import torch

from . import comm as _comm
from .errors import InvalidArgumentError, MismatchError, MpidistError, NotOfferedError
from .parallel.flat import tensors_by_kind
from .parallel.join import last_joiner
from .parallel.model_state import broadcast_in_place
from .parallel.reducer import (COMPRESSION_DTYPES, GradientBuckets, check_not_synchronized, register_gradient_hooks,
                               trainable_parameters)
from .parallel.sync_batchnorm import SyncBatchNorm  # noqa: F401  (hvd.SyncBatchNorm)
from .timeline import Timeline


# ---- reduction ops (Horovod's constants) -----------------------------------------------------
Average, Sum, Min, Max, Product = "avg", "sum", "min", "max", "prod"
Adasum = "adasum"


def _op(op, average=None, adasum_in=None):
    # Horovod's rule (handle_average_backwards_compatibility): `average` is the deprecated
    # spelling of `op`, and giving both is an error rather than one silently winning.
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        return Average if average is None or average else Sum
    if op == Adasum:
        if adasum_in is None:
            return op
        raise NotOfferedError(f"op=hvd.Adasum is offered by allreduce and DistributedOptimizer, not by {adasum_in}")
    if op not in (Average, Sum, Min, Max, Product):
        raise InvalidArgumentError(f"unknown op {op!r}; use hvd.Average, Sum, Min, Max or Product")
    return op


class ProcessSet:
    """A subset of the ranks running collectives of their own (Horovod's process sets), on an MPI
    sub-communicator. Give it a list of global ranks, or an mpi4py communicator this rank
    belongs to; register it with hvd.init(process_sets=[...]) or hvd.add_process_set(), in the
    same order on every rank, then pass process_set= to the operations. Only its ranks may call
    them; a broadcast's root_rank is a global rank of the set."""

    def __init__(self, ranks_or_comm):
        self.process_set_id = None
        self.ranks = None
        self.mpi_comm = None
        self._comm = None  # the mpidist Communicator of this rank's set, once registered
        if isinstance(ranks_or_comm, (list, tuple, range)):
            if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in ranks_or_comm):
                raise ValueError("ProcessSet takes a list of process ranks or an mpi4py communicator, got "
                                 f"{list(ranks_or_comm)!r}")
            self.ranks = sorted(int(r) for r in ranks_or_comm)
        elif isinstance(ranks_or_comm, _comm.load_mpi().Comm):
            self.mpi_comm = ranks_or_comm
        else:
            raise ValueError("ProcessSet takes a list of process ranks or an mpi4py communicator, got "
                             f"{type(ranks_or_comm).__name__}")

    def size(self) -> int:
        return len(self._registered().ranks)

    def rank(self) -> int:
        """This rank's position in the set (-1 outside it)."""
        return self._comm.rank if self._comm is not None else -1

    def included(self) -> bool:
        return self._comm is not None

    def _registered(self):
        if self.process_set_id is None:
            raise InvalidArgumentError(f"{self} is not registered: pass it to hvd.init(process_sets=[...]) or "
                                       "hvd.add_process_set() on every rank first")
        return self

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


class _GlobalProcessSet(ProcessSet):
    """Horovod's default process set: all ranks, on the world communicator."""

    def __init__(self):
        self.process_set_id = 0
        self.mpi_comm = None

    @property
    def ranks(self):
        return list(range(size())) if _comm.is_initialized() else []

    @property
    def _comm(self):
        return _comm.world()


global_process_set = _GlobalProcessSet()
_process_sets = {0: global_process_set}  # id -> registered ProcessSet
_registered_so_far = [0]  # ids are never reused, as Horovod's


def _comm_of(process_set):
    """The communicator that runs `process_set`'s operations on this rank."""
    if process_set is None or process_set is global_process_set:
        return _comm.world()
    if not isinstance(process_set, ProcessSet):
        raise InvalidArgumentError(f"process_set= takes an hvd.ProcessSet, got {type(process_set).__name__}")
    process_set._registered()
    if process_set._comm is None:
        raise InvalidArgumentError(f"rank {rank()} is not in {process_set}: only the ranks of a process set "
                                   "may call its operations")
    return process_set._comm


def _collective_comm(process_set):
    """_comm_of, for the collectives that ranks waiting in join() take no part in (all but the
    all-reduces): while the ranks still training know that some wait there, such a collective
    would wait for them until MPIDIST_TIMEOUT, so it is refused at once."""
    comm = _comm_of(process_set)
    waiting = _ranks_waiting_in_join(comm) if comm is _comm.world() else 0
    if waiting:
        raise MpidistError(f"{waiting} rank(s) ran out of data and wait in hvd.join(), where they take part only "
                           "in all-reduces and the DistributedOptimizer's gradient exchanges: run other "
                           "collectives before any rank joins, or after every rank has")
    return comm


def _root_in(process_set, root_rank) -> int:
    """A broadcast root given as a global rank, as its position in the process set."""
    if process_set is None or process_set is global_process_set:
        return root_rank
    if root_rank not in process_set.ranks:
        raise InvalidArgumentError(f"root_rank={root_rank} is not in {process_set}")
    return process_set.ranks.index(root_rank)


def _register(process_set: ProcessSet) -> ProcessSet:
    """Give `process_set` the next id and its sub-communicator. Collective over all ranks, which
    must register the same sets in the same order (checked, with the same error on every rank)."""
    world, mpi = _comm.world(), _comm.load_mpi()
    if process_set.process_set_id is not None:
        raise InvalidArgumentError(f"{process_set} is registered already")
    if process_set.mpi_comm is None:
        members = process_set.ranks
        problem = (None if members and len(set(members)) == len(members) and 0 <= members[0]
                   and members[-1] < world.size else
                   f"ProcessSet ranks {members} must be distinct ranks of 0..{world.size - 1}, at least one")
    else:
        group = process_set.mpi_comm.Get_group()
        members = sorted(mpi.Group.Translate_ranks(group, list(range(group.Get_size())), world.mpi.Get_group()))
        problem = None if mpi.UNDEFINED not in members else "a ProcessSet's communicator holds ranks outside the world"
    # Every rank's view of the set, so that every rank reaches the same verdict.
    mine = np.array(members if problem is None else [-1], dtype=np.int64)
    lengths = world.allgather(np.array([len(mine)], dtype=np.int64))
    everyone = world.allgather(mine)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    seen = [everyone[offsets[k]:offsets[k + 1]].tolist() for k in range(world.size)]
    if problem is not None:
        raise InvalidArgumentError(problem)
    if any(view == [-1] for view in seen):
        raise InvalidArgumentError(f"another rank refused its ProcessSet (ranks by rank: {seen})")
    if process_set.mpi_comm is None:
        if any(view != seen[0] for view in seen):
            raise MismatchError(f"ranks registered different process sets at the same point: {seen} by rank")
        sub = world.mpi.Split(0 if world.rank in members else mpi.UNDEFINED, key=world.rank)
    else:  # each rank's communicator: its members must all have passed the same one
        if any(seen[member] != view for view in seen for member in view):
            raise MismatchError(f"the ranks' ProcessSet communicators do not agree on their members: {seen} by rank")
        sub = process_set.mpi_comm
    process_set.ranks = members
    if sub != mpi.COMM_NULL:
        process_set._comm = _comm.Communicator(sub)  # a duplicate: the split below is freed here
        if process_set.mpi_comm is None:
            sub.Free()
    _registered_so_far[0] += 1
    process_set.process_set_id = _registered_so_far[0]
    _process_sets[process_set.process_set_id] = process_set
    return process_set


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of ranks) after init; every rank must call it,
    with the same sets in the same order. Returns the ProcessSet."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    return _register(process_set)


def remove_process_set(process_set) -> bool:
    """Unregister a process set and free its communicator (every rank, same order). False for the
    global one."""
    if process_set is global_process_set or process_set.process_set_id == 0:
        return False
    process_set._registered()
    _process_sets.pop(process_set.process_set_id, None)
    if process_set._comm is not None:
        process_set._comm.free()  # its own duplicate; a user's communicator stays the user's
    process_set.process_set_id, process_set._comm = None, None
    return True


class _Cast:
    """Horovod's compressor interface: compress(tensor) -> (tensor, ctx), decompress(tensor, ctx).
    `wire` is what mpidist's own all-reduces (DistributedOptimizer, allreduce) send: None, "fp16"
    or "bf16" (DataParallel's compression names)."""

    wire = None

    @classmethod
    def compress(cls, tensor):
        # As Horovod: only floating-point tensors are cast; ctx is the dtype to cast back to.
        if cls.wire is None or not tensor.dtype.is_floating_point:
            return tensor, None
        return tensor.to(COMPRESSION_DTYPES[cls.wire]), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Gradient compression for DistributedOptimizer and allreduce (Horovod's classes)."""

    class none(_Cast):  # noqa: N801 - Horovod's names
        wire = None

    class fp16(_Cast):  # noqa: N801
        wire = "fp16"

    class bf16(_Cast):  # noqa: N801
        wire = "bf16"


# ---- the timeline (Horovod's HOROVOD_TIMELINE, start_timeline and stop_timeline) ----------------

_timeline = None  # the Timeline this process writes, if any
_tracing = threading.local()  # .inside: a traced operation is running (its inner ones are not recorded)
_unnamed = collections.Counter()  # activity -> operations recorded without a name
_timeline_variable_read = False  # HOROVOD_TIMELINE is read by the first init()


def start_timeline(file_path, mark_cycles=False):
    """Record the collective operations in `file_path` (Chrome's trace format), replacing any
    timeline being written. As in Horovod, rank 0 writes it (every rank may call this). mpidist
    has no negotiation cycles, so mark_cycles adds nothing."""
    stop_timeline()
    if rank() == 0:
        global _timeline
        _timeline = Timeline(str(file_path))


def stop_timeline():
    """Finish the timeline file (also done at exit)."""
    global _timeline
    if _timeline is not None:
        _timeline.close()
        _timeline = None


atexit.register(stop_timeline)


def _traced(activity):
    """Record each call as a span of `activity` on the row of its `name=` (or a new
    "<activity>.noname.<n>" row); an asynchronous call's span ends when synchronize() sees it done."""
    def decorate(function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def traced(*args, **kwargs):
            if _timeline is None or getattr(_tracing, "inside", False):
                return function(*args, **kwargs)
            name = signature.bind(*args, **kwargs).arguments.get("name")
            if name is None:
                _unnamed[activity] += 1
                name = f"{activity.lower()}.noname.{_unnamed[activity]}"
            _tracing.inside = True
            start = time.perf_counter()
            try:
                result = function(*args, **kwargs)
            finally:
                _tracing.inside = False
            if isinstance(result, _Handle) and not isinstance(result.handle, _DoneHandle):
                result.trace = (str(name), activity, start)
            elif _timeline is not None:
                _timeline.span(str(name), activity, start, time.perf_counter())
            return result
        return traced
    return decorate


# ---- process information ---------------------------------------------------------------------

def init(comm=None, process_sets=None):
    """Initialize (idempotent). `comm` may be an mpi4py communicator, as in Horovod;
    `process_sets` a list of ProcessSet to register (in the same order on every rank) or
    "dynamic" (accepted: add_process_set works either way)."""
    world = _comm.init(comm)
    _homogeneous(world)  # collective: found here, where every rank calls, so the query is local
    global _timeline_variable_read
    if not _timeline_variable_read:  # once: a later init() must not restart a stopped timeline
        _timeline_variable_read = True
        path = os.environ.get("HOROVOD_TIMELINE", "")
        if path and path != "DYNAMIC":  # DYNAMIC: started later by start_timeline()
            start_timeline(path)
    if process_sets is not None and process_sets != "dynamic":
        for process_set in process_sets:
            if process_set.process_set_id is None:
                _register(process_set)
    return world


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


_homogeneity = {}  # Communicator -> bool


def _homogeneous(world) -> bool:
    if world not in _homogeneity:
        # Every node has the same number of ranks iff the largest and smallest local_size agree.
        extremes = np.array([world.local_size, -world.local_size], dtype=np.int64)
        world.allreduce(extremes, op="max")
        _homogeneity[world] = bool(extremes[0] == -extremes[1])
    return _homogeneity[world]


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks (found by init(); if mpidist was
    initialized without hvd.init(), the first call is a collective every rank must make)."""
    return _homogeneous(_comm.world())


@_traced("BARRIER")
def barrier(process_set=None):
    """Wait until every rank has called barrier()."""
    _collective_comm(process_set).barrier()


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


@_traced("JOIN")
def join(device=-1) -> int:
    """This rank has run out of data (Horovod's hvd.join()): until every rank has called join(),
    take part with zeros in the other ranks' gradient exchanges of the DistributedOptimizer and
    in their all-reduces over all ranks (they still average over every rank, as in Horovod; see
    the notes above _announce). Returns the rank that joined last (the highest of several joining
    at the same step)."""
    world = _comm.world()  # not _comm_of: the ranks still training call join() once others have
    if any(o._adasum_comm is world for o in _ADASUM_OPTIMIZERS):
        raise NotOfferedError("hvd.join() with a DistributedOptimizer(op=hvd.Adasum): a joined rank has no "
                              "change of its own to combine; use op=hvd.Average")
    live = _live_optimizer_buckets(world)
    if len(live) > 1:
        raise NotOfferedError(f"hvd.join() with {len(live)} live DistributedOptimizers: a joined rank could not "
                              "tell whose exchange comes next; join with one")
    exchanges = 0
    if live:
        buckets = live[0]
        if buckets.op not in ("avg", "sum"):
            raise NotOfferedError(f"hvd.join() with op={buckets.op!r}: a joined rank's zeros would change a "
                                  "minimum, maximum or product; use op=hvd.Average or hvd.Sum")
        buckets.check_idle()
        # The first ranks to join shadow the next exchange unannounced: it tells the others.
        if buckets.active_ranks < world.size or buckets.shadow():
            _take_part_while_joined(world, buckets)
        exchanges = buckets.restart_exchange_count()
        buckets.end_join()
    return last_joiner(world, exchanges)


# Ranks that have joined (run out of data) take part, with zeros, in what the ranks still
# training do over all ranks: the DistributedOptimizer's gradient exchanges and all-reduces, as in
# Horovod. The training ranks learn that a rank has joined from their next exchange, which the
# joined rank shadows unannounced (each exchange sums the count of ranks that bring gradients).
# From then on, until every rank has joined, the training ranks announce each of those
# operations before running it: one small all-reduce over all ranks, in which the joined ranks
# add zeros and each training rank adds 1 and what comes next (an exchange, or an all-reduce's
# size, dtype, op and device). When the sum of the 1s is 0, every rank has joined.

_NEXT_EXCHANGE, _NEXT_ALLREDUCE = 1, 2
_ANNOUNCED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                     torch.int16, torch.int32, torch.int64)
_ANNOUNCED_OPS = (Sum, Average)  # zeros change no sum; an average still divides by every rank
_ANNOUNCED_DEVICES = ("cpu", "cuda")


def _ranks_waiting_in_join(world) -> int:
    """How many ranks the last exchange of this rank's DistributedOptimizer over all ranks
    showed waiting in join() (0 on a rank that waits there itself: it resets the count)."""
    return max((world.size - b.active_ranks for b in _OPTIMIZER_BUCKETS if b.comm is world), default=0)


def _announce(world, fields):
    """One announcement (collective over all ranks): a training rank passes what comes next
    (a list of numbers), a joined rank None. Returns what the training ranks announced, or None
    once every rank has joined."""
    from mpi4py import MPI

    from .collectives.api import wait_with_deadline  # imported here: the collectives initialize MPI
    message = np.zeros(7, dtype=np.int64)
    if fields is not None:
        message[0], message[1:1 + len(fields)] = 1, fields
    wait_with_deadline(world.mpi.Iallreduce(MPI.IN_PLACE, message, op=MPI.SUM), world.mpi,
                       what="announcement to the ranks waiting in hvd.join()")
    training = int(message[0])
    if training == 0:
        return None
    if (message[1:] % training).any():
        raise MismatchError("the ranks still training announced different operations to the ranks waiting in "
                            "hvd.join(): every rank must run the same collectives in the same order")
    return (message[1:] // training).tolist()


def _announce_allreduce(comm, tensor, op, asynchronous, wire_dtype=None) -> None:
    """Before an all-reduce over all ranks (and before anything changes `tensor`, so that a
    refusal leaves it as it was): tell the ranks waiting in join() to take part. `wire_dtype`
    is the dtype the tensor is sent in, where compression changes it."""
    if comm is not _comm.world() or not _ranks_waiting_in_join(comm):
        return
    dtype = wire_dtype or tensor.dtype
    if op not in _ANNOUNCED_OPS or dtype not in _ANNOUNCED_DTYPES or tensor.device.type not in _ANNOUNCED_DEVICES:
        raise MpidistError(f"ranks wait in hvd.join() and take part in all-reduces with zeros: op={op!r} of a "
                           f"{dtype} tensor on {tensor.device.type} is not one they can join (sum or "
                           "average of a CPU or CUDA tensor of a standard dtype)")
    _announce(comm, [_NEXT_ALLREDUCE, tensor.numel(), _ANNOUNCED_DTYPES.index(dtype),
                     _ANNOUNCED_OPS.index(op), _ANNOUNCED_DEVICES.index(tensor.device.type), int(asynchronous)])


def _announce_exchange(buckets) -> None:
    """Before each gradient exchange of the DistributedOptimizer (GradientBuckets.before_exchange)."""
    if buckets.active_ranks < buckets.comm.size:
        _announce(buckets.comm, [_NEXT_EXCHANGE])


def _take_part_while_joined(world, buckets) -> None:
    """A joined rank's side: take part in what the training ranks announce until all have joined."""
    while (fields := _announce(world, None)) is not None:
        kind, numel, dtype, op, device, asynchronous = fields[:6]
        if kind == _NEXT_EXCHANGE:
            buckets.shadow()
        elif kind == _NEXT_ALLREDUCE:
            zeros = torch.zeros(numel, dtype=_ANNOUNCED_DTYPES[dtype], device=_ANNOUNCED_DEVICES[device])
            if asynchronous:
                world.allreduce_async(zeros, op=_ANNOUNCED_OPS[op]).wait()
            else:
                world.allreduce(zeros, op=_ANNOUNCED_OPS[op])
        else:
            raise MismatchError(f"rank {world.rank} waits in hvd.join() and was told of an operation it does "
                                f"not know ({fields})")


def _live_optimizer_buckets(comm) -> list:
    """The gradient buckets of the live DistributedOptimizers on `comm`."""
    live = [b for b in _OPTIMIZER_BUCKETS if b.comm is comm]
    if len(live) > 1:
        gc.collect()  # an optimizer the program dropped may only wait for the cycle collector
        live = [b for b in _OPTIMIZER_BUCKETS if b.comm is comm]
    return live


class _Elastic:
    def __getattr__(self, name):
        raise NotOfferedError("Horovod elastic training is not offered by mpidist")


elastic = _Elastic()


# ---- collectives -----------------------------------------------------------------------------
# allreduce, allgather, broadcast and alltoall are differentiable, as Horovod's (its
# HorovodAllreduce, HorovodAllgather, HorovodBroadcast and HorovodAlltoall autograd functions);
# the in-place and asynchronous variants are not, as in Horovod.

def _scaled(tensor, factor):
    if factor != 1.0:
        tensor.mul_(factor)


def _check_scale_factors(tensors, prescale_factor, postscale_factor):
    """Scale factors multiply in the tensor's own dtype, which torch refuses for integer tensors:
    refused here with the reason, before anything is sent."""
    if prescale_factor == 1.0 and postscale_factor == 1.0:
        return
    for tensor in tensors:
        if not tensor.is_floating_point():
            raise InvalidArgumentError(f"prescale_factor={prescale_factor} and postscale_factor={postscale_factor} "
                                       f"need floating-point tensors; got a {tensor.dtype} tensor")


def _wire_dtype(tensor, compression):
    """The dtype `compression` sends `tensor` in, or None to send it as it is."""
    wire_dtype = COMPRESSION_DTYPES.get(getattr(compression, "wire", None))
    if wire_dtype is not None and tensor.is_floating_point() and tensor.dtype != wire_dtype:
        return wire_dtype
    return None


def _allreduce_into(tensor, op, compression, prescale_factor, postscale_factor, comm):
    _check_scale_factors([tensor], prescale_factor, postscale_factor)
    wire_dtype = _wire_dtype(tensor, compression)
    _announce_allreduce(comm, tensor, op, asynchronous=False, wire_dtype=wire_dtype)
    _scaled(tensor, prescale_factor)
    wire = tensor.to(wire_dtype) if wire_dtype is not None else tensor
    if op == Adasum:
        comm.adasum_allreduce(wire)
    else:
        comm.allreduce(wire, op=op)
    if wire is not tensor:
        tensor.copy_(wire)
    _scaled(tensor, postscale_factor)
    return tensor


def _contiguous_copy(tensor):
    return tensor.detach().clone(memory_format=torch.contiguous_format)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, compression, prescale_factor, postscale_factor, comm):
        ctx.settings = (op, compression, prescale_factor, postscale_factor, comm)
        return _allreduce_into(_contiguous_copy(tensor), *ctx.settings)

    @staticmethod
    def backward(ctx, grad):
        op = ctx.settings[0]
        if op not in (Average, Sum):
            raise NotOfferedError(f"hvd.allreduce with op={op!r} has no gradient; only Average and Sum "
                                  "are differentiable (as in Horovod)")
        # Each rank's input enters every rank's output through the same linear map, so its
        # gradient is the same reduction (op and scale factors) of all ranks' output gradients.
        return _allreduce_into(_contiguous_copy(grad), *ctx.settings), None, None, None, None, None


# Horovod (since v0.22, PR #2687) averages the output gradients of allgather and broadcast over
# the ranks: every rank's loss counts 1/size, as in DistributedOptimizer's averaged gradients.
_GATHER_GRADIENT_OP = Average


def _combined_gradient(grad, comm):
    return _allreduce_into(_contiguous_copy(grad), _GATHER_GRADIENT_OP, Compression.none, 1.0, 1.0, comm)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, comm):
        ctx.shape, ctx.comm = tensor.shape, comm
        return comm.allgather(tensor.detach().contiguous())

    @staticmethod
    def backward(ctx, grad):
        world = ctx.comm
        combined = _combined_gradient(grad, world)
        rows = ctx.shape[0] if len(ctx.shape) else 1  # a 0-d tensor is gathered as one row
        all_rows = world.allgather(np.array([rows], dtype=np.int64))
        offset = int(all_rows[:world.rank].sum())
        return combined.narrow(0, offset, rows).reshape(ctx.shape), None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, comm):
        ctx.root, ctx.comm = root, comm
        return comm.broadcast(_contiguous_copy(tensor), root=root)

    @staticmethod
    def backward(ctx, grad):
        # Every rank's output is the root's input: the root's gradient combines all ranks'
        # output gradients; the other ranks' inputs were not used (zero gradient, as Horovod).
        combined = _combined_gradient(grad, ctx.comm)
        if ctx.comm.rank != ctx.root:
            combined.zero_()
        return combined, None, None


@_traced("ALLREDUCE")
def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=None, compression=Compression.none):
    return _allreduce_into(tensor, _op(op, average), compression, prescale_factor, postscale_factor,
                           _comm_of(process_set))


@_traced("ALLREDUCE")
def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """A new tensor holding the reduction of `tensor` over all ranks (average by default).
    Differentiable when `tensor` requires grad."""
    return _Allreduce.apply(tensor, _op(op, average), compression, prescale_factor, postscale_factor,
                            _comm_of(process_set))


class _Handle:
    """An asynchronous operation in flight. Its finishing step (postscale_factor) runs once, however
    often synchronize() is called on it."""

    def __init__(self, handle, result, finish=None):
        self.handle, self.result, self.finish = handle, result, finish
        self.finished = False
        self.trace = None  # (name, activity, start) while the timeline waits for its end


@_traced("ALLREDUCE")
def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None):
    comm = _comm_of(process_set)
    op = _op(op, average)
    _check_scale_factors([tensor], prescale_factor, postscale_factor)
    _announce_allreduce(comm, tensor, op, asynchronous=True)  # refused for Adasum
    _scaled(tensor, prescale_factor)
    if op == Adasum:  # runs at once, in order behind the asynchronous operations in flight
        comm.adasum_allreduce(tensor)
        return _Handle(_DoneHandle(tensor), tensor, lambda t: _scaled(t, postscale_factor))
    handle = comm.allreduce_async(tensor, op=op)
    return _Handle(handle, tensor, lambda t: _scaled(t, postscale_factor))


@_traced("ALLREDUCE")
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None):
    return allreduce_async_(_contiguous_copy(tensor), average, name, op, prescale_factor,
                            postscale_factor, process_set)


def poll(handle) -> bool:
    return handle.handle.done()


def synchronize(handle):
    """Wait for an asynchronous operation; returns its result tensor (the same one on every call)."""
    if not handle.finished:
        handle.handle.wait()
        if handle.finish is not None:
            handle.finish(handle.result)
        handle.finished = True
        if handle.trace is not None and _timeline is not None:
            name, activity, start = handle.trace
            finished = getattr(handle.handle, "finished", None)  # when the engine completed it
            _timeline.span(name, activity, start, finished or time.perf_counter())
        handle.trace = None
    return handle.result


@_traced("BROADCAST")
def broadcast_(tensor, root_rank, name=None, process_set=None):
    return _collective_comm(process_set).broadcast(tensor, root=_root_in(process_set, root_rank))


@_traced("BROADCAST")
def broadcast(tensor, root_rank, name=None, process_set=None):
    """A new tensor holding `root_rank`'s `tensor`. Differentiable when `tensor` requires grad."""
    comm = _collective_comm(process_set)
    return _Broadcast.apply(tensor, _root_in(process_set, root_rank), comm)


class _DoneHandle:
    """Broadcast and allgather complete before returning; the handle only carries the result."""

    def __init__(self, result):
        self.result = result

    def done(self):
        return True

    def wait(self):
        return self.result


@_traced("BROADCAST")
def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    return _Handle(_DoneHandle(broadcast_(tensor, root_rank, name, process_set)), tensor)


@_traced("BROADCAST")
def broadcast_async(tensor, root_rank, name=None, process_set=None):
    result = broadcast(tensor.detach(), root_rank, name, process_set)
    return _Handle(_DoneHandle(result), result)


@_traced("ALLGATHER")
def allgather(tensor, name=None, process_set=None):
    """Every rank's `tensor` concatenated along the first dimension (which may differ by rank).
    Differentiable when `tensor` requires grad."""
    return _Allgather.apply(tensor, _collective_comm(process_set))


@_traced("ALLGATHER")
def allgather_async(tensor, name=None, process_set=None):
    result = allgather(tensor.detach(), name, process_set)
    return _Handle(_DoneHandle(result), result)


@_traced("ALLREDUCE")
def sparse_allreduce_async(tensor, name=None, op=Average, process_set=None):
    """Horovod's all-reduce of a sparse COO tensor: every rank's indices and values gathered into
    one sparse tensor (duplicate indices left uncoalesced; they add up), the values divided by the
    rank count for op=Average. Returns a callable that gives the result, as Horovod's does."""
    op = _op(op, adasum_in="sparse_allreduce_async")
    if op not in (Average, Sum):
        raise InvalidArgumentError(f"sparse_allreduce_async takes op=hvd.Average or hvd.Sum, got {op!r}")
    if not tensor.is_sparse:
        raise InvalidArgumentError(f"sparse_allreduce_async takes a sparse COO tensor, got layout {tensor.layout}")
    comm = _collective_comm(process_set)
    shapes = comm.allgather(np.array([tensor.shape], dtype=np.int64))
    if (shapes != shapes[0]).any():
        raise MismatchError(f"sparse_allreduce_async: the ranks' tensors have different shapes "
                            f"{[tuple(row) for row in shapes.tolist()]} by rank")
    # allgather concatenates along the first dimension: the indices travel one row per element.
    indices = allgather(tensor._indices().t().contiguous(), name, process_set)
    values = allgather(tensor._values().contiguous(), name, process_set)
    if op == Average:
        values = values / comm.size
    result = torch.sparse_coo_tensor(indices.t(), values, tensor.shape)
    return lambda: result


def _reducescatter(tensor, op, compression, prescale_factor, postscale_factor, comm):
    """Rank r's block of rows of the reduction (the first rows % size ranks get one row more)."""
    _check_scale_factors([tensor], prescale_factor, postscale_factor)
    source = tensor.detach().contiguous()
    wire_dtype = _wire_dtype(source, compression)
    if prescale_factor != 1.0:
        source = source * prescale_factor
    if wire_dtype is not None:
        result = comm.reduce_scatter(source.to(wire_dtype), op=op).to(tensor.dtype)
    else:
        result = comm.reduce_scatter(source, op=op)
    _scaled(result, postscale_factor)
    return result


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, compression, prescale_factor, postscale_factor, comm):
        ctx.op, ctx.scale, ctx.shape, ctx.comm = op, prescale_factor * postscale_factor, tensor.shape, comm
        return _reducescatter(tensor, op, compression, prescale_factor, postscale_factor, comm)

    @staticmethod
    def backward(ctx, grad):
        if ctx.op not in (Average, Sum):
            raise NotOfferedError(f"hvd.reducescatter with op={ctx.op!r} has no gradient; only Average and Sum "
                                  "are differentiable (as in Horovod)")
        # Each input row enters only the output of the rank its block goes to, scaled: its
        # gradient is that rank's output gradient, scaled the same way (as allreduce's, the
        # gradient of the sum of the ranks' losses).
        gathered = ctx.comm.allgather(grad.detach().contiguous())
        _scaled(gathered, ctx.scale / ctx.comm.size if ctx.op == Average else ctx.scale)
        return gathered.reshape(ctx.shape), None, None, None, None, None


@_traced("REDUCESCATTER")
def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=None,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce `tensor` over the ranks and give rank r its r-th block of rows (the first
    rows % size ranks get one row more, as Horovod splits). Differentiable when `tensor`
    requires grad (op Average or Sum)."""
    return _Reducescatter.apply(tensor, _op(op, adasum_in="reducescatter"), compression, prescale_factor, postscale_factor,
                                _collective_comm(process_set))


@_traced("REDUCESCATTER")
def reducescatter_async(tensor, name=None, op=Average, process_set=None, prescale_factor=1.0,
                        postscale_factor=1.0):
    result = _reducescatter(tensor, _op(op, adasum_in="reducescatter"), Compression.none, prescale_factor, postscale_factor,
                            _collective_comm(process_set))
    return _Handle(_DoneHandle(result), result)


# ---- grouped collectives ---------------------------------------------------------------------
# Horovod's grouped_* operations run a list of tensors as one operation. Here an all-reduce of a
# group packs the tensors of each dtype and device into one buffer (one all-reduce per kind, in
# the order the kinds first appear, the same on every rank); allgather and reducescatter run per
# tensor. Results, differentiability and handles are Horovod's.

def _pack(members):
    return torch.cat([member.reshape(-1) for member in members])


def _unpack(flat, members):
    offset = 0
    for member in members:
        member.copy_(flat[offset:offset + member.numel()].view(member.shape))
        offset += member.numel()


def _check_group_allreduce(tensors, op, prescale_factor, postscale_factor):
    """What the all-reduce of one kind would refuse, checked for all of them before the first is
    sent (an in-place group is then left as it was)."""
    from .collectives.api import check_op  # imported here: the collectives initialize MPI
    _check_scale_factors(tensors, prescale_factor, postscale_factor)
    if op != Adasum:  # Adasum checks its dtypes itself
        for tensor in tensors:
            check_op(op, str(tensor.dtype).removeprefix("torch."))


def _grouped_allreduce_into(tensors, op, compression, prescale_factor, postscale_factor, comm):
    _check_group_allreduce(tensors, op, prescale_factor, postscale_factor)
    for members in tensors_by_kind(tensors):
        flat = _pack(members)
        _allreduce_into(flat, op, compression, prescale_factor, postscale_factor, comm)
        _unpack(flat, members)
    return list(tensors)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, settings, *tensors):
        ctx.settings = settings
        return tuple(_grouped_allreduce_into([_contiguous_copy(t) for t in tensors], *settings))

    @staticmethod
    def backward(ctx, *grads):
        op = ctx.settings[0]
        if op not in (Average, Sum):
            raise NotOfferedError(f"hvd.grouped_allreduce with op={op!r} has no gradient; only Average and Sum "
                                  "are differentiable (as in Horovod)")
        return (None, *_grouped_allreduce_into([_contiguous_copy(g) for g in grads], *ctx.settings))


def _check_group(tensors, what):
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise InvalidArgumentError(f"hvd.{what} takes a non-empty list of tensors")
    return tensors


@_traced("ALLREDUCE")
def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """New tensors holding the reductions of `tensors` (one operation per dtype and device).
    Differentiable when the tensors require grad."""
    tensors = _check_group(tensors, "grouped_allreduce")
    settings = (_op(op, average, "grouped_allreduce"), compression, prescale_factor, postscale_factor, _comm_of(process_set))
    return list(_GroupedAllreduce.apply(settings, *tensors))


@_traced("ALLREDUCE")
def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=None):
    tensors = _check_group(tensors, "grouped_allreduce_")
    return _grouped_allreduce_into(tensors, _op(op, average, "grouped_allreduce"), Compression.none, prescale_factor, postscale_factor,
                                   _comm_of(process_set))


class _GroupHandle:
    """Several asynchronous operations waited for together."""

    def __init__(self, handles):
        self.handles = handles

    def done(self):
        return all(handle.done() for handle in self.handles)

    def wait(self):
        for handle in self.handles:
            handle.wait()

    @property
    def finished(self):
        """When the last of them completed (perf_counter), once all have."""
        times = [handle.finished for handle in self.handles]
        return max(times) if times and None not in times else None


@_traced("ALLREDUCE")
def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None):
    comm = _comm_of(process_set)
    tensors = _check_group(tensors, "grouped_allreduce_async_")
    op = _op(op, average, "grouped_allreduce")
    _check_group_allreduce(tensors, op, prescale_factor, postscale_factor)
    handles, packed = [], []
    for members in tensors_by_kind(tensors):
        flat = _pack(members)
        _announce_allreduce(comm, flat, op, asynchronous=True)
        _scaled(flat, prescale_factor)
        handles.append(comm.allreduce_async(flat, op=op))
        packed.append((flat, members))

    def finish(_result):
        for flat, members in packed:
            _scaled(flat, postscale_factor)
            _unpack(flat, members)

    return _Handle(_GroupHandle(handles), tensors, finish)


@_traced("ALLREDUCE")
def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None):
    tensors = _check_group(tensors, "grouped_allreduce_async")
    return grouped_allreduce_async_([_contiguous_copy(t) for t in tensors], average, name, op, prescale_factor,
                                    postscale_factor, process_set)


@_traced("ALLGATHER")
def grouped_allgather(tensors, name=None, process_set=None):
    return [allgather(t, name, process_set) for t in _check_group(tensors, "grouped_allgather")]


@_traced("ALLGATHER")
def grouped_allgather_async(tensors, name=None, process_set=None):
    result = grouped_allgather([t.detach() for t in _check_group(tensors, "grouped_allgather_async")],
                               name, process_set)
    return _Handle(_DoneHandle(result), result)


@_traced("REDUCESCATTER")
def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average, process_set=None,
                          prescale_factor=1.0, postscale_factor=1.0):
    tensors = _check_group(tensors, "grouped_reducescatter")
    _check_scale_factors(tensors, prescale_factor, postscale_factor)  # all of them before the first is sent
    return [reducescatter(t, name, compression, op, process_set, prescale_factor, postscale_factor)
            for t in tensors]


@_traced("REDUCESCATTER")
def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=None, prescale_factor=1.0,
                                postscale_factor=1.0):
    result = grouped_reducescatter([t.detach() for t in _check_group(tensors, "grouped_reducescatter_async")],
                                   name, Compression.none, op, process_set, prescale_factor, postscale_factor)
    return _Handle(_DoneHandle(result), result)


def _alltoall(tensor, splits, world):
    """(received rows, received row counts by rank) for `tensor`'s first-dimension `splits` over
    the communicator `world`."""
    from mpi4py import MPI
    if tensor.dim() == 0:
        raise InvalidArgumentError("alltoall splits the first dimension: give a tensor of at least one dimension")
    rows = tensor.shape[0]
    if splits is None:
        if rows % world.size:
            raise InvalidArgumentError(f"alltoall without splits= divides the first dimension ({rows}) "
                                       f"evenly over the {world.size} ranks; pass splits=")
        send_rows = np.full(world.size, rows // world.size, dtype=np.int64)
    else:
        send_rows = np.array(splits.tolist() if isinstance(splits, torch.Tensor) else list(splits),
                             dtype=np.int64).reshape(-1)
        if len(send_rows) != world.size or (send_rows < 0).any() or send_rows.sum() != rows:
            raise InvalidArgumentError(f"alltoall splits={send_rows.tolist()} must give one row count >= 0 "
                                       f"per rank ({world.size}) summing to the first dimension ({rows})")
    # GPU tensors go through host memory: MPI reads plain CPU buffers here.
    source = tensor.detach().cpu().contiguous()
    row_shape = tuple(source.shape[1:])
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * source.element_size()

    def exchange(channel):
        # First the row counts, with each rank's row size and element size so that ranks whose
        # rows differ all raise (every rank then sees a value unlike its own) instead of
        # misreading each other's bytes.
        mine = np.stack([send_rows, np.full(world.size, row_bytes), np.full(world.size, source.element_size())],
                        axis=1)
        theirs = np.empty_like(mine)
        channel.mpi.Alltoall([mine, MPI.INT64_T], [theirs, MPI.INT64_T])
        if (theirs[:, 1:] != mine[:, 1:]).any():
            raise MismatchError(f"alltoall: ranks differ in row size or element size (bytes per row by rank "
                                f"{theirs[:, 1].tolist()}, element sizes {theirs[:, 2].tolist()}); every rank "
                                "must pass the same dtype and shape except the first dimension")
        received_rows = theirs[:, 0]
        output = torch.empty((int(received_rows.sum()),) + row_shape, dtype=source.dtype)
        if row_bytes:
            # Typed buffers (raw bytes counted in rows), never pickle.
            row = MPI.BYTE.Create_contiguous(row_bytes).Commit()
            try:
                send_offsets = np.concatenate([[0], np.cumsum(send_rows)[:-1]])
                receive_offsets = np.concatenate([[0], np.cumsum(received_rows)[:-1]])
                channel.mpi.Alltoallv(
                    [source.reshape(-1).view(torch.uint8).numpy(), (send_rows.tolist(), send_offsets.tolist()), row],
                    [output.reshape(-1).view(torch.uint8).numpy(),
                     (received_rows.tolist(), receive_offsets.tolist()), row])
            finally:
                row.Free()
        return output, received_rows

    output, received_rows = _comm.api().in_order(world, exchange)
    return output.to(tensor.device), torch.tensor(received_rows.tolist(), dtype=torch.int32)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, comm):
        output, received = _alltoall(tensor, splits, comm)
        ctx.received, ctx.comm = received, comm
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _received_grad):
        # The gradient of the rows this rank sent comes back from the ranks that received them.
        grad_input, _ = _alltoall(grad.contiguous(), ctx.received, ctx.comm)
        return grad_input, None, None


@_traced("ALLTOALL")
def alltoall(tensor, splits=None, name=None, process_set=None):
    """Send `splits[k]` rows of `tensor` (first dimension; equal parts without splits=) to rank k
    and return the rows received, in rank order. As in Horovod: with splits= the result is
    (tensor, received_splits), an int32 tensor of the row counts received from each rank.
    Differentiable when `tensor` requires grad."""
    output, received = _Alltoall.apply(tensor, splits, _collective_comm(process_set))
    return output if splits is None else (output, received)


@_traced("ALLTOALL")
def alltoall_async(tensor, splits=None, name=None, process_set=None):
    """As Horovod's: synchronize() returns (received rows, received splits), with or without splits=."""
    output, received = _alltoall(tensor.detach(), splits, _collective_comm(process_set))
    result = (output, received)
    return _Handle(_DoneHandle(result), result)


@_traced("BROADCAST")
def broadcast_parameters(params, root_rank=0):
    """Broadcast a state_dict or an iterable of (name, tensor) from `root_rank`, in place."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    world = _collective_comm(None)
    with torch.no_grad():
        for _, tensor in items:
            if isinstance(tensor, torch.Tensor):
                broadcast_in_place(world, tensor.data, root_rank)


@_traced("BROADCAST")
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


@_traced("BROADCAST")
def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Broadcast a JSON-serializable object (mpidist never unpickles received data, so values
    come back as JSON gives them: dict keys become strings, tuples lists)."""
    return _comm.broadcast_json(_collective_comm(process_set), obj, _root_in(process_set, root_rank), "broadcast_object")


@_traced("ALLGATHER")
def allgather_object(obj, name=None, process_set=None):
    """Every rank's JSON-serializable object, in a list by rank (JSON, as broadcast_object)."""
    world = _collective_comm(process_set)
    try:
        data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy()
        error = None
    except (TypeError, ValueError) as exc:
        data, error = np.empty(0, dtype=np.uint8), exc
    # A rank that cannot encode sends length -1, so that every rank raises instead of the
    # others waiting for its bytes.
    lengths = world.allgather(np.array([-1 if error else len(data)], dtype=np.int64))
    if (lengths < 0).any():
        failed = [k for k, length in enumerate(lengths) if length < 0]
        detail = f": {error}" if error else ""
        raise InvalidArgumentError(f"allgather_object sends JSON only (no pickle); rank(s) {failed} "
                                   f"passed an object JSON cannot encode{detail}") from error
    gathered = world.allgather(data)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [json.loads(gathered[offsets[k]:offsets[k + 1]].tobytes().decode()) for k in range(world.size)]


# ---- DistributedOptimizer --------------------------------------------------------------------

_OPTIMIZER_BUCKETS = weakref.WeakSet()  # of the live DistributedOptimizers, for join()


class _DistributedOptimizer:
    """Mixed into the wrapped optimizer's class: gradients are all-reduced in buckets during
    backward (after `backward_passes_per_step` passes) and waited for in step()/synchronize()."""

    def _setup_distributed(self, named_parameters, compression, backward_passes_per_step, op,
                           gradient_predivide_factor, groups, comm):
        params = [p for group in self.param_groups for p in group["params"]]
        labels = {id(p): f"param.{index}" for index, p in enumerate(params)}  # for the timeline
        if named_parameters is not None:
            named = list(named_parameters)
            names = [n for n, _ in named]
            if len(set(names)) != len(names):
                raise InvalidArgumentError("named_parameters contains duplicate names")
            known = {id(p) for _, p in named}
            missing = [i for i, p in enumerate(params) if id(p) not in known]
            if missing:
                raise InvalidArgumentError(f"named_parameters does not name optimizer parameters {missing}")
            labels.update((id(p), n) for n, p in named)
        op = _op(op)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise InvalidArgumentError("gradient_predivide_factor needs op=hvd.Average")
        trainable = trainable_parameters(params)
        check_not_synchronized(trainable, "DistributedOptimizer")
        self._buckets = GradientBuckets(trainable, comm, bucket_mb=_fusion_bucket_mb(),
                                        compression=getattr(compression, "wire", None), op=op,
                                        predivide=gradient_predivide_factor,
                                        passes_per_step=backward_passes_per_step,
                                        groups=_explicit_groups(groups, params, trainable))
        self._skip_sync = False
        register_gradient_hooks(self._buckets, "gradient_ready", trainable, "DistributedOptimizer")
        _OPTIMIZER_BUCKETS.add(self._buckets)
        self._buckets.before_exchange = _announce_exchange
        # The timeline's row of each bucket: "allreduce.<its parameters' names>".
        self._bucket_rows = ["allreduce." + "+".join(labels[id(p)] for p in bucket.params)
                             for bucket in self._buckets.buckets]

    def synchronize(self):
        """Wait for the gradients' all-reduces (call before clipping gradients, then step()
        inside skip_synchronize())."""
        timeline = _timeline
        if timeline is None:
            self._buckets.wait()
            return
        # On the timeline: each bucket's all-reduce from its launch during backward to its
        # completion, and the wait here on a row of its own.
        self._buckets.trace = spans = []
        start = time.perf_counter()
        try:
            self._buckets.wait()
        finally:
            self._buckets.trace = None
        timeline.span("DistributedOptimizer", "SYNCHRONIZE", start, time.perf_counter())
        for row, (began, ended) in zip(self._bucket_rows, spans):
            timeline.span(row, "ALLREDUCE", began, ended)

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


_ADASUM_OPTIMIZERS = weakref.WeakSet()  # of the live Adasum DistributedOptimizers, for join()


class _DistributedAdasumOptimizer:
    """Mixed into the wrapped optimizer's class with op=hvd.Adasum (Horovod's
    _DistributedAdasumOptimizer): each rank steps the wrapped optimizer on its own gradients, so
    its state (momentum, Adam's moments) stays its own, and the parameters become the step's
    starting point plus the Adasum over the ranks of their changes, tensor by tensor. Gradients
    are not exchanged during backward; everything happens in step()."""

    def _setup_adasum(self, compression, comm):
        if comm.size & (comm.size - 1):
            raise InvalidArgumentError(
                f"DistributedOptimizer(op=hvd.Adasum) needs a power-of-two number of ranks (its pairs "
                f"form a binary tree); there are {comm.size}")
        params = trainable_parameters([p for group in self.param_groups for p in group["params"]])
        check_not_synchronized(params, "DistributedOptimizer")
        self._adasum_params = params
        self._adasum_comm = comm
        self._wire = COMPRESSION_DTYPES.get(getattr(compression, "wire", None))
        _ADASUM_OPTIMIZERS.add(self)

    def synchronize(self):
        pass  # as in Horovod: the changes are combined in step()

    def skip_synchronize(self):
        raise InvalidArgumentError("skip_synchronize() has no use with op=hvd.Adasum: the parameters' "
                                   "changes are combined in step(), after the local step")

    def step(self, closure=None):
        params = self._adasum_params
        start = {id(p): p.detach().clone() for p in params}
        result = super().step(closure)
        if self._adasum_comm.size == 1:
            return result
        began = time.perf_counter()
        self._combine_changes(params, start)
        if _timeline is not None:
            _timeline.span("DistributedOptimizer", "ADASUM", began, time.perf_counter())
        return result

    def _combine_changes(self, params, start):
        with torch.no_grad():
            for members in tensors_by_kind(params):
                change = _pack([p - start[id(p)] for p in members])
                wire = change.to(self._wire) if self._wire is not None and change.is_floating_point() else change
                self._adasum_comm.adasum_allreduce(wire, sizes=[p.numel() for p in members])
                if wire is not change:
                    change.copy_(wire)
                for param, part in zip(members, change.split([p.numel() for p in members])):
                    param.copy_(start[id(param)] + part.view_as(param))


def _fusion_bucket_mb() -> float:
    """Horovod's HOROVOD_FUSION_THRESHOLD (bytes) as the buckets' size in MB: unset, DataParallel's
    25; 0 (Horovod: no fusion), a bucket per gradient."""
    from .collectives.common import env_number  # imported here: the collectives initialize MPI
    threshold = env_number("HOROVOD_FUSION_THRESHOLD", 25 * 2 ** 20, minimum=0)
    return max(threshold, 1) / 2 ** 20  # a 1-byte bucket holds one gradient, however small


def _explicit_groups(groups, params, trainable) -> list:
    """Horovod's `groups`: a number n (the trainable parameters in optimizer order, cut into n runs
    of nearly equal length, as Horovod's split_list cuts them) or a list of lists of parameters.
    Each group is all-reduced as one bucket (GradientBuckets); parameters in no group, and every
    parameter when groups is None, are bucketed automatically. Frozen parameters are left out."""
    if groups is None:
        return []
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups <= 0:
            raise InvalidArgumentError(f"groups={groups}: pass a positive number of groups or a list of "
                                       "lists of parameters")
        quotient, remainder = divmod(len(trainable), groups)
        runs = [trainable[k * quotient + min(k, remainder):(k + 1) * quotient + min(k + 1, remainder)]
                for k in range(groups)]
        return [run for run in runs if run]
    if not isinstance(groups, (list, tuple)):
        raise InvalidArgumentError(f"groups must be a positive number or a list of lists of parameters, "
                                   f"got {type(groups).__name__}")
    known, trainable_ids, seen, result = {id(p) for p in params}, {id(p) for p in trainable}, set(), []
    for k, group in enumerate(groups):
        if not isinstance(group, (list, tuple)):
            raise InvalidArgumentError(f"groups[{k}] is a {type(group).__name__}; each group must be a list "
                                       "of parameters")
        for member in group:
            if not isinstance(member, torch.Tensor):
                raise InvalidArgumentError(f"groups[{k}] holds a {type(member).__name__}; groups must consist "
                                           "of torch.Tensor parameters")
            if id(member) in seen:
                raise InvalidArgumentError(f"groups[{k}]: a parameter can only appear once in groups")
            if id(member) not in known:
                raise InvalidArgumentError(f"groups[{k}] holds a tensor that is not a parameter of the "
                                           "wrapped optimizer")
            seen.add(id(member))
        members = [p for p in group if id(p) in trainable_ids]
        if members:
            result.append(members)
    return result


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None):
    """Wrap a torch optimizer the way horovod.torch.DistributedOptimizer does."""
    comm = _comm_of(process_set)
    adasum = _op(op) == Adasum
    if adasum and gradient_predivide_factor != 1.0:
        raise InvalidArgumentError("gradient_predivide_factor needs op=hvd.Average")
    if num_groups:
        warnings.warn("DistributedOptimizer: num_groups is the older name of groups (as in Horovod)",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    mixin = _DistributedAdasumOptimizer if adasum else _DistributedOptimizer
    cls = type(optimizer.__class__.__name__, (mixin, optimizer.__class__), {})
    distributed = cls.__new__(cls)
    distributed.__dict__.update(optimizer.__dict__)
    if adasum:
        distributed._setup_adasum(compression, comm)
    else:
        distributed._setup_distributed(named_parameters, compression, backward_passes_per_step, op,
                                       gradient_predivide_factor, groups, comm)
    return distributed
