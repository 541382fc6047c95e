"""The small-message fast path of all-reduce (Communicator.allreduce and the torch.distributed
backend try it first).

A small MPI_Allreduce takes about a microsecond, so every microsecond of Python in front of it
shows. Small CPU messages that the general path would hand to the MPI library anyway skip it
(buffer description, context, dispatch) and go straight to MPI_Allreduce; float16/bfloat16 take
the MPI route's float32 round trip through a scratch buffer kept for this. With the cross-rank
call check on, the general path runs: the check is a collective of its own.
"""
from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from .. import _C
from ..runtime.wire import FLOAT_DTYPES, HALF_DTYPES, ITEMSIZE
from . import native

FAST_OPS = dict(native.MPI_OPS, avg=MPI.SUM)
# The dtypes MPI reduces itself, and the half types it reduces through float32.
FAST_DTYPES = tuple(native.MPI_TYPES) + HALF_DTYPES


def fast_spec(name: str) -> tuple:
    """(MPI datatype, item size, our name): half types travel as float32."""
    return (MPI.FLOAT if name in HALF_DTYPES else native.MPI_TYPES[name], ITEMSIZE[name], name)


# The dtype objects of the array libraries -> fast_spec, so a call costs one dictionary lookup
# (NumPy has no bfloat16; the torch entries are made when torch is first seen).
FAST_NUMPY_TYPES = {np.dtype(name): fast_spec(name) for name in FAST_DTYPES if name != "bfloat16"}
FAST_TORCH_TYPES = {}


def fill_fast_torch_types(torch) -> None:
    for name in FAST_DTYPES:
        FAST_TORCH_TYPES[getattr(torch, name)] = fast_spec(name)


def small_cpu_allreduce(comm, array, op, algorithm) -> bool:
    """All-reduce a small contiguous CPU array with one MPI_Allreduce when that is where the
    general path would end up too. Returns False, having done nothing, otherwise (the general
    path then also gives the error messages). `comm` is the channel the call runs on: a
    Communicator without an asynchronous engine, or an engine (in order, engine.in_order)."""
    if comm.check_calls or comm._engine is not None or (algorithm != "auto" and algorithm != "mpi"):
        return False
    mpi_op = FAST_OPS.get(op)
    if mpi_op is None:
        return False
    kind = type(array)
    if kind is np.ndarray:
        spec = FAST_NUMPY_TYPES.get(array.dtype)
        flags = array.flags
        if spec is None or not flags.c_contiguous or not flags.writeable:  # the general path refuses
            return False
        nbytes = array.nbytes
    else:
        torch = sys.modules.get("torch")
        if torch is None or kind is not torch.Tensor and not isinstance(array, torch.Tensor):
            return False
        if not FAST_TORCH_TYPES:
            fill_fast_torch_types(torch)
        spec = FAST_TORCH_TYPES.get(array.dtype)
        if spec is None or not array.is_cpu or not array.is_contiguous():
            return False
        nbytes = array.numel() * spec[1]
    mpi_type, itemsize, name = spec
    half = name in HALF_DTYPES
    average = op == "avg"
    if nbytes == 0 or algorithm == "auto" and nbytes >= comm.fast_path_bounds[half] \
            or average and name not in FLOAT_DTYPES:  # the general path refuses an integer average
        return False
    count = nbytes // itemsize
    if not half:
        # mpi4py's buffer gives the address several times faster than NumPy's .ctypes.data, and
        # the scaling goes straight to the CPU kernel: the arguments are known good here.
        if kind is np.ndarray:
            message = MPI.buffer.frombuffer(array)
        else:
            message = MPI.buffer.fromaddress(array.data_ptr(), nbytes)
        comm.mpi.Allreduce(MPI.IN_PLACE, [message, mpi_type], mpi_op)
        if average:  # as finish_average does
            _C.scale(message.address, count, name, 1.0 / comm.size)
        return True
    wide = comm.fast_path_scratch
    if wide is None or wide.size < count:
        wide = comm.fast_path_scratch = np.empty(max(count, 1024), dtype=np.float32)
    native.allreduce_through_float32(comm.mpi, array.ctypes.data if kind is np.ndarray else array.data_ptr(),
                                     name, count, wide.ctypes.data, mpi_op, 1.0 / comm.size if average else 1.0)
    return True
