"""The rows of `mpidist bench allreduce --device cuda` that are not an algorithm of their own:
the routes a CUDA buffer can take ("staged:<algorithm>" through pinned host memory,
"cuda-aware:<algorithm>" handed to a CUDA-aware MPI), each on a Communicator of its own, and
the "bound" row, the time the node window's all-reduce needs at least at the device-to-device
copy bandwidth measured on the node's GPUs.
"""
from __future__ import annotations

import time

import numpy as np

ROUTES = ("staged", "cuda-aware")  # "route:<algorithm>" names of --device cuda

# torch and mpi4py's MPI are imported in the functions that use them, as in bench.py.


def cuda_algorithms(comm) -> list:
    """--device cuda's default rows: the device window, the staged route of the same algorithm, the
    ring through a CUDA-aware MPI where the library is one, NCCL where CuPy has it, and the bound
    (other routes by name: --algorithms staged:ring,...)."""
    from .collectives import nccl
    algorithms = ["hierarchical", "staged:hierarchical"]
    if comm.is_cuda_aware():
        algorithms.append("cuda-aware:ring")
    if nccl.bindings() is not None:
        algorithms.append("nccl")
    return algorithms + ["bound"]


def route_communicators(comm, algorithms) -> dict:
    """A Communicator for each route named in `algorithms` ("staged:ring" ...), kept from the node
    window in GPU memory and told whether MPI reads GPU memory (collective)."""
    from .collectives import device_window
    from .comm import Communicator
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
            device_window.keep_off(routes[route], f"the {route} route of mpidist bench")
    return routes


def window_traffic(nbytes: int, local_size: int) -> float:
    """Bytes one rank's all-reduce through the node window reads and writes in device memory
    (node_window.py; L local ranks, n bytes): copy-in (L-1)/L n read and written, the reduction n
    read and n/L written, its publication n/L written, the copy-out (L-1)/L n read and written."""
    n, L = nbytes, local_size
    return 4 * (L - 1) / L * n + n + 2 * n / L


def device_copy_seconds(comm, nbytes: int) -> tuple:
    """(seconds a device-to-device copy of `nbytes` takes on the node's slowest GPU, the most
    local ranks on one GPU): each copy measured by the first local rank of its GPU, the fastest
    of a few."""
    import torch
    from mpi4py import MPI
    device = torch.cuda.current_device()
    devices = np.empty(comm.local_size, dtype=np.int64)
    comm.node_comm.Allgather([np.array([device], dtype=np.int64), MPI.INT64_T], [devices, MPI.INT64_T])
    seconds = np.zeros(1)
    if list(devices).index(device) == comm.local_rank:
        source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        target = torch.empty_like(source)
        target.copy_(source)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            target.copy_(source)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds[0] = min(times)
    comm.node_comm.Allreduce(MPI.IN_PLACE, seconds, op=MPI.MAX)
    return float(seconds[0]), int((devices == device).sum())


def bound_us(comm, nbytes: int) -> float:
    """The "bound" row's time: the window's traffic of every rank on the busiest GPU at the rate
    a copy reads and writes that GPU's memory."""
    copy_seconds, ranks_on_gpu = device_copy_seconds(comm, nbytes)
    rate = 2 * nbytes / copy_seconds  # a copy reads and writes every byte
    return ranks_on_gpu * window_traffic(nbytes, comm.local_size) / rate * 1e6
