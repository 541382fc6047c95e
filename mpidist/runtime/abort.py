"""An uncaught exception on one rank ends the whole job: the rank prints its traceback, then
calls MPI_Abort, which stops every rank (what `python -m mpi4py script.py` does).

Without it, the failed rank's interpreter waits in MPI_Finalize and the others wait in their next
collective until MPIDIST_TIMEOUT. md.init() installs the hook (install_abort_on_exception) in a
world of more than one rank unless MPIDIST_ABORT_ON_EXCEPTION=0; a program that handles its
ranks' failures itself keeps Python's own behaviour with that setting.
"""
from __future__ import annotations

import contextlib
import io
import sys

from . import config

# The exit status of a job aborted by an uncaught exception; a KeyboardInterrupt gives
# 128 + SIGINT, as a shell reports a process ended by Ctrl-C (mpi4py's choice too).
EXCEPTION_STATUS = 1
INTERRUPT_STATUS = 128 + 2


def install_abort_on_exception(world_mpi) -> None:
    """Make an uncaught exception abort the job on the mpi4py communicator `world_mpi` (called by
    md.init(); once per process). Nothing changes in a world of one rank, or with
    MPIDIST_ABORT_ON_EXCEPTION=0."""
    if world_mpi.Get_size() == 1 or not config.value("MPIDIST_ABORT_ON_EXCEPTION"):
        return
    if getattr(sys.excepthook, "aborts_job", False):
        return
    previous_hook = sys.excepthook

    def abort_on_exception(kind, exception, trace):
        # The traceback first, printed by whichever hook the program had, and flushed: MPI_Abort
        # ends the process without Python's own flushing at exit. It goes out in one write:
        # printed in pieces, mpirun may forward some of them after its own abort message, which
        # then cuts a line of the traceback in two.
        stream, printed = _stream_that_outlives_the_abort(), io.StringIO()
        with contextlib.redirect_stderr(printed):
            previous_hook(kind, exception, trace)
        status = INTERRUPT_STATUS if issubclass(kind, KeyboardInterrupt) else EXCEPTION_STATUS
        stream.write(printed.getvalue() + f"mpidist: rank {world_mpi.Get_rank()} of {world_mpi.Get_size()} ended "
                     f"with an uncaught {kind.__name__}: aborting the whole job (MPIDIST_ABORT_ON_EXCEPTION=0 "
                     "leaves the other ranks running)\n")
        flush_output()
        stream.flush()
        world_mpi.Abort(status)

    abort_on_exception.aborts_job = True
    sys.excepthook = abort_on_exception


def abort_job(status: int) -> None:
    """End every rank of the job with `status` (MPI_Abort on the world) after flushing the output,
    where an uncaught exception would: MPI initialized, more than one rank, and
    MPIDIST_ABORT_ON_EXCEPTION not 0; otherwise return."""
    from .mpi import load_mpi
    MPI = load_mpi()
    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1 or \
            not config.value("MPIDIST_ABORT_ON_EXCEPTION"):
        return
    flush_output()
    MPI.COMM_WORLD.Abort(status)


def _stream_that_outlives_the_abort():
    """sys.stderr, unless it is a buffer in memory: then the process's own stderr.

    A hook installed after this one wraps it, and may collect what it prints in memory to write
    out once it returns (torch.distributed's, which init_process_group installs, prefixes every
    line with the rank): MPI_Abort ends the process before that, and the traceback with it."""
    if isinstance(sys.stderr, io.StringIO) and sys.__stderr__ is not None:
        return sys.__stderr__
    return sys.stderr


def flush_output() -> None:
    """Flush stdout and stderr before a process ends without Python's own flushing at exit
    (MPI_Abort, os._exit)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced streams
            pass
