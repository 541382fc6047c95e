"""mpidist: MPI-based HPC training for PyTorch.

    import mpidist as md
    md.init()
    md.allreduce(array, op="sum", algorithm="auto")

The library's public API is this package's __all__ and that of a few modules (docs/architecture.md
lists them); the `mpidist` command is built on it alone.
"""
__version__ = "0.1.0"

__all__ = [
    "__version__",
    # the world and its collectives
    "init", "is_initialized", "world", "Communicator", "rank", "size", "local_rank", "local_size",
    "allreduce", "allreduce_async", "adasum_allreduce", "broadcast", "allgather", "reduce_scatter", "barrier",
    # the errors (mpidist.errors has them all)
    "MpidistError", "DeadlineError", "InvalidArgumentError", "LaunchMismatchError", "MismatchError",
    "MPIUnavailableError", "NonContiguousError", "NotInitializedError", "NotOfferedError", "PeerExitedError",
    "RankDiedError", "UnsupportedBufferError", "UnsupportedDtypeError",
    # the training modes, imported (with torch) when first used: __getattr__ below
    "DataParallel", "Join", "ParameterAveraging", "Pipeline", "ParameterServer", "Update", "CentralStorage",
    "ZeroRedundancyOptimizer", "elastic", "SyncBatchNorm",
]

from . import launch as _launch
from .runtime import mpi as _mpi

# Before anything can import mpi4py.MPI (the program itself, between `import mpidist` and
# md.init()): MPI reads these when it starts.
_mpi.apply_start_settings()
# torchrun's RANK, LOCAL_RANK, ... from the launcher's variables, for code that reads them
# before init_process_group (to pick its GPU); MPI does not start here.
_launch.set_launcher_variables()

from . import distributed as _distributed  # noqa: E402
from .comm import Communicator, init, is_initialized, world  # noqa: E402
from .errors import (  # noqa: E402
    DeadlineError,
    InvalidArgumentError,
    LaunchMismatchError,
    MismatchError,
    MpidistError,
    MPIUnavailableError,
    NonContiguousError,
    NotInitializedError,
    NotOfferedError,
    PeerExitedError,
    RankDiedError,
    UnsupportedBufferError,
    UnsupportedDtypeError,
)

# dist.init_process_group("mpidist"): the backend's name reaches torch.distributed once that loads.
_distributed.register_when_torch_loads()
# md.allreduce and the others inside a compiled function: run at a graph break, never traced.
_distributed.keep_compile_out_of_mpidist()


def rank() -> int:
    return world().rank


def size() -> int:
    return world().size


def local_rank() -> int:
    return world().local_rank


def local_size() -> int:
    return world().local_size


def allreduce(array, op="sum", algorithm="auto", out=None):
    """All-reduce over the world communicator; in place unless `out` is given. Returns the result."""
    return world().allreduce(array, op=op, algorithm=algorithm, out=out)


def allreduce_async(array, op="sum", algorithm="auto", out=None):
    """Start an all-reduce in the background; returns a handle with wait() and done()."""
    return world().allreduce_async(array, op=op, algorithm=algorithm, out=out)


def adasum_allreduce(array, sizes=None):
    """Adasum over the world communicator, in place (a power-of-two number of ranks)."""
    return world().adasum_allreduce(array, sizes=sizes)


def broadcast(array, root=0):
    return world().broadcast(array, root=root)


def allgather(array):
    return world().allgather(array)


def reduce_scatter(array, op="sum"):
    return world().reduce_scatter(array, op=op)


def barrier():
    world().barrier()


def __getattr__(name):
    # The training modes need torch; import it only when they are used.
    if name == "DataParallel":
        from .parallel.data_parallel import DataParallel
        return DataParallel
    if name == "Join":
        from .parallel.uneven_inputs import Join
        return Join
    if name == "ParameterAveraging":
        from .parallel.parameter_averaging import ParameterAveraging
        return ParameterAveraging
    if name == "Pipeline":
        from .parallel.pipeline import Pipeline
        return Pipeline
    if name in ("ParameterServer", "Update"):
        from .parallel import ps
        return getattr(ps, name)
    if name == "CentralStorage":
        from .parallel.central_storage import CentralStorage
        return CentralStorage
    if name == "ZeroRedundancyOptimizer":
        from .parallel.zero import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer
    if name == "elastic":
        from .parallel import elastic_training
        return elastic_training
    if name == "SyncBatchNorm":
        from .parallel.sync_batchnorm import SyncBatchNorm
        return SyncBatchNorm
    raise AttributeError(f"module 'mpidist' has no attribute {name!r}")
