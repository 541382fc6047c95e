"""Leaving MPI at the end of a fault-tolerant run in which a rank died, or that runs ULFM's
failure detector: MPI_Finalize with a time limit.

After a death, Open MPI 5's MPI_Finalize sometimes never returns on the survivors (its runtime's
end-of-job barrier waits forever; docs/elastic.md). With ULFM's heartbeat failure detector on
(`--mca mpi_ft_detector true`), it sometimes never returns even when no rank died: each rank's
detector waits in MPI_Finalize for the last heartbeat of the rank it observes, and in a run where
every rank had finished its program, some ranks spun there for minutes while the others waited
for them in the end-of-job barrier (benchmarks/faults.py, docs/faults.md). So in a run under
ULFM, md.init() registers finalize_after_a_death to run at exit: when a rank of the job is known
dead (to any survivor: they agree on it first, a_survivor_knows_of_a_death), or the detector is
on, it calls
MPI_Finalize itself, through ctypes so that Python's lock is released during the call (mpi4py's
MPI.Finalize holds it), and a watchdog thread ends the process with os._exit once
MPIDIST_FINALIZE_TIMEOUT has passed, with the exit status the program was going to return.
mpi4py, which finalizes MPI after Python's own exit handlers, then finds MPI finalized and does
nothing. Runs in which no rank died, and programs that told mpi4py not to finalize
(mpi4py.rc.finalize = False), are left to mpi4py as always.

The exit status: Python decides it before its exit handlers run and tells them nothing, so it is
noted on the way: an uncaught exception (sys.last_value, set before sys.excepthook is called)
gives 1 (130 for a KeyboardInterrupt, as a shell reports Ctrl-C), and sys.exit, wrapped by
install(), notes its argument (None: 0, a number: itself, anything else: 1, as Python does). A
SystemExit raised by the program itself, not through sys.exit, is not seen: such a program leaves
with 0. A process that recorded a rank's loss (losses.py) and whose program leaves with 0 ends with
MPIDIST_EXIT_ON_RANK_LOSS's status instead, through os._exit once MPI_Finalize has returned.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading

from . import config, losses
from .abort import EXCEPTION_STATUS, INTERRUPT_STATUS, flush_output
from .mpi import failed_ranks, load_mpi, loaded_mpi_libraries

_requested_status = None
_watchdog = None


def install() -> None:
    """Register finalize_after_a_death at exit, start its watchdog and note the status given to
    sys.exit (md.init() calls it once, in a fault-tolerant run, before registering its other exit
    handlers, so that those run first)."""
    global _watchdog
    if _watchdog is not None:
        return
    losses.exit_status_on_loss()  # a malformed MPIDIST_EXIT_ON_RANK_LOSS is refused on every rank, at md.init()
    exit_python = sys.exit

    def exit_noting_status(status=None):
        global _requested_status
        _requested_status = status
        exit_python(status)

    exit_noting_status.__doc__ = exit_python.__doc__
    sys.exit = exit_noting_status
    _watchdog = Watchdog()
    atexit.register(finalize_after_a_death)


def note_exit_status(status: int) -> None:
    """Note the status a program's main() returns, for `sys.exit(main())`: Python looks sys.exit
    up before main() runs, so the sys.exit that install() wraps, inside main() (md.init()), is
    not the one called."""
    global _requested_status
    _requested_status = status


class Watchdog:
    """A thread, started early (Python may refuse to start threads while it exits), that waits
    to be armed with a deadline, then ends the process with os._exit unless disarmed in time."""

    def __init__(self):
        self.armed, self.disarmed = threading.Event(), threading.Event()
        self.limit, self.status, self.message = 0.0, 0, ""
        threading.Thread(target=self._watch, name="mpidist-finalize-watchdog", daemon=True).start()

    def arm(self, limit: float, status: int, message: str) -> None:
        self.limit, self.status, self.message = limit, status, message
        self.armed.set()

    def _watch(self) -> None:
        self.armed.wait()
        if not self.disarmed.wait(self.limit):
            print(self.message, file=sys.stderr)
            flush_output()
            os._exit(self.status)


def exit_status() -> int:
    """The status this process ends with: its program's (program_status), or where that is 0 and
    this process recorded a rank's loss, MPIDIST_EXIT_ON_RANK_LOSS's (losses.py)."""
    return program_status() or (losses.exit_status_on_loss() if losses.lost_any() else 0)


def program_status() -> int:
    """The status this process's program was going to exit with (see the module's docstring)."""
    error = getattr(sys, "last_value", None)
    if error is not None:
        return INTERRUPT_STATUS if isinstance(error, KeyboardInterrupt) else EXCEPTION_STATUS
    if _requested_status is None:
        return 0
    if isinstance(_requested_status, int):
        return _requested_status & 0xFF
    return EXCEPTION_STATUS


def detector_on() -> bool:
    """Whether ULFM's heartbeat failure detector runs in this process: mpirun's
    `--mca mpi_ft_detector true` reaches the ranks as OMPI_MCA_mpi_ft_detector."""
    return os.environ.get("OMPI_MCA_mpi_ft_detector", "").strip().lower() in ("1", "true", "yes", "on", "enabled")


def finalize_after_a_death() -> None:
    """MPI_Finalize under a watchdog, when MPI knows a rank of the job dead or ULFM's failure
    detector is on (see the module's docstring); otherwise nothing."""
    MPI = load_mpi()
    import mpi4py  # here, not at the top: importing mpidist must not need mpi4py (errors.MPIUnavailableError)
    if MPI.Is_finalized() or mpi4py.rc.finalize is False:  # finalized already, or by the program's choice never
        return
    dead = failed_ranks(MPI.COMM_WORLD)
    died = a_survivor_knows_of_a_death(MPI, bool(dead) or losses.lost_any())
    if not died and not detector_on():
        return
    status, limit = exit_status(), config.value("MPIDIST_FINALIZE_TIMEOUT")
    flush_output()  # what the program printed must not wait on a call that may never return
    barrier = "(Open MPI's end-of-job barrier, docs/elastic.md)"
    why = (f"after rank(s) {dead} of the job died {barrier}" if dead else
           f"after a rank of the job died, as another rank knew {barrier}" if died else
           "with ULFM's failure detector on (its end waits for the heartbeats of the rank it observes, "
           "docs/faults.md)")
    _watchdog.arm(limit, status, f"mpidist: rank {MPI.COMM_WORLD.Get_rank()}: MPI_Finalize has not returned "
                  f"{limit:g} s (MPIDIST_FINALIZE_TIMEOUT) {why}: exiting with status {status} without it")
    _mpi_function("MPI_Finalize")()
    _watchdog.disarmed.set()
    if status != program_status():
        flush_output()
        os._exit(status)  # Python would exit 0: it decided its status before its exit handlers ran


def a_survivor_knows_of_a_death(MPI, known_here: bool) -> bool:
    """Whether any surviving rank of the job knows of a rank's death, `known_here` being this
    rank's answer: ULFM's agreement over the world (MPIX_Comm_agree), which gives every survivor
    the same answer. A rank that never exchanged with the dead one may not have heard of the death
    by the time it leaves, and would then wait in an MPI_Finalize that its peers left after
    MPIDIST_FINALIZE_TIMEOUT. The agreement also raises MPI_ERR_PROC_FAILED alike on every survivor
    where a rank died before it and not every rank has acknowledged that."""
    try:
        return MPI.COMM_WORLD.Agree(0 if known_here else 1) == 0
    except MPI.Exception as error:
        if error.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED):
            return True
        raise


def _mpi_function(name):
    """`name` from the loaded MPI library, called through ctypes.CDLL, which releases Python's
    lock during the call."""
    for path in loaded_mpi_libraries():
        function = getattr(ctypes.CDLL(path), name, None)
        if function is not None:
            return function
    raise RuntimeError(f"{name} is in none of the loaded MPI libraries {loaded_mpi_libraries()}")
