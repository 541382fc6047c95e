"""mpidist's own collective algorithms, one per file, and what runs them.

api.py holds the public calls; callcheck.py the argument checks and the cross-rank call check;
engine.py the asynchronous engine and its handles; fastpath.py small all-reduces straight to MPI;
routes.py each buffer's route to the algorithms (staging.py through host memory where needed,
device_route.py in GPU memory); registry.py the algorithms by name; select.py
algorithm="auto"'s choice; cost_model.py the algorithms' predicted times, which it uses where
nothing was measured. Every call takes the channel it runs on (channel.py) first. This
package's namespace is what a Communicator's collective methods call (comm.py, above it).
Importing it does not start MPI: its modules read MPI's names through runtime/mpi.py's MPI,
which starts MPI (or says clearly that mpi4py or the MPI library is missing) at the first use.
"""
from .adasum import adasum_allreduce  # noqa: F401
from .alltoall import alltoall  # noqa: F401
from .api import (  # noqa: F401
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
from .callcheck import OPS  # noqa: F401
from .engine import AsyncEngine, Handle, in_order  # noqa: F401
from .fastpath import small_cpu_allreduce  # noqa: F401
from .node_buckets import forget_released_windows, free_released_windows  # noqa: F401
from .registry import ALGORITHMS, ALLREDUCE  # noqa: F401
from .select import auto_choice  # noqa: F401
