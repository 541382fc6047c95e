"""The public collective calls: allreduce, broadcast, allgather, reduce_scatter, barrier, and
the asynchronous forms (allreduce_async, broadcast_async, allgather_async, reduce_scatter_async).

Each call checks its arguments on this rank (a refusal still joins the call check, so the other
ranks fail at once), then runs in order on its channel (engine.in_order): it resolves the route
of its buffer (routes.py: staged, or in GPU memory) and checks the buffer's GPU for it, the ranks
agree on the call (callcheck.py), and the route runs the collective.
The asynchronous forms check their arguments at the call and queue the rest on the
communicator's engine (engine.py), whose thread runs them in submission order. Each run is a
span in torch.profiler's trace and on the timeline while either records (runtime/tracing.py).
"""
from __future__ import annotations

import numpy as np

from .. import buffers
from ..buffers import DTYPES, BufferInfo
from ..errors import InvalidArgumentError, MpidistError
from ..runtime.deadlines import wait_for_collective
from ..runtime.mpi import MPI
from ..runtime.tracing import traced
from .callcheck import (
    BARRIER_SIGNATURE,
    OPS,
    check_algorithm,
    check_op,
    check_root,
    check_same_call,
    checked_here,
    checked_in_order,
    join_call_check,
    resolve_algorithm,
    share_refusal,
    signature,
    window_for_checks,
)
from .common import COLLECTIVES, split_counts
from .engine import Handle, in_order
from .registry import ALGORITHMS
from .routes import route_for
from .staging import copy_buffer


def allreduce(comm, array, op="sum", algorithm="auto", out=None, shape=None):
    """All-reduce `array` across the communicator; in place unless `out` is given. Returns the result.
    The ranks' arrays must agree in count; with `shape` (a shape, or a tuple of shapes) the ranks
    must pass equal ones too (hvd's calls: Horovod refuses tensors of different shapes)."""
    return checked_in_order(comm, lambda: prepare_allreduce(array, op, algorithm, out),
                            lambda channel, target, target_info, source_info:
                            _run_allreduce(channel, target, target_info, op, algorithm, source_info, shape))


def prepare_allreduce(array, op, algorithm, out):
    """Check the arguments locally. Returns the buffer to reduce and its description, and with
    `out` the input's description (to be copied into `out` first; None in place)."""
    info = buffers.describe(array)
    check_op(op, info.dtype)
    check_algorithm(algorithm)
    if out is None:
        buffers.check_writable(array, "allreduce writes its result into the array (in place; or pass out=)")
        return array, info, None
    out_info = buffers.describe(out)
    buffers.check_writable(out, "allreduce writes its result into out=")
    if (out_info.count, out_info.dtype, out_info.device) != (info.count, info.dtype, info.device):
        raise InvalidArgumentError(
            f"out= must match the input: input has {info.count} x {info.dtype} on {info.device}, "
            f"out has {out_info.count} x {out_info.dtype} on {out_info.device}")
    return out, out_info, info


@traced("mpidist.allreduce", "ALLREDUCE")
def _run_allreduce(comm, array, info, op, algorithm, source_info=None, shape=None):
    """All-reduce `array` (described by `info`); with `source_info`, copy that input into it
    first, once the ranks have agreed on the call, so a refused call leaves out= untouched."""
    # The signature carries the algorithm this rank will run, not the one asked for: ranks with
    # different MPIDIST_ALLREDUCE_ALGORITHM (or tuning tables) would otherwise pass the check
    # and then run algorithms whose messages do not match.
    name, route = _route(comm, info, "allreduce", algorithm)
    if comm.check_calls:
        check_same_call(comm, comm.mpi, signature("allreduce", info, op, name, row_shape=shape), shape)
    if source_info is not None:
        copy_buffer(info, source_info)
    route.allreduce(comm, array, info, op, name)
    window_for_checks(comm)
    return array


def _route(comm, info, collective, algorithm=None):
    """(the all-reduce algorithm `algorithm` resolves to, or None for the other collectives; the
    route of `info`), its GPU checked for the route. A refusal is shared with the call check
    before it is raised: the other ranks would otherwise go on into the route and wait there for
    this rank until MPIDIST_TIMEOUT."""
    try:
        name = None if algorithm is None else resolve_algorithm(algorithm, info, comm)
        route = route_for(info, name)
        route.check_gpu(comm, info, collective)
    except MpidistError:
        share_refusal(comm)
        raise
    return name, route


