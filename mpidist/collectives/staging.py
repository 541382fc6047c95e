"""The staged route (routes.py): each collective's algorithm on the buffer where the algorithm can
read it (host memory; GPU memory where the MPI library reads it, and for the algorithms that work
on GPU memory only), else on a pinned host copy of it; and copies between described buffers.

Every buffer takes this route except the CUDA buffers of the device route (device_route.py),
which comes back here where it cannot keep them in GPU memory.
"""
from __future__ import annotations

import contextlib
import ctypes

from .. import buffers, kernels
from ..buffers import BufferInfo
from .broadcast import broadcast as broadcast_algorithm
from .common import TAGS, Context, finish_average, kernel_op
from .registry import ALLREDUCE, DEVICE_MEMORY_ALGORITHMS, HOST_MEMORY_ALGORITHMS
from .ring import allgather_ring, reduce_scatter_ring
from .select import table_choice


@contextlib.contextmanager
def staged(channel, array, info: BufferInfo, host_only: bool = False):
    """The buffer the algorithm should work on: the array itself, or a pinned host copy when
    the array lives on a GPU and the MPI library cannot read GPU memory (or the algorithm
    works in host memory only: `host_only`)."""
    if info.is_cuda and (host_only or not channel.is_cuda_aware()):
        host = channel.staging.stage_in(array, info)
        yield host
        channel.staging.stage_out(array, info, host)
        return
    if info.is_cuda:
        buffers.synchronize(array, info)
    yield info


def copy_buffer(dst: BufferInfo, src: BufferInfo) -> None:
    if src.nbytes == 0 or dst.ptr == src.ptr:
        return
    if src.is_cuda:
        kernels.copy_ptr(dst.ptr, src.ptr, src.nbytes, device=src.device)
        kernels.synchronize(src.device)
    else:
        ctypes.memmove(dst.ptr, src.ptr, src.nbytes)


# ---- the route's entry points: each runs once the ranks have agreed on the call --------------------

def allreduce(channel, array, info: BufferInfo, op: str, algorithm: str) -> None:
    """All-reduce `array` in place with `algorithm`: a name of ALLREDUCE, or "auto" (a CUDA buffer
    the device route could not keep in GPU memory): the table's choice."""
    if algorithm == "auto":
        algorithm = table_choice(channel, info)
    if info.is_cuda and algorithm not in DEVICE_MEMORY_ALGORITHMS:
        with staged(channel, array, info, host_only=algorithm in HOST_MEMORY_ALGORITHMS) as work:
            _reduce_with(ALLREDUCE[algorithm], channel, work, op)
        return
    if info.is_cuda:  # an algorithm of GPU memory, which runs after the caller's stream
        buffers.synchronize(array, info)
    _reduce_with(ALLREDUCE[algorithm], channel, info, op)  # host memory: the hot path, no context manager


def _reduce_with(algorithm, channel, info: BufferInfo, op: str) -> None:
    ctx = Context(channel, channel.mpi, info, op=kernel_op(op), tag=TAGS["allreduce"])
    ctx.average = op == "avg"
    algorithm(ctx)
    if ctx.average:  # the algorithm left the division to us
        finish_average(ctx, op)


def broadcast(channel, array, info: BufferInfo, root: int) -> None:
    with staged(channel, array, info) as work:
        broadcast_algorithm(Context(channel, channel.mpi, work, tag=TAGS["broadcast"]), root)


def allgather(channel, array, info: BufferInfo, out, chunks) -> None:
    """Every rank's `array` into `out` at its chunk (`chunks`: (offset, count) per rank, in elements)."""
    out_info = buffers.describe(out)
    with staged(channel, out, out_info) as work:
        own_offset = chunks[channel.rank][0]
        with staged(channel, array, info) as source:
            copy_buffer(BufferInfo(work.ptr + own_offset * work.itemsize, info.count, info.dtype,
                                   work.device, work.kind), source)
        allgather_ring(Context(channel, channel.mpi, work, tag=TAGS["allgather"]), chunks, rotation=-1)


def reduce_scatter(channel, array, info: BufferInfo, out, chunks, op: str) -> None:
    """This rank's chunk of the reduction of every rank's `array` into `out` (`chunks`: (offset,
    count) per rank, in elements); `array` is left unchanged."""
    work_copy = buffers.new_array(array, (info.count,))
    work_info = buffers.describe(work_copy)
    copy_buffer(work_info, info)
    with staged(channel, work_copy, work_info) as work:
        ctx = Context(channel, channel.mpi, work, op=kernel_op(op), tag=TAGS["reduce_scatter"])
        if channel.size > 1 and info.count:
            reduce_scatter_ring(ctx, chunks, rotation=-1)
        offset, count = chunks[channel.rank]
        finish_average(ctx, op, offset, count)
    out_info = buffers.describe(out)
    copy_buffer(out_info, BufferInfo(work_info.ptr + chunks[channel.rank][0] * info.itemsize, out_info.count,
                                     info.dtype, info.device, info.kind))
