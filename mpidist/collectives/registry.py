"""The algorithm registry: every all-reduce algorithm by the name `algorithm=` gives it.

A new algorithm is one file beside the others and one line here. A buffer reaches its algorithm
by a route (routes.py): the algorithm works on the buffer where it lies or on a staged host copy,
except that for CUDA memory "hierarchical" is served by the device route (device_route.py: the
node window in GPU memory inside a node, the GPU lane between nodes, this file's hierarchical.py
in host memory on a staged copy where neither can be used), which `auto` takes for CUDA buffers
too. The device route has no name of its own among the algorithms: it is not one more algorithm
to choose but where "hierarchical" and `auto` run on GPU memory, and a name of its own would
have to mean something on CPU buffers, in the tuning table and in `mpidist bench` as well.
"""
from __future__ import annotations

from .hierarchical import hierarchical_allreduce
from .native import native_allreduce
from .nccl import nccl_allreduce
from .recursive_doubling import recursive_doubling_allreduce
from .recursive_halving import recursive_halving_allreduce
from .reduce_bcast import reduce_bcast_allreduce
from .ring import ring_allreduce
from .tree import tree_allreduce

ALLREDUCE = {
    "ring": ring_allreduce,
    "tree": tree_allreduce,
    "recursive_halving": recursive_halving_allreduce,
    "recursive_doubling": recursive_doubling_allreduce,
    "reduce_bcast": reduce_bcast_allreduce,
    "hierarchical": hierarchical_allreduce,
    "mpi": native_allreduce,
    "nccl": nccl_allreduce,
}
ALGORITHMS = ("auto",) + tuple(ALLREDUCE)
# Algorithms that work in host memory only (the hierarchical one reduces in a node-shared window,
# which CUDA kernels cannot address): the staged route gives them GPU buffers through host
# staging, always. CUDA buffers of "hierarchical" take the device route, which stages them only
# where it cannot keep them in GPU memory.
HOST_MEMORY_ALGORITHMS = frozenset({"hierarchical"})
# Algorithms that work on GPU memory only, never staged (nccl.check_usable refuses the others).
DEVICE_MEMORY_ALGORITHMS = frozenset({"nccl"})
