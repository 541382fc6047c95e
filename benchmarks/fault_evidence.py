"""What a launch of the fault campaign (benchmarks/faults.py) left behind, read back: the lines of
its output that report accuracy, gradients and faults, the steps in the hook's phase logs
(benchmarks/fault_hook.py) and their rates, and its checkpoints."""
from __future__ import annotations

import glob
import os
import re


def phase_log(directory: str) -> dict:
    """rank -> [(time, phase, step)] from the hook's logs."""
    logs = {}
    for path in glob.glob(os.path.join(directory, "rank-*.log")):
        rank = int(re.search(r"rank-(\d+)\.log", path).group(1))
        with open(path) as f:
            logs[rank] = [(float(t), phase, int(step)) for t, phase, step in
                          (line.split() for line in f if len(line.split()) == 3)]
    return logs


def first_match(run: dict, pattern: str):
    """The match of `pattern` in the first line of a launch's output that has one, or None."""
    for _, line in run["lines"]:
        found = re.search(pattern, line)
        if found:
            return found
    return None


def output_tail(run: dict) -> str:
    """The end of a launch's output, for a run's record."""
    return "\n".join(line for _, line in run["lines"])[-3000:]


def accuracy_of(run: dict):
    found = first_match(run, r"final test accuracy: ([0-9.]+)")
    return float(found.group(1)) if found else None


def gradients_applied(run: dict):
    """The gradients the server applied in this launch (its summary line), or None."""
    found = first_match(run, r"parameter server \(.*\): \d+ updates of (\d+) gradients")
    return int(found.group(1)) if found else None


def gradients_resumed(run: dict) -> int:
    """The gradients applied to the checkpoint a relaunch resumed from (its "resumed from" line)."""
    found = first_match(run, r"resumed from .* gradients per worker \[([0-9, ]*)\]")
    return sum(int(n) for n in found.group(1).split(",") if n.strip()) if found else 0


def work_done(logs: dict) -> int:
    """The training steps the workers did (the server's log has none)."""
    return sum(1 for log in logs.values() for _, phase, _ in log if phase == "done")


def first_line(run: dict, pattern: str, after: float):
    for t, line in run["lines"]:
        if t >= after and re.search(pattern, line):
            return t
    return None


def step_times(log: list, until: float) -> list:
    done = [t for t, phase, _ in log if phase == "done" and t < until]
    return [b - a for a, b in zip(done, done[1:])]


def rate(logs: dict, ranks, since: float, until: float) -> float | None:
    """Training steps per second and rank that `ranks` completed in [since, until]: the job's
    steps per second in data parallel, a worker's in parameter-server mode."""
    ranks = list(ranks)
    count = sum(1 for r in ranks for t, phase, _ in logs.get(r, []) if phase == "done" and since <= t <= until)
    return count / len(ranks) / (until - since) if until > since and count else None


def training_seconds(logs: dict) -> float:
    """From the first step completed on any rank to the last."""
    done = [t for log in logs.values() for t, phase, _ in log if phase == "done"]
    return max(done) - min(done)


def first_step(logs: dict, ranks) -> float:
    return min((t for r in ranks for t, phase, _ in logs.get(r, []) if phase == "done"), default=float("inf"))


def newest_checkpoint(directory: str):
    from mpidist.checkpoint import latest_checkpoint
    for where in (os.path.join(directory, "ps"), directory):
        if os.path.isdir(where):
            found = latest_checkpoint(where)
            if found is not None:
                return found
    return None


def loads(path: str, args) -> str | None:
    """None when the checkpoint at `path` loads into the network and optimizer of `mpidist train`,
    else the error."""
    import torch

    from mpidist.checkpoint import load_checkpoint
    from mpidist.cli.train import build_model
    model = build_model()
    try:
        load_checkpoint(path, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), restore_rng=False)
    except Exception as exc:  # any failure to load is what the record keeps
        return f"{type(exc).__name__}: {exc}"
    return None


def final_weights(directory: str) -> dict:
    """The model and optimizer tensors of the newest checkpoint in `directory`."""
    import h5py
    path = newest_checkpoint(directory)
    tensors = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: tensors.__setitem__(name, item[()])
                     if isinstance(item, h5py.Dataset) and name.startswith(("model/", "optimizer/")) else None)
    return tensors
