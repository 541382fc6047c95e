"""Shared-memory all-reduce of fixed buffers on one node, advanced by polling from the caller's
thread: the gradient buckets' all-reduce when every rank shares one node.

The steps are the node window's sliced all-reduce (node_window.py, csrc/node_steps.h), run in
the extension. What differs is how the ranks wait for each other: instead of waiting in each
round, the caller advances the all-reduce with progress(), which runs the steps with patience 0
(whatever the other ranks' counters allow) and never blocks. GradientBuckets calls it from its
gradient hooks, so with one core per rank the exchange happens between the layers of backward,
with no thread to schedule and no core spent spinning while a peer computes.

A bucket's buffer may be several arrays (its gradients, laid end to end): the copies and the
reduction then work on the gradients where they lie, with no packing into a flat buffer.

Each bucket has its own slot per rank and its own counter per rank, kept for the life of the
buckets, so all buckets can be in flight at once. Call c of a bucket is the window's rounds 2c-1
(copied in) and 2c (reduced slice published) on the bucket's counters. One slot per bucket is
enough because the calls of a bucket never overlap: a rank starts call c+1 only after finishing
call c, and it writes into its slot in call c+1 (1) the other ranks' slices, which those ranks
read in call c before publishing it, and this rank has seen them publish; (2) its own slice,
only once every rank's counter says it has started call c+1, so has finished copying call c's
result out. With two ranks each publishes into the other's slot (node_window.py's result_slot),
so each slot only ever holds the other rank's half: half the shared memory in use, which the
caches feel (training-cpu.md). It is safe because a rank writes that half in call c+1 only after
its own copy-out of call c, and the other rank publishes into it only after seeing this rank's
copy-in of call c+1.

With results_in_slots (DataParallel's gradient_as_bucket_view) every rank writes its reduced slice
into its own slot and into every other rank's, over the contribution to that slice it has just
read there, so each slot ends with the whole result and the caller's gradients become views of
its slot: no copy-out. The arrays given to start() are then only read, and may be those views;
the copy-in skips them. Safe for the same reason as above: nobody writes a rank's slot from the
end of its call c until its copy-in of call c+1, so between the two its gradients (the views) are
its own, and backward may accumulate into them.
"""
from __future__ import annotations

import os
import time
import weakref

import numpy as np

from .. import _C
from ..buffers import describe
from ..errors import InvalidArgumentError
from ..runtime.mpi import load_mpi
from .common import kernel_op
from .node_window import COUNTER_BYTES, wait_for_counters, yield_seconds, zero_counters


class ReleasedWindows:
    """The windows of one node communicator whose NodeSlots this rank no longer uses.

    A NodeSlots lives as long as anything refers to it (its buckets, a pending all-reduce, a
    gradient that is a view of a slot) and is dropped at a different moment on each rank, while
    freeing its window is collective. So a dropped NodeSlots only puts its window here, and each
    new NodeSlots on the communicator (a collective step) first frees the windows that every rank
    has put here: memory is given back before more is taken, and a program that builds
    DataParallel again and again holds at most the windows still in use plus the ones dropped
    since the last construction.
    """

    def __init__(self, node_comm):
        self.node_comm = node_comm  # kept alive: the registry is keyed by its id()
        self.created = 0  # windows made on this communicator; the same count on every rank
        self.windows = {}  # window number -> MPI window, released on this rank

    def release(self, number: int, win) -> None:
        self.windows[number] = win

    def free_common(self) -> int:
        """Free the windows every rank has released (collective over the node communicator);
        returns how many."""
        everyone = self.node_comm.allgather(sorted(self.windows))
        common = sorted(set(everyone[0]).intersection(*everyone[1:]))
        for number in common:  # the same windows in the same order on every rank
            win = self.windows.pop(number)
            win.Unlock_all()
            win.Free()
        return len(common)


_released = {}  # id(node communicator) -> its ReleasedWindows


