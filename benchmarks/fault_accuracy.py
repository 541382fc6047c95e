"""The fault campaign's rule for a parameter-server run's accuracy (benchmarks/faults.py's
docstring): a run judged against its job's undisturbed references with as much work, and the
rule's false alarms, the references it calls wrong when each is judged against the others."""
from __future__ import annotations

import statistics


def digits_test_size() -> int:
    from mpidist.data import HDF5Dataset, default_digits_path
    return len(HDF5Dataset(default_digits_path(), "test"))


def accuracy_verdict(accuracy, work, references: list, resolution: float) -> dict:
    """A parameter-server run's accuracy judged against its job's references with as much work
    (benchmarks/faults.py's docstring; `resolution`: one test item's share of the accuracy): its lost share
    of work, the references' range there, the bound, and whether it is wrong."""
    import numpy as np
    if accuracy is None or work is None:
        return {"wrong": True, "work": work}
    lengths = {}  # seed -> [(work, accuracy)] of its references
    for r in references:
        lengths.setdefault(r["reference_seed"], []).append((r["work"], r["accuracy"]))
    at_same_work = [float(np.interp(work, *zip(*sorted(points)))) for points in lengths.values()]
    low, high = min(at_same_work), max(at_same_work)
    bound = low - max(high - low, resolution)
    full = statistics.median(max(points)[0] for points in lengths.values())
    return {"work": work, "lost_share": 1 - work / full, "references_at_same_work": [low, high],
            "accuracy_bound": bound, "wrong": accuracy < bound}


def undisturbed_below_bound(references: list, resolution: float) -> tuple:
    """How often the rule calls an undisturbed run wrong: each reference judged, as a disturbed run
    with its work would be, against the references of the other seeds (its own left out).
    Returns (below, judged): the rule's false alarms, beside which the disturbed runs' count of
    wrong ones is read."""
    seeds = sorted({r["reference_seed"] for r in references})
    if len(seeds) < 3:  # the others need two seeds for a spread
        return 0, 0
    below = 0
    for r in references:
        others = [o for o in references if o["reference_seed"] != r["reference_seed"]]
        below += accuracy_verdict(r["accuracy"], r["work"], others, resolution)["wrong"]
    return below, len(references)
