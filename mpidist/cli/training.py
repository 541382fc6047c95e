"""What a training mode plugs into `mpidist train`'s one loop (train.run_epochs): the Mode it
fills in (how a step runs, what a stop signal's step and an epoch's end do, what the progress
shows), and what every mode shares: the progress display, the stop line, --resume without a
checkpoint.
"""
from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm

from ..checkpoint import CheckpointError
from ..runtime import on_every_rank

# The first words of the line `mpidist train` prints when a stop signal ended it early (slurm/train.sbatch
# looks for them to requeue the job).
STOPPED_EARLY = "mpidist train: stopped early"


class Mode:
    """A training mode, as the loop sees it. `who` is named in the progress bar's description,
    `shown` says whether this rank shows progress. The defaults: no stop of its own, no
    end-of-epoch work."""
    who = "rank 0"
    shown = False

    def batches(self, loader) -> int:
        """The steps of the epoch about to start."""
        return len(loader)

    def run_step(self, x, y, train_batch) -> tuple:
        """One step on the batch (x, y): (its output, or None where this rank has none; its
        loss). `train_batch` runs forward, loss, backward and an apply step (train.train_batch)."""
        raise NotImplementedError(f"{type(self).__name__} runs no step")

    def interrupted(self, step: int, epoch: int) -> bool:
        """After each step: whether a stop signal ends the run here (checkpointed and said)."""
        return False

    def finished(self) -> bool:
        """After each step is counted: whether this rank's training is over."""
        return False

    def postfix(self, loss: float, seen: int, correct: int, elapsed: float) -> dict:
        """What the progress shows after a step: the loss, `seen` samples and `correct` answers
        of this epoch so far, `elapsed` seconds into it."""
        return {"loss": f"{loss:.3f}"}

    def end_epoch(self, epoch: int, step: int, counts: tuple, elapsed: float) -> None:
        """After epoch `epoch` (from 0) at `step`; `counts`: this rank's (loss sum, correct,
        samples) of the epoch."""


def stopped_line(stop, step: int, epoch: int, epochs: int, path: str) -> str:
    """The start of the line that says a stop signal stopped every rank after `step`."""
    return (f"{STOPPED_EARLY}: a stop signal ({stop.signalled or 'on another rank'}) came; every rank stopped after "
            f"step {step} (epoch {epoch + 1}/{epochs}); checkpoint {path}")


class ProgressLines:
    """Progress for output that is not a terminal (a batch job's log): a plain line every
    `seconds`, with the steps done and the latest values, in place of tqdm's bar. The bar redraws
    itself after a carriage return, which in a file makes one line of every redraw of an epoch."""

    def __init__(self, total: int, desc: str, seconds: float):
        self.total, self.desc, self.seconds = total, desc, seconds
        self.done, self.values = 0, {}
        self.last = time.monotonic()

    def set_postfix(self, **values) -> None:
        self.values = values

    def update(self, steps: int = 1) -> None:
        self.done += steps
        now = time.monotonic()
        if now - self.last >= self.seconds:
            self.last = now
            values = "".join(f", {name} {value}" for name, value in self.values.items())
            print(f"{self.desc}: step {self.done}/{self.total}{values}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress(args, total: int, desc: str, shown: bool):
    """What shows an epoch's progress on this rank (`shown`, unless --no-progress): tqdm's bar on
    a terminal, elsewhere a plain line every --progress-seconds (ProgressLines)."""
    shown = shown and not args.no_progress
    if shown and not sys.stderr.isatty():
        return ProgressLines(total, desc, args.progress_seconds)
    return tqdm(total=total, desc=desc, disable=not shown, leave=True)


def nothing_to_resume(args, directory, say, which: str = "") -> None:
    """--resume found no checkpoint in `directory` (every rank alike): an error, unless
    --resume=auto, which starts from scratch. A mistyped --checkpoint-dir would otherwise throw
    away the progress of the run it was to continue."""
    if args.resume == "auto":
        say(f"no checkpoint {which}in {directory}: starting from scratch (--resume=auto)", flush=True)
        return
    found = "does not exist" if not os.path.exists(directory) else f"holds no checkpoint {which}".rstrip()
    raise on_every_rank(CheckpointError(
        f"--resume: {directory} {found}; check --checkpoint-dir, or pass --resume=auto to start from scratch "
        "when there is no checkpoint yet (the first run of a requeued job)"))
