"""The node window: the protocol by which the ranks of one node run a collective through memory
they all map, whatever that memory is. The one place that says how: its flags, its waits and
their deadline, its constants and its steps; the hierarchical all-reduce (hierarchical.py), the
node window in GPU memory (device_window.py), the gradient buckets' polled all-reduce
(node_buckets.py) and the fast path (fastpath.py) run these steps.

Every local rank has a slot (two on one node of more than two ranks: NodeWindow.next_slots says
why) in a window that every other local rank can read and write. The ranks order their steps by
flags: a 64-bit counter per local rank in host shared memory, which only grows. sync() is the
one ordering step: the rank makes its own writes complete (settle()), raises its counter to the
next round, and waits until every other local rank's counter has reached it; a rank that does
not arrive within MPIDIST_TIMEOUT is named in a DeadlineError, so nobody spins forever on a flag.
Every local rank calls sync() as many times in the same order, so the rounds agree.

The memory is a backend (NodeMemory: allocate, copy, reduce_and_publish, settle, free);
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
  the one-shot's own (next_one_shot_half); sync; each reduces every such slot, in local-rank
  order, into its buffer.
  In host memory the whole call is one call into the extension (csrc/node_steps.h: the same
  steps and rounds, written once in C++, with the GIL released); it polls the flags for the
  window's yield time and hands a longer wait to sync's own (wait_for_round), then goes on.
  The gradient buckets (node_buckets.py) run the same C++ steps with patience 0, so that a
  bucket's all-reduce advances between the layers of backward and never blocks there.
- reduce-scatter: the all-reduce's first half (the others' chunks in, sync, the own chunk reduced
  into the output), then a sync, after which nobody reads the slots any more.
- broadcast: the root copies its buffer into its slot; sync; the others copy it out; sync.
- allgather: each rank copies its chunk into its slot; sync; each copies every other chunk out;
  sync.
- across nodes (hierarchical.py): each rank copies its whole buffer into its slot; sync; it
  reduces its slice of every slot into local rank 0's result region (reduce_into_result_region;
  another sync where a lane's slice spans several ranks' slices); the lanes exchange across nodes;
  sync; each copies the whole result out (copy_result_out).
"""
from __future__ import annotations

import ctypes
import os
import typing

from .. import _C
from ..buffers import ITEMSIZE, BufferInfo
from ..runtime.deadlines import deadline_error, wait_in_collective
from ..runtime.mpi import load_mpi
from .common import reduce_and_publish, result_slot, split_counts

COUNTER_BYTES = 64  # one cache line per counter: ranks never write the same line
YIELD_SECONDS = 100e-6  # how long a wait polls without sleeping, with more ranks than cores
OWN_CORE_YIELD_SECONDS = 1e-3  # the same where every rank can have a core of its own
NAP_SECONDS = 50e-6  # then the sleep between polls
# The room of the call check's signature at the start of a checked one-shot's slots.
SIGNATURE_BYTES = _C.node_signature_bytes

# The rounds of the node window one all-reduce in the extension takes, sliced and one-shot.
ALLREDUCE_ROUNDS = (_C.node_allreduce_rounds(False), _C.node_allreduce_rounds(True))

# Up to this size a host-memory all-reduce on one node goes one-shot: one round instead of two,
# each rank reducing the whole message (benchmarks/results/node-protocol-cpu.md), unless the
# tuning file has a bound measured for the rank count (select.py).
ONE_SHOT_BYTES = 64 * 1024


def yield_seconds(affinities, local_size: int) -> float:
    """How long a waiting rank polls before napping, from the CPUs each local rank may run on.

    A short nap sleeps more than twice as long as asked on Linux (timer slack), so a rank that
    naps reacts late to its peer; polling costs nothing where the peer has a core of its own, and
    takes the core the peer needs where it has not (training-cpu.md, 3 ranks on 2 cores)."""
    cpus = set().union(*affinities)
    return OWN_CORE_YIELD_SECONDS if len(cpus) >= local_size else YIELD_SECONDS


def zero_counters(win, address: int, nbytes: int, node_comm) -> None:
    """Zero this rank's `nbytes` of counters at `address` in `win` (a locked shared window), and
    return once every local rank has zeroed its own (collective over the node): nobody raises a
    counter before every counter is zero."""
    ctypes.memset(address, 0, nbytes)
    win.Sync()
    node_comm.Barrier()
    win.Sync()