def free_released_windows(node_comm) -> None:
    """Before `node_comm` itself is freed: free the windows of its dropped NodeSlots that every
    rank has released (collective over it) and forget it, so the registry keeps neither alive."""
    registry = _released.pop(id(node_comm), None)
    if registry is not None and registry.node_comm is node_comm:
        registry.free_common()


def forget_released_windows(node_comm) -> None:
    """Forget `node_comm`'s released windows without freeing them: it lost a rank, so no
    collective can run on it (Communicator.abandon)."""
    _released.pop(id(node_comm), None)


def released_windows(node_comm) -> ReleasedWindows:
    registry = _released.get(id(node_comm))
    if registry is None or registry.node_comm is not node_comm:
        registry = _released[id(node_comm)] = ReleasedWindows(node_comm)
    return registry


class NodeSlots:
    """One shared window for a fixed list of buffer sizes: per rank, a counter and a slot for each.

    With `results_in_slots`, each all-reduce leaves its result in this rank's slot of the bucket
    (address(index), the arrays laid end to end) and only reads the arrays it was given, which may
    be views of that slot: no copy-out. Collective over the node communicator; every local rank
    must pass the same sizes and the same `results_in_slots` (checked, with the same error on
    every rank). A NodeSlots no longer referred to gives its window back at the next NodeSlots
    construction on the same communicator (ReleasedWindows), or free() gives it back at once.
    """

    def __init__(self, node_comm, sizes, results_in_slots: bool = False):
        self.node_comm = node_comm
        self.local_rank = node_comm.Get_rank()
        self.local_size = node_comm.Get_size()
        self.results_in_slots = bool(results_in_slots)
        sizes = [int(s) for s in sizes]
        check_same_layout(node_comm, sizes, self.results_in_slots)
        header = (len(sizes) * COUNTER_BYTES + 4095) // 4096 * 4096
        offsets, position = [], header
        for size in sizes:
            offsets.append(position)
            position += (size + 63) // 64 * 64
        registry = released_windows(node_comm)
        registry.free_common()
        MPI = load_mpi()
        self.win = MPI.Win.Allocate_shared(position, 1, comm=node_comm)
        self.number = registry.created
        registry.created += 1
        self._release = weakref.finalize(self, registry.release, self.number, self.win)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        bases = [self.win.Shared_query(k)[0].address for k in range(self.local_size)]
        zero_counters(self.win, bases[self.local_rank], header, node_comm)
        # counters[b][k] / slots[b][k]: bucket b's counter and slot in local rank k's segment.
        self.counters = [[base + b * COUNTER_BYTES for base in bases] for b in range(len(sizes))]
        self.slots = [[base + offset for base in bases] for offset in offsets]
        self.sizes = sizes
        self.calls = [0] * len(sizes)
        self.yield_seconds = yield_seconds(node_comm.allgather(os.sched_getaffinity(0)), self.local_size)

    def start(self, index: int, arrays, op: str) -> "PolledAllreduce":
        """Start the all-reduce of bucket `index`: `arrays` (contiguous CPU arrays of one dtype,
        reduced as if laid end to end) with op sum, avg, min, max or prod. The result replaces the
        arrays, or with results_in_slots is left in this rank's slot."""
        infos = [describe(a) for a in arrays]
        if any(info.device != "cpu" for info in infos):
            raise InvalidArgumentError(f"bucket {index}: the shared slots hold host memory; got a {infos[0].device} array")
        if len({info.dtype for info in infos}) != 1:
            raise InvalidArgumentError(f"bucket {index} mixes dtypes {sorted({i.dtype for i in infos})}")
        nbytes = sum(info.nbytes for info in infos)
        if nbytes != self.sizes[index]:
            raise InvalidArgumentError(
                f"bucket {index} holds {nbytes} bytes but its shared slot was made for {self.sizes[index]}")
        self.calls[index] += 1
        segments = [(info.ptr, info.nbytes) for info in infos]
        return PolledAllreduce(self, index, self.calls[index], segments, infos[0].dtype, kernel_op(op),
                               average=op == "avg")

    def address(self, index: int) -> int:
        """Where this rank's slot of bucket `index` starts."""
        return self.slots[index][self.local_rank]

    def free(self) -> None:
        """Free the window now (collective over the node communicator)."""
        if self.win is not None:
            self._release.detach()
            self.win.Unlock_all()
            self.win.Free()
            self.win = None


