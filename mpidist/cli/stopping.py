"""A training loop's graceful stop: a signal (SLURM's warning before the time limit, SIGUSR1 by
`--signal=USR1@60`, or SIGTERM) asks for it, and every rank stops at the same step boundary.

A signal reaches the ranks at different moments (or only some of them), so the ranks agree on the
step: at every step boundary each rank contributes whether it has been signalled to a nonblocking
all-reduce (MAX) that completes during the next step, and all stop at the boundary where the
first such result says yes: one step after the first signal, at no cost but one small
nonblocking collective per step. A second signal while stopping takes the signal's own action at
once (a second SIGTERM ends the process), for a user who does not want to wait.
"""
from __future__ import annotations

import os
import signal

import numpy as np

from ..runtime import load_mpi, wait_for_collective

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class GracefulStop:
    """Catches `signals` on this rank from its making until close(); should_stop(comm), called by
    every rank of `comm` (an mpidist Communicator) at every step boundary, is True on every rank
    at the same boundary once a signal has reached any of them. Make it as early as possible: a
    stop signal that comes before it takes the signal's own action (SIGUSR1 ends the process)."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signalled = None  # the name of the first signal this rank received
        self._mpi = None  # the agreement's communicator, duplicated at the first step boundary
        self._mine = np.zeros(1, dtype=np.int64)
        self._agreed = np.zeros(1, dtype=np.int64)
        self._request = None
        self._previous = {number: signal.signal(number, self._on_signal) for number in signals}

    def _on_signal(self, number, frame) -> None:
        if self.signalled is not None:
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        self.signalled = signal.Signals(number).name

    def should_stop(self, comm) -> bool:
        """Whether every rank stops here (the same answer on every rank of `comm`)."""
        if self._mpi is None:
            self._mpi = comm.mpi.Dup()  # the agreement's messages never meet the training's
        if self._request is not None:
            wait_for_collective(self._request, self._mpi, "agreement on a graceful stop")
            self._request = None
            if self._agreed[0]:
                return True
        self._mine[0] = self.signalled is not None
        self._request = self._mpi.Iallreduce(self._mine, self._agreed, op=load_mpi().MAX)
        return False

    def close(self) -> None:
        """Finish the agreement in flight, free its communicator (collective: every rank that
        called should_stop calls it) and restore the signals' previous handlers."""
        if self._request is not None:
            wait_for_collective(self._request, self._mpi, "agreement on a graceful stop")
            self._request = None
        if self._mpi is not None:
            self._mpi.Free()
            self._mpi = None
        for number, handler in self._previous.items():
            signal.signal(number, handler)
