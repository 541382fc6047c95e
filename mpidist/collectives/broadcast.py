"""Broadcast: binomial tree for small messages; scatter + ring allgather for large ones.

Binomial tree: ceil(log2 p) steps of the whole message (the root sends log2(p) copies).
Scatter + allgather (van de Geijn): the root sends each rank its 1/p chunk, then a ring
allgather completes everyone; every rank moves about 2n bytes whatever p is.
"""
from __future__ import annotations

from ..runtime import config
from .common import Context, split_counts
from .ring import allgather_ring
from .tree import tree_broadcast

SCATTER_ALLGATHER_BYTES = config.value("MPIDIST_BCAST_SCATTER_BYTES")


def broadcast(ctx: Context, root: int) -> None:
    if ctx.size == 1 or ctx.info.count == 0:
        return
    if ctx.size <= 2 or ctx.info.nbytes < SCATTER_ALLGATHER_BYTES:
        tree_broadcast(ctx, root=root)
        return
    chunks = split_counts(ctx.info.count, ctx.size)
    if ctx.rank == root:
        sends = [ctx.isend(ctx.info, offset, count, rank)
                 for rank, (offset, count) in enumerate(chunks) if rank != root and count]
        ctx.wait(sends)
    else:
        offset, count = chunks[ctx.rank]
        ctx.recv(ctx.info, offset, count, root)
    # Rank r now holds chunk r, which is what allgather_ring expects with rotation -1.
    allgather_ring(ctx, chunks, rotation=-1)
