"""Every wait for another rank: one helper (wait_until), one limit (MPIDIST_TIMEOUT) and one error
(DeadlineError) that names the rank or ranks that went silent.

A rank that stops, raises, or calls something else leaves its peers waiting; with a deadline
they raise instead of hanging, and the message says who they were waiting for. Before that, a
wait in a collective that runs past MPIDIST_STALL_WARNING prints the stall report (stall.py).
"""
from __future__ import annotations

import os
import time

from ..errors import DeadlineError
from . import config, stall

# The default cadence of a wait: yield the core for the first 10 ms (an oversubscribed peer gets
# it without a timer's delay), then nap 0.5 ms between tests (a long wait does not burn the core
# the awaited rank may need).
YIELD_SECONDS = 0.01
NAP_SECONDS = 0.0005


def timeout() -> float:
    """MPIDIST_TIMEOUT in seconds (read at every wait, so a program may change it)."""
    return config.value("MPIDIST_TIMEOUT")


def poll_until(test, on_timeout, yield_seconds: float = YIELD_SECONDS, nap_seconds: float = NAP_SECONDS,
               on_stall=None) -> None:
    """Call test() until it returns True: yielding the core between calls for the first
    `yield_seconds`, then sleeping `nap_seconds` between calls; after MPIDIST_TIMEOUT seconds
    on_timeout() is called, which raises. Callers with their own measured cadence pass it.
    on_stall(waited, timeout), when given, is called once after MPIDIST_STALL_WARNING seconds."""
    start = time.monotonic()
    stall_warning = config.value("MPIDIST_STALL_WARNING") if on_stall is not None else None
    while not test():
        waited = time.monotonic() - start
        if waited < yield_seconds:
            os.sched_yield()
            continue
        limit = timeout()
        if waited > limit:
            on_timeout()
        if stall_warning is not None and waited > stall_warning:
            stall_warning = None
            if waited < limit:
                on_stall(waited, limit)
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


def wait_in_collective(test, mpi, what: str, on_timeout, yield_seconds: float = YIELD_SECONDS,
                       nap_seconds: float = NAP_SECONDS) -> None:
    """Poll test() until it returns True, as this rank's wait in the collective `what` on the
    mpi4py communicator `mpi`: the wait is published on the stall board, a wait past
    MPIDIST_STALL_WARNING prints the stall report (which reads from the other ranks' records who
    has not arrived), a rank whose program ended without entering ends the wait (PeerExitedError),
    and after MPIDIST_TIMEOUT on_timeout() raises. Every collective's wait goes through here, so
    the report covers them all."""
    stall.publish(what)
    exits = stall.ExitWatch(mpi, what)

    def arrived():
        if test():
            return True
        exits.check()  # raises once a rank that never entered has ended its program
        return False

    poll_until(arrived, on_timeout, yield_seconds, nap_seconds,
               on_stall=lambda waited, limit: stall.report(mpi, what, waited, limit))
    stall.returned()


def wait_for_collective(request, mpi, what: str) -> None:
    """Wait for a nonblocking collective `request` on the mpi4py communicator `mpi`
    (wait_in_collective_of)."""
    wait_in_collective_of(request.Test, mpi, what)


def wait_in_collective_of(test, mpi, what: str, yield_seconds: float = YIELD_SECONDS,
                          nap_seconds: float = NAP_SECONDS) -> None:
    """Poll test() until it returns True, as this rank's wait in the collective `what` of every
    rank of `mpi` (wait_in_collective). Which rank is missing is not known here, so the
    deadline's error names every other rank; the stall report before it names the missing ones."""
    others = other_ranks(mpi)
    waiting_in = f"the {what}"

    def timed_out():
        raise deadline_error(f"rank {mpi.Get_rank()}", waiting_in,
                             f"ranks {list(others)} (at least one of them did not enter it)", peers=others,
                             advice="Some rank did not enter the same collective (it may have raised an error, or "
                                    "called a different collective). This communicator can no longer be used safely.")

    wait_in_collective(test, mpi, waiting_in, timed_out, yield_seconds, nap_seconds)
