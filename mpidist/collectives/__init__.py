"""mpidist's own collective algorithms, one per file, and what runs them.

api.py holds the public calls; callcheck.py the argument checks and the cross-rank call check;
engine.py the asynchronous engine and its handles; fastpath.py small all-reduces straight to MPI;
staging.py GPU buffers through host memory; registry.py the algorithms by name; select.py
algorithm="auto"'s choice; cost_model.py the algorithms' predicted times, which it uses where
nothing was measured. Every call takes the channel it runs on (channel.py) first. This
package's namespace is what a Communicator's collective methods call (comm.py, above it);
importing it initializes MPI.
"""
from ..runtime.mpi import load_mpi

# A clear error when mpi4py or the MPI library is missing, before the modules below import
# mpi4py's MPI module.
load_mpi()

from .adasum import adasum_allreduce  # noqa: E402,F401
from .alltoall import alltoall  # noqa: E402,F401
from .api import (  # noqa: E402,F401
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    barrier,
    broadcast,
    broadcast_async,
    reduce_scatter,
    reduce_scatter_async,
)
from .callcheck import OPS  # noqa: E402,F401
from .engine import AsyncEngine, Handle, in_order  # noqa: E402,F401
from .fastpath import small_cpu_allreduce  # noqa: E402,F401
from .node_buckets import forget_released_windows, free_released_windows  # noqa: E402,F401
from .registry import ALGORITHMS, ALLREDUCE  # noqa: E402,F401
from .select import auto_choice  # noqa: E402,F401
