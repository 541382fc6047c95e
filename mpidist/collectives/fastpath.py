"""The fast path of all-reduce (Communicator.allreduce and the torch.distributed backend try it
first).

A small all-reduce takes microseconds, so every microsecond of Python in front of it shows, and a
large one on one node is a few tens of them. Contiguous CPU messages whose route the general path
would choose from the size alone skip it (buffer description, context, dispatch): those it hands
to the MPI library go straight to MPI_Allreduce (float16/bfloat16 through the MPI route's float32
round trip, in a scratch buffer kept for this), and those it gives to the hierarchical all-reduce
on one node go straight into the node protocol once the window exists (one call into the
extension: node_window.one_shot_on_node up to the window's one-shot bound, host_allreduce_on_node
above it). With the cross-rank call check on, the check runs first, as the general path's own
round in that window (callcheck.NodeCheck) of the signature the general path would make, and a
one-shot message goes along in the same round (under "auto" also one that would have gone to
MPI); without the window (or across nodes) the general path runs.

What to do with a kind of call (dtype, size, op, algorithm) is decided at its first call and kept
on the channel (FastPlan), so that a call is a lookup and the route's own work.
"""
from __future__ import annotations

import sys
import typing

import numpy as np

from .. import _C
from ..buffers import BufferInfo
from ..runtime.mpi import MPI
from ..runtime.wire import FLOAT_DTYPES, HALF_DTYPES, ITEMSIZE
from . import native
from .callcheck import NodeCheck, resolve_algorithm, settle_difference, signature
from .node_window import SIGNATURE_BYTES, host_allreduce_on_node, one_shot_on_node

# The dtypes MPI reduces itself, and the half types it reduces through float32.
FAST_DTYPES = tuple(native.MPI_TYPE_NAMES) + HALF_DTYPES

# The dtype objects of the array libraries -> (our name, item size), so that describing a call
# costs one dictionary lookup (NumPy has no bfloat16; the torch entries are made when torch is
# first seen).
FAST_NUMPY_TYPES = {np.dtype(name): (name, ITEMSIZE[name]) for name in FAST_DTYPES if name != "bfloat16"}
FAST_TORCH_TYPES = {}


def described(array, kind) -> tuple:
    """(our dtype name, bytes) of `array` (of type `kind`): a contiguous, writable CPU NumPy array
    or torch tensor of a dtype the fast path takes; (None, 0) for any other, which the general
    path takes (and refuses where it must)."""
    if kind is np.ndarray:
        spec = FAST_NUMPY_TYPES.get(array.dtype)
        flags = array.flags
        if spec is None or not flags.c_contiguous or not flags.writeable:
            return None, 0
        return spec[0], array.nbytes
    torch = sys.modules.get("torch")
    if torch is None or kind is not torch.Tensor and not isinstance(array, torch.Tensor):
        return None, 0
    if not FAST_TORCH_TYPES:
        FAST_TORCH_TYPES.update({getattr(torch, name): (name, ITEMSIZE[name]) for name in FAST_DTYPES})
    spec = FAST_TORCH_TYPES.get(array.dtype)
    if spec is None or not array.is_cpu or not array.is_contiguous():
        return None, 0
    return spec[0], array.numel() * spec[1]


def fast_route(comm, nbytes: int, half: bool, algorithm: str):
    """"mpi", "node" (the node protocol) or None (the general path) for this message."""
    if algorithm == "auto":
        mpi_below, node_below = comm.fast_path_bounds[half]
        if nbytes < mpi_below:
            return "mpi"
        return "node" if nbytes < node_below else None
    if algorithm == "hierarchical":
        return "node" if comm.num_nodes == 1 else None
    return "mpi" if algorithm == "mpi" else None


class FastPlan(typing.NamedTuple):
    """What the fast path does with one kind of call on a channel (make_plan), made at its first
    call and again when the channel's state it depends on (`made_under`: channel_state) changed."""

    made_under: tuple
    route: typing.Optional[str]  # "mpi" (MPI_Allreduce), "node" (the node protocol) or None: the general path
    mpi_type: typing.Any
    mpi_op: typing.Any
    count: int
    dtype: str
    reduce_op: str  # an average is a sum times `scale`
    scale: float
    one_shot: bool  # the node protocol's one-shot (window.takes_one_shot), else its sliced all-reduce
    check: typing.Optional[NodeCheck]  # the call check, where it runs: in the node window, first
    along: bool  # whether the message goes in the check's round (then that round is all of it)


def channel_state(comm) -> tuple:
    """What the plans depend on that may change between calls: the call check's setting, the
    bounds of "auto", and the node window (which the general path makes) with the size of its
    one-shot slots (which grow)."""
    window = comm.node_window
    return comm.check_calls, comm.fast_path_bounds, window, 0 if window is None else window.one_shot_capacity


