"""What every algorithm shares: one call's context, chunking, and the exchange-and-reduce step.

An algorithm works on one flat buffer (a BufferInfo) in place. It sends byte ranges with
mpi4py's buffer interface (never pickling), and reduces with the fused kernels of mpidist._C.
"""
from __future__ import annotations

import ctypes
import threading

from .. import kernels
from ..buffers import ITEMSIZE, BufferInfo, mpi_spec
from ..runtime import config, deadlines
from ..runtime.mpi import MPI

# Large messages are cut into segments so the reduction of one segment overlaps the arrival of
# the next. 256 KiB keeps a segment in L2 while it is reduced.
SEGMENT_BYTES = config.value("MPIDIST_SEGMENT_BYTES")

# The collectives the call check (callcheck.py) knows, in the order of its signatures' first
# field. "first allreduce_async" (and the other "first"s): the first asynchronous call of each
# rank starts the background thread, which duplicates the communicator (a collective of its own);
# ranks check that they all do so, with the same call.
COLLECTIVES = ("allreduce", "broadcast", "allgather", "reduce_scatter", "first allreduce_async", "adasum",
               "alltoall", "first broadcast_async", "first allgather_async", "first reduce_scatter_async", "barrier",
               "join")
# Tags keep the messages of different collectives apart should a rank ever run ahead.
TAGS = {name: 0x4D44 + index for index, name in enumerate(COLLECTIVES)}

# A transfer's wait first tests this many times in a row, as MPI's own wait would spin, before
# the polled wait with its deadline and stall report, whose set-up costs a few microseconds that
# a transfer about to complete should not pay.
QUICK_TESTS = 32

# Every point-to-point request the algorithms start, until it is seen completed. mpi4py frees a
# request whose object is collected; one still active then (its collective ended in an error
# because a peer died, under ULFM) makes Open MPI end the whole job when it completes in error
# later ("Send error after request freed ... on a NULL communicator"). Held here, such a request
# is never freed, and the survivors go on.
_STARTED: list = []
_STARTED_LOCK = threading.Lock()
_PRUNE_AT = [1024]


def started(request):
    """Hold `request` (an mpi4py Request just started) until it is seen completed."""
    with _STARTED_LOCK:
        _STARTED.append(request)
        if len(_STARTED) >= _PRUNE_AT[0]:
            _STARTED[:] = [r for r in _STARTED if r]  # a completed request is MPI_REQUEST_NULL: falsy
            _PRUNE_AT[0] = max(1024, 2 * len(_STARTED))
    return request


class Context:
    """One collective call: the MPI communicator to use, the buffer, the reduction op, scratch."""

    def __init__(self, comm, mpi, info: BufferInfo, op: str = "sum", tag: int = 0):
        self.comm = comm
        self.mpi = mpi
        self.rank = mpi.Get_rank()
        self.size = mpi.Get_size()
        self.info = info
        self.op = op
        self.tag = tag
        # op="avg": the sum still has to be divided by the rank count. An algorithm that can do
        # it while the data is still in cache does so and clears this; otherwise the caller
        # scales the whole result afterwards.
        self.average = False
        self._peer_of = {}  # id of a request of isend/irecv: the rank at its other end (wait's error)

    # ---- memory --------------------------------------------------------------------------

    def scratch(self, count: int, slot: int = 0) -> BufferInfo:
        return self.comm.scratch.get(self.info, count * self.info.itemsize, slot)

    def reduce(self, dst: BufferInfo, dst_offset: int, src: BufferInfo, src_offset: int, count: int):
        """dst[dst_offset:+count] = dst[...] op src[src_offset:+count] (fixed operand order)."""
        if count == 0:
            return
        size = dst.itemsize
        kernels.reduce_ptr(dst.ptr + dst_offset * size, src.ptr + src_offset * size, count,
                           dst.dtype, self.op, device=dst.device)
        if dst.is_cuda:
            kernels.synchronize(dst.device)

    def copy(self, dst: BufferInfo, dst_offset: int, src: BufferInfo, src_offset: int, count: int):
        if count == 0:
            return
        size = dst.itemsize
        if dst.is_cuda:
            kernels.copy_ptr(dst.ptr + dst_offset * size, src.ptr + src_offset * size, count * size,
                             device=dst.device)
            kernels.synchronize(dst.device)
        else:
            ctypes.memmove(dst.ptr + dst_offset * size, src.ptr + src_offset * size, count * size)

    # ---- point to point ------------------------------------------------------------------

    def isend(self, info: BufferInfo, offset: int, count: int, dest: int):
        request = started(self.mpi.Isend(mpi_spec(info, offset, count), dest=dest, tag=self.tag))
        self._peer_of[id(request)] = dest
        return request

    def irecv(self, info: BufferInfo, offset: int, count: int, source: int):
        request = started(self.mpi.Irecv(mpi_spec(info, offset, count), source=source, tag=self.tag))
        self._peer_of[id(request)] = source
        return request

    def send(self, info: BufferInfo, offset: int, count: int, dest: int):
        if count:
            self.wait([self.isend(info, offset, count, dest)])

    def recv(self, info: BufferInfo, offset: int, count: int, source: int):
        if count:
            self.wait([self.irecv(info, offset, count, source)])

    def wait(self, requests: list) -> None:
        """Wait for `requests` (of this call's isend and irecv). Polled rather than MPI's blocking
        wait, which never returns while a peer is gone without an error (frozen, or its node cut
        off the network): a wait past MPIDIST_STALL_WARNING prints the stall report, and one past
        MPIDIST_TIMEOUT raises DeadlineError naming the ranks whose transfers did not complete."""
        for _ in range(QUICK_TESTS):
            if MPI.Request.Testall(requests):
                return

        def timed_out():
            MPI.Request.Testsome(requests)  # those that completed become null (falsy)
            silent = sorted({self._peer_of[id(request)] for request in requests if request})
            name = next((name for name, tag in TAGS.items() if tag == self.tag), f"tag {self.tag}")
            raise deadlines.deadline_error(
                f"rank {self.rank}", f"the {name}'s transfers with rank(s) {silent}", f"rank(s) {silent}",
                peers=tuple(silent), advice="A rank may have stopped or frozen, or its node may have lost the "
                                            "network. This communicator can no longer be used safely.")

        deadlines.wait_in_collective(lambda: MPI.Request.Testall(requests), self.mpi, "a transfer of an algorithm",
                                     timed_out)

    def sendrecv(self, send_offset: int, send_count: int, dest: int,
                 recv_into: BufferInfo, recv_offset: int, recv_count: int, source: int):
        """Send part of the call's buffer while receiving into `recv_into`; empty parts are skipped."""
        requests = []
        if recv_count:
            requests.append(self.irecv(recv_into, recv_offset, recv_count, source))
        if send_count:
            requests.append(self.isend(self.info, send_offset, send_count, dest))
        self.wait(requests)

    def exchange_and_reduce(self, send_offset: int, send_count: int, dest: int,
                            recv_offset: int, recv_count: int, source: int, slot: int = 0):
        """Send one range of the buffer to `dest` while receiving a peer's copy of another range
        from `source` and reducing it into place, segment by segment as segments arrive."""
        scratch = self.scratch(recv_count, slot) if recv_count else None
        receives = [(offset, count, self.irecv(scratch, offset, count, source))
                    for offset, count in segments(recv_count, self.info.itemsize)]
        sends = [self.isend(self.info, send_offset + offset, count, dest)
                 for offset, count in segments(send_count, self.info.itemsize)]
        for offset, count, request in receives:
            self.wait([request])
            self.reduce(self.info, recv_offset + offset, scratch, offset, count)
        self.wait(sends)


