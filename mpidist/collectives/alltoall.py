"""All-to-all: rank r sends the k-th block of rows of its array (the first dimension cut by
`splits`, or into equal blocks) to rank k, and receives every rank's r-th block, in rank order.

Two exchanges of the MPI library: MPI_Alltoall of the row counts (with each rank's dtype and
bytes per row, so that ranks whose rows differ all raise instead of misreading each other's
bytes, even with the call check off), then MPI_Alltoallv of the rows as typed buffers (one MPI
datatype per row: counts stay small however large the rows). Bytes sent per rank: the rows it
gives away.
"""
from __future__ import annotations

import contextlib

import numpy as np

from .. import buffers
from ..buffers import BufferInfo
from ..errors import InvalidArgumentError, MismatchError
from ..runtime.mpi import MPI
from ..runtime.wire import DTYPES, code_of
from .callcheck import check_same_call, checked_in_order, signature
from .staging import staged


def alltoall(comm, array, splits=None):
    """(received array, received row counts by rank as an int64 NumPy array) for `array`'s rows
    sent `splits[k]` to rank k (equal blocks without `splits`). The received array is a new array
    of the same kind, dtype and device."""
    return checked_in_order(comm, lambda: check_alltoall(comm, array, splits),
                            lambda channel, info, send_rows: _run(channel, array, info, send_rows))


def check_alltoall(comm, array, splits):
    """The array's description and the rows it sends to each rank (refused locally when wrong)."""
    info = buffers.describe(array)
    if len(array.shape) == 0:
        raise InvalidArgumentError("alltoall splits the first dimension: give an array of at least one dimension")
    rows = int(array.shape[0])
    if splits is None:
        if rows % comm.size:
            raise InvalidArgumentError(f"alltoall without splits= divides the first dimension ({rows}) "
                                       f"evenly over the {comm.size} ranks; pass splits=")
        return info, np.full(comm.size, rows // comm.size, dtype=np.int64)
    requested = np.asarray(list(splits))
    if requested.size and requested.dtype.kind not in "iu":  # a float count would be truncated unseen
        raise InvalidArgumentError(f"alltoall splits={requested.tolist()} must be integers (row counts), "
                                   f"got {requested.dtype}")
    send_rows = requested.astype(np.int64).reshape(-1)
    if len(send_rows) != comm.size or (send_rows < 0).any() or send_rows.sum() != rows:
        raise InvalidArgumentError(f"alltoall splits={send_rows.tolist()} must give one row count >= 0 "
                                   f"per rank ({comm.size}) summing to the first dimension ({rows})")
    return info, send_rows


def _run(channel, array, info, send_rows):
    row_shape = tuple(int(n) for n in array.shape[1:])
    # The first dimension may differ, so the count is not part of the check (as allgather's).
    check_same_call(channel, channel.mpi, signature("alltoall", BufferInfo(0, 0, info.dtype, info.device, info.kind),
                                                    row_shape=row_shape), row_shape)
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * info.itemsize
    dtype_code = code_of(info.dtype)
    mine = np.stack([send_rows, np.full(channel.size, row_bytes, dtype=np.int64),
                     np.full(channel.size, dtype_code, dtype=np.int64)], axis=1)
    theirs = np.empty_like(mine)
    channel.mpi.Alltoall([mine, MPI.INT64_T], [theirs, MPI.INT64_T])
    if (theirs[:, 2] != dtype_code).any():
        raise MismatchError(f"alltoall: ranks differ in dtype (by rank {[DTYPES[code] for code in theirs[:, 2]]}); "
                            "every rank must pass the same dtype")
    if (theirs[:, 1] != row_bytes).any():
        raise MismatchError(f"alltoall: ranks differ in row shape (bytes per row by rank "
                            f"{theirs[:, 1].tolist()}); every rank must pass the same shape except the first "
                            "dimension")
    received_rows = theirs[:, 0].copy()
    out = buffers.new_array(array, (int(received_rows.sum()),) + row_shape)
    if row_bytes:
        out_info = buffers.describe(out)
        with staged(channel, array, info) as source, _received_into(channel, out, out_info) as target:
            _exchange_rows(channel.mpi, source, send_rows, target, received_rows, row_bytes)
    return out, received_rows


@contextlib.contextmanager
def _received_into(channel, out, out_info: BufferInfo):
    """The memory MPI receives into: the output itself, or a pinned host buffer (a slot of its
    own, beside the staged input's) copied to the GPU after."""
    if out_info.is_cuda and not channel.is_cuda_aware():
        host = channel.staging.host_buffer(out_info.nbytes, slot=1)
        view = BufferInfo(host.data_ptr(), out_info.count, out_info.dtype, "cpu", "torch")
        yield view
        channel.staging.stage_out(out, out_info, view)
        return
    yield out_info


def _exchange_rows(mpi, source: BufferInfo, send_rows, target: BufferInfo, received_rows, row_bytes: int) -> None:
    row = MPI.BYTE.Create_contiguous(row_bytes).Commit()
    try:
        mpi.Alltoallv([_memory(source), (send_rows.tolist(), _offsets(send_rows)), row],
                      [_memory(target), (received_rows.tolist(), _offsets(received_rows)), row])
    finally:
        row.Free()


def _memory(info: BufferInfo):
    # An empty buffer may have no address at all; MPI reads none of it.
    return MPI.buffer.fromaddress(info.ptr, info.nbytes) if info.nbytes else MPI.BOTTOM


def _offsets(rows) -> list:
    return np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64).tolist()
