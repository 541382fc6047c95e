"""Hierarchical (node-aware) all-reduce through the node window (node_window.py) in host memory:
an MPI-3 shared-memory window, its steps ordered by the window's flags (sync). CUDA buffers on
one node run the same one-node protocol in GPU memory (device_window.py).

The L ranks of a node share a window in which each has a slot as large as the message. The
buffer is cut into L slices (split_counts); local rank i reduces slice i, its operands always in
local-rank order, in one k-way pass (reduce_many), so every rank ends with the same bits.

When the whole communicator is one node:
1. Every rank copies into its slot the L-1 slices that the other ranks reduce; its own slice
   stays in its own buffer.
2. Sync.
3. Each rank reduces its slice of its own buffer and of the other ranks' slots into its own
   buffer (for op="avg" it divides the slice right away, while it is in cache), and publishes
   the result in its slot's own-slice region, which step 1 left free.
4. Sync.
5. Each rank copies the other ranks' result slices out of their slots.
Per rank (n = message bytes): (L-1)/L·n read and written (copy in), n read and n/L written (its
reduction), n/L read and written (publishing), (L-1)/L·n read and written (copy out): 4.5n bytes
for L = 2, two syncs, no MPI messages. With two ranks each publishes its result into the
other's slot instead, over the other's copy of its slice, which its reduction has just read (block
by block, each block read before it is overwritten), and copies the other's result out of its own
slot: each slot then only ever holds the other rank's half, and the lines written are the ones
just read, still in cache (node_buckets.py's buckets do the same; it roughly halved the time of a
large message, benchmarks/results/hierarchical-two-ranks-cpu.md).

With more than one node, every node has `lanes` ranks that talk across nodes (its first local
ranks; as many as the smallest node has), and lane k carries slice k of split_counts(count, lanes):
1. every rank copies its whole buffer into its slot; sync;
2. each rank reduces its slice of all L slots into the result region (with lanes = L, the slice
   that its lane carries; otherwise a sync follows, as its lane's slice is someone else's);
3. the ranks of lane k, one per node, all-reduce slice k of the result region across nodes
   (between 2 nodes recursive doubling, one exchange; on more, recursive halving, or the ring for
   large messages on a node count that is not a power of two); sync;
4. every rank copies the whole result out.
Per rank that is 2n (copy in) + n + n/L (reduction) + 2n (copy out) inside the node and two
syncs (three with fewer lanes than ranks); between nodes each lane rank sends
2(N-1)/N · n/lanes bytes for N nodes. The lanes share the node's link, so a node sends what a
single leader would, but over `lanes` connections driven by as many processes: one process
alone, polling TCP between its reductions, drove a 500 Mbit/s link at about half its rate on a
busy host (docs/multinode.md).

The window is kept per communicator and grown when a larger message comes. On one node of more
than two ranks it holds two slots per rank, and consecutive calls alternate between them
(NodeWindow.next_slots says why). On one node the steps above run in the extension, in one call
(node_window.py), and messages of at most the channel's one_shot_bytes go one-shot: one sync,
each rank reducing every rank's copy, in slots of their own (NodeWindow.next_one_shot_slots).
"""
from __future__ import annotations

import ctypes

import numpy as np
from mpi4py import MPI

from .. import kernels
from ..buffers import BufferInfo
from .common import Context, segments, split_counts
from .node_window import HostMemory, NodeWindow, allreduce_on_node
from .recursive_doubling import recursive_doubling_allreduce
from .recursive_halving import recursive_halving_allreduce
from .ring import ring_allreduce

# Across nodes, the ring avoids recursive halving's fold (2n extra bytes for the extra
# nodes) once messages are this large and the node count is not a power of two.
RING_ACROSS_NODES_BYTES = 1024 * 1024


class HierarchicalWindow(NodeWindow):
    """The node window (node_window.py) in host memory: on one node of more than two ranks every
    local rank has two slots, with two ranks, or with several nodes, one, and with several nodes
    local rank 0 also holds a result region. With several nodes it also owns the lane
    communicator of this rank (None for a rank beyond the lanes)."""

    def __init__(self, node_comm, comm, spans_nodes: bool, one_shot_bytes: int):
        local_size = node_comm.Get_size()
        super().__init__(node_comm, HostMemory(node_comm), alternates=not spans_nodes and local_size > 2,
                         result_region=spans_nodes, one_shot_bytes=one_shot_bytes)
        self.spans_nodes = spans_nodes
        self.lanes, self.lane_comm = lane_communicator(comm, self.local_rank, local_size) if spans_nodes \
            else (1, None)

    def free(self) -> None:
        """Free the window and the lane communicator (collective over the channel's ranks)."""
        super().free()
        if self.lane_comm is not None:
            self.lane_comm.Free()
            self.lane_comm = None


