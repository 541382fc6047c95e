"""The node window: the protocol by which the ranks of one node run a collective through memory
they all map, whatever that memory is.

Every local rank has a slot (two on one node of more than two ranks: NodeWindow.next_slots says
why) in a window that every other local rank can read and write. The ranks order their steps by
flags: a 64-bit counter per local rank in host shared memory, which only grows. sync() is the
one ordering step: the rank makes its own writes complete (settle()), raises its counter to the
next round, and waits until every other local rank's counter has reached it; a rank that does
not arrive within MPIDIST_TIMEOUT is named in a DeadlineError, so nobody spins forever on a flag.
Every local rank calls sync() as many times in the same order, so the rounds agree.

The memory is a backend with five operations (allocate, copy, reduce_and_publish, settle, free);
copies and reductions may run asynchronously (on a CUDA stream) until settle() returns:
HostMemory here (an MPI-3 shared-memory window: the CPU path, and the stand-in that CI runs) and
DeviceMemory in device_window.py (GPU memory shared through CUDA IPC). The rounds, slices and
flags below are the same for both; only the memory and what settle() waits for differ.

The collectives, on one node (L local ranks, the buffer cut into L slices by split_counts):
- all-reduce: each rank copies into its slot the L-1 slices the others reduce; sync; it reduces
  its own slice of its own buffer and the others' slots in local-rank order (one k-way pass, so
  every rank gets the same bits), publishing the result; sync; it copies the others' results out.
  In host memory a message of at most the window's one_shot_bytes (`mpidist tune` measures it,
  else ONE_SHOT_BYTES) goes one-shot instead: each rank copies its whole buffer into a slot of
  the one-shot's own (next_one_shot_slots); sync; each reduces every such slot, in local-rank
  order, into its buffer.
  In host memory the whole call is one call into the extension (csrc/node_steps.h: the same
  steps and rounds, written once in C++, with the GIL released); it polls the flags for the
  window's yield time and hands a longer wait to sync's own (wait_for_round), then goes on.
- reduce-scatter: the all-reduce's first half (the others' chunks in, sync, the own chunk reduced
  into the output), then a sync, after which nobody reads the slots any more.
- broadcast: the root copies its buffer into its slot; sync; the others copy it out; sync.
- allgather: each rank copies its chunk into its slot; sync; each copies every other chunk out;
  sync.
"""
from __future__ import annotations

import ctypes
import os

from .. import _C
from ..buffers import BufferInfo
from ..runtime.deadlines import deadline_error, wait_in_collective
from ..runtime.mpi import load_mpi
from .common import reduce_and_publish, result_slot, split_counts
from .node_buckets import COUNTER_BYTES, NAP_SECONDS, yield_seconds

# Up to this size a host-memory all-reduce on one node goes one-shot: one round instead of two,
# each rank reducing the whole message (benchmarks/results/node-protocol-cpu.md), unless the
# tuning file has a bound measured for the rank count (select.py).
ONE_SHOT_BYTES = 64 * 1024


