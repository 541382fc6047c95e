"""Recursive-halving all-reduce (Rabenseifner): reduce-scatter by recursive halving, then
allgather by recursive doubling.

2*log2(p2) steps; each rank sends about 2(p2-1)/p2 * n bytes, like the ring, in logarithmically
many steps. Rank counts that are not a power of two are folded to the power of two p2 below
(extra ranks hand their data in first and get the result back last, + 2n bytes for them).
"""
from __future__ import annotations

from .common import Context, fold_in, fold_out, real_rank


def recursive_halving_allreduce(ctx: Context) -> None:
    if ctx.size == 1 or ctx.info.count == 0:
        return
    new_rank, p2 = fold_in(ctx)
    if new_rank >= 0:
        low, high = 0, ctx.info.count
        halvings = []
        distance = p2 // 2
        while distance >= 1:
            partner = real_rank(new_rank ^ distance, ctx, p2)
            middle = low + (high - low) // 2
            if new_rank & distance:
                keep, give = (middle, high), (low, middle)
            else:
                keep, give = (low, middle), (middle, high)
            ctx.exchange_and_reduce(give[0], give[1] - give[0], partner,
                                    keep[0], keep[1] - keep[0], partner)
            halvings.append((low, high, partner))
            low, high = keep
            distance //= 2
        # Walk the same pairs back: each step doubles the complete range this rank holds.
        for outer_low, outer_high, partner in reversed(halvings):
            if low == outer_low:
                other = (high, outer_high)
            else:
                other = (outer_low, low)
            ctx.sendrecv(low, high - low, partner, ctx.info, other[0], other[1] - other[0], partner)
            low, high = outer_low, outer_high
    fold_out(ctx, new_rank, p2)