def broadcast(comm, array, root=0):
    """Broadcast `root`'s array into every rank's array, in place. Returns the array."""
    return checked_in_order(comm, lambda: _check_broadcast(comm, array, root), _broadcast)


def _check_broadcast(comm, array, root):
    info = buffers.describe(array)
    root = check_root(root, comm.size)
    if comm.rank != root:  # the root's array is only read
        buffers.check_writable(array, f"broadcast writes root {root}'s data into rank {comm.rank}'s array")
    return array, info, root


@traced("mpidist.broadcast", "BROADCAST")
def _broadcast(comm, array, info, root):
    _, route = _route(comm, info, "broadcast")
    check_same_call(comm, comm.mpi, signature("broadcast", info, root=root))
    route.broadcast(comm, array, info, root)
    return array


def allgather(comm, array):
    """Concatenate every rank's array along the first dimension (ranks may differ in that
    dimension, as in Horovod). Returns a new array of the same kind and device."""
    return checked_in_order(comm, lambda: (array, buffers.describe(array)), _allgather)


def _allgather_signature(collective, array, info):
    """The first dimension may differ, so the count is not part of the check; the row shape is."""
    row_shape = tuple(array.shape)[1:]
    return signature(collective, BufferInfo(0, 0, info.dtype, info.device, info.kind), row_shape=row_shape), row_shape


@traced("mpidist.allgather", "ALLGATHER")
def _allgather(comm, array, info):
    shape = tuple(array.shape)
    rows = shape[0] if shape else 1
    fields, row_shape = _allgather_signature("allgather", array, info)
    row_elements = int(np.prod(row_shape)) if row_shape else 1
    _, route = _route(comm, info, "allgather")
    check_same_call(comm, comm.mpi, fields, row_shape)
    all_rows = np.empty(comm.size, dtype=np.int64)
    comm.mpi.Allgather([np.array([rows], dtype=np.int64), MPI.INT64_T], [all_rows, MPI.INT64_T])
    total = int(all_rows.sum())
    out = buffers.new_array(array, (total,) + row_shape if shape else (total,))
    offsets = np.concatenate([[0], np.cumsum(all_rows)[:-1]]) * row_elements
    chunks = [(int(o), int(r) * row_elements) for o, r in zip(offsets, all_rows)]
    route.allgather(comm, array, info, out, chunks)
    return out


def reduce_scatter(comm, array, op="sum"):
    """Reduce across ranks and give rank r the r-th block of rows of the result (the first
    rows % p ranks get one extra row). The input is left unchanged. Returns a new array."""
    return checked_in_order(comm, lambda: _check_reduce_scatter(array, op), _reduce_scatter)


def _check_reduce_scatter(array, op):
    info = buffers.describe(array)
    check_op(op, info.dtype)
    return array, info, op


def _reduce_scatter_signature(collective, array, info, op):
    # The row shape too: ranks with equal counts but different rows would cut the blocks
    # differently (a truncated message, wrong sums or a hang).
    row_shape = tuple(array.shape)[1:]
    return signature(collective, info, op, row_shape=row_shape), row_shape


@traced("mpidist.reduce_scatter", "REDUCESCATTER")
def _reduce_scatter(comm, array, info, op):
    shape = tuple(array.shape)
    rows = shape[0] if shape else 1
    row_elements = info.count // rows if rows else 0
    _, route = _route(comm, info, "reduce_scatter")
    check_same_call(comm, comm.mpi, *_reduce_scatter_signature("reduce_scatter", array, info, op))
    chunks = [(o * row_elements, c * row_elements) for o, c in split_counts(rows, comm.size)]
    my_rows = split_counts(rows, comm.size)[comm.rank][1]
    out = buffers.new_array(array, (my_rows,) + shape[1:] if shape else (my_rows,))
    route.reduce_scatter(comm, array, info, out, chunks, op)
    return out


