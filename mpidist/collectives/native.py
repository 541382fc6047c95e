"""The MPI library's own MPI_Allreduce, as a peer to compare with and as a fallback.

MPI has no float16/bfloat16 reductions, so for those this takes the route a user would:
upcast to float32, MPI_Allreduce, round back (the rounding happens once, at the end).
"""
from __future__ import annotations

from mpi4py import MPI

from .. import kernels
from ..buffers import BufferInfo
from .common import Context

MPI_TYPES = {
    "float32": MPI.FLOAT, "float64": MPI.DOUBLE, "int32": MPI.INT32_T, "int64": MPI.INT64_T,
    "uint8": MPI.UINT8_T, "int8": MPI.INT8_T,
}
MPI_OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}
HALF_TYPES = ("float16", "bfloat16")


def native_allreduce(ctx: Context) -> None:
    info = ctx.info
    if info.count == 0:
        return
    if info.dtype in HALF_TYPES:
        wide = ctx.comm.scratch.get(BufferInfo(info.ptr, info.count, "float32", info.device, info.kind),
                                    info.count * 4, slot=7)
        kernels.cast_ptr(wide.ptr, "float32", info.ptr, info.dtype, info.count, device=info.device)
        _mpi_allreduce(ctx, wide)
        # op="avg": the cast back divides too, so the result is rounded once.
        scale = 1.0 / ctx.size if ctx.average else 1.0
        kernels.cast_ptr(info.ptr, info.dtype, wide.ptr, "float32", info.count, scale=scale, device=info.device)
        ctx.average = False
    else:
        _mpi_allreduce(ctx, info)


def _mpi_allreduce(ctx: Context, info: BufferInfo) -> None:
    memory = MPI.buffer.fromaddress(info.ptr, info.nbytes)
    ctx.mpi.Allreduce(MPI.IN_PLACE, [memory, info.count, MPI_TYPES[info.dtype]], MPI_OPS[ctx.op])
