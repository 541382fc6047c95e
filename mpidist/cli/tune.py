"""`mpidist tune`: the decision table of algorithm="auto" (collectives/select.py reads it from
MPIDIST_TUNING_FILE), made from the all-reduce benchmark's rows: the fastest algorithm that got
every answer right, per size range; and on one node the bound up to which the node window's
one-shot all-reduce beats its sliced steps.
"""
from __future__ import annotations

import dataclasses
import typing

from .. import Communicator
from ..runtime import fault_tolerant
from . import bench

TUNE_SIZES = "8,64,512,4K,16K,64K,256K,1M,4M,16M"
# auto may pick the MPI library's own all-reduce where it is the fastest.
TUNED_ALGORITHMS = tuple(name for name in bench.OUR_ALLREDUCE if name != "auto") + ("mpi",)
# The one-shot is measured against the sliced steps at the sizes up to this one: its reduction
# reads every rank's whole message, which costs more than a round long before it.
ONE_SHOT_LARGEST = 1024 * 1024


class Tuned(typing.NamedTuple):
    table: list  # [{"max_bytes": b, "algorithm": a}, ...]
    measurements: list  # the benchmark's rows the table (and the cost model) come from
    one_shot_bytes: typing.Optional[int]  # None: not measured (across nodes, one rank, no windows)


def tune(comm, options: bench.Options) -> Tuned:
    """Measure the one-shot bound (on one node), then our algorithms with it; returns the rows of
    a decision table, the fastest algorithm per size range (the bound between two measured sizes
    is their geometric mean; the last row has max_bytes None), the measured rows and the bound."""
    options = dataclasses.replace(options, collective="allreduce",
                                  algorithms=list(options.algorithms or TUNED_ALGORITHMS))
    one_shot_bytes = measure_one_shot(comm, options)
    # On a communicator of its own, whose node window takes the bound when it is made.
    tuned = Communicator(comm.mpi)
    if one_shot_bytes is not None:
        tuned.one_shot_bytes = one_shot_bytes
    try:
        rows = bench.run(tuned, options)
    finally:
        tuned.free()
    return Tuned(decision_table(rows), rows, one_shot_bytes)


def measure_one_shot(comm, options: bench.Options):
    """On one node of several ranks with shared-memory windows: the largest all-reduce for which
    the node window's one-shot is to be taken, from the hierarchical all-reduce measured with the
    one-shot at every size up to ONE_SHOT_LARGEST and then at none (the first dtype's times);
    None elsewhere."""
    sizes = [size for size in options.sizes if size <= ONE_SHOT_LARGEST]
    if comm.num_nodes != 1 or comm.size == 1 or fault_tolerant() or not sizes:
        return None
    times = []
    for bound in (max(sizes), 0):
        probe = Communicator(comm.mpi)
        probe.one_shot_bytes = bound
        try:
            rows = bench.run(probe, dataclasses.replace(options, algorithms=["hierarchical"], sizes=sizes,
                                                        dtypes=options.dtypes[:1], quiet=True))
        finally:
            probe.free()
        times.append({row["bytes"]: row["time_us"] for row in rows if not row["wrong"]})
    return one_shot_bound(*times)


def one_shot_bound(one_shot: dict, sliced: dict) -> int:
    """The bound of the one-shot from the times ({bytes: us}) of both: it goes on while it is the
    faster, up to the geometric mean of the last size it won and the next; 0 if it loses at the
    smallest, the largest size measured if it never loses."""
    won = 0
    for size in sorted(set(one_shot) & set(sliced)):
        if one_shot[size] > sliced[size]:
            return int((won * size) ** 0.5) if won else 0
        won = size
    return won


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