def check_same_layout(node_comm, sizes, results_in_slots: bool) -> None:
    heads = np.empty((node_comm.Get_size(), 2), dtype=np.int64)  # per rank: bucket count, mode
    node_comm.Allgather(np.array([len(sizes), int(results_in_slots)], dtype=np.int64), heads)
    lengths, modes = heads[:, 0], heads[:, 1]
    if (modes != modes[0]).any():
        raise InvalidArgumentError(
            "gradient_as_bucket_view differs between ranks of this node: "
            f"{[bool(m) for m in modes]} by local rank; pass the same value on every rank")
    if (lengths != lengths[0]).any():
        raise InvalidArgumentError(
            f"ranks of this node have different numbers of gradient buckets: {lengths.tolist()} "
            "(is the model the same on every rank?)")
    mine = np.array([len(sizes)] + sizes, dtype=np.int64)
    table = np.empty((node_comm.Get_size(), mine.size), dtype=np.int64)
    node_comm.Allgather(mine, table)
    differing = [k for k in range(table.shape[0]) if (table[k] != mine).any()]
    if (table != table[0]).any():
        raise InvalidArgumentError(
            f"gradient bucket sizes differ between ranks of this node (local ranks {differing} differ "
            f"from this one): bytes per bucket {table[:, 1:].tolist()} (is the model the same on every rank?)")


class PolledAllreduce:
    """One all-reduce of one bucket (in place, or into the slots with results_in_slots), the
    node window's sliced steps run with patience 0: progress() advances it without blocking,
    wait() finishes it. The copy-in happens at once, in the constructor."""

    def __init__(self, slots: NodeSlots, index: int, call: int, segments, dtype: str, op: str, average: bool):
        self.slots = slots
        self.index = index
        self.started = time.perf_counter()
        self.finished = None
        scale = 1.0 / slots.local_size if average else 1.0
        # Call c takes the window's rounds 2c-1 and 2c on the bucket's counters.
        self.round = 2 * (call - 1)
        self.call = (slots.slots[index], slots.counters[index], slots.local_rank, self.round, segments, dtype, op,
                     scale, slots.results_in_slots)
        self.others = [counter for k, counter in enumerate(slots.counters[index]) if k != slots.local_rank]
        self.step = _C.node_bucket_allreduce(*self.call, 0, 0.0, 1)  # the copy-in, then round 2c-1 published

    def done(self) -> bool:
        return self.finished is not None

    def progress(self) -> bool:
        """Do every step the other ranks' counters allow; True once the result is in place."""
        if self.finished is not None:  # done already: the hooks keep asking
            return True
        # Every gradient hook asks: the counters first, so that a step no rank allows yet costs
        # no handing over of the bucket's segments.
        if not _C.counters_reached(self.others, self.waited_round()):
            return False
        self.step = _C.node_bucket_allreduce(*self.call, self.step, 0.0)
        if self.step < 0:
            self.finished = time.perf_counter()
        return self.finished is not None

    def wait(self) -> None:
        # Yield, then nap: with more ranks than cores a spinning rank takes the core its peer
        # needs to catch up (naps made benchmarks/training.py's steps shorter than yielding
        # alone, benchmarks/results/training-cpu.md). With a core per rank the yielding lasts
        # longer (yield_seconds).
        if self.progress():  # finished already, in the gradient hooks: no wait to publish
            return
        slots = self.slots
        wait_for_counters(slots.counters[self.index], slots.local_rank, self.waited_round(), slots.node_comm,
                          f"the all-reduce of gradient bucket {self.index}",
                          "They stopped before reaching it (different numbers of backward passes?)",
                          slots.yield_seconds, polled=self)

    def waited_round(self) -> int:
        """The round of the bucket's counters the unfinished step waits for."""
        return self.round + self.step
