"""The front door of every collective: argument checks, the cross-rank call check, host staging
for GPU buffers, algorithm dispatch, and asynchronous handles.
"""
from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from .. import _C, buffers, kernels
from ..buffers import ITEMSIZE, BufferInfo, DTYPES
from ..runtime.wire import FLOAT_DTYPES
from ..errors import InvalidArgumentError, MismatchError, MpidistError, UnsupportedDtypeError
from . import native
from .broadcast import broadcast as broadcast_algorithm
from ..runtime import deadlines
from ..runtime.deadlines import wait_for_collective as wait_with_deadline
from .common import Context, split_counts
from .hierarchical import hierarchical_allreduce
from .native import native_allreduce
from .recursive_doubling import recursive_doubling_allreduce
from .recursive_halving import recursive_halving_allreduce
from .reduce_bcast import reduce_bcast_allreduce
from .ring import allgather_ring, reduce_scatter_ring, ring_allreduce
from .select import choose_allreduce
from .tree import tree_allreduce

ALLREDUCE = {
    "ring": ring_allreduce,
    "tree": tree_allreduce,
    "recursive_halving": recursive_halving_allreduce,
    "recursive_doubling": recursive_doubling_allreduce,
    "reduce_bcast": reduce_bcast_allreduce,
    "hierarchical": hierarchical_allreduce,
    "mpi": native_allreduce,
}
ALGORITHMS = ("auto",) + tuple(ALLREDUCE)
# Algorithms that work in host memory only (the hierarchical one reduces in a node-shared window,
# which CUDA kernels cannot address): GPU buffers reach them through host staging, always.
HOST_MEMORY_ALGORITHMS = frozenset({"hierarchical"})
OPS = ("sum", "avg", "min", "max", "prod")
# "first allreduce_async": the first asynchronous call of each rank starts the background thread,
# which duplicates the communicator (a collective of its own); ranks check that they all do so.
COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce_scatter", "first allreduce_async", "adasum")
# Tags keep the messages of different collectives apart should a rank ever run ahead.
TAGS = {name: 0x4D44 + index for index, name in enumerate(COLLECTIVES)}
SIGNATURE_FIELDS = ("collective", "count", "dtype", "op", "algorithm", "root", "row shape")
# The "collective" field of a rank that refused its own arguments (see share_refusal).
REFUSED = -1
REFUSED_SIGNATURE = dict.fromkeys(SIGNATURE_FIELDS, 0) | {"collective": REFUSED}


# ---- argument checks (local: refused before any communication) --------------------------

def check_op(op: str, dtype: str) -> str:
    if op not in OPS:
        raise InvalidArgumentError(f"unknown op {op!r}; choose one of {', '.join(OPS)}")
    if op == "avg" and dtype not in FLOAT_DTYPES:
        raise UnsupportedDtypeError(
            f"op='avg' needs a floating-point dtype, got {dtype}: an integer average would be "
            "silently truncated; use op='sum' and divide yourself")
    return op


