"""What Horovod's common layer gives every framework: init() and the process information
(rank, size, local and cross ranks, homogeneity), which backends are built, the reduction ops
(Average, Sum, ..., Adasum) with Horovod's rule for the deprecated `average=`, and the names of its
exceptions (horovod.common.exceptions) on mpidist's errors.
"""
from __future__ import annotations

import numpy as np

from .. import _C
from .. import comm as _comm
from ..errors import InvalidArgumentError, MismatchError, NotOfferedError
from . import timeline
from .negotiation import negotiator_of
from .process_sets import register_at_init

# ---- reduction ops (Horovod's constants) -----------------------------------------------------
Average, Sum, Min, Max, Product = "avg", "sum", "min", "max", "prod"
Adasum = "adasum"


def resolve_op(op, average=None, adasum_in=None):
    # Horovod's rule (handle_average_backwards_compatibility): `average` is the deprecated
    # spelling of `op`, and giving both is an error rather than one silently winning.
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        return Average if average is None or average else Sum
    if op == Adasum:
        if adasum_in is None:
            return op
        raise NotOfferedError("op=hvd.Adasum is offered by allreduce, grouped_allreduce and DistributedOptimizer, "
                              f"not by {adasum_in}")
    if op not in (Average, Sum, Min, Max, Product):
        raise InvalidArgumentError(f"unknown op {op!r}; use hvd.Average, Sum, Min, Max or Product")
    return op


# ---- process information ---------------------------------------------------------------------

def init(comm=None, process_sets=None):
    """Initialize (idempotent). `comm` may be an mpi4py communicator, as in Horovod;
    `process_sets` a list of ProcessSet to register (the same sets in the same order on every
    rank; those registered already are left as they are, on every rank alike) or "dynamic"
    (accepted: add_process_set works either way)."""
    world = _comm.init(comm)
    _homogeneous(world)  # collective: found here, where every rank calls, so the query is local
    timeline.start_from_environment()
    negotiator_of(world)  # collective: made here, where every rank calls, before any operation
    if process_sets is not None and not (isinstance(process_sets, str) and process_sets == "dynamic"):
        register_at_init(process_sets)
    return world


def shutdown():
    pass  # MPI is finalized at exit by mpi4py


def is_initialized() -> bool:
    return _comm.is_initialized()


def size() -> int:
    return _comm.world().size


def rank() -> int:
    return _comm.world().rank


def local_size() -> int:
    return _comm.world().local_size


def local_rank() -> int:
    return _comm.world().local_rank


def cross_size() -> int:
    return _comm.world().num_nodes


def cross_rank() -> int:
    return _comm.world().node_rank


_homogeneity = {}  # Communicator -> bool


def _homogeneous(world) -> bool:
    if world not in _homogeneity:
        # Every node has the same number of ranks iff the largest and smallest local_size agree.
        extremes = np.array([world.local_size, -world.local_size], dtype=np.int64)
        world.allreduce(extremes, op="max")
        _homogeneity[world] = bool(extremes[0] == -extremes[1])
    return _homogeneity[world]


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks (found by init(); if mpidist was
    initialized without hvd.init(), the first call is a collective every rank must make)."""
    return _homogeneous(_comm.world())


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def mpi_threads_supported() -> bool:
    from mpi4py import MPI  # imported here: importing mpi4py's MPI initializes MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def cuda_built() -> bool:
    return bool(_C.built_with_cuda)


# ---- Horovod's exceptions -------------------------------------------------------------------------
# Horovod raises HorovodInternalError when a collective fails across the ranks; mpidist raises
# MismatchError then (the ranks called different collectives or arguments, a rank refused its
# own, ranks wait in join(); DeadlineError, a subclass, when a rank did not answer in time).
HorovodInternalError = MismatchError


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod elastic's interrupt when hosts are added to the job. An MPI job's ranks never
    grow (a dead rank is seen as an error, hvd.elastic.run recovers from it), so mpidist never
    raises it; scripts that catch it run unchanged."""

    def __init__(self, skip_sync=False):
        super().__init__("the hosts of the job changed")
        self.skip_sync = skip_sync


class HorovodVersionMismatchError(ImportError):
    """Horovod's error when torch differs from the version Horovod was built with. mpidist's
    extension does not link torch, so it never raises it; scripts that catch it run unchanged."""

    def __init__(self, name, version, installed_version):
        super().__init__(f"{name} {version} differs from {installed_version}, the version it was built with")
        self.name, self.version, self.installed_version = name, version, installed_version
