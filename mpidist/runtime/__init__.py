"""The runtime floor: what every other part of mpidist stands on, none of which initializes MPI.

- mpi.py: loading mpi4py's MPI module, and the settings that must precede MPI's start.
- config.py: every MPIDIST_* environment variable, read in one place, each with its default and meaning.
- deadlines.py: the one helper every wait for another rank goes through, and its error.
- stall.py: the stall report of a collective wait, from the records every rank publishes.
- abort.py: an uncaught exception on one rank aborts the whole job.
- tracing.py: communication events for torch.profiler and the timeline file.
- wire.py: the dtype table of the whole package, and typed header+payload messages between ranks.
- together.py: raise_together, the one way for ranks to fail together (every rank raises the same error).
- leave.py: MPI_Finalize with a time limit, for a fault-tolerant run in which a rank died.
- losses.py: what a fault-tolerant job lost to a rank's death, summed up at its end.
- cuda_aware.py: whether the MPI library reads GPU memory (its own answer, and a probe).
- nccl_library.py: which NCCL library mpidist loads, whether it will do, and its few C functions.

Importing any of these leaves MPI alone (mpi4py.MPI is not imported), so `import mpidist` can
happen before the program, or its launcher, has settled how MPI should start.

The public names (__all__), for programs on mpidist such as the `mpidist` command:
- on_every_rank: mark an error that every rank raises alike, so that it is reported once.
- share_failure: collective; where any rank's part of a task failed, every rank raises the same error.
- abort_job: end every rank of the job with a status, where an uncaught exception would.
- note_exit_status: the status main() returns, for the exit of a run in which a rank died.
- wait_for_collective: wait for a nonblocking MPI collective, with mpidist's deadline and stall report.
- load_mpi: mpi4py's MPI module (this starts MPI), with a clear error where it is missing.
- fault_tolerant, fault_tolerance_missing: whether this run survives a dead rank, and why not.
- mpi_cuda_support: whether the MPI library reads GPU memory, and how that was decided.
- describe_nccl: the NCCL library mpidist would load (version and path), or why none.
- COLLECTIVE_DTYPES, ITEMSIZE: the dtypes the collectives reduce; every dtype's item size in bytes.
"""
from .abort import abort_job
from .cuda_aware import library_support as mpi_cuda_support
from .deadlines import wait_for_collective
from .leave import note_exit_status
from .mpi import fault_tolerance_missing, fault_tolerant, load_mpi
from .nccl_library import describe as describe_nccl
from .together import on_every_rank, share_failure
from .wire import COLLECTIVE_DTYPES, ITEMSIZE

__all__ = ["on_every_rank", "share_failure", "abort_job", "note_exit_status", "wait_for_collective", "load_mpi",
           "fault_tolerant", "fault_tolerance_missing", "mpi_cuda_support", "describe_nccl", "COLLECTIVE_DTYPES",
           "ITEMSIZE"]