class HostMemory:
    """Slots in an MPI-3 shared-memory window of host memory."""

    device = "cpu"
    # Whether the all-reduce's steps run in the extension, which copies and reduces with the CPU
    # itself: a memory whose copies differ from the CPU's (a test's deferred ones) says False.
    steps_in_extension = True

    def __init__(self, node_comm):
        self.node_comm = node_comm
        self.win = None

    def allocate(self, nbytes: int) -> list:
        """Give this rank `nbytes` (collective over the node); the base of every local rank's
        memory, in local-rank order."""
        MPI = load_mpi()
        self.win = MPI.Win.Allocate_shared(nbytes, 1, comm=self.node_comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        return [self.win.Shared_query(k)[0].address for k in range(self.node_comm.Get_size())]

    @staticmethod
    def copy(dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    @staticmethod
    def reduce_and_publish(dst: int, sources, nbytes: int, dtype: str, op: str, scale: float, publish) -> None:
        reduce_and_publish(dst, sources, nbytes, dtype, op, scale, publish)

    def settle(self) -> None:
        """The CPU's stores are complete when they return; store_counter's fence orders them."""

    def free(self) -> None:
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.win = None


class Flags:
    """One counter per local rank, each on a cache line of its own, in host shared memory: made
    once per window and never regrown, so the rounds go on across growths of the slots."""

    def __init__(self, node_comm):
        self.memory = HostMemory(node_comm)
        self.counters = self.memory.allocate(COUNTER_BYTES)
        me = node_comm.Get_rank()
        ctypes.memset(self.counters[me], 0, COUNTER_BYTES)
        self.memory.win.Sync()
        node_comm.Barrier()  # every counter is zero before anyone raises one
        self.memory.win.Sync()

    def free(self) -> None:
        self.memory.free()


class NodeWindow:
    """The window of one node: every local rank's slots, of `capacity` bytes each, in `memory`
    (a backend: HostMemory or device_window.DeviceMemory), and the flags that order the rounds.

    With `alternates` (one node of more than two ranks) every rank has two slots, one in each half
    of its memory, and consecutive calls alternate between them; with `result_region` local rank 0
    holds a result region of `capacity` bytes after its slot (the hierarchical all-reduce across
    nodes). The one-shot all-reduce in host memory, of messages up to `one_shot_bytes`, has slots
    of its own (next_one_shot_slots). Collective over `node_comm`: made at the same call on every
    local rank."""

    def __init__(self, node_comm, memory, alternates: bool, result_region: bool = False,
                 one_shot_bytes: int = ONE_SHOT_BYTES):
        self.node_comm = node_comm
        self.memory = memory
        self.local_rank = node_comm.Get_rank()
        self.local_size = node_comm.Get_size()
        self.alternates = alternates
        self.result_region = result_region
        self.capacity = 0
        self.calls = 0
        self.bases: list = []
        self.result = None
        self.flags = Flags(node_comm)
        self.rounds = 0
        self.one_shot_bytes = one_shot_bytes
        self.one_shot_memory = None
        self.one_shot_bases: list = []
        self.one_shot_capacity = 0
        self.one_shot_calls = 0
        self.yield_seconds = yield_seconds(node_comm.allgather(os.sched_getaffinity(0)), self.local_size)

    def next_slots(self, nbytes: int) -> list:
        """The slot addresses (in local-rank order) this call uses: consecutive calls alternate
        between the two halves of the window.

        On one node a rank leaves the call as soon as it has copied the results out of the other
        ranks' slots, with no sync behind it, so a fast rank starts its next call while a slow
        one may still be copying. Had the next call the same slots and another message size,
        its slices would lie elsewhere and the fast rank's copy-in could overwrite a result the
        slow rank has not read yet. The next call uses the other half; the one after it comes
        back to this half only after every rank has passed the syncs of the call between,
        so after every rank has finished reading this one. Every rank makes the same calls in
        the same order, so all agree on the half.

        Two ranks need no second half: each reads the results out of its own slot, so a rank's
        next copy-in overwrites only what it has read itself, and its peer writes there again
        only after the next call's first sync. Across nodes the slots are read only before the
        second sync, and the result region is rewritten only after the next call's first
        sync, which every rank reaches only once it has copied the result out."""
        self.ensure(nbytes)
        if not self.alternates:
            return list(self.bases)
        half = self.calls % 2 * self.capacity
        self.calls += 1
        return [base + half for base in self.bases]

    def next_one_shot_slots(self, nbytes: int) -> list:
        """The slots (in local-rank order, `nbytes` at least) of this one-shot all-reduce, in
        host memory of their own, made at the first one-shot call and grown as ensure() grows the
        others (collective over the node).

        A one-shot call has a single sync, after which every rank reads every other's slot, so
        a fast rank's next one-shot call could overwrite a slot a slow rank is still reading:
        consecutive one-shot calls alternate between two halves, and the one after the next
        comes back to this half only after every rank has passed the next one's sync, so after
        every rank has read this one. The other calls never touch these slots; theirs the
        one-shot never touches."""
        if nbytes > self.one_shot_capacity:
            capacity = (max(nbytes, 2 * self.one_shot_capacity, 4096) + 63) // 64 * 64
            if self.one_shot_memory is not None:
                self.sync()  # nobody may still be reading the old slots
                self.one_shot_memory.free()
            self.one_shot_memory = HostMemory(self.node_comm)
            self.one_shot_bases = self.one_shot_memory.allocate(2 * capacity)
            self.one_shot_capacity = capacity
        half = self.one_shot_calls % 2 * self.one_shot_capacity
        self.one_shot_calls += 1
        return [base + half for base in self.one_shot_bases]

    def ensure(self, nbytes: int) -> None:
        """Grow the slots to hold `nbytes` each (collective over the node; every local rank has
        the same message size, so all decide alike). The memory is given back and made anew,
        so a device backend exports it again."""
        if self.bases and nbytes <= self.capacity:
            return
        capacity = max(nbytes, 2 * self.capacity, 4096)
        capacity = (capacity + 63) // 64 * 64
        if self.bases:
            self.sync()  # nobody may still be copying out of the old memory
        self.memory.free()
        self.bases = []
        slots = 2 if self.alternates else 1
        extra = capacity if self.result_region and self.local_rank == 0 else 0
        self.bases = self.memory.allocate(slots * capacity + extra)
        self.result = self.bases[0] + capacity if self.result_region else None
        self.capacity = capacity

    def sync(self) -> None:
        """Every local rank's writes before its sync() are visible to every other one after it."""
        self.memory.settle()
        self.rounds += 1
        _C.store_counter(self.flags.counters[self.local_rank], self.rounds)
        self.wait_for_round(self.rounds)

    def wait_for_round(self, round_: int) -> None:
        """Wait until every other local rank has reached `round_`; one that does not within
        MPIDIST_TIMEOUT is named in a DeadlineError."""
        counters = self.flags.counters
        others = [counter for k, counter in enumerate(counters) if k != self.local_rank]
        if _C.counters_reached(others, round_):
            return
        what = f"round {round_} of the node window"

        def timed_out():
            behind = [k for k, counter in enumerate(counters)
                      if k != self.local_rank and not _C.counters_reached([counter], round_)]
            raise deadline_error(f"local rank {self.local_rank}", what, f"local ranks {behind} of this node",
                                 peers=behind, advice="They stopped before reaching it (an error, or another "
                                                      "collective); this communicator can no longer be used safely.")

        wait_in_collective(lambda: _C.counters_reached(others, round_), self.node_comm, what, timed_out,
                           self.yield_seconds, NAP_SECONDS)

    def free(self) -> None:
        """Give the memory and the flags back (collective over the node)."""
        self.memory.free()
        self.bases = []
        self.capacity = 0
        if self.one_shot_memory is not None:
            self.one_shot_memory.free()
            self.one_shot_memory = None
            self.one_shot_capacity = 0
        if self.flags is not None:
            self.flags.free()
            self.flags = None


def slices_of(count: int, parts: int, itemsize: int) -> list:
    """(byte offset, byte length) of each local rank's slice of `count` elements."""
    return [(offset * itemsize, part * itemsize) for offset, part in split_counts(count, parts)]


def copy_in_others(window: NodeWindow, slot: int, info: BufferInfo, slices) -> None:
    """Copy into this rank's slot the slices the other local ranks reduce, where they lie."""
    for k, (start, length) in enumerate(slices):
        if k != window.local_rank and length:
            window.memory.copy(slot + start, info.ptr + start, length)


def allreduce_on_node(window: NodeWindow, info: BufferInfo, op: str, scale: float = 1.0) -> None:
    """All-reduce `info` in place among the window's ranks (one node), its result times `scale`."""
    if getattr(window.memory, "steps_in_extension", False):
        host_allreduce_on_node(window, info.ptr, info.nbytes, info.count, info.dtype, op, scale)
        return
    me = window.local_rank
    slots = window.next_slots(info.nbytes)
    slices = slices_of(info.count, window.local_size, info.itemsize)
    copy_in_others(window, slots[me], info, slices)
    window.sync()
    start, length = slices[me]
    if length:
        # reduce_many loads every operand of an element before storing it, so its destination may
        # be one of its sources: this rank's own buffer, or (two ranks) the peer's slot.
        sources = [info.ptr + start if k == me else slot + start for k, slot in enumerate(slots)]
        window.memory.reduce_and_publish(info.ptr + start, sources, length, info.dtype, op, scale,
                                         [result_slot(slots, me) + start])
    window.sync()
    for k, (offset, size) in enumerate(slices):
        if k != me and size:
            window.memory.copy(info.ptr + offset, result_slot(slots, k) + offset, size)
    window.memory.settle()  # the result is in place when this returns


def host_allreduce_on_node(window: NodeWindow, address: int, nbytes: int, count: int, dtype: str, op: str,
                           scale: float) -> None:
    """allreduce_on_node in host memory, of `count` elements of `dtype` (`nbytes` in all) at
    `address` (the small-message fast path calls it so): the steps run in the extension
    (csrc/node_steps.h), which returns a step whose round some rank has not reached yet; this
    waits for it, with the deadline, and the extension goes on from that step."""
    one_shot = nbytes <= window.one_shot_bytes
    slots = window.next_one_shot_slots(nbytes) if one_shot else window.next_slots(nbytes)
    call = (slots, window.flags.counters, window.local_rank, window.rounds, address, count, dtype, op, scale,
            one_shot)
    step = _C.node_allreduce(*call, 0, window.yield_seconds)
    while step >= 0:
        window.wait_for_round(window.rounds + step)
        step = _C.node_allreduce(*call, step, window.yield_seconds)
    window.rounds += _C.node_allreduce_rounds(one_shot)


def reduce_scatter_on_node(window: NodeWindow, info: BufferInfo, chunks, out: BufferInfo, op: str,
                           scale: float = 1.0) -> None:
    """Reduce `info` among the window's ranks; local rank r gets chunk r (`chunks`: (offset, count)
    in elements per rank) of the result, times `scale`, in `out`. `info` is only read."""
    me = window.local_rank
    slots = window.next_slots(info.nbytes)
    itemsize = info.itemsize
    slices = [(offset * itemsize, count * itemsize) for offset, count in chunks]
    copy_in_others(window, slots[me], info, slices)
    window.sync()
    start, length = slices[me]
    if length:
        sources = [info.ptr + start if k == me else slot + start for k, slot in enumerate(slots)]
        window.memory.reduce_and_publish(out.ptr, sources, length, info.dtype, op, scale, [])
    window.sync()  # the others have read this rank's slot


def broadcast_on_node(window: NodeWindow, info: BufferInfo, root: int) -> None:
    """Give every local rank local rank `root`'s `info`, in place."""
    slots = window.next_slots(info.nbytes)
    if window.local_rank == root:
        window.memory.copy(slots[root], info.ptr, info.nbytes)
    window.sync()
    if window.local_rank != root:
        window.memory.copy(info.ptr, slots[root], info.nbytes)
    window.sync()  # the root's slot has been read


def allgather_on_node(window: NodeWindow, out: BufferInfo, chunks) -> None:
    """Local rank k's chunk of `out` (`chunks`: (offset, count) in elements per rank; this rank's
    own already in place) into every rank's `out`."""
    me = window.local_rank
    itemsize = out.itemsize
    slots = window.next_slots(max(count for _, count in chunks) * itemsize)
    offset, count = chunks[me]
    if count:
        window.memory.copy(slots[me], out.ptr + offset * itemsize, count * itemsize)
    window.sync()
    for k, (offset, count) in enumerate(chunks):
        if k != me and count:
            window.memory.copy(out.ptr + offset * itemsize, slots[k], count * itemsize)
    window.sync()  # every slot has been read
