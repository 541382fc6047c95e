"""`mpidist tune`: the decision table of algorithm="auto" (collectives/select.py reads it from
MPIDIST_TUNING_FILE), made from the all-reduce benchmark's rows: the fastest algorithm that got
every answer right, per size range.
"""
from __future__ import annotations

import dataclasses

from . import bench

TUNE_SIZES = "8,64,512,4K,16K,64K,256K,1M,4M,16M"
# auto may pick the MPI library's own all-reduce where it is the fastest.
TUNED_ALGORITHMS = tuple(name for name in bench.OUR_ALLREDUCE if name != "auto") + ("mpi",)


def tune(comm, options: bench.Options) -> tuple[list[dict], list[dict]]:
    """Run the all-reduce benchmark for our algorithms; returns the rows of a decision table,
    [{"max_bytes": b, "algorithm": a}, ...], the fastest algorithm per size range (the bound
    between two measured sizes is their geometric mean; the last row has max_bytes None), and
    the measured rows the table (and the cost model) come from."""
    options = dataclasses.replace(options, collective="allreduce",
                                  algorithms=list(options.algorithms or TUNED_ALGORITHMS))
    rows = bench.run(comm, options)
    return decision_table(rows), rows


def decision_table(rows) -> list[dict]:
    best = {}
    for row in rows:
        if row["wrong"]:
            continue  # an algorithm that got a wrong answer is never chosen
        held = best.get(row["bytes"])
        if held is None or row["time_us"] < held["time_us"]:
            best[row["bytes"]] = row
    sizes = sorted(best)
    table = []
    for index, size in enumerate(sizes):
        algorithm = best[size]["algorithm"]
        bound = None if index + 1 == len(sizes) else int((size * sizes[index + 1]) ** 0.5)
        if table and table[-1]["algorithm"] == algorithm:
            table[-1]["max_bytes"] = bound
        else:
            table.append({"max_bytes": bound, "algorithm": algorithm})
    return table
