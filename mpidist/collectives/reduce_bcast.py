"""Reduce + broadcast through a single aggregator (rank 0): the "single node aggregator" baseline.

Every rank sends its whole buffer to rank 0, which reduces all p buffers in one k-way pass
(reduce_many), then rank 0 broadcasts the result down a binomial tree. Rank 0 receives
(p-1) * n bytes, so it is the bottleneck the other algorithms avoid.
"""
from __future__ import annotations

from .. import kernels
from .common import Context
from .tree import tree_broadcast

# The aggregator receives all ranks' blocks of this many bytes before reducing them, which
# bounds its scratch memory to (p - 1) * BLOCK_BYTES.
BLOCK_BYTES = 4 * 1024 * 1024


def reduce_bcast_allreduce(ctx: Context) -> None:
    if ctx.size == 1 or ctx.info.count == 0:
        return
    info = ctx.info
    block_count = max(1, BLOCK_BYTES // info.itemsize)
    for offset in range(0, info.count, block_count):
        count = min(block_count, info.count - offset)
        if ctx.rank == 0:
            scratches = [ctx.scratch(count, slot) for slot in range(ctx.size - 1)]
            receives = [ctx.irecv(scratch, 0, count, source)
                        for source, scratch in enumerate(scratches, start=1)]
            ctx.wait(receives)
            start = info.ptr + offset * info.itemsize
            kernels.reduce_many_ptr(start, [start] + [s.ptr for s in scratches], count, info.dtype,
                                    ctx.op, device=info.device)
            if info.is_cuda:
                kernels.synchronize(info.device)
        else:
            ctx.send(info, offset, count, 0)
    tree_broadcast(ctx, root=0)
