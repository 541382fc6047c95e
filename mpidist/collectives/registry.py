"""The algorithm registry: every all-reduce algorithm by the name `algorithm=` gives it.

A new algorithm is one file beside the others and one line here.
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
# which CUDA kernels cannot address): GPU buffers reach them through host staging, always.
# On one node, CUDA buffers of "hierarchical" go to the node window in GPU memory instead where its
# ranks can share it (device_window.py); only where they cannot are they staged.
HOST_MEMORY_ALGORITHMS = frozenset({"hierarchical"})
# Algorithms that work on GPU memory only, never staged (nccl.check_usable refuses the others).
DEVICE_MEMORY_ALGORITHMS = frozenset({"nccl"})
