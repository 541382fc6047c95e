"""Adasum all-reduce: adaptive summation of the ranks' vectors (Maleki et al., "Scaling
Distributed Training with Adaptive Summation", MLSys 2021; Horovod's op=hvd.Adasum).

Two vectors a and b combine into

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 where its vector's squared norm is below sqrt(DBL_MIN), as in Horovod):
the sum of orthogonal vectors, the mean of parallel ones. The combination is not associative, so
the order is part of the result: ranks pair as a binary tree, (0, 1), (2, 3), ... first, then the
pairs' results (0-1 with 2-3, ...), which needs a power-of-two rank count (Horovod refuses the
others too). Given `sizes`, the vector is several tensors laid end to end and each tensor gets
its own coefficients (Horovod's per-tensor Adasum of a fused buffer).

The tree runs as vector-halving, distance-doubling: at level L = 1, 2, 4, ... a rank exchanges
half of the part it holds with rank ^ L, keeps the other half, and combines its own copy of that
half with the partner's. The dot product and norms are over the whole vectors of the two
subtrees being combined, so each rank's partial sums (float64) are summed over the 2L ranks that
hold pieces of them (recursive doubling within that group: every rank adds the same two partial
sums at each step, so all hold the same bits). The combination is computed in float64 and
rounded to the dtype once per level. Last, the pieces travel back the same pairs (an allgather by
recursive doubling): each element is computed by one rank only, so every rank ends with the
same bits.

Bytes sent per rank: 2(p-1)/p n (n/2 + n/4 + ... on the way down and again on the way up), plus
24 bytes per tensor per step of the sums; 2 log2(p) exchanges with a partner and
log2(p)(log2(p)+1)/2 small exchanges for the sums.
"""
from __future__ import annotations

import sys

import numpy as np

from .. import buffers
from ..errors import InvalidArgumentError, UnsupportedDtypeError
from ..runtime.deadlines import wait_for_request
from ..runtime.mpi import MPI
from .callcheck import check_same_call, checked_in_order, signature
from .common import TAGS, started
from .staging import staged

ADASUM_DTYPES = ("float16", "float32", "float64")
# Below this squared norm a vector counts as zero and keeps its coefficient 1 (Horovod's bound).
TINY_NORM_SQUARED = np.sqrt(sys.float_info.min)


def adasum_allreduce(comm, array, sizes=None):
    """Adasum of `array` over the ranks of `comm`, in place; returns the array. `sizes`: the
    element counts of the tensors laid end to end in it (default: one tensor)."""
    return checked_in_order(comm, lambda: check_adasum(comm, array, sizes),
                            lambda channel, info, sizes: _run(channel, array, info, sizes))


def check_adasum(comm, array, sizes):
    info = buffers.describe(array)
    buffers.check_writable(array, "Adasum writes its result into the array (in place)")
    if info.dtype not in ADASUM_DTYPES:
        raise UnsupportedDtypeError(f"Adasum combines floating-point vectors of {', '.join(ADASUM_DTYPES)}; "
                                    f"got {info.dtype}")
    if comm.size & (comm.size - 1):
        raise InvalidArgumentError(
            f"Adasum needs a power-of-two number of ranks (its pairs form a binary tree); this "
            f"communicator has {comm.size}")
    sizes = [info.count] if sizes is None else [int(s) for s in sizes]
    if any(s < 0 for s in sizes) or sum(sizes) != info.count:
        raise InvalidArgumentError(f"Adasum sizes {sizes} must be counts >= 0 adding up to the array's "
                                   f"{info.count} elements")
    return info, sizes