def finish_average(ctx: Context, op: str, offset: int = 0, count: int | None = None) -> None:
    """op="avg": divide elements [offset, offset + count) of the result by the rank count."""
    count = ctx.info.count - offset if count is None else count
    if op == "avg" and count:
        kernels.scale_ptr(ctx.info.ptr + offset * ctx.info.itemsize, count, ctx.info.dtype,
                          1.0 / ctx.size, device=ctx.info.device)
        if ctx.info.is_cuda:
            kernels.synchronize(ctx.info.device)


def kernel_op(op: str) -> str:
    """The kernels' op for a collective's op: an average is a sum, divided afterwards."""
    return "sum" if op == "avg" else op


def split_counts(count: int, parts: int):
    """(offset, count) of `parts` nearly equal chunks; the first count % parts get one more."""
    base, extra = divmod(count, parts)
    chunks, offset = [], 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        chunks.append((offset, size))
        offset += size
    return chunks


def segments(count: int, itemsize: int):
    """(offset, count) pieces of at most SEGMENT_BYTES; both sides of a transfer cut alike."""
    per_segment = max(1, SEGMENT_BYTES // itemsize)
    return [(offset, min(per_segment, count - offset)) for offset in range(0, count, per_segment)]


def largest_power_of_two_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def fold_in(ctx: Context):
    """Make a power-of-two group out of any rank count (Rabenseifner's first step).

    Of the first 2*rem ranks (rem = p - p2), each even rank hands its whole buffer to the odd
    rank above it and sits out; the others renumber to 0..p2-1. Returns (new rank or -1, p2).
    """
    p2 = largest_power_of_two_at_most(ctx.size)
    rem = ctx.size - p2
    n = ctx.info.count
    if ctx.rank < 2 * rem:
        if ctx.rank % 2 == 0:
            ctx.send(ctx.info, 0, n, ctx.rank + 1)
            return -1, p2
        scratch = ctx.scratch(n)
        ctx.recv(scratch, 0, n, ctx.rank - 1)
        ctx.reduce(ctx.info, 0, scratch, 0, n)
        return ctx.rank // 2, p2
    return ctx.rank - rem, p2


def real_rank(new_rank: int, ctx: Context, p2: int) -> int:
    rem = ctx.size - p2
    return new_rank * 2 + 1 if new_rank < rem else new_rank + rem


def fold_out(ctx: Context, new_rank: int, p2: int) -> None:
    """Give the ranks that sat out the finished result (the last step of fold_in's pairing)."""
    rem = ctx.size - p2
    if ctx.rank < 2 * rem:
        if new_rank < 0:
            ctx.recv(ctx.info, 0, ctx.info.count, ctx.rank + 1)
        else:
            ctx.send(ctx.info, 0, ctx.info.count, ctx.rank - 1)


def reduce_and_publish(dst: int, sources, nbytes: int, dtype: str, op: str, scale: float, publish) -> None:
    """dst = sources[0] op sources[1] op ... (dst may be one of them), times `scale` unless it is
    1, and copied to each address in `publish` (which may be sources too): one kernel call that
    does the three steps block by block while each block is in L1 (results/publish-cpu.md)."""
    kernels.reduce_many_to_ptr([dst, *publish], sources, nbytes // ITEMSIZE[dtype], dtype, op, scale)


def result_slot(slots: list, owner: int) -> int:
    """Where the reduced slice of local rank `owner` is published on one node (hierarchical.py,
    node_buckets.py): the other rank's slot with two ranks, over that rank's copy of the slice, which
    the reduction has just read, else the owner's own slot."""
    return slots[1 - owner] if len(slots) == 2 else slots[owner]
