"""The rows of `mpidist bench allreduce --device cuda` that are not an algorithm of their own:
the routes a CUDA buffer can take ("staged:<algorithm>" through pinned host memory,
"cuda-aware:<algorithm>" handed to a CUDA-aware MPI), each on a Communicator of its own; the
"bound" row is bench_bound.py's.
"""
from __future__ import annotations

ROUTES = ("staged", "cuda-aware")  # "route:<algorithm>" names of --device cuda

# torch and mpi4py's MPI are imported in the functions that use them, as in bench.py.


def cuda_algorithms(comm) -> list:
    """--device cuda's default rows: the device window, the staged route of the same algorithm, the
    ring through a CUDA-aware MPI where the library is one, NCCL where it loads
    (runtime/nccl_library.py), and the bound (other routes by name: --algorithms staged:ring,...)."""
    from ..collectives import nccl_bindings
    algorithms = ["hierarchical", "staged:hierarchical"]
    if comm.is_cuda_aware():
        algorithms.append("cuda-aware:ring")
    if nccl_bindings() is not None:
        algorithms.append("nccl")
    return algorithms + ["bound"]


def route_communicators(comm, algorithms) -> dict:
    """A Communicator for each route named in `algorithms` ("staged:ring" ...), kept off the device
    route (the node window in GPU memory and the GPU lane) and told whether MPI reads GPU memory
    (collective)."""
    from .. import Communicator
    from ..collectives import keep_off_device_route
    unknown = [a for a in algorithms if ":" in a and a.split(":", 1)[0] not in ROUTES]
    if unknown:
        raise ValueError(f"unknown routes {unknown}; a route is one of {', '.join(ROUTES)}")
    if any(a.startswith("cuda-aware:") for a in algorithms) and not comm.is_cuda_aware():
        raise ValueError("the cuda-aware route needs a CUDA-aware MPI library (mpidist info)")
    routes = {}
    for route in ROUTES:
        if any(a.startswith(route + ":") for a in algorithms):
            routes[route] = Communicator(comm.mpi)
            routes[route].cuda_aware = route == "cuda-aware"
            routes[route].check_calls = comm.check_calls
            keep_off_device_route(routes[route], f"the {route} route of mpidist bench")
    return routes
