"""What a collective call may be: the local argument checks, and the cross-rank call check.

The call check: before a collective moves any data, every rank contributes its signature (which
collective, count, dtype, op, algorithm, root, row shape or shape; as int64 numbers) to one small
allgather with a deadline; any difference raises MismatchError on every rank, naming who passed
what (of ranks that called different collectives, in the fields those share: FIELDS_OF). Where
the ranks share one node and its node window exists, they first compare in the window, one call
into the node protocol (agreed_on_node; the fast path sends its all-reduce along
in the same round), and exchange their signatures only to name a difference. A rank
that refused its own arguments still joins, with a row that says so (share_refusal), so the
others fail at once instead of waiting out MPIDIST_TIMEOUT. So does a
rank that has run out of data and waits in join (join_call_check): a rank calling another
collective meanwhile raises, naming it, while the joined rank waits on; in an all-reduce that
sums or averages it takes part with zeros.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..buffers import DTYPES, BufferInfo
from ..errors import InvalidArgumentError, MismatchError, MpidistError, UnsupportedDtypeError
from ..runtime import stall
from ..runtime.deadlines import wait_for_collective, wait_in_collective_of
from ..runtime.mpi import MPI, fault_tolerant
from ..runtime.wire import FLOAT_DTYPES
from .common import COLLECTIVES
from .engine import in_order
from .hierarchical import channel_node_window
from .nccl import check_usable
from .node_window import SIGNATURE_BYTES, one_shot_on_node
from .registry import ALGORITHMS, ALLREDUCE
from .select import table_choice

OPS = ("sum", "avg", "min", "max", "prod")
SIGNATURE_FIELDS = ("collective", "count", "dtype", "op", "algorithm", "root", "row shape")
# The fields each collective has beyond its name, by the name a difference in them is given. In
# its signature the others hold NOT_APPLICABLE (no code of a real value), and a mismatch between
# two collectives names only the fields both have: a broadcast has no algorithm to differ from an
# all-reduce's. The first dimension of allgather's and alltoall's inputs may differ between ranks:
# their count is no field. The column "row shape" holds, by collective, one of ROW_SHAPE_FIELDS.
ROW_SHAPE = "row shape (shape[1:])"
ROW_SHAPE_FIELDS = (ROW_SHAPE, "shape", "tensor sizes")  # an all-reduce's caller's shape, Adasum's sizes
FIELDS_OF = {
    "allreduce": ("count", "dtype", "op", "algorithm", "shape"),
    "first allreduce_async": ("count", "dtype", "op", "algorithm"),
    "broadcast": ("count", "dtype", "root"),
    "first broadcast_async": ("count", "dtype", "root"),
    "allgather": ("dtype", ROW_SHAPE),
    "first allgather_async": ("dtype", ROW_SHAPE),
    "reduce_scatter": ("count", "dtype", "op", ROW_SHAPE),
    "first reduce_scatter_async": ("count", "dtype", "op", ROW_SHAPE),
    "adasum": ("count", "dtype", "tensor sizes"),
    "alltoall": ("dtype", ROW_SHAPE),
    "barrier": (),
    "join": (),
}
NOT_APPLICABLE = -1


def column_of(field: str) -> str:
    """The signature column (SIGNATURE_FIELDS) that holds a field of FIELDS_OF."""
    return "row shape" if field in ROW_SHAPE_FIELDS else field


def fields_of(code: int) -> tuple:
    """The fields of the collective whose code a signature holds (none for a code of none)."""
    return FIELDS_OF[COLLECTIVES[code]] if 0 <= code < len(COLLECTIVES) else ()
# The "collective" field of a rank that refused its own arguments (see share_refusal).
REFUSED = -1
REFUSED_SIGNATURE = dict.fromkeys(SIGNATURE_FIELDS, NOT_APPLICABLE) | {"collective": REFUSED}
# A barrier moves no data: its signature is the collective alone. So is a joined rank's.
BARRIER_SIGNATURE = dict.fromkeys(SIGNATURE_FIELDS, NOT_APPLICABLE) | {"collective": COLLECTIVES.index("barrier")}
JOINED = COLLECTIVES.index("join")
JOIN_SIGNATURE = dict.fromkeys(SIGNATURE_FIELDS, NOT_APPLICABLE) | {"collective": JOINED}


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
    """The all-reduce this rank will run, by the name the call check compares: `algorithm`, or for
    "auto" MPIDIST_ALLREDUCE_ALGORITHM or the table's choice. A CUDA buffer of "auto" on several
    ranks stays "auto": its route (routes.py: the device route) decides with the other ranks
    whether it stays in GPU memory, and where it cannot, runs the table's choice staged."""
    if algorithm == "nccl":
        check_usable(info)
    if algorithm != "auto":
        return algorithm
    if info.is_cuda and comm.size > 1 and comm.forced_algorithm is None:
        return "auto"
    chosen = table_choice(comm, info)
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
    `row_shape` (allgather, reduce_scatter; an all-reduce's shape or shapes) names the row shape
    should the ranks' differ.
    """
    if not comm.check_calls or mpi.Get_size() == 1:
        return
    if not agreed_on_node(comm, fields):
        settle_difference(comm, mpi, fields, row_shape)


def settle_difference(comm, mpi, fields: dict, row_shape: tuple | None = None) -> None:
    """The call check's MPI exchange, for ranks not known to agree (no node window to compare
    in, or it found a difference): returns where every rank's signature is `fields` (or the
    others' differ only by joined ranks that take part), else raises MismatchError naming the
    differences, on every rank alike."""
    table = exchange_signatures(mpi, fields)
    if (table == table[mpi.Get_rank()]).all():
        return
    refused = [rank for rank in range(len(table)) if table[rank, 0] == REFUSED]
    if refused:  # decided alike on every rank, before the exchange below
        raise MismatchError(
            f"ranks {refused} refused their arguments to this collective (each raised its own error "
            "there: see those ranks' output), so the other ranks cannot run it either")
    joined = [rank for rank in range(len(table)) if table[rank, 0] == JOINED]
    if joined and _joined_ranks_take_part(table):
        return
    if joined:  # the joined ranks wait on (join_call_check); the others learn why they cannot go on
        raise MismatchError(
            f"{COLLECTIVES[fields['collective']]} is not supported with join: ranks {joined} have run out of data "
            "and wait in join() for the others, taking part only in the operations join() shadows; run it before "
            "any rank joins, or after every rank has")
    row_shapes = None
    shape_codes = table[:, SIGNATURE_FIELDS.index("row shape")]
    if (shape_codes != shape_codes[0]).any():
        # The signature holds only a number standing for the row shape. Every rank sees the same
        # table, so every rank takes this second exchange (all are known to be here: the first
        # one completed), and the message can name the shapes. Error path only: pickling is fine.
        row_shapes = mpi.allgather(row_shape)
    raise MismatchError(describe_mismatch(table, row_shapes))


def call_check_name(fields: dict) -> str:
    """What the stall report and the deadline call the call check of `fields`."""
    collective = fields["collective"]
    return f"{COLLECTIVES[collective] if collective != REFUSED else 'refused'} call check"


def signature_row(fields: dict) -> np.ndarray:
    """The signature `fields` as the int64 row the ranks compare."""
    return np.array([fields[name] for name in SIGNATURE_FIELDS], dtype=np.int64)


def exchange_signatures(mpi, fields: dict) -> np.ndarray:
    """Every rank's signature (a row by rank), exchanged with the deadline."""
    mine = signature_row(fields)
    table = np.empty((mpi.Get_size(), len(mine)), dtype=np.int64)
    request = mpi.Iallgather([mine, MPI.INT64_T], [table, MPI.INT64_T])
    wait_for_collective(request, mpi, what=call_check_name(fields))
    return table