def check_algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise InvalidArgumentError(
            f"unknown all-reduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    return algorithm


def resolve_algorithm(algorithm: str, info: BufferInfo, comm) -> str:
    if algorithm != "auto":
        return algorithm
    chosen = choose_allreduce(info.nbytes, comm.size, comm.tuning_table, info.dtype, comm.forced_algorithm)
    if chosen not in ALLREDUCE:
        raise InvalidArgumentError(
            f"MPIDIST_ALLREDUCE_ALGORITHM={chosen!r} is not an all-reduce algorithm; "
            f"choose one of {', '.join(ALLREDUCE)}")
    return chosen


def check_root(root, size: int) -> int:
    if not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise InvalidArgumentError(f"root={root!r} is not a rank of this communicator (size {size})")
    return int(root)


# ---- the cross-rank call check -------------------------------------------------------------

def check_same_call(comm, mpi, fields: dict, row_shape: tuple | None = None) -> None:
    """All ranks exchange what they were asked to do; any difference raises on every rank.

    Costs one small allgather. It runs non-blocking with a deadline (MPIDIST_TIMEOUT seconds),
    so a rank that never joins the collective turns into an error instead of a hang.
    `row_shape` (allgather, reduce_scatter) names the row shape should the ranks' differ.
    """
    if not comm.check_calls or mpi.Get_size() == 1:
        return
    mine = np.array([fields[name] for name in SIGNATURE_FIELDS], dtype=np.int64)
    table = np.empty((mpi.Get_size(), len(mine)), dtype=np.int64)
    request = mpi.Iallgather([mine, MPI.INT64_T], [table, MPI.INT64_T])
    collective = fields["collective"]
    wait_with_deadline(request, mpi, what=f"{COLLECTIVES[collective] if collective != REFUSED else 'refused'} "
                                          "call check")
    if (table == mine).all():
        return
    refused = [rank for rank in range(len(table)) if table[rank, 0] == REFUSED]
    if refused:  # decided alike on every rank, before the exchange below
        raise MismatchError(
            f"ranks {refused} refused their arguments to this collective (each raised its own error "
            "there: see those ranks' output), so the other ranks cannot run it either")
    row_shapes = None
    shape_codes = table[:, SIGNATURE_FIELDS.index("row shape")]
    if (shape_codes != shape_codes[0]).any():
        # The signature holds only a number standing for the row shape. Every rank sees the same
        # table, so every rank takes this second exchange (all are known to be here: the first
        # one completed), and the message can name the shapes. Error path only: pickling is fine.
        row_shapes = mpi.allgather(row_shape)
    raise MismatchError(describe_mismatch(table, row_shapes))


def share_refusal(comm) -> None:
    """Called on a rank whose own arguments were just refused, before it raises that error: it
    still takes part in the call check, with a row that says "refused", so that the other ranks
    raise MismatchError at once instead of waiting MPIDIST_TIMEOUT for it. `comm` is the channel
    the collective would have run on (the communicator, or its async engine). With the check off
    (MPIDIST_CHECK=0) there is no exchange to join: nothing happens."""
    if not comm.check_calls or comm.size == 1:
        return
    with contextlib.suppress(MpidistError):  # this rank's own error is the one to report
        check_same_call(comm, comm.mpi, REFUSED_SIGNATURE)


def describe_mismatch(table: np.ndarray, row_shapes: list | None = None) -> str:
    names = {"collective": COLLECTIVES, "dtype": DTYPES, "op": OPS, "algorithm": ALGORITHMS}
    parts = []
    for column, field in enumerate(SIGNATURE_FIELDS):
        values = table[:, column]
        if (values == values[0]).all():
            continue
        groups = {}
        for rank, value in enumerate(values):
            groups.setdefault(signature_label(field, int(value), names, row_shapes, rank), []).append(rank)
        title = field
        if field == "row shape":  # Adasum's carries the sizes of the tensors in the buffer
            title = "tensor sizes" if (table[:, 0] == COLLECTIVES.index("adasum")).all() else "row shape (shape[1:])"
        part = f"{title}: " + "; ".join(f"ranks {ranks} have {label}" for label, ranks in groups.items())
        if field == "algorithm":
            part += " (the algorithm each rank would run, from algorithm=, MPIDIST_ALLREDUCE_ALGORITHM or auto's table)"
        parts.append(part)
    return "ranks called the same collective with different arguments: " + " | ".join(parts)


def signature_label(field: str, value: int, names: dict, row_shapes: list | None, rank: int) -> str:
    if field == "row shape":
        if row_shapes is None:
            return "a different row shape"
        shape = row_shapes[rank]
        return "no row shape" if shape is None else str(tuple(shape))
    if field in names:
        # A value out of range means the peer sent something that is no signature of this
        # mpidist (another MPI message crossed the check): say so rather than fail here.
        return names[field][value] if 0 <= value < len(names[field]) else f"an unknown value {value}"
    return str(value)


def signature(collective: str, info: BufferInfo, op: str = "sum", algorithm: str = "auto", root: int = 0,
              row_shape: tuple | None = None) -> dict:
    """What a rank was asked to do, as numbers. `algorithm` is the one the rank will run (after
    MPIDIST_ALLREDUCE_ALGORITHM and auto's choice); `row_shape` is shape[1:] where it matters."""
    return {"collective": COLLECTIVES.index(collective), "count": info.count,
            "dtype": DTYPES.index(info.dtype), "op": OPS.index(op), "algorithm": ALGORITHMS.index(algorithm),
            "root": root, "row shape": 0 if row_shape is None else row_shape_code(row_shape)}


def row_shape_code(row_shape: tuple) -> int:
    # Python's hash of a tuple of ints is the same in every process (only str and bytes hashes
    # are salted per process); equal codes of different shapes are vanishingly unlikely.
    return hash(tuple(int(n) for n in row_shape)) & 0x7FFFFFFF


# ---- staging ---------------------------------------------------------------------------------

@contextlib.contextmanager
def staged(comm, array, info: BufferInfo, host_only: bool = False):
    """The buffer the algorithm should work on: the array itself, or a pinned host copy when
    the array lives on a GPU and the MPI library cannot read GPU memory (or the algorithm
    works in host memory only: `host_only`)."""
    if info.is_cuda and (host_only or not comm.is_cuda_aware()):
        host = comm.staging.stage_in(array, info)
        yield host
        comm.staging.stage_out(array, info, host)
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
        import ctypes
        ctypes.memmove(dst.ptr, src.ptr, src.nbytes)


def finish_average(ctx: Context, op: str, offset: int = 0, count: int | None = None) -> None:
    count = ctx.info.count - offset if count is None else count
    if op == "avg" and count:
        kernels.scale_ptr(ctx.info.ptr + offset * ctx.info.itemsize, count, ctx.info.dtype,
                          1.0 / ctx.size, device=ctx.info.device)
        if ctx.info.is_cuda:
            kernels.synchronize(ctx.info.device)


def kernel_op(op: str) -> str:
    return "sum" if op == "avg" else op


# ---- the collectives ---------------------------------------------------------------------------

def allreduce(comm, array, op="sum", algorithm="auto", out=None):
    """All-reduce `array` across the communicator; in place unless `out` is given. Returns the result."""
    try:
        target, target_info, source_info = prepare_allreduce(array, op, algorithm, out)
    except MpidistError:
        in_order(comm, share_refusal)
        raise
    return in_order(comm, lambda channel: _run_allreduce(channel, target, target_info, op, algorithm, source_info))


# ---- the small-message fast path (Communicator.allreduce tries it first) ---------------------------
# A small MPI_Allreduce takes about a microsecond, so every microsecond of Python in front of it
# shows. Small CPU messages that the general path would hand to the MPI library anyway skip it
# (buffer description, context, dispatch) and go straight to MPI_Allreduce; float16/bfloat16 take
# the MPI route's float32 round trip through a scratch buffer kept for this. With the cross-rank
# call check on, the general path runs: the check is a collective of its own.

FAST_OPS = dict(native.MPI_OPS, avg=MPI.SUM)
HALF_NAMES = native.HALF_TYPES


def fast_spec(name: str) -> tuple:
    """(MPI datatype, item size, our name): half types travel as float32."""
    return (MPI.FLOAT if name in HALF_NAMES else native.MPI_TYPES[name], ITEMSIZE[name], name)


# dtype -> fast_spec; the torch entries are made when torch is first seen.
FAST_NUMPY_TYPES = {np.dtype(name): fast_spec(name) for name in tuple(native.MPI_TYPES) + ("float16",)}
FAST_TORCH_TYPES = {}


def fill_fast_torch_types(torch) -> None:
    for name in tuple(native.MPI_TYPES) + HALF_NAMES:
        FAST_TORCH_TYPES[getattr(torch, name)] = fast_spec(name)


def small_cpu_allreduce(comm, array, op, algorithm) -> bool:
    """All-reduce a small contiguous CPU array with one MPI_Allreduce when that is where the
    general path would end up too. Returns False, having done nothing, otherwise (the general
    path then also gives the error messages)."""
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
    half = name in HALF_NAMES
    average = op == "avg"
    if nbytes == 0 or algorithm == "auto" and nbytes >= comm.fast_path_bounds[half] \
            or average and name not in FLOAT_DTYPES:  # the general path refuses an integer average
        return False
    count = nbytes // itemsize
    if not half:
        # mpi4py's buffer gives the address in 0.1 us (NumPy's .ctypes.data takes 0.8 us), and
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


def in_order(comm, work):
    """Run a blocking collective. Once the communicator has an asynchronous engine, the work
    runs on the engine's thread behind the operations already queued there: the collectives of
    one communicator then never run concurrently (MPI libraries do not all allow creating
    shared-memory windows from two threads at once) and always in program order."""
    engine = comm._engine
    if engine is None:
        return work(comm)
    return engine.submit("collective", work).wait()


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


def _run_allreduce(comm, array, info, op, algorithm, source_info=None):
    """All-reduce `array` (described by `info`); with `source_info`, copy that input into it
    first, once the ranks have agreed on the call, so a refused call leaves out= untouched."""
    mpi = comm.mpi
    # The signature carries the algorithm this rank will run, not the one asked for: ranks with
    # different MPIDIST_ALLREDUCE_ALGORITHM (or tuning tables) would otherwise pass the check
    # and then run algorithms whose messages do not match.
    try:
        name = resolve_algorithm(algorithm, info, comm)
    except MpidistError:
        share_refusal(comm)
        raise
    if comm.check_calls:
        check_same_call(comm, mpi, signature("allreduce", info, op, name))
    if source_info is not None:
        copy_buffer(info, source_info)
    if info.is_cuda:
        with staged(comm, array, info, host_only=name in HOST_MEMORY_ALGORITHMS) as work:
            _reduce_with(ALLREDUCE[name], Context(comm, mpi, work, op=kernel_op(op), tag=TAGS["allreduce"]), op)
    else:  # the hot path of small messages: no context manager
        _reduce_with(ALLREDUCE[name], Context(comm, mpi, info, op=kernel_op(op), tag=TAGS["allreduce"]), op)
    return array


def _reduce_with(algorithm, ctx: Context, op: str) -> None:
    ctx.average = op == "avg"
    algorithm(ctx)
    if ctx.average:  # the algorithm left the division to us
        finish_average(ctx, op)


def broadcast(comm, array, root=0):
    """Broadcast `root`'s array into every rank's array, in place. Returns the array."""
    return in_order(comm, lambda channel: _broadcast(channel, array, root))


def _broadcast(comm, array, root=0):
    try:
        info = buffers.describe(array)
        root = check_root(root, comm.size)
        if comm.rank != root:  # the root's array is only read
            buffers.check_writable(array, f"broadcast writes root {root}'s data into rank {comm.rank}'s array")
    except MpidistError:
        share_refusal(comm)
        raise
    check_same_call(comm, comm.mpi, signature("broadcast", info, root=root))
    with staged(comm, array, info) as work:
        broadcast_algorithm(Context(comm, comm.mpi, work, tag=TAGS["broadcast"]), root)
    return array


def allgather(comm, array):
    """Concatenate every rank's array along the first dimension (ranks may differ in that
    dimension, as in Horovod). Returns a new array of the same kind and device."""
    return in_order(comm, lambda channel: _allgather(channel, array))


def _allgather(comm, array):
    try:
        info = buffers.describe(array)
    except MpidistError:
        share_refusal(comm)
        raise
    shape = tuple(array.shape)
    rows = shape[0] if shape else 1
    row_shape = shape[1:]
    row_elements = int(np.prod(row_shape)) if row_shape else 1
    # The first dimension may differ, so the count is not part of the check.
    check_same_call(comm, comm.mpi, signature("allgather", BufferInfo(0, 0, info.dtype, info.device, info.kind),
                                              row_shape=row_shape), row_shape)
    all_rows = np.empty(comm.size, dtype=np.int64)
    comm.mpi.Allgather([np.array([rows], dtype=np.int64), MPI.INT64_T], [all_rows, MPI.INT64_T])
    total = int(all_rows.sum())
    out = buffers.new_array(array, (total,) + row_shape if shape else (total,))
    out_info = buffers.describe(out)
    offsets = np.concatenate([[0], np.cumsum(all_rows)[:-1]]) * row_elements
    chunks = [(int(o), int(r) * row_elements) for o, r in zip(offsets, all_rows)]
    with staged(comm, out, out_info) as work:
        own_offset = chunks[comm.rank][0]
        with staged(comm, array, info) as source:
            copy_buffer(BufferInfo(work.ptr + own_offset * work.itemsize, info.count, info.dtype,
                                   work.device, work.kind), source)
        allgather_ring(Context(comm, comm.mpi, work, tag=TAGS["allgather"]), chunks, rotation=-1)
    return out


def reduce_scatter(comm, array, op="sum"):
    """Reduce across ranks and give rank r the r-th block of rows of the result (the first
    rows % p ranks get one extra row). The input is left unchanged. Returns a new array."""
    return in_order(comm, lambda channel: _reduce_scatter(channel, array, op))


def _reduce_scatter(comm, array, op="sum"):
    try:
        info = buffers.describe(array)
        check_op(op, info.dtype)
    except MpidistError:
        share_refusal(comm)
        raise
    shape = tuple(array.shape)
    rows = shape[0] if shape else 1
    row_elements = info.count // rows if rows else 0
    # The row shape too: ranks with equal counts but different rows would cut the blocks
    # differently (a truncated message, wrong sums or a hang).
    check_same_call(comm, comm.mpi, signature("reduce_scatter", info, op, row_shape=shape[1:]), shape[1:])
    chunks = [(o * row_elements, c * row_elements) for o, c in split_counts(rows, comm.size)]
    my_rows = split_counts(rows, comm.size)[comm.rank][1]
    out = buffers.new_array(array, (my_rows,) + shape[1:] if shape else (my_rows,))
    work_copy = buffers.new_array(array, (info.count,))
    work_info = buffers.describe(work_copy)
    copy_buffer(work_info, info)
    with staged(comm, work_copy, work_info) as work:
        ctx = Context(comm, comm.mpi, work, op=kernel_op(op), tag=TAGS["reduce_scatter"])
        if comm.size > 1 and info.count:
            reduce_scatter_ring(ctx, chunks, rotation=-1)
        offset, count = chunks[comm.rank]
        finish_average(ctx, op, offset, count)
    out_info = buffers.describe(out)
    copy_buffer(out_info, BufferInfo(work_info.ptr + chunks[comm.rank][0] * info.itemsize, out_info.count,
                                     info.dtype, info.device, info.kind))
    return out


# ---- asynchronous handles --------------------------------------------------------------------

class Handle:
    """The result of an asynchronous collective: wait() for it, or ask done()."""

    def __init__(self, description: str):
        self.description = description
        self._finished = threading.Event()
        self._result = None
        self._error = None
        self.started = self.finished = None  # perf_counter times on the engine's thread

    def _complete(self, result=None, error=None):
        self._result, self._error = result, error
        self.finished = time.perf_counter()
        self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None):
        if not self._finished.wait(timeout if timeout is not None else deadlines.timeout() + 60):
            raise MpidistError(f"{self.description} did not complete within the timeout")
        if self._error is not None:
            raise self._error
        return self._result


