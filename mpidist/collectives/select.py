"""How algorithm="auto" picks an all-reduce algorithm.

The built-in table below reflects the usual trade-off: recursive doubling has the fewest steps
(latency) but sends the whole buffer log2(p) times; ring and recursive halving send the
bandwidth-optimal 2(p-1)/p * n bytes. MPIDIST_ALLREDUCE_ALGORITHM forces one algorithm, like
Open MPI's coll_tuned forced algorithms.
"""
from __future__ import annotations

import os

# (upper bound in bytes, algorithm); the first row whose bound exceeds the message size wins.
BUILTIN_TABLE = (
    (32 * 1024, "recursive_doubling"),
    (float("inf"), "recursive_halving"),
)


def choose_allreduce(nbytes: int, ranks: int, table=None) -> str:
    forced = os.environ.get("MPIDIST_ALLREDUCE_ALGORITHM")
    if forced and forced != "auto":
        return forced
    if ranks == 1:
        return "ring"  # nothing to exchange; any algorithm returns at once
    for bound, algorithm in (table or BUILTIN_TABLE):
        if nbytes < bound:
            return algorithm
    return (table or BUILTIN_TABLE)[-1][1]
