"""Ring all-reduce: reduce-scatter then allgather around the ring.

2(p-1) steps; each rank sends and receives 2(p-1)/p * n bytes, the bandwidth-optimal amount.
The buffer is cut into p chunks; in the reduce-scatter each step passes one partially reduced
chunk to the right neighbour, which adds its own copy. Receives are segmented so that reducing
one segment overlaps the arrival of the next.
"""
from __future__ import annotations

from .common import Context, split_counts


def reduce_scatter_ring(ctx: Context, chunks, rotation: int = 0) -> int:
    """Reduce-scatter phase; returns the index of the chunk this rank then holds complete,
    which is (rank + 1 + rotation) mod p."""
    p, r = ctx.size, ctx.rank
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        send_offset, send_count = chunks[(r - step + rotation) % p]
        recv_offset, recv_count = chunks[(r - step - 1 + rotation) % p]
        ctx.exchange_and_reduce(send_offset, send_count, right, recv_offset, recv_count, left)
    return (r + 1 + rotation) % p


def allgather_ring(ctx: Context, chunks, rotation: int = 0) -> None:
    """Allgather phase: rank r starts with chunk (r + 1 + rotation) complete and ends with all."""
    p, r = ctx.size, ctx.rank
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        send_offset, send_count = chunks[(r + 1 + rotation - step) % p]
        recv_offset, recv_count = chunks[(r + rotation - step) % p]
        ctx.sendrecv(send_offset, send_count, right, ctx.info, recv_offset, recv_count, left)


def ring_allreduce(ctx: Context) -> None:
    if ctx.size == 1 or ctx.info.count == 0:
        return
    chunks = split_counts(ctx.info.count, ctx.size)
    reduce_scatter_ring(ctx, chunks)
    allgather_ring(ctx, chunks)
