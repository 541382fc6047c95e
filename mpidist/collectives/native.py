"""The MPI library's own MPI_Allreduce, as a peer to compare with and as a fallback.

MPI has no float16/bfloat16 reductions, so for those this takes the route a user would:
upcast to float32, MPI_Allreduce, round back (the rounding happens once, at the end).
"""
from __future__ import annotations

import functools

from .. import kernels
from ..buffers import BufferInfo
from ..runtime.mpi import MPI
from ..runtime.wire import HALF_DTYPES
from .common import Context

# MPI's datatypes and operations by mpidist's names, read from mpi4py at their first use
# (mpi_types(), mpi_ops()): importing the collectives must not start MPI.
MPI_TYPE_NAMES = {"float32": "FLOAT", "float64": "DOUBLE", "int32": "INT32_T", "int64": "INT64_T",
                  "uint8": "UINT8_T", "int8": "INT8_T"}
MPI_OP_NAMES = {"sum": "SUM", "min": "MIN", "max": "MAX", "prod": "PROD"}


@functools.cache
def mpi_types() -> dict:
    return {dtype: getattr(MPI, name) for dtype, name in MPI_TYPE_NAMES.items()}


@functools.cache
def mpi_ops() -> dict:
    return {op: getattr(MPI, name) for op, name in MPI_OP_NAMES.items()}


def native_allreduce(ctx: Context) -> None:
    info = ctx.info
    if info.count == 0:
        return
    if info.dtype in HALF_DTYPES:
        wide = ctx.comm.scratch.get(BufferInfo(info.ptr, info.count, "float32", info.device, info.kind),
                                    info.count * 4, slot=7)
        # op="avg": the cast back divides too, so the result is rounded once.
        scale = 1.0 / ctx.size if ctx.average else 1.0
        allreduce_through_float32(ctx.mpi, info.ptr, info.dtype, info.count, wide.ptr, mpi_ops()[ctx.op],
                                  scale, info.device)
        ctx.average = False
    else:
        _mpi_allreduce(ctx, info)


def allreduce_through_float32(mpi, ptr: int, dtype: str, count: int, wide_ptr: int, mpi_op, scale: float,
                              device: str = "cpu") -> None:
    """MPI_Allreduce of `count` float16/bfloat16 at `ptr` through float32 room at `wide_ptr`:
    upcast, reduce, and round back once (times `scale`)."""
    kernels.cast_ptr(wide_ptr, "float32", ptr, dtype, count, device=device)
    # On a GPU the casts are queued on a stream, and a CUDA-aware MPI reads the memory outside it.
    kernels.synchronize(device)
    mpi.Allreduce(MPI.IN_PLACE, [MPI.buffer.fromaddress(wide_ptr, count * 4), count, MPI.FLOAT], mpi_op)
    kernels.cast_ptr(ptr, dtype, wide_ptr, "float32", count, scale=scale, device=device)
    kernels.synchronize(device)


def _mpi_allreduce(ctx: Context, info: BufferInfo) -> None:
    memory = MPI.buffer.fromaddress(info.ptr, info.nbytes)
    ctx.mpi.Allreduce(MPI.IN_PLACE, [memory, info.count, mpi_types()[info.dtype]], mpi_ops()[ctx.op])
