"""Hierarchical (node-aware) all-reduce: the ranks of a node reduce through the node window in
host memory (node_window.py owns those steps: its flags, slots and slices, its one-shot and
sliced all-reduce in one call into the extension); across nodes, this module's lanes.

On one node (n = message bytes, L local ranks) the sliced all-reduce moves per rank (L-1)/L·n
bytes read and written (copy in), n read and n/L written (its reduction), n/L read and written
(publishing), (L-1)/L·n read and written (copy out): 4.5n bytes for L = 2, two syncs, no MPI
messages. With two ranks each publishes its result into the other's slot, over the copy of its
slice the reduction has just read, so the lines written are still in cache (it roughly halved
the time of a large message, benchmarks/results/hierarchical-two-ranks-cpu.md).

With more than one node, every node has `lanes` ranks that talk across nodes (its first local
ranks; as many as the smallest node has: the channel's NodeGroups), and lane k carries slice k
of split_counts(count, lanes): the node's ranks reduce the whole message into local rank 0's
result region (node_window.reduce_into_result_region); the ranks of lane k, one per node,
all-reduce slice k of it across nodes (between 2 nodes recursive doubling, one exchange; on
more, recursive halving, or the ring for large messages on a node count that is not a power of
two); every rank copies the whole result out (node_window.copy_result_out). Per rank that is 2n
(copy in) + n + n/L (reduction) + 2n (copy out) inside the node and two syncs (three with fewer
lanes than ranks); between nodes each lane rank sends 2(N-1)/N · n/lanes bytes for N nodes. The
lanes share the node's link, so a node sends what a single leader would, but over `lanes`
connections driven by as many processes: one process alone, polling TCP between its reductions,
drove a 500 Mbit/s link at about half its rate on a busy host (docs/multinode.md).

The window is kept per channel and grown when a larger message comes. CUDA buffers across nodes
take the same steps in a window of GPU memory where gpu_lane.py chooses the NCCL or CUDA-aware
MPI lane (its `lane` runs slice k between the nodes), else this one in host memory on a staged copy.
"""
from __future__ import annotations

from ..buffers import BufferInfo
from ..channel import NodeGroups
from .common import Context, segments, split_counts
from .node_window import HostMemory, NodeWindow, allreduce_on_node, copy_result_out, reduce_into_result_region
from .recursive_doubling import recursive_doubling_allreduce
from .recursive_halving import recursive_halving_allreduce
from .ring import ring_allreduce

# Across nodes, the ring avoids recursive halving's fold (2n extra bytes for the extra
# nodes) once messages are this large and the node count is not a power of two.
RING_ACROSS_NODES_BYTES = 1024 * 1024


class HierarchicalWindow(NodeWindow):
    """The node window (node_window.py) in host memory: on one node of more than two ranks every
    local rank has two slots, with two ranks, or with several nodes, one, and with several nodes
    local rank 0 also holds a result region. With several nodes it also names this rank's lane
    across them (lane_comm: None for a rank beyond the lanes), which the channel owns."""

    def __init__(self, groups: NodeGroups, spans_nodes: bool, one_shot_bytes: int, memory=None):
        node_comm = groups.node
        memory = HostMemory(node_comm) if memory is None else memory
        super().__init__(node_comm, memory, alternates=not spans_nodes and node_comm.Get_size() > 2,
                         result_region=spans_nodes, one_shot_bytes=one_shot_bytes)
        self.spans_nodes = spans_nodes
        self.lanes, self.lane_comm = groups.lanes, groups.lane
        self.device = getattr(memory, "device", "cpu")  # where the result region's slices are

    def across(self, ctx: Context, info: BufferInfo) -> None:
        """All-reduce this lane's slice `info` with the other nodes (a window of GPU memory runs
        its own lane: gpu_lane.py)."""
        across_nodes(ctx, self.lane_comm, info)


def node_window(ctx: Context) -> HierarchicalWindow:
    """The window of ctx's channel (channel.Channel), made on first use over the channel's node
    communicators; the channel frees it."""
    return channel_node_window(ctx.comm)


def channel_node_window(channel) -> HierarchicalWindow:
    """The node window of `channel`, made at the first call (collective over the channel)."""
    if channel.node_window is None:
        groups = channel.node_communicators()
        channel.node_window = HierarchicalWindow(groups, spans_nodes=groups.node.Get_size() < channel.size,
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
        window.across(ctx, info)  # one rank per node: nothing to share
        return
    if window.spans_nodes:
        reduce_across_nodes(ctx, window)
        return
    # Divide each slice as it is reduced, while it is in cache, not the whole buffer later.
    allreduce_on_node(window, info, ctx.op, 1.0 / ctx.size if ctx.average else 1.0)
    ctx.average = False


def reduce_across_nodes(ctx: Context, window: HierarchicalWindow) -> None:
    """The node window's steps across nodes (node_window.py), the lanes' exchange between them."""
    info = ctx.info
    reduce_into_result_region(window, info, ctx.op, window.lanes)
    if window.lane_comm is not None:
        offset, count = split_counts(info.count, window.lanes)[window.local_rank]
        if count:
            lane_slice = BufferInfo(window.result + offset * info.itemsize, count, info.dtype, window.device,
                                    info.kind)
            window.across(ctx, lane_slice)
    copy_result_out(window, info)