def wait_for_counters(counters: list, local_rank: int, round_: int, node_comm, what: str, advice: str,
                      yield_s: float, polled=None) -> None:
    """Wait until every other local rank's counter (`counters`, in local-rank order) has reached
    `round_`: the stall report names who is behind, and one that does not arrive within
    MPIDIST_TIMEOUT is named in a DeadlineError, with `advice`. With `polled` (an all-reduce that
    goes on through its rounds as it is polled: node_buckets.PolledAllreduce) the wait lasts until
    polled.progress() is true, and polled.waited_round() names the round it waits for now."""
    if polled is None:
        others = [counter for k, counter in enumerate(counters) if k != local_rank]

        def test():
            return _C.counters_reached(others, round_)
    else:
        test = polled.progress
    if test():
        return

    def timed_out():
        waited = round_ if polled is None else polled.waited_round()
        behind = [k for k, counter in enumerate(counters)
                  if k != local_rank and not _C.counters_reached([counter], waited)]
        raise deadline_error(f"local rank {local_rank}", what, f"local ranks {behind} of this node", peers=behind,
                             advice=advice)

    wait_in_collective(test, node_comm, what, timed_out, yield_s, NAP_SECONDS)


class NodeMemory(typing.Protocol):
    """What the node window's memory does (HostMemory, device_window.DeviceMemory): copies and
    reductions may be asynchronous until settle() returns."""

    steps_in_extension: bool  # whether the all-reduce runs in the extension's C++ steps

    def allocate(self, nbytes: int) -> list: ...
    def copy(self, dst: int, src: int, nbytes: int) -> None: ...
    def reduce_and_publish(self, dst: int, sources, nbytes: int, dtype: str, op: str, scale: float,
                           publish) -> None: ...
    def settle(self) -> None: ...
    def free(self) -> None: ...


class HostMemory:
    """Slots in an MPI-3 shared-memory window of host memory (a NodeMemory)."""

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
        zero_counters(self.memory.win, self.counters[node_comm.Get_rank()], COUNTER_BYTES, node_comm)

    def free(self) -> None:
        self.memory.free()


