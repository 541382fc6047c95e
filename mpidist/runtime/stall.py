"""The stall report: a rank that has waited in a collective longer than MPIDIST_STALL_WARNING
prints which ranks have not arrived and what each of them last called.

Which rank is missing cannot be seen from inside a collective, and a missing rank may be busy
computing, away from MPI. So every rank publishes what it is waiting in, and when, on a board:
an MPI window made once by md.init() over the world (open_board), one record per rank in the
rank's own memory. Publishing is a local write of a few bytes (publish, returned); only a wait
that runs past the warning reads the other ranks' records (report), with one-sided gets that
need nothing from the rank read. Without a board (a Communicator made without md.init()) the
report names every other rank of the communicator, as the deadline error does.

The same records tell a waiting rank that a peer's program has ended (ExitWatch): md.init()
has every rank mark its record at exit, and a rank still waiting for that peer in a collective
raises PeerExitedError a few seconds later instead of waiting out MPIDIST_TIMEOUT.

A rank that has entered the collective is not always one that can finish it: a collective of
several stages (the gradient buckets' all-reduce on one node) needs every rank to go on polling
it, and a rank frozen inside its wait (SIGSTOP, a node that hangs) publishes the same text as the
ranks waiting for it. So a wait that polls (wait_in_collective, through ExitWatch) also writes when
it last polled, and the report names a rank whose record says it waits here but has not polled
for POLL_STALE_SECONDS. A wait that does not poll from its own thread (hvd's negotiated handles)
leaves that time unset, and its rank counts as arrived, as before.
"""
from __future__ import annotations

import atexit
import os
import sys
import time

import numpy as np

from ..errors import PeerExitedError
from .mpi import fault_tolerant, load_mpi

TEXT_BYTES = 104
RECORD_BYTES = 32 + TEXT_BYTES  # time (float64), state (int64), text length (int64), polled (float64), text
NO_CALL, WAITING, RETURNED, EXITED = 0, 1, 2, 3
# How long a report may wait for the records of the other ranks: on one node a read is a copy
# from shared memory; across nodes, with no hardware one-sided support, a read needs the other
# rank's MPI library to make progress, which a rank busy away from MPI does not.
READ_SECONDS = 2.0
# How often a waiting rank looks for peers whose program has ended (after waiting this long), and
# how long such a peer must have been gone before the wait is declared hopeless. A rank exits only
# after its last call returned; a call it did enter completes at the others within moments (its
# messages are on their way, or delivered), so a wait still open seconds after is for a call the
# peer never entered.
EXIT_CHECK_SECONDS = 1.0
EXIT_GRACE_SECONDS = 2.0
# How often a polling wait writes the time it last polled, and how old that time must be for a
# rank waiting in the same collective to count as stuck in it rather than arrived: far longer than
# a time slice of a rank that shares its core with others, and at most half the reporter's own
# wait (with a short MPIDIST_STALL_WARNING, a rank frozen just before the others began waiting is
# still named).
POLL_MARK_SECONDS = 0.25
POLL_STALE_SECONDS = 3.0

_board = None