def _run(channel, array, info, sizes):
    check_same_call(channel, channel.mpi, signature("adasum", info, row_shape=tuple(sizes)), row_shape=tuple(sizes))
    if channel.size == 1 or info.count == 0:
        return array
    with staged(channel, array, info, host_only=True) as work:
        # The partner's halves arrive in the channel's reusable scratch (at most half the data).
        received = buffers.as_numpy(channel.scratch.get(work, (info.count + 1) // 2 * info.itemsize))
        AdasumTree(channel, buffers.as_numpy(work), received, sizes).run()
    return array


class AdasumTree:
    """One Adasum call on one rank: `data` (a NumPy view of the host buffer) is combined in place;
    `received` (at least half its length) takes the partner's halves."""

    def __init__(self, channel, data: np.ndarray, received: np.ndarray, sizes):
        self.mpi = channel.mpi
        self.rank = channel.rank
        self.size = channel.size
        self.data = data
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.received = received

    def run(self) -> None:
        low, high = 0, self.data.size
        steps = []
        level = 1
        while level < self.size:
            partner = self.rank ^ level
            middle = low + (high - low) // 2
            left = not self.rank & level  # holds the lower subtree's vector
            keep, give = ((low, middle), (middle, high)) if left else ((middle, high), (low, middle))
            theirs = self.received[:keep[1] - keep[0]]
            self._exchange(self.data[give[0]:give[1]], theirs, partner)
            mine = self.data[keep[0]:keep[1]]
            lower, upper = (mine, theirs) if left else (theirs, mine)
            sums = self._group_sums(self._partial_sums(keep[0], lower, upper), level)
            self._combine(keep[0], lower, upper, sums)
            steps.append((keep, give, partner))
            low, high = keep
            level *= 2
        for keep, give, partner in reversed(steps):  # the allgather: the same pairs, back up
            self._exchange(self.data[keep[0]:keep[1]], self.data[give[0]:give[1]], partner)

    def _tensors_in(self, start: int, length: int):
        """(tensor index, first, last) of each tensor overlapping elements [start, start + length),
        first and last relative to `start`."""
        end = start + length
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        for index in range(max(first, 0), len(self.starts) - 1):
            low, high = max(self.starts[index], start), min(self.starts[index + 1], end)
            if low >= end:
                break
            if low < high:
                yield index, low - start, high - start

    def _partial_sums(self, start: int, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
        """Per tensor: this rank's part of lower.upper, |lower|^2 and |upper|^2, in float64."""
        sums = np.zeros((len(self.starts) - 1, 3), dtype=np.float64)
        for index, first, last in self._tensors_in(start, lower.size):
            a = lower[first:last].astype(np.float64, copy=False)
            b = upper[first:last].astype(np.float64, copy=False)
            sums[index] = (np.dot(a, b), np.dot(a, a), np.dot(b, b))
        return sums

    def _group_sums(self, sums: np.ndarray, level: int) -> np.ndarray:
        """Sum `sums` over the 2 * level ranks merging their subtrees (recursive doubling)."""
        other = np.empty_like(sums)
        distance = 1
        while distance <= level:
            self._exchange(sums, other, self.rank ^ distance)
            sums = sums + other  # a + b == b + a in floating point: both partners get the same bits
            distance *= 2
        return sums

    def _combine(self, start: int, lower: np.ndarray, upper: np.ndarray, sums: np.ndarray) -> None:
        for index, first, last in self._tensors_in(start, lower.size):
            dot, lower_norm, upper_norm = sums[index]
            lower_coefficient = 1.0 - dot / (2 * lower_norm) if lower_norm >= TINY_NORM_SQUARED else 1.0
            upper_coefficient = 1.0 - dot / (2 * upper_norm) if upper_norm >= TINY_NORM_SQUARED else 1.0
            combined = (lower_coefficient * lower[first:last].astype(np.float64)
                        + upper_coefficient * upper[first:last].astype(np.float64))
            self.data[start + first:start + last] = combined  # rounded to the dtype once

    def _exchange(self, send: np.ndarray, receive: np.ndarray, partner: int) -> None:
        requests = []
        if receive.size:
            requests.append(started(self.mpi.Irecv([receive, MPI.BYTE], source=partner, tag=TAGS["adasum"])))
        if send.size:
            requests.append(started(self.mpi.Isend([send, MPI.BYTE], dest=partner, tag=TAGS["adasum"])))
        for request in requests:
            wait_for_request(request, f"rank {self.mpi.Get_rank()}", f"the Adasum exchange with rank {partner}",
                             f"rank {partner}", peers=(partner,))
