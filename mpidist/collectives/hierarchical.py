"""Hierarchical (node-aware) all-reduce through an MPI-3 shared-memory window.

1. Every rank copies its buffer into its slot of a window shared by the ranks of its node.
2. Each of the L local ranks reduces its 1/L slice of all L slots in one k-way pass
   (reduce_many, operands always in local-rank order) into the window's result region.
3. The node leaders all-reduce the node results across nodes (recursive halving, or the ring
   for large messages on a node count that is not a power of two).
4. Every rank copies the result out of the window.
On the node nothing goes through MPI messages: each rank writes n bytes (copy in), reads L slices
of n/L bytes and writes one (its reduction), and reads n bytes (copy out); between nodes only
the leaders talk, each sending 2(N-1)/N * n bytes for N nodes (recursive halving or ring).
The window is kept per communicator and grown when a larger message comes.
"""
from __future__ import annotations

import ctypes

from mpi4py import MPI

from .. import kernels
from ..buffers import BufferInfo
from .common import Context, split_counts
from .recursive_halving import recursive_halving_allreduce
from .ring import ring_allreduce

# Across nodes, the ring avoids recursive halving's fold (2n extra bytes for the extra
# nodes) once messages are this large and the node count is not a power of two.
RING_ACROSS_NODES_BYTES = 1024 * 1024


class NodeWindow:
    """The shared window of one node: L slots of `capacity` bytes plus a result region."""

    def __init__(self, node_comm, leader_comm):
        self.node_comm = node_comm
        self.leader_comm = leader_comm
        self.local_rank = node_comm.Get_rank()
        self.local_size = node_comm.Get_size()
        self.win = None
        self.capacity = 0

    def ensure(self, nbytes: int) -> None:
        """Grow the window to hold `nbytes` per slot (collective over the node; every local rank
        has the same message size, so all decide alike)."""
        if nbytes <= self.capacity:
            return
        capacity = max(nbytes, 2 * self.capacity, 4096)
        capacity = (capacity + 63) // 64 * 64
        if self.win is not None:
            self.node_comm.Barrier()  # nobody may still be copying out of the old window
        self.free()
        # Local rank 0's segment also holds the result region, right after its slot.
        mine = 2 * capacity if self.local_rank == 0 else capacity
        self.win = MPI.Win.Allocate_shared(mine, 1, comm=self.node_comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.slots = [self.win.Shared_query(k)[0].address for k in range(self.local_size)]
        self.result = self.slots[0] + capacity
        self.capacity = capacity

    def sync(self) -> None:
        """Every local rank's stores are visible to every other one after this."""
        self.win.Sync()
        self.node_comm.Barrier()
        self.win.Sync()

    def free(self) -> None:
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.win = None
            self.capacity = 0


def node_window(ctx: Context) -> NodeWindow:
    """The window of ctx's communicator, made on first use. A Communicator lends its node and
    leader communicators; an asynchronous engine (private duplicate, own thread) splits its own
    from its duplicate so it never shares a communicator with the caller's thread."""
    window = getattr(ctx.comm, "node_window", None)
    if window is None:
        if hasattr(ctx.comm, "node_comm"):
            node, leaders = ctx.comm.node_comm, ctx.comm.leader_comm
        else:
            owner = ctx.comm.comm
            node = ctx.mpi.Split(owner.node_rank, owner.rank)
            leaders = ctx.mpi.Split(0 if owner.local_rank == 0 else MPI.UNDEFINED, owner.rank)
            leaders = None if leaders == MPI.COMM_NULL else leaders
        window = NodeWindow(node, leaders)
        ctx.comm.node_window = window
    return window


def across_nodes(ctx: Context, leaders, info: BufferInfo) -> None:
    nodes = leaders.Get_size()
    leader_ctx = Context(ctx.comm, leaders, info, op=ctx.op, tag=ctx.tag)
    if nodes & (nodes - 1) and info.nbytes >= RING_ACROSS_NODES_BYTES:
        ring_allreduce(leader_ctx)
    else:
        recursive_halving_allreduce(leader_ctx)


def hierarchical_allreduce(ctx: Context) -> None:
    info = ctx.info
    if ctx.size == 1 or info.count == 0:
        return
    window = node_window(ctx)
    if window.local_size == 1:
        across_nodes(ctx, window.leader_comm, info)  # one rank per node: nothing to share
        return
    window.ensure(info.nbytes)
    itemsize = info.itemsize
    ctypes.memmove(window.slots[window.local_rank], info.ptr, info.nbytes)
    window.sync()
    offset, count = split_counts(info.count, window.local_size)[window.local_rank]
    if count:
        start = offset * itemsize
        kernels.reduce_many_ptr(window.result + start, [slot + start for slot in window.slots],
                                count, info.dtype, ctx.op)
    window.sync()
    if window.leader_comm is not None and window.leader_comm.Get_size() > 1:
        across_nodes(ctx, window.leader_comm, BufferInfo(window.result, info.count, info.dtype, "cpu", "numpy"))
    window.sync()
    ctypes.memmove(info.ptr, window.result, info.nbytes)