def lane_communicator(comm, local_rank: int, local_size: int) -> tuple:
    """(lanes, this rank's lane communicator or None): the smallest node's rank count, and the
    ranks of local rank `local_rank` on every node, in the order of `comm` (collective over comm)."""
    smallest = np.array([local_size], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, smallest, op=MPI.MIN)
    lanes = int(smallest[0])
    lane = comm.Split(local_rank if local_rank < lanes else MPI.UNDEFINED, comm.Get_rank())
    return lanes, (None if lane == MPI.COMM_NULL else lane)


def node_window(ctx: Context) -> HierarchicalWindow:
    """The window of ctx's channel (channel.Channel), made on first use over the channel's node
    communicators; the channel frees it."""
    channel = ctx.comm
    if channel.node_window is None:
        node, _ = channel.node_communicators()
        channel.node_window = HierarchicalWindow(node, ctx.mpi, spans_nodes=node.Get_size() < ctx.size,
                                                 one_shot_bytes=channel.one_shot_bytes)
    return channel.node_window


class LinkContext(Context):
    """The context of the exchanges across nodes: every transfer in segments, all posted at once.

    Over Open MPI's TCP transport one large message (a rendezvous of MiBs) moved at about half
    the link's rate, many messages of a segment each at the full rate (docs/multinode.md);
    exchange_and_reduce segments already, and here the plain transfers (the allgather halves of
    recursive halving and of the ring) do too. Both sides cut a range alike (segments())."""

    def sendrecv(self, send_offset: int, send_count: int, dest: int,
                 recv_into: BufferInfo, recv_offset: int, recv_count: int, source: int):
        requests = [self.irecv(recv_into, recv_offset + offset, count, source)
                    for offset, count in segments(recv_count, recv_into.itemsize)]
        requests += [self.isend(self.info, send_offset + offset, count, dest)
                     for offset, count in segments(send_count, self.info.itemsize)]
        self.wait(requests)


def across_nodes(ctx: Context, peers, info: BufferInfo) -> None:
    """All-reduce `info` among `peers`, one rank per node.

    Between 2 nodes recursive halving and recursive doubling send the same bytes, but recursive
    doubling in one exchange of one message each way, and was the faster of the two at 2 x 2
    over 500 Mbit/s from a few MiB (docs/multinode.md)."""
    nodes = peers.Get_size()
    if nodes == 2:
        recursive_doubling_allreduce(Context(ctx.comm, peers, info, op=ctx.op, tag=ctx.tag))
        return
    link_ctx = LinkContext(ctx.comm, peers, info, op=ctx.op, tag=ctx.tag)
    if nodes & (nodes - 1) and info.nbytes >= RING_ACROSS_NODES_BYTES:
        ring_allreduce(link_ctx)
    else:
        recursive_halving_allreduce(link_ctx)


def hierarchical_allreduce(ctx: Context) -> None:
    info = ctx.info
    if ctx.size == 1 or info.count == 0:
        return
    window = node_window(ctx)
    if window.local_size == 1:
        across_nodes(ctx, window.lane_comm, info)  # one rank per node: nothing to share
        return
    if window.spans_nodes:
        reduce_across_nodes(ctx, window, window.next_slots(info.nbytes))
        return
    # Divide each slice as it is reduced, while it is in cache, not the whole buffer later.
    allreduce_on_node(window, info, ctx.op, 1.0 / ctx.size if ctx.average else 1.0)
    ctx.average = False


def reduce_across_nodes(ctx: Context, window: HierarchicalWindow, slots: list) -> None:
    info = ctx.info
    itemsize = info.itemsize
    ctypes.memmove(slots[window.local_rank], info.ptr, info.nbytes)
    window.sync()
    offset, count = split_counts(info.count, window.local_size)[window.local_rank]
    if count:
        start = offset * itemsize
        kernels.reduce_many_ptr(window.result + start, [slot + start for slot in slots], count,
                                info.dtype, ctx.op)
    if window.lanes < window.local_size:
        window.sync()  # a lane's slice spans the reductions of several ranks
    if window.lane_comm is not None:
        offset, count = split_counts(info.count, window.lanes)[window.local_rank]
        if count:
            lane_slice = BufferInfo(window.result + offset * itemsize, count, info.dtype, "cpu", "numpy")
            across_nodes(ctx, window.lane_comm, lane_slice)
    window.sync()
    ctypes.memmove(info.ptr, window.result, info.nbytes)