def make_plan(comm, dtype: str, nbytes: int, op: str, algorithm: str) -> FastPlan:
    """The FastPlan of an all-reduce of `nbytes` of `dtype` on `comm` as it is now: a route where
    the general path would take the same one from the size alone."""
    average = op == "avg"
    mpi_op = MPI.SUM if average else native.mpi_ops().get(op)
    reduce_op, scale = ("sum", 1.0 / comm.size) if average else (op, 1.0)
    window = comm.node_window  # the general path makes it, at the same call on every rank
    mpi_type = MPI.FLOAT if dtype in HALF_DTYPES else native.mpi_types()[dtype]  # half types travel as float32
    plan = FastPlan(channel_state(comm), None, mpi_type, mpi_op, nbytes // ITEMSIZE[dtype], dtype, reduce_op, scale,
                    window is not None and window.takes_one_shot(nbytes), None, False)
    if mpi_op is None or nbytes == 0 or average and dtype not in FLOAT_DTYPES:  # the general path refuses an integer average
        return plan
    route = fast_route(comm, nbytes, dtype in HALF_DTYPES, algorithm)
    if route is None or route == "node" and window is None:
        return plan
    if not comm.check_calls or comm.size == 1:
        return plan._replace(route=route)
    if window is None or comm.num_nodes != 1:
        return plan
    # Sent along with the check where it would go one-shot anyway (and under "auto" also where it
    # would go to MPI: the check's round then costs less than the check and MPI_Allreduce), if it
    # fits the slots as they are (growing them is a collective: it must wait until the ranks agree
    # on the call). An explicit algorithm="mpi" keeps MPI's own all-reduce.
    along = (route == "node" or algorithm == "auto") and window.takes_one_shot(nbytes) \
        and SIGNATURE_BYTES + nbytes <= window.one_shot_capacity
    # The signature the general path would make, by its own functions (only for a route taken:
    # resolving an algorithm name the general path refuses would raise here, on this rank alone).
    info = BufferInfo(0, plan.count, dtype, "cpu", "numpy")
    fields = signature("allreduce", info, op, resolve_algorithm(algorithm, info, comm))
    return plan._replace(route=route, check=NodeCheck(comm, window, fields, along), along=along)


# Plans kept per channel (Channel.fast_path_plans) before the table starts over.
KEPT_PLANS = 256


def fast_cpu_allreduce(comm, array, op, algorithm) -> bool:
    """All-reduce a contiguous CPU array with one MPI_Allreduce, or one call into the node
    protocol, when that is where the general path would end up too; with the call check on, after
    the check (a difference raises, on every rank) or in its round. Returns False, having done
    nothing, otherwise (the general path then also gives the error messages). `comm` is the
    channel the call runs on: a Communicator without an asynchronous engine, or an engine (in
    order, engine.in_order)."""
    if comm._engine is not None:
        return False
    kind = type(array)
    dtype, nbytes = described(array, kind)
    if dtype is None:
        return False
    plans = comm.fast_path_plans
    try:
        plan = plans.get((dtype, nbytes, op, algorithm))
    except TypeError:  # an unhashable op or algorithm: the general path refuses it
        return False
    if plan is None or plan.made_under != channel_state(comm):
        if len(plans) >= KEPT_PLANS:
            plans.clear()
        plan = plans[dtype, nbytes, op, algorithm] = make_plan(comm, dtype, nbytes, op, algorithm)
    _, route, mpi_type, mpi_op, count, _, reduce_op, scale, one_shot, check, along = plan
    if route is None:
        return False
    # mpi4py's buffer gives a NumPy array's address several times faster than .ctypes.data, and
    # the scaling goes straight to the CPU kernel: the arguments are known good here.
    address = MPI.buffer.frombuffer(array).address if kind is np.ndarray else array.data_ptr()
    if check is not None:
        if not (check.agreed(address, count, dtype, reduce_op, scale, nbytes) if along else check.agreed()):
            # The general path's exchange names the difference (MismatchError on every rank), or
            # lets the call go on (joined ranks; a rank whose message did not come along): the
            # message is then still to be reduced.
            settle_difference(comm, comm.mpi, check.fields)
        elif along:
            return True
    if route == "node" and one_shot:
        one_shot_on_node(comm.node_window, address, count, dtype, reduce_op, scale, nbytes)
    elif route == "node":
        host_allreduce_on_node(comm.node_window, address, nbytes, dtype, reduce_op, scale)
    elif dtype not in HALF_DTYPES:
        comm.mpi.Allreduce(MPI.IN_PLACE, [MPI.buffer.fromaddress(address, nbytes), mpi_type], mpi_op)
        if scale != 1.0:  # an average, as finish_average does
            _C.scale(address, count, dtype, scale)
    else:
        wide = comm.fast_path_scratch
        if wide is None or wide.size < count:
            wide = comm.fast_path_scratch = np.empty(max(count, 1024), dtype=np.float32)
        native.allreduce_through_float32(comm.mpi, address, dtype, count, wide.ctypes.data, mpi_op, scale)
    return True
