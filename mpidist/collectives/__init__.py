"""mpidist's own collective algorithms, one per file, and what runs them.

api.py holds the public calls; callcheck.py the argument checks and the cross-rank call check;
engine.py the asynchronous engine and its handles; fastpath.py CPU all-reduces straight to MPI or the node protocol;
routes.py each buffer's route to the algorithms (staging.py through host memory where needed,
device_route.py in GPU memory); registry.py the algorithms by name; select.py
algorithm="auto"'s choice; cost_model.py the algorithms' predicted times, which it uses where
nothing was measured. Every call takes the channel it runs on (channel.py) first. This
package's namespace is what a Communicator's collective methods call (comm.py, above it).
Importing it does not start MPI: its modules read MPI's names through runtime/mpi.py's MPI,
which starts MPI (or says clearly that mpi4py or the MPI library is missing) at the first use.

The public names (__all__): the collective calls, each on a Communicator (or its engine), with
Handle (what the *_async calls return), ALGORITHMS (all-reduce's algorithm names) and OPS (the
reduction ops); and what the `mpidist` command reads or sets of the inside:
- save_tuning_table, read_tuning_file: algorithm="auto"'s tuning file, written by `mpidist tune`.
- ONE_SHOT_BYTES: up to this size the node window's all-reduce is one-shot, unless tuned (bench's bound).
- describe_lane: the lane between nodes CUDA buffers would take, and why (`mpidist info`).
- nccl_bindings: the NCCL library's binding, or None where none loads (bench's "nccl" row).
- keep_off_device_route: send a channel's CUDA buffers the staged way (bench's routes).
The other names here are comm.py's, below the public surface.
"""
from .adasum import adasum_allreduce
from .alltoall import alltoall
from .api import (
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
from .callcheck import OPS
from .device_route import keep_off as keep_off_device_route
from .engine import AsyncEngine, Handle, in_order  # noqa: F401
from .fastpath import fast_cpu_allreduce  # noqa: F401
from .gpu_lane import describe_lane
from .nccl import bindings as nccl_bindings
from .node_buckets import forget_released_windows, free_released_windows  # noqa: F401
from .node_window import ONE_SHOT_BYTES
from .registry import ALGORITHMS, ALLREDUCE  # noqa: F401
from .select import auto_choice, read_tuning_file, save_tuning_table  # noqa: F401

__all__ = [
    "allreduce", "allreduce_async", "broadcast", "broadcast_async", "allgather", "allgather_async", "reduce_scatter",
    "reduce_scatter_async", "alltoall", "adasum_allreduce", "barrier", "Handle", "ALGORITHMS", "OPS",
    "save_tuning_table", "read_tuning_file", "ONE_SHOT_BYTES", "describe_lane", "nccl_bindings",
    "keep_off_device_route",
]
