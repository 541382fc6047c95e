"""Failing together: where some ranks met an error, every rank raises the same one, naming the
ranks that failed and why, instead of the others going on or waiting for them. raise_together
(or agreed_error, for a caller that raises the agreed error its own way) is the package's one way
to do this; on_root (work that rank 0 does while the others wait) and share_failure (every rank's
part of one task) are built on it, for mpidist's Communicators as well as mpi4py's.

It is collective over an mpi4py communicator given by the caller (this module never loads MPI).
Each rank passes the exception it met, or None. The ranks exchange one length each (the whole
cost when none failed), then the failures as class name and message in UTF-8 (wire.allgather_texts):
nothing is pickled, and a class is raised on another rank only if it is one of mpidist's errors
or a built-in exception.
"""
from __future__ import annotations

import builtins

from .. import errors
from . import wire

# A failure crosses the wire as "ClassName:message" (a class name holds no colon).
SEPARATOR = ":"


def gather_failures(mpi, problem: BaseException | None, what: str) -> list:
    """Collective: every rank's (class name, message) of `problem`, or None where it had none,
    in a list by rank."""
    text = None if problem is None else f"{type(problem).__name__}{SEPARATOR}{problem}"
    return [None if text is None else tuple(text.split(SEPARATOR, 1))
            for text in wire.allgather_texts(mpi, text, f"agreement on {what}")]


def exception_class(name: str) -> type:
    """The exception class a failure's class name stands for on every rank: one of mpidist's
    errors or a built-in exception, otherwise MpidistError (the message then keeps the name)."""
    found = getattr(errors, name, None) or getattr(builtins, name, None)
    if isinstance(found, type) and issubclass(found, Exception):
        return found
    return errors.MpidistError


def describe(failures: list, raised: type, what: str) -> str:
    """'{what} failed: rank 1: ...; ranks 0, 2: ...', ranks grouped by equal failures, each
    failure's class named where it is not the raised one."""
    groups = {}
    for rank, failure in enumerate(failures):
        if failure is not None:
            groups.setdefault(failure, []).append(rank)
    parts = []
    for (name, message), ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who}: {message}" if name == raised.__name__ else f"{who}: {name}: {message}")
    return f"{what} failed: {'; '.join(parts)}"


def agreed_error(mpi, problem: BaseException | None, what: str, error: type | None = None,
                 message=None) -> Exception | None:
    """Collective over `mpi`: None on every rank if no rank passed a `problem`; otherwise the same
    error on every rank. Its class is `error`, or else the lowest failing rank's class
    (exception_class); its message is `message(failures)` of the gathered failures
    (gather_failures) where given, describe() by default."""
    failures = gather_failures(mpi, problem, what)
    failed = [failure for failure in failures if failure is not None]
    if not failed:
        return None
    agreed = error or exception_class(failed[0][0])
    return agreed(message(failures) if message else describe(failures, agreed, what))


def raise_together(mpi, problem: BaseException | None, what: str, error: type | None = None,
                   message=None) -> None:
    """Collective over `mpi`: return on every rank if no rank passed a `problem`; otherwise raise
    the same error on every rank (agreed_error), chained to this rank's own problem."""
    agreed = agreed_error(mpi, problem, what, error, message)
    if agreed is not None:
        raise agreed from problem


def mpi_of(comm):
    """The mpi4py communicator behind an mpidist Communicator, an mpi4py communicator, or None."""
    return getattr(comm, "mpi", comm)


def on_root(comm, work, what: str, error=errors.MpidistError):
    """Run ``work()`` on rank 0 while the other ranks wait; return its result on rank 0.

    Collective when ``comm`` is given. If ``work`` raises, rank 0 re-raises it and every other
    rank raises ``error`` naming ``what``, so a failure never leaves ranks waiting forever.
    Without a communicator ``work()`` simply runs here.
    """
    mpi = mpi_of(comm)
    if mpi is None:
        return work()
    result = raised = None
    if mpi.Get_rank() == 0:
        try:
            result = work()
        except BaseException as exc:  # reported to the other ranks, then re-raised here
            raised = exc
    agreed = agreed_error(mpi, raised, what, error, message=lambda failures: f"rank 0 failed {what}; see rank 0's error")
    if raised is not None:
        raise raised
    if agreed is not None:
        raise agreed
    return result


def on_every_rank(error: BaseException) -> BaseException:
    """Mark ``error`` as one that every rank raises alike (the ranks agreed on it), so that a
    command reports it once, from rank 0 (cli.main), not once per rank."""
    error.on_every_rank = True
    return error


def share_failure(comm, failure: Exception | None, what: str, error=errors.MpidistError) -> None:
    """Collective: every rank passes the exception its part of ``what`` raised, or None. Where
    any rank failed, every rank raises the same ``error`` (marked ``on_every_rank``): the first
    failure's message, naming the ranks that failed unless all failed alike. So no rank goes on
    while others stopped. Without a communicator ``failure`` is raised as it is."""
    mpi = mpi_of(comm)
    if mpi is None:
        if failure is not None:
            raise failure
        return
    def first_failure(failures):
        failed = [rank for rank, entry in enumerate(failures) if entry is not None]
        first = failures[failed[0]][1]
        if len(failed) < len(failures) or len({message for _, message in failures}) > 1:
            return f"{what} failed on rank(s) {failed}: {first}"
        return first

    agreed = agreed_error(mpi, failure, what, error, message=first_failure)
    if agreed is not None:
        raise on_every_rank(agreed) from failure
