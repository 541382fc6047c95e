"""algorithm="nccl": NCCL's own all-reduce of CUDA buffers, as a peer to measure ours against (as
"mpi" is on the CPU).

NCCL is the library runtime/nccl_library.py loads (MPIDIST_NCCL_LIBRARY, else the environment's;
2.30 or newer, where NCCL_MULTI_RANK_GPU_ENABLE=1 lets two ranks share one GPU). Rank 0 of the
group makes NCCL's unique id and broadcasts it over MPI, so NCCL starts wherever mpirun or srun
started the ranks, with no MASTER_ADDR (communicator_over; the NCCL lane between nodes,
gpu_lane.py, starts its communicators so too). One NCCL communicator per channel, made at its
first NCCL call on every rank and kept with the channel; it runs on the legacy default stream,
synchronized before returning.
"""
from __future__ import annotations

import numpy as np

from .. import kernels
from ..buffers import BufferInfo
from ..errors import InvalidArgumentError
from ..runtime import nccl_library
from ..runtime.mpi import load_mpi
from ..runtime.together import raise_together
from .common import Context

UNIQUE_ID_BYTES = nccl_library.UNIQUE_ID_BYTES
NCCL_DTYPES = {"float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16", "float32": "NCCL_FLOAT32",
               "float64": "NCCL_FLOAT64", "int32": "NCCL_INT32", "int64": "NCCL_INT64", "uint8": "NCCL_UINT8",
               "int8": "NCCL_INT8"}
NCCL_OPS = {"sum": "NCCL_SUM", "prod": "NCCL_PROD", "min": "NCCL_MIN", "max": "NCCL_MAX"}


def bindings():
    """The NCCL library (runtime/nccl_library.py), or None where there is none (problem() says why)."""
    try:
        return nccl_library.load()
    except InvalidArgumentError:
        return None


def version() -> int | None:
    """NCCL's version code (2.30.1 is 23001), None without NCCL."""
    nccl = bindings()
    return None if nccl is None else nccl.version


def check_usable(info: BufferInfo) -> None:
    """Refuse, with the reason, a buffer NCCL cannot reduce here."""
    if not info.is_cuda:
        raise InvalidArgumentError(f"algorithm='nccl' reduces GPU buffers only; this buffer is on {info.device}")
    problem = nccl_library.problem()
    if problem is not None:
        raise InvalidArgumentError(f"algorithm='nccl' needs NCCL: {problem}")
    if info.dtype not in NCCL_DTYPES:
        raise InvalidArgumentError(f"algorithm='nccl': NCCL has no {info.dtype}")


def encode_unique_id(unique_id) -> np.ndarray:
    """NCCL's unique id as CuPy gives it (bytes, or a tuple of 128 ints in older CuPy) in int64s
    for an MPI broadcast: its form first, then its 128 values."""
    if isinstance(unique_id, (bytes, bytearray)):
        return np.concatenate([[1], np.frombuffer(bytes(unique_id), dtype=np.int8).astype(np.int64)])
    return np.concatenate([[0], np.asarray(unique_id, dtype=np.int64)])


def decode_unique_id(encoded: np.ndarray):
    """The unique id in the form CuPy gave it, for NcclCommunicator."""
    values = encoded[1:]
    return values.astype(np.int8).tobytes() if encoded[0] == 1 else tuple(int(v) for v in values)


def communicator_over(mpi, device_index: int, what: str):
    """A new NCCL communicator of the ranks of mpi4py communicator `mpi` on GPU `device_index`
    (collective over `mpi`). Rank 0's failure to make the unique id, or NCCL refusing the
    communicator on any rank, is raised on every rank, naming `what`."""
    nccl = bindings()
    MPI = load_mpi()
    encoded, problem = np.zeros(1 + UNIQUE_ID_BYTES, dtype=np.int64), None
    if mpi.Get_rank() == 0:
        try:
            encoded[:] = encode_unique_id(nccl.get_unique_id())
        except Exception as error:  # raised on every rank below
            problem = error
    raise_together(mpi, problem, f"making NCCL's unique id for {what}")
    mpi.Bcast([encoded, MPI.INT64_T], root=0)
    made = None
    try:
        import cupy  # here: a rank without CuPy is named with the others
        with cupy.cuda.Device(device_index):
            made = nccl.NcclCommunicator(mpi.Get_size(), decode_unique_id(encoded), mpi.Get_rank())
    except Exception as error:  # NCCL's refusal comes to every rank; this names them all
        problem = error
    raise_together(mpi, problem, f"making the NCCL communicator for {what}")
    return made


def communicator(channel, device_index: int):
    """The channel's NCCL communicator, made at the first call (collective over the channel)."""
    if getattr(channel, "nccl_comm", None) is None:
        channel.nccl_comm = communicator_over(channel.mpi, device_index, "algorithm='nccl'")
    return channel.nccl_comm


def reduce_with(comm, info: BufferInfo, op: str) -> None:
    """CUDA buffer `info` all-reduced in place by NCCL communicator `comm` on the legacy default
    stream (op: a kernel op, not avg)."""
    import cupy
    with cupy.cuda.Device(info.device_index):
        comm.allReduce(info.ptr, info.ptr, info.count, getattr(nccl_library, NCCL_DTYPES[info.dtype]),
                       getattr(nccl_library, NCCL_OPS[op]), 0)


def nccl_allreduce(ctx: Context) -> None:
    """ctx.info (a CUDA buffer, in place) reduced by NCCL; op avg as a sum, then divided here."""
    info = ctx.info
    if ctx.size == 1 or info.count == 0:
        return
    reduce_with(communicator(ctx.comm, info.device_index), info, ctx.op)
    if ctx.average:
        kernels.scale_ptr(info.ptr, info.count, info.dtype, 1.0 / ctx.size, device=info.device)
        ctx.average = False
    kernels.synchronize(info.device)