def join_round(comm) -> bool:
    """One round of a rank waiting in join, on its channel (engine.in_order): it meets the other
    ranks' next call check (join_call_check) and takes part with zeros in their all-reduce that
    sums or averages (starting its engine with them at their first asynchronous one), as
    Horovod's joined ranks do; anything else the others raise at, and it waits on. True once
    every rank has joined."""
    called = join_call_check(comm)
    if called is None:
        return True
    if called.get("collective") == COLLECTIVES.index("first allreduce_async"):
        comm.async_engine()
    elif called:
        info = BufferInfo(0, called["count"], DTYPES[called["dtype"]], "cpu", "numpy")
        zeros = np.zeros(info.nbytes, dtype=np.uint8)  # all-zero bytes: zero in every dtype
        info = info._replace(ptr=zeros.ctypes.data)
        name = ALGORITHMS[called["algorithm"]]
        route_for(info, name).allreduce(comm, zeros, info, OPS[called["op"]], name)
        window_for_checks(comm)  # as the others do after their all-reduce (_run_allreduce)
    return False


def barrier(comm) -> None:
    """Wait until every rank has called barrier(), in order behind the communicator's queued
    asynchronous collectives, with the deadline (MPIDIST_TIMEOUT). With the call check on, the
    check is the barrier (its allgather completes on no rank before every rank has entered it),
    so a rank that called another collective meanwhile makes every rank raise at once."""
    in_order(comm, _barrier)


@traced("mpidist.barrier", "BARRIER")
def _barrier(comm) -> None:
    if comm.check_calls:
        check_same_call(comm, comm.mpi, BARRIER_SIGNATURE)
    else:
        wait_for_collective(comm.mpi.Ibarrier(), comm.mpi, what="barrier")


# ---- asynchronous collectives: queued on the communicator's engine (engine.py) -------------------

def _async_engine(comm, first_call: dict, row_shape=None):
    """The communicator's asynchronous engine. The first asynchronous call starts it, which
    duplicates the communicator, a collective on it: the ranks check first (signature
    `first_call`) that every one of them is starting it with the same call, not running another
    collective there (whose messages would cross the duplication's own)."""
    if comm._engine is None and comm.check_calls:
        check_same_call(comm, comm.mpi, first_call, row_shape)
    return comm.async_engine()


def allreduce_async(comm, array, op="sum", algorithm="auto", out=None, shape=None) -> Handle:
    target, target_info, source_info, name = checked_here(
        comm, lambda: _prepare_allreduce_async(comm, array, op, algorithm, out))
    engine = _async_engine(comm, signature("first allreduce_async", target_info, op, name))
    if source_info is not None:
        # Copied now, as the call returns: the caller may reuse the input at once.
        copy_buffer(target_info, source_info)
    return engine.submit("allreduce_async",
                         lambda eng: _run_allreduce(eng, target, target_info, op, algorithm, shape=shape))


def _prepare_allreduce_async(comm, array, op, algorithm, out):
    target, target_info, source_info = prepare_allreduce(array, op, algorithm, out)
    return target, target_info, source_info, resolve_algorithm(algorithm, target_info, comm)


def broadcast_async(comm, array, root=0) -> Handle:
    """broadcast, run in the background: the handle's wait() returns the array (written in
    place on every rank but the root). The array must not be used until then."""
    array, info, root = checked_here(comm, lambda: _check_broadcast(comm, array, root))
    engine = _async_engine(comm, signature("first broadcast_async", info, root=root))
    return engine.submit("broadcast_async", lambda eng: _broadcast(eng, array, info, root))


def allgather_async(comm, array) -> Handle:
    """allgather, run in the background: the handle's wait() returns the new array. The input
    must not change until then."""
    array, info = checked_here(comm, lambda: (array, buffers.describe(array)))
    engine = _async_engine(comm, *_allgather_signature("first allgather_async", array, info))
    return engine.submit("allgather_async", lambda eng: _allgather(eng, array, info))


def reduce_scatter_async(comm, array, op="sum") -> Handle:
    """reduce_scatter, run in the background: the handle's wait() returns this rank's block. The
    input must not change until then."""
    array, info, op = checked_here(comm, lambda: _check_reduce_scatter(array, op))
    engine = _async_engine(comm, *_reduce_scatter_signature("first reduce_scatter_async", array, info, op))
    return engine.submit("reduce_scatter_async", lambda eng: _reduce_scatter(eng, array, info, op))