class Board:
    """The window of records over communicator `mpi` (made collectively), readable by any rank
    at any time: every rank's window is locked shared for the whole run."""

    def __init__(self, mpi):
        MPI = load_mpi()
        self.mpi = mpi
        self.window = MPI.Win.Allocate(RECORD_BYTES, disp_unit=1, comm=mpi)
        self.window.Lock_all(MPI.MODE_NOCHECK)
        # Memoryviews rather than NumPy views: every collective writes its record twice, and
        # storing one item through a memoryview costs less than through a NumPy array.
        memory = memoryview(self.window.tomemory()).cast("B")
        self.time = memory[0:8].cast("d")
        self.state = memory[8:16].cast("q")
        self.length = memory[16:24].cast("q")
        self.polled = memory[24:32].cast("d")
        self.text = memory[32:RECORD_BYTES]
        self.state[0] = NO_CALL
        self.published = None  # the text of the last publish()
        self.pid = os.getpid()

    def publish(self, what: str) -> None:
        if what != self.published:  # a call like the last one finds its text there already
            data = _as_published(what)
            self.text[:len(data)] = data
            self.length[0] = len(data)
            self.published = what
        self.polled[0] = 0.0  # unknown until this wait polls (mark_polled)
        self.time[0] = time.time()
        self.state[0] = WAITING

    def mark_polled(self) -> None:
        self.polled[0] = time.time()

    def returned(self) -> None:
        self.time[0] = time.time()
        self.state[0] = RETURNED

    def exited(self) -> None:
        if os.getpid() != self.pid:
            return  # a forked child (a data loader's worker) ending: its memory may be the rank's
        self.time[0] = time.time()
        self.state[0] = EXITED

    def read(self, board_ranks) -> dict:
        """{board rank: (state, time, text, polled)} of the ranks whose records arrived within
        READ_SECONDS (polled: when its wait last polled; 0 when unknown)."""
        MPI = load_mpi()
        records = {rank: np.zeros(RECORD_BYTES, dtype=np.uint8) for rank in board_ranks}
        requests = {rank: self.window.Rget([records[rank], MPI.BYTE], rank) for rank in board_ranks}
        deadline = time.monotonic() + READ_SECONDS
        pending = dict(requests)
        while pending and time.monotonic() < deadline:
            pending = {rank: request for rank, request in pending.items() if not request.Test()}
            time.sleep(0.001)
        read = {}
        for rank, record in records.items():
            if rank in pending:
                continue
            length = int(record[16:24].view(np.int64)[0])
            text = record[32:32 + max(0, min(length, TEXT_BYTES))].tobytes().decode(errors="replace")
            read[rank] = (int(record[8:16].view(np.int64)[0]), float(record[0:8].view(np.float64)[0]), text,
                          float(record[24:32].view(np.float64)[0]))
        return read


def _as_published(what: str) -> bytes:
    """The text of `what` as a record holds it: its first TEXT_BYTES bytes."""
    return what.encode()[:TEXT_BYTES]


def open_board(mpi) -> None:
    """Make the board over the world communicator `mpi` (collective; md.init() calls it once).
    An MPI library that cannot make the window (no one-sided support) leaves the stall report
    without names, as it is without md.init()."""
    global _board
    if _board is None and mpi.Get_size() > 1:
        try:
            _board = Board(mpi)
        except load_mpi().Exception:
            _board = None
        else:
            # Registered after mpi4py's import, so it runs before MPI_Finalize.
            atexit.register(_board.exited)


def publish(what: str) -> None:
    """Say on this rank's record that it now waits in `what`."""
    if _board is not None:
        _board.publish(what)


def returned() -> None:
    """Say on this rank's record that its wait is over."""
    if _board is not None:
        _board.returned()


def board_ranks(mpi, ranks) -> list:
    """The board's ranks of `ranks` of communicator `mpi` (None for a rank not on the board)."""
    MPI = load_mpi()
    group, board_group = mpi.Get_group(), _board.mpi.Get_group()
    translated = MPI.Group.Translate_ranks(group, list(ranks), board_group)
    group.Free()
    board_group.Free()
    return [None if rank == MPI.UNDEFINED else rank for rank in translated]


