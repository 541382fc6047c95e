"""Recursive-doubling all-reduce: log2(p2) exchanges of the whole buffer.

The latency-optimal choice for small messages (log2 p steps) at the price of log2(p) * n bytes
per rank. Both partners of a step combine the same two partial results in the same operand
order (lower rank's first), so every rank ends with bitwise identical values.
"""
from __future__ import annotations

from .common import Context, fold_in, fold_out, real_rank


def recursive_doubling_allreduce(ctx: Context) -> None:
    if ctx.size == 1 or ctx.info.count == 0:
        return
    n = ctx.info.count
    new_rank, p2 = fold_in(ctx)
    if new_rank >= 0:
        current, other = ctx.info, ctx.scratch(n, slot=1)
        distance = 1
        while distance < p2:
            partner_new = new_rank ^ distance
            partner = real_rank(partner_new, ctx, p2)
            sends = ctx.isend(current, 0, n, partner)
            ctx.recv(other, 0, n, partner)
            ctx.wait([sends])
            if new_rank < partner_new:
                ctx.reduce(current, 0, other, 0, n)
            else:
                ctx.reduce(other, 0, current, 0, n)
                current, other = other, current
            distance <<= 1
        if current is not ctx.info:
            ctx.copy(ctx.info, 0, current, 0, n)
    fold_out(ctx, new_rank, p2)