class NodeWindow:
    """The window of one node: every local rank's slots, of `capacity` bytes each, in `memory`
    (a backend: HostMemory or device_window.DeviceMemory), and the flags that order the rounds.

    With `alternates` (one node of more than two ranks) every rank has two slots, one in each half
    of its memory, and consecutive calls alternate between them; with `result_region` local rank 0
    holds a result region of `capacity` bytes after its slot (the hierarchical all-reduce across
    nodes). The one-shot all-reduce in host memory, of messages up to `one_shot_bytes`, has slots
    of its own (next_one_shot_half). Collective over `node_comm`: made at the same call on every
    local rank."""

    def __init__(self, node_comm, memory: NodeMemory, alternates: bool, result_region: bool = False,
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
        self.one_shot = None  # _C.NodeOneShotSlots: the one-shot slots, for _C.node_one_shot
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

    def takes_one_shot(self, nbytes: int) -> bool:
        """Whether a host all-reduce of `nbytes` goes one-shot here (the window's bound)."""
        return nbytes <= self.one_shot_bytes

    def next_one_shot_half(self, nbytes: int) -> int:
        """The half (0 or 1) of the one-shot slots (`nbytes` at least each) this one-shot
        all-reduce runs in; the slots are in host memory of their own, made at the first one-shot
        call and grown as ensure() grows the others (collective over the node), and held by
        `one_shot` (the extension's NodeOneShotSlots, which _C.node_one_shot takes).

        A one-shot call has a single sync, after which every rank reads every other's slot, so
        a fast rank's next one-shot call could overwrite a slot a slow rank is still reading:
        consecutive one-shot calls alternate between two halves, and the one after the next
        comes back to this half only after every rank has passed the next one's sync, so after
        every rank has read this one. The other calls never touch these slots; theirs the
        one-shot never touches. The slots hold any message up to the default one-shot bound
        (ONE_SHOT_BYTES) from the start, and every message they grow for, behind the call check's
        signature (SIGNATURE_BYTES): the fast path sends a message along with its check only where
        it fits the slots as they are."""
        if nbytes > self.one_shot_capacity:
            self.grow_one_shot_slots(nbytes)
        half = self.one_shot_calls % 2
        self.one_shot_calls += 1
        return half

    def grow_one_shot_slots(self, nbytes: int = 0) -> None:
        """Make the one-shot slots hold `nbytes` (collective over the node), and at least any
        message of the fast path behind its signature."""
        least = max(nbytes, ONE_SHOT_BYTES) + SIGNATURE_BYTES
        capacity = (max(least, 2 * self.one_shot_capacity) + 63) // 64 * 64
        if self.one_shot_memory is not None:
            self.sync()  # nobody may still be reading the old slots
            self.one_shot_memory.free()
        self.one_shot_memory = HostMemory(self.node_comm)
        bases = self.one_shot_memory.allocate(2 * capacity)
        self.one_shot_capacity = capacity
        self.one_shot = _C.NodeOneShotSlots(self.flags.counters, self.local_rank, bases,
                                            [base + capacity for base in bases], capacity)

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

    def others_reached(self, round_: int) -> bool:
        """Whether every other local rank has reached `round_`."""
        return _C.counters_reached([c for k, c in enumerate(self.flags.counters) if k != self.local_rank], round_)

    def wait_for_round(self, round_: int) -> None:
        """Wait until every other local rank has reached `round_`; one that does not within
        MPIDIST_TIMEOUT is named in a DeadlineError."""
        wait_for_counters(self.flags.counters, self.local_rank, round_, self.node_comm,
                          f"round {round_} of the node window", "They stopped before reaching it (an error, or "
                          "another collective); this communicator can no longer be used safely.", self.yield_seconds)

    def free(self) -> None:
        """Give the memory and the flags back (collective over the node)."""
        self.memory.free()
        self.bases = []
        self.capacity = 0
        if self.one_shot_memory is not None:
            self.one_shot_memory.free()
            self.one_shot_memory = None
            self.one_shot_capacity = 0
            self.one_shot = None
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
    if window.memory.steps_in_extension:
        host_allreduce_on_node(window, info.ptr, info.nbytes, info.dtype, op, scale)
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


def host_allreduce_on_node(window: NodeWindow, address: int, nbytes: int, dtype: str, op: str,
                           scale: float, wait=None, one_shot: bool | None = None) -> None:
    """allreduce_on_node in host memory, of the `nbytes` of `dtype` at `address`: the steps run in
    the extension (csrc/node_steps.h), one-shot up to the window's bound (one_shot_on_node),
    unless `one_shot` says, else sliced."""
    count = nbytes // ITEMSIZE[dtype]
    if window.takes_one_shot(nbytes) if one_shot is None else one_shot:
        one_shot_on_node(window, address, count, dtype, op, scale, nbytes, wait=wait)
        return
    slots = window.next_slots(nbytes)  # first: growing them is a round of the window's own
    call = (slots, window.flags.counters, window.local_rank, window.rounds, address, count, dtype, op, scale)
    steps_in_extension(window, _C.node_allreduce, call, wait, ALLREDUCE_ROUNDS[False])


def one_shot_on_node(window: NodeWindow, address: int, count: int, dtype: str, op: str, scale: float,
                     room: int, signature: int = 0, wait=None) -> bool:
    """The one-shot all-reduce of `count` items of `dtype` at `address`, `room` bytes of the
    slots in all (SIGNATURE_BYTES more behind a signature). With `signature` (the address of
    SIGNATURE_BYTES: the call check's row) every rank's signature is compared first: returns
    False, having reduced nothing, where they differ (on every rank alike), True otherwise. The
    fast path calls it so, having worked out its arguments once per kind of call."""
    half = window.next_one_shot_half(room)  # first: growing the slots is a round of the window's own
    call = (window.one_shot, half, window.rounds, address, count, dtype, op, scale, signature)
    return steps_in_extension(window, _C.node_one_shot, call, wait, ALLREDUCE_ROUNDS[True]) \
        != _C.node_signatures_differ


def steps_in_extension(window: NodeWindow, run, call: tuple, wait, rounds: int) -> int:
    """Run an all-reduce of the extension (`run`: node_allreduce or node_one_shot, with `call`,
    its arguments up to the step), which returns a step whose round some rank has not reached
    yet: this waits for it, with the deadline (`wait(round)`, by default window.wait_for_round),
    and the extension goes on from that step. The all-reduce takes `rounds` of the window's
    rounds. Returns the extension's last return value."""
    first = window.rounds
    step = run(*call, 0, window.yield_seconds)
    while step >= 0:
        (wait or window.wait_for_round)(first + step)
        step = run(*call, step, window.yield_seconds)
    window.rounds = first + rounds
    return step


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


def reduce_into_result_region(window: NodeWindow, info: BufferInfo, op: str, lanes: int) -> None:
    """The node's half of an all-reduce across nodes: every local rank's whole `info` into its
    slot; sync; this rank's slice of every slot, reduced in local-rank order, into local rank 0's
    result region; where a lane's slice spans several ranks' slices (`lanes` below the local size),
    another sync, so the region is whole before a lane sends it."""
    slots = window.next_slots(info.nbytes)
    window.memory.copy(slots[window.local_rank], info.ptr, info.nbytes)
    window.sync()
    offset, count = split_counts(info.count, window.local_size)[window.local_rank]
    if count:
        start = offset * info.itemsize
        window.memory.reduce_and_publish(window.result + start, [slot + start for slot in slots],
                                         count * info.itemsize, info.dtype, op, 1.0, [])
    if lanes < window.local_size:
        window.sync()


def copy_result_out(window: NodeWindow, info: BufferInfo) -> None:
    """Once every lane has its slice of the result region back from the other nodes (sync): the
    whole result into `info`."""
    window.sync()
    window.memory.copy(info.ptr, window.result, info.nbytes)