class ExitWatch:
    """Watches, during one wait in `what` on communicator `mpi`, for the ranks of `mpi` whose
    program has ended: check() raises PeerExitedError once one has been gone for
    EXIT_GRACE_SECONDS (see there why that is safe). It reads the records only after
    EXIT_CHECK_SECONDS of waiting, and then once per EXIT_CHECK_SECONDS. It does nothing without a
    board, nor in a fault-tolerant run (ULFM), where a dead rank is the MPI library's to report
    and reading its record could fail. Made and checked by the waiting rank's own polls, it also
    marks on this rank's record that its wait still polls (every POLL_MARK_SECONDS)."""

    def __init__(self, mpi, what: str):
        self.mpi, self.what = mpi, what
        self.active = _board is not None and not fault_tolerant()
        self.next_check = time.monotonic() + EXIT_CHECK_SECONDS
        self.next_mark = time.monotonic() + POLL_MARK_SECONDS
        self.gone_since = None
        if _board is not None:
            _board.mark_polled()

    def check(self) -> None:
        now = time.monotonic()
        if _board is not None and now >= self.next_mark:
            _board.mark_polled()
            self.next_mark = now + POLL_MARK_SECONDS
        if not self.active or now < self.next_check:
            return
        self.next_check = now + EXIT_CHECK_SECONDS
        me = self.mpi.Get_rank()
        others = [rank for rank in range(self.mpi.Get_size()) if rank != me]
        on_board = board_ranks(self.mpi, others)
        records = _board.read([rank for rank in on_board if rank is not None])
        gone = [rank for rank, board_rank in zip(others, on_board) if records.get(board_rank, (None,))[0] == EXITED]
        if not gone:
            return
        if self.gone_since is None:
            self.gone_since = now
        if now - self.gone_since >= EXIT_GRACE_SECONDS:
            raise PeerExitedError(f"rank {me}: {self.what} cannot complete: the program of rank(s) {gone} ended (it "
                                  "returned, called sys.exit or raised an uncaught exception) without entering it. "
                                  "Every rank must make the same collective calls before it exits", peers=gone)


def report(mpi, what: str, waited: float, timeout: float) -> None:
    """Print the stall report of this rank, which has waited `waited` seconds in `what` on the
    mpi4py communicator `mpi`. With a board, only the lowest-ranked rank that sees itself among
    those arrived prints it, not every waiting rank; without one, each rank prints its own."""
    me = mpi.Get_rank()
    others = [rank for rank in range(mpi.Get_size()) if rank != me]
    if _board is None:
        print(f"mpidist: rank {me} has waited {waited:.0f} s in {what} (MPIDIST_STALL_WARNING); some of ranks "
              f"{others} have not arrived; still waiting until MPIDIST_TIMEOUT ({timeout:.0f} s)",
              file=sys.stderr, flush=True)
        return
    on_board = board_ranks(mpi, others)
    records = _board.read([rank for rank in on_board if rank is not None])
    now = time.time()
    published = _as_published(what).decode(errors="replace")
    missing, lines = [], []
    for rank, board_rank in zip(others, on_board):
        state, since, text, polled = records.get(board_rank, (None, 0.0, "", 0.0))
        stuck = polled > 0 and now - polled > min(POLL_STALE_SECONDS, waited / 2)
        if state == WAITING and text == published and not stuck:
            if rank < me:
                return  # a lower rank waits here too: it prints the report
            continue
        missing.append(rank)
        name = f"rank {rank}" + (f" (world rank {board_rank})" if board_rank != rank else "")
        if state == WAITING and text == published:
            lines.append(f"{name}: entered {text} {now - since:.0f} s ago, but its wait has not polled for "
                         f"{now - polled:.0f} s (the process is frozen, or its poll is held up, in MPI or elsewhere)")
        elif state is None:
            lines.append(f"{name}: its record could not be read within {READ_SECONDS:.0f} s (it is busy away "
                         "from MPI, or gone)")
        elif state == NO_CALL:
            lines.append(f"{name}: has not waited in any mpidist collective since md.init()")
        elif state == WAITING:
            lines.append(f"{name}: waits in {text} (for {now - since:.0f} s)")
        elif state == EXITED:
            lines.append(f"{name}: its program ended {now - since:.0f} s ago")
        else:
            lines.append(f"{name}: last called {text}, which returned {now - since:.0f} s ago; no collective since")
    if not missing:
        return  # every rank has arrived: the collective is completing
    print(f"mpidist: stall: rank {me} has waited {waited:.0f} s in {what} (MPIDIST_STALL_WARNING); ranks {missing} "
          f"have not arrived:\n" + "\n".join(f"  {line}" for line in lines) +
          f"\n  (still waiting until MPIDIST_TIMEOUT, {timeout:.0f} s)", file=sys.stderr, flush=True)