class AsyncEngine:
    """A background thread that runs a communicator's asynchronous collectives in submission
    order on a private duplicate of the communicator, so they progress while the caller computes
    (as Horovod's background thread does). Every rank must submit them in the same order."""

    def __init__(self, comm):
        self.comm = comm
        # Nonblocking, with the call check's deadline: a rank whose first asynchronous call never
        # comes (refused locally, or it called something else) would otherwise hang here forever.
        self.mpi, request = comm.mpi.Idup()
        wait_with_deadline(request, comm.mpi, what="duplication of the communicator for asynchronous "
                                                    "collectives (at the first allreduce_async)")
        self.rank, self.size = comm.rank, comm.size
        self.scratch = buffers.ScratchPool()
        self.staging = buffers.HostStaging()
        self.check_calls = comm.check_calls
        self.tuning_table = comm.tuning_table
        self.forced_algorithm = comm.forced_algorithm
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="mpidist-async", daemon=True)
        self._thread.start()

    def is_cuda_aware(self) -> bool:
        return self.comm.is_cuda_aware()

    def submit(self, description: str, work) -> Handle:
        handle = Handle(description)
        self._queue.put((handle, work))
        return handle

    def _serve(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, work = item
            handle.started = time.perf_counter()
            try:
                handle._complete(result=work(self))
            except BaseException as exc:  # handed to the waiting caller
                handle._complete(error=exc)

    def stop(self):
        self._queue.put(None)
        self._thread.join()
        window = getattr(self, "node_window", None)
        if window is not None:
            window.free()
            window.node_comm.Free()
            if window.leader_comm is not None:
                window.leader_comm.Free()
        self.mpi.Free()


def allreduce_async(comm, array, op="sum", algorithm="auto", out=None) -> Handle:
    try:
        target, target_info, source_info = prepare_allreduce(array, op, algorithm, out)
        name = resolve_algorithm(algorithm, target_info, comm)
    except MpidistError:
        # The others' call check runs on the engine's communicator, or, at their first
        # asynchronous call, on this one: in_order picks the same.
        in_order(comm, share_refusal)
        raise
    if comm._engine is None and comm.check_calls:
        # Starting the engine duplicates the communicator, a collective on it: check first that
        # every rank is starting it too, not running another collective there (whose messages
        # would cross the duplication's own).
        check_same_call(comm, comm.mpi, signature("first allreduce_async", target_info, op, name))
    if source_info is not None:
        # Copied now, as the call returns: the caller may reuse the input at once.
        copy_buffer(target_info, source_info)
    engine = comm.async_engine()
    return engine.submit("allreduce_async",
                         lambda eng: _run_allreduce(eng, target, target_info, op, algorithm))
