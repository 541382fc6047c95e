"""The small-message fast path of all-reduce (Communicator.allreduce and the torch.distributed
backend try it first).

A small all-reduce takes microseconds, so every microsecond of Python in front of it shows.
Contiguous CPU messages whose route the general path would choose from the size alone skip it
(buffer description, context, dispatch): those it hands to the MPI library go straight to
MPI_Allreduce (float16/bfloat16 through the MPI route's float32 round trip, in a scratch buffer
kept for this), and those up to ONE_SHOT_BYTES (the default one-shot bound, which a tuned bound
may move: the window chooses one-shot or sliced) that it gives to the hierarchical all-reduce on
one node go straight into the node protocol (node_window.host_allreduce_on_node: one call into
the extension) once the window exists. With the cross-rank call check on, the check runs first,
as the general path's own round in that window (callcheck.compared_on_node) of a signature made
once per kind of call, and a one-shot message goes along in the same round (under "auto" also
one that would have gone to MPI); without the window (or across nodes) the general path runs.
"""
from __future__ import annotations

import sys

import numpy as np

from .. import _C
from ..buffers import BufferInfo
from ..runtime.mpi import MPI
from ..runtime.wire import FLOAT_DTYPES, HALF_DTYPES, ITEMSIZE
from . import native
from .callcheck import (
    call_check_name,
    compared_on_node,
    resolve_algorithm,
    settle_difference,
    signature,
    signature_header,
)
from .node_window import ONE_SHOT_BYTES, SIGNATURE_BYTES, host_allreduce_on_node

# The dtypes MPI reduces itself, and the half types it reduces through float32.
FAST_DTYPES = tuple(native.MPI_TYPE_NAMES) + HALF_DTYPES


def fast_spec(name: str) -> tuple:
    """(MPI datatype, item size, our name): half types travel as float32."""
    return (MPI.FLOAT if name in HALF_DTYPES else native.mpi_types()[name], ITEMSIZE[name], name)


# op -> MPI operation, and the dtype objects of the array libraries -> fast_spec, so a call costs
# one dictionary lookup each. They are filled at the first call, since reading MPI's names starts
# MPI (NumPy has no bfloat16; the torch entries are made when torch is first seen).
FAST_OPS = {}
FAST_NUMPY_TYPES = {}
FAST_TORCH_TYPES = {}


def fill_fast_tables() -> dict:
    """Fill FAST_NUMPY_TYPES and FAST_OPS; returns FAST_OPS."""
    FAST_NUMPY_TYPES.update({np.dtype(name): fast_spec(name) for name in FAST_DTYPES if name != "bfloat16"})
    FAST_OPS.update(native.mpi_ops(), avg=MPI.SUM)
    return FAST_OPS


def fill_fast_torch_types(torch) -> None:
    for name in FAST_DTYPES:
        FAST_TORCH_TYPES[getattr(torch, name)] = fast_spec(name)


def fast_route(comm, nbytes: int, half: bool, algorithm: str):
    """"mpi", "node" (the node protocol) or None (the general path) for this message."""
    if algorithm == "auto":
        mpi_below, node_below = comm.fast_path_bounds[half]
        if nbytes < mpi_below:
            return "mpi"
        return "node" if nbytes < node_below and nbytes <= ONE_SHOT_BYTES else None
    if algorithm == "hierarchical":
        return "node" if comm.num_nodes == 1 and nbytes <= ONE_SHOT_BYTES else None
    return "mpi" if algorithm == "mpi" else None


def described(array, kind) -> tuple:
    """(fast_spec, bytes) of `array` (of type `kind`): a contiguous, writable CPU NumPy array or
    torch tensor of a dtype the fast path takes; (None, 0) for any other, which the general path
    takes (and refuses where it must)."""
    if kind is np.ndarray:
        spec = FAST_NUMPY_TYPES.get(array.dtype)
        flags = array.flags
        if spec is None or not flags.c_contiguous or not flags.writeable:
            return None, 0
        return spec, array.nbytes
    torch = sys.modules.get("torch")
    if torch is None or kind is not torch.Tensor and not isinstance(array, torch.Tensor):
        return None, 0
    if not FAST_TORCH_TYPES:
        fill_fast_torch_types(torch)
    spec = FAST_TORCH_TYPES.get(array.dtype)
    if spec is None or not array.is_cpu or not array.is_contiguous():
        return None, 0
    return spec, array.numel() * spec[1]


