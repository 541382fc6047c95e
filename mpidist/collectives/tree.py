"""Tree all-reduce: binomial-tree reduce to rank 0, then binomial-tree broadcast.

2*ceil(log2 p) steps of the whole message: latency-friendly, but each interior rank moves up to
log2(p) copies of the buffer. Large messages go segment by segment, so a parent is reducing
segment k while its children already send segment k+1 (a pipelined tree).
"""
from __future__ import annotations

from .common import Context, segments


def binomial_tree(rank: int, size: int, root: int):
    """(parent or None, children in increasing distance) of `rank` in the binomial tree at `root`."""
    relative = (rank - root) % size
    parent, children = None, []
    mask = 1
    while mask < size:
        if relative & mask:
            parent = (relative - mask + root) % size
            break
        if relative + mask < size:
            children.append((relative + mask + root) % size)
        mask <<= 1
    return parent, children


def tree_reduce(ctx: Context, root: int = 0) -> None:
    """Reduce every rank's buffer into `root`'s buffer; children are added in a fixed order."""
    parent, children = binomial_tree(ctx.rank, ctx.size, root)
    pending_sends = []
    for offset, count in segments(ctx.info.count, ctx.info.itemsize):
        scratches = [ctx.scratch(count, slot) for slot in range(len(children))]
        receives = [ctx.irecv(scratch, 0, count, child) for scratch, child in zip(scratches, children)]
        for scratch, request in zip(scratches, receives):
            ctx.wait([request])
            ctx.reduce(ctx.info, offset, scratch, 0, count)
        if parent is not None:
            pending_sends.append(ctx.isend(ctx.info, offset, count, parent))
    ctx.wait(pending_sends)


def tree_broadcast(ctx: Context, root: int = 0, offset: int = 0, count: int | None = None) -> None:
    """Broadcast `root`'s buffer (or a range of it) down the binomial tree, segment by segment."""
    parent, children = binomial_tree(ctx.rank, ctx.size, root)
    count = ctx.info.count - offset if count is None else count
    pending_sends = []
    # Farthest child first: its subtree is the largest and has the most steps still to go.
    for segment_offset, segment_count in segments(count, ctx.info.itemsize):
        start = offset + segment_offset
        if parent is not None:
            ctx.recv(ctx.info, start, segment_count, parent)
        for child in reversed(children):
            pending_sends.append(ctx.isend(ctx.info, start, segment_count, child))
    ctx.wait(pending_sends)


def tree_allreduce(ctx: Context) -> None:
    if ctx.size == 1 or ctx.info.count == 0:
        return
    tree_reduce(ctx, root=0)
    tree_broadcast(ctx, root=0)
