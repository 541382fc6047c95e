"""What a fault-tolerant job lost when a rank died and it went on without it: the record of each
loss (elastic training's shrinks, the parameter server's dropped workers), the one line that sums
them up at the end of the job, and the exit status MPIDIST_EXIT_ON_RANK_LOSS asks of such a job.

A job that survives a death does its work and exits 0, as it should; this line is what makes the
loss visible at the end of a batch log, where nobody has to read every line to find it. Each mode
records its losses here, on every rank that knows of them, and names the one rank that reports
them (elastic training: the lowest surviving rank, rank 0 of the shrunk world; a parameter
server: its coordinating server, which always survives a loss it goes on from). That rank prints
the line of the losses not yet told when training ends (md.elastic.run returns, serve() returns)
and, for losses recorded after that or in a program that never gets there, at exit: each loss
is told once.

The exit status: with MPIDIST_EXIT_ON_RANK_LOSS set to a status other than 0, every rank that
recorded a loss ends with that status (leave.py, which calls MPI_Finalize itself in a run where a
rank died), unless its program was ending with an error status of its own; mpirun reports a
rank's non-zero status as its own.
"""
from __future__ import annotations

import atexit
import dataclasses
import sys
import time

from ..errors import InvalidArgumentError
from . import config

# The job's start, as this process sees it: mpidist is imported first thing in a program.
STARTED = time.time()
HIGHEST_STATUS = 255

_recorded = []  # every loss this process knows of
_untold = []  # those this rank reports and has not told yet


@dataclasses.dataclass(frozen=True)
class RankLoss:
    """A rank the job lost and went on without: who it was (`who`: "rank 1 of 3 (md.elastic.run)"),
    where training was (`where`: "epoch=1 steps=7"), when its death was seen (time.time()) and
    what its loss cost (`cost`)."""
    who: str
    where: str
    time: float
    cost: str

    def describe(self) -> str:
        clock = time.strftime("%H:%M:%S", time.gmtime(self.time))
        return f"{self.who} at {self.where} ({clock} UTC, {self.time - STARTED:.1f} s after the start): {self.cost}"


def record(loss: RankLoss, reports: bool) -> None:
    """Remember `loss`; `reports`: this rank is the one that tells it (see the module's notes)."""
    if not _recorded:
        # Registered after md.init()'s leave.install(), so run before its MPI_Finalize.
        atexit.register(tell)
    _recorded.append(loss)
    if reports:
        _untold.append(loss)


def lost_any() -> bool:
    return bool(_recorded)


def tell() -> None:
    """Print the line of the losses this rank reports and has not told yet (nothing when none), on
    standard error."""
    if not _untold:
        return
    status = exit_status_on_loss()
    ending = f"this rank exits with status {status} (MPIDIST_EXIT_ON_RANK_LOSS)" if status else \
        "the job's exit status is its program's (MPIDIST_EXIT_ON_RANK_LOSS=<status> makes it that status)"
    losses = "; ".join(loss.describe() for loss in _untold)
    _untold.clear()
    print(f"mpidist: the job lost {losses}; {ending}", file=sys.stderr, flush=True)


def exit_status_on_loss() -> int:
    """MPIDIST_EXIT_ON_RANK_LOSS: the status a rank that recorded a loss exits with; 0, the
    default, leaves the status to the program."""
    status = config.value("MPIDIST_EXIT_ON_RANK_LOSS")
    if status > HIGHEST_STATUS:
        raise InvalidArgumentError(f"environment variable MPIDIST_EXIT_ON_RANK_LOSS={status} must be an exit status, "
                                   f"0 to {HIGHEST_STATUS} (0, the default: the program's own)")
    return status