def small_cpu_allreduce(comm, array, op, algorithm) -> bool:
    """All-reduce a small contiguous CPU array with one MPI_Allreduce, or one call into the node
    protocol, when that is where the general path would end up too; with the call check on,
    after the check (check_on_node: a difference raises there, on every rank). Returns False,
    having done nothing, otherwise (the general path then also gives the error messages). `comm` is the
    channel the call runs on: a Communicator without an asynchronous engine, or an engine (in
    order, engine.in_order)."""
    if comm._engine is not None:
        return False
    mpi_op = (FAST_OPS or fill_fast_tables()).get(op)
    if mpi_op is None:
        return False
    kind = type(array)
    spec, nbytes = described(array, kind)
    if spec is None:
        return False
    mpi_type, itemsize, name = spec
    half = name in HALF_DTYPES
    average = op == "avg"
    if nbytes == 0 or average and name not in FLOAT_DTYPES:  # the general path refuses an integer average
        return False
    route = fast_route(comm, nbytes, half, algorithm)
    if route is None:
        return False
    on_node = route == "node"
    count = nbytes // itemsize
    window = comm.node_window  # the general path makes it, at the same call on every rank
    if on_node and window is None:
        return False
    # mpi4py's buffer gives the address several times faster than NumPy's .ctypes.data, and
    # the scaling goes straight to the CPU kernel: the arguments are known good here.
    message = MPI.buffer.frombuffer(array) if kind is np.ndarray else MPI.buffer.fromaddress(array.data_ptr(), nbytes)
    reduce_op, scale = ("sum", 1.0 / comm.size) if average else (op, 1.0)
    if comm.check_calls and comm.size > 1:
        if window is None or comm.num_nodes != 1:
            return False
        # Sent along with the check where it would go one-shot anyway (and under "auto" also where
        # it would go to MPI: the check's round then costs less than the check and MPI_Allreduce),
        # if it fits the slots as they are (growing them is a collective: it must wait until the
        # ranks agree on the call). An explicit algorithm="mpi" keeps MPI's own all-reduce.
        along = (on_node or algorithm == "auto") and nbytes <= window.one_shot_bytes \
            and SIGNATURE_BYTES + nbytes <= window.one_shot_capacity
        if check_on_node(comm, window, name, count, op, algorithm,
                         (message.address, nbytes, name, reduce_op, scale) if along else None):
            return True
    if on_node:
        host_allreduce_on_node(window, message.address, nbytes, name, reduce_op, scale)
        return True
    if not half:
        comm.mpi.Allreduce(MPI.IN_PLACE, [message, mpi_type], mpi_op)
        if average:  # as finish_average does
            _C.scale(message.address, count, name, scale)
        return True
    wide = comm.fast_path_scratch
    if wide is None or wide.size < count:
        wide = comm.fast_path_scratch = np.empty(max(count, 1024), dtype=np.float32)
    native.allreduce_through_float32(comm.mpi, message.address, name, count, wide.ctypes.data, mpi_op, scale)
    return True


# Signatures kept per channel (Channel.fast_path_signatures) before the table starts over.
KEPT_SIGNATURES = 256


def check_on_node(comm, window, dtype: str, count: int, op: str, algorithm: str, message=None) -> bool:
    """The call check of this all-reduce in the node window: the general path's checked round
    (callcheck.compared_on_node) of the signature the general path would make, made by its own
    functions at the first call of each kind and kept on the channel; with `message` (as
    compared_on_node takes it) the all-reduce in the same round. Returns whether the message was
    reduced there. Where the ranks differ, the general path's exchange names the difference
    (MismatchError on every rank), or lets the call go on (joined ranks; a rank whose message
    did not come along): the message is then still to be reduced."""
    key = (dtype, count, op, algorithm)
    known = comm.fast_path_signatures.get(key)
    if known is None:
        if len(comm.fast_path_signatures) >= KEPT_SIGNATURES:
            comm.fast_path_signatures.clear()
        info = BufferInfo(0, count, dtype, "cpu", "numpy")
        fields = signature("allreduce", info, op, resolve_algorithm(algorithm, info, comm))
        headers = (signature_header(fields, False), signature_header(fields, True))
        # The headers are kept with their addresses, which the extension reads: alive as long.
        known = comm.fast_path_signatures[key] = (fields, headers, [header.ctypes.data for header in headers],
                                                  call_check_name(fields))
    fields, _, addresses, what = known
    if compared_on_node(comm, window, addresses[message is not None], what, message):
        return message is not None
    settle_difference(comm, comm.mpi, fields)
    return False