def agreed_on_node(channel, fields: dict) -> bool | None:
    """Whether every rank's signature is `fields`, decided in the channel's node window where its
    ranks share one node and the window exists (a checked all-reduce made it, at the same call on
    every rank, so every rank takes the same way): one checked one-shot round of the node
    protocol (NodeCheck), with no message. The wait is the call check's, as through MPI
    (the stall report, a peer's exit, the deadline naming the other ranks). None where there is no
    such window: the ranks then exchange their signatures through MPI (exchange_signatures), as
    they also do to name the differences once this says there are some."""
    window = channel.node_window
    if window is None or channel.num_nodes != 1:
        return None
    return NodeCheck(channel, window, fields).agreed()


def window_for_checks(channel) -> None:
    """Make the channel's node window, where the call check is on, there is none yet and the
    channel's ranks share one node's memory; called once every rank has taken part in a checked
    all-reduce (collective over the channel: every rank decides alike). Not after the check
    alone: a rank that gave up at its deadline has left its signature behind, so the others can
    agree without it (a barrier, whose check is all of it, then completes), and they would wait
    for it in the window's making, which has no deadline. The checks of the calls after it are a
    round of the window (agreed_on_node), and the fast path can take checked
    all-reduces. Otherwise only a hierarchical all-reduce makes the window, and a communicator of
    small all-reduces keeps paying for an MPI exchange on every checked call. Under ULFM there are
    no shared-memory windows (runtime/mpi.py)."""
    if channel.check_calls and channel.node_window is None and channel.num_nodes == 1 and channel.size > 1 \
            and not fault_tolerant():
        channel_node_window(channel).grow_one_shot_slots()  # the checks' round is a one-shot


