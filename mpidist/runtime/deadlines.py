"""Every wait for another rank: one helper (wait_until), one limit (MPIDIST_TIMEOUT) and one error
(DeadlineError) that names the rank or ranks that went silent.

A rank that stops, raises, or calls something else leaves its peers waiting; with a deadline
they raise instead of hanging, and the message says who they were waiting for.
"""
from __future__ import annotations

import os
import time

from ..errors import DeadlineError
from . import config

# The default cadence of a wait: yield the core for the first 10 ms (an oversubscribed peer gets
# it without a timer's delay), then nap 0.5 ms between tests (a long wait does not burn the core
# the awaited rank may need).
YIELD_SECONDS = 0.01
NAP_SECONDS = 0.0005


def timeout() -> float:
    """MPIDIST_TIMEOUT in seconds (read at every wait, so a program may change it)."""
    return config.value("MPIDIST_TIMEOUT")


def poll_until(test, on_timeout, yield_seconds: float = YIELD_SECONDS, nap_seconds: float = NAP_SECONDS) -> None:
    """Call test() until it returns True: yielding the core between calls for the first
    `yield_seconds`, then sleeping `nap_seconds` between calls; after MPIDIST_TIMEOUT seconds
    on_timeout() is called, which raises. Callers with their own measured cadence pass it."""
    start = time.monotonic()
    while not test():
        waited = time.monotonic() - start
        if waited < yield_seconds:
            os.sched_yield()
            continue
        if waited > timeout():
            on_timeout()
        time.sleep(nap_seconds)


def deadline_error(who: str, what: str, silent: str, peers=(), advice: str = "") -> DeadlineError:
    """The error of a wait that ran out: `who` waited for `what`, and `silent` (the peer, named)
    did not answer; `peers` are its ranks; `advice` says what to do."""
    message = (f"{who}: {what} did not complete within {timeout():.0f} s (MPIDIST_TIMEOUT): "
               f"no answer from {silent}")
    return DeadlineError(message + (f". {advice}" if advice else ""), peers=peers)


def wait_until(test, who: str, what: str, silent: str, peers=(), advice: str = "",
               yield_seconds: float = YIELD_SECONDS, nap_seconds: float = NAP_SECONDS) -> None:
    """Poll test() until it returns True; after MPIDIST_TIMEOUT raise DeadlineError naming the
    silent peer (see deadline_error)."""
    def timed_out():
        raise deadline_error(who, what, silent, peers, advice)

    poll_until(test, timed_out, yield_seconds, nap_seconds)


def wait_for_request(request, who: str, what: str, silent: str, peers=(), advice: str = "") -> None:
    """Wait for one nonblocking MPI request (anything with Test()) with the deadline."""
    wait_until(request.Test, who, what, silent, peers, advice)


def other_ranks(mpi) -> tuple:
    """The ranks of communicator `mpi` other than this one: who a collective waits for."""
    me = mpi.Get_rank()
    return tuple(rank for rank in range(mpi.Get_size()) if rank != me)


def wait_for_collective(request, mpi, what: str) -> None:
    """Wait for a nonblocking collective `request` on the mpi4py communicator `mpi`. Which rank
    is missing cannot be known from here, so the error names every other rank."""
    others = other_ranks(mpi)
    wait_until(request.Test, f"rank {mpi.Get_rank()}", f"the {what}",
               f"ranks {list(others)} (at least one of them did not enter it)", peers=others,
               advice="Some rank did not enter the same collective (it may have raised an error, or called a "
                      "different collective). This communicator can no longer be used safely.")