def signature_header(fields: dict, with_message: bool) -> np.ndarray:
    """What a rank writes before its message in a checked one-shot round of the node window: the
    signature row and whether its message follows in the same round (the fast path:
    where one rank sends its message along and another does not, their headers differ, and the
    exchange decides; node_window.SIGNATURE_BYTES in all)."""
    header = np.zeros(SIGNATURE_BYTES // 8, dtype=np.int64)
    header[:len(SIGNATURE_FIELDS)] = signature_row(fields)
    header[len(SIGNATURE_FIELDS)] = with_message
    return header


class NodeCheck:
    """The call check of one kind of call as a checked one-shot round of a node window
    (node_window.one_shot_on_node with a signature): its header (signature_header, with or
    without a message behind it), and its wait (the call check's, as through MPI: the stall report,
    a peer's exit, the deadline naming the other ranks). The general path makes one per check
    (agreed_on_node); the fast path keeps one per kind of call (fastpath.FastPlan),
    with `with_message` where its message goes along."""

    def __init__(self, channel, window, fields: dict, with_message: bool = False):
        self.window = window
        self.fields = fields
        self.header = signature_header(fields, with_message)  # the extension reads it at this address
        self.address = self.header.ctypes.data
        what = call_check_name(fields)
        self.published = f"the {what}"  # the record of this rank's last call, also where nothing waits
        mpi, seconds = channel.mpi, window.yield_seconds

        def wait(round_):
            wait_in_collective_of(lambda: window.others_reached(round_), mpi, what, seconds)
        self.wait = wait

    def agreed(self, address: int = 0, count: int = 0, dtype: str = "int64", op: str = "sum", scale: float = 1.0,
               nbytes: int = 0) -> bool:
        """Whether every rank wrote this header, the same answer on every rank; with a message
        (`count` items of `dtype` at `address`, `nbytes` in all, where the header says so) its
        all-reduce (`op`, times `scale`) in the same round where they did."""
        stall.publish(self.published)
        agreed = one_shot_on_node(self.window, address, count, dtype, op, scale, SIGNATURE_BYTES + nbytes,
                                  self.address, self.wait)
        stall.returned()
        return agreed


def join_call_check(comm) -> dict | None:
    """One round of a rank waiting in join: it takes part in the others' next call check with a
    row that says "join". Returns None once every rank's row does (and with the check off,
    MPIDIST_CHECK=0, where there is no exchange); the signature fields of the others' call when
    it is one the joined ranks take part in with zeros (an all-reduce that sums or averages, or
    the first asynchronous one, which starts the engine; the caller runs its side); else {}: the
    others called something else, raise there (check_same_call), and the joined rank waits for
    their next call."""
    if not comm.check_calls or comm.size == 1:
        return None
    if agreed_on_node(comm, JOIN_SIGNATURE):  # every rank waits in join
        return None
    table = exchange_signatures(comm.mpi, JOIN_SIGNATURE)
    training = table[table[:, 0] != JOINED]
    if not len(training):
        return None
    if not _joined_ranks_take_part(table):
        return {}
    return dict(zip(SIGNATURE_FIELDS, training[0].tolist()))


# What ranks waiting in join take part in, with zeros, as Horovod's joined ranks do: all-reduces
# that sum or average (zeros change no sum, and an average still divides by every rank).
JOINABLE_COLLECTIVES = (COLLECTIVES.index("allreduce"), COLLECTIVES.index("first allreduce_async"))
JOINABLE_OPS = (OPS.index("sum"), OPS.index("avg"))


def _joined_ranks_take_part(table: np.ndarray) -> bool:
    """Whether the ranks not waiting in join (a row that says "join") all called the same
    all-reduce, one the joined ranks take part in."""
    training = table[table[:, 0] != JOINED]
    first = training[0]
    return bool((training == first).all()) and first[0] in JOINABLE_COLLECTIVES \
        and first[SIGNATURE_FIELDS.index("op")] in JOINABLE_OPS


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


def checked_here(comm, check):
    """check() this rank's arguments, before the collective joins the queue of its communicator.
    A refusal still joins the other ranks' call check on the channel they use (share_refusal;
    in_order picks the same one: the engine's, or the communicator's before it has one), then
    raises here."""
    try:
        return check()
    except MpidistError:
        in_order(comm, share_refusal)
        raise


def checked_in_order(comm, check, run):
    """A collective that checks its arguments before it joins the queue of its communicator:
    check() on this rank (checked_here), then run(channel, *what check returned) in order
    (engine.in_order)."""
    checked = checked_here(comm, check)
    return in_order(comm, lambda channel: run(channel, *checked))


def describe_mismatch(table: np.ndarray, row_shapes: list | None = None) -> str:
    """The differences in `table` (a signature by rank), field by field; of ranks that called
    different collectives, only in the fields those collectives share (FIELDS_OF)."""
    names = {"collective": COLLECTIVES, "dtype": DTYPES, "op": OPS, "algorithm": ALGORITHMS}
    codes = [int(code) for code in table[:, 0]]
    shared = [field for field in fields_of(codes[0]) if all(field in fields_of(code) for code in codes)]
    parts = []
    for field in ("collective", *shared):
        column = column_of(field)
        values = table[:, SIGNATURE_FIELDS.index(column)]
        if (values == values[0]).all():
            continue
        groups = {}
        for rank, value in enumerate(values):
            groups.setdefault(signature_label(column, int(value), names, row_shapes, rank), []).append(rank)
        part = f"{field}: " + "; ".join(f"ranks {ranks} have {label}" for label, ranks in groups.items())
        if field == "algorithm":
            part += (" (the algorithm each rank would run, from algorithm=, MPIDIST_ALLREDUCE_ALGORITHM or auto's "
                     "table; auto itself for a CUDA buffer, whose route the ranks decide together)")
        parts.append(part)
    called = "the same collective with different arguments" if len(set(codes)) == 1 else "different collectives"
    return f"ranks called {called}: " + " | ".join(parts)


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
    MPIDIST_ALLREDUCE_ALGORITHM and auto's choice); `row_shape` is shape[1:] where it matters (or
    the shape, or a tuple of shapes, that an all-reduce's caller asks the ranks to agree on). The
    fields `collective` does not have hold NOT_APPLICABLE (FIELDS_OF)."""
    values = {"count": info.count, "dtype": DTYPES.index(info.dtype), "op": OPS.index(op),
              "algorithm": ALGORITHMS.index(algorithm), "root": root,
              "row shape": 0 if row_shape is None else row_shape_code(row_shape)}
    columns = {column_of(field) for field in FIELDS_OF[collective]}
    return {"collective": COLLECTIVES.index(collective)} | {
        column: values[column] if column in columns else NOT_APPLICABLE for column in SIGNATURE_FIELDS[1:]}


def row_shape_code(row_shape: tuple) -> int:
    # Python's hash of a tuple of ints is the same in every process (only str and bytes hashes
    # are salted per process); equal codes of different shapes are vanishingly unlikely.
    return hash(_as_ints(row_shape)) & 0x7FFFFFFF


def _as_ints(shape: tuple) -> tuple:
    """A shape, or a tuple of shapes, as (nested) tuples of Python ints."""
    return tuple(_as_ints(n) if isinstance(n, tuple) else int(n) for n in shape)
