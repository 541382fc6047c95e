"""The "bound" row of `mpidist bench allreduce`: no measurement of a collective but a model of the
least time the node window's all-reduce (collectives/node_window.py) can take on this node: the
bytes one rank reads and writes for it, at the copy rate each rank gets, measured in the same run.
Every other row can then be read as a fraction of what the memory allows. It prices every byte at
the rate of a copy of the message's size, so where the protocol's reads hit cache (the slices it
has just written) the all-reduce can beat it (benchmarks/results/node-protocol-cpu.md).

On CUDA: the device window's traffic of every rank on the busiest GPU at the rate a
device-to-device copy reads and writes that GPU's memory. On the CPU: the host protocol's traffic
(one-shot up to ONE_SHOT_BYTES, sliced above) at the rate each local rank copies host memory while
all of them copy at once for a while, so that ranks sharing cores or memory channels are counted
as they share them (more ranks than cores: each gets its share of a core); the copies are at least
COPY_BYTES long, as shorter ones measure the call, not the memory. Across nodes the link bounds
an all-reduce rather than the memory: there is no CPU bound row there.
"""
from __future__ import annotations

import math
import time

import numpy as np

COPY_BYTES = 1 << 20
COPY_SECONDS = 0.01  # each rank copies this long in a round: many of the scheduler's time slices
COPY_ROUNDS = 5  # the fastest of these is the rate

# torch, mpi4py's MPI and the collectives (which import it) are imported in the functions that use
# them, as in bench.py.


def window_traffic(nbytes: int, local_size: int) -> float:
    """Bytes one rank's sliced all-reduce through the node window reads and writes (L local
    ranks, n bytes): copy-in (L-1)/L n read and written, the reduction n read and n/L written,
    its publication n/L written, the copy-out (L-1)/L n read and written."""
    n, L = nbytes, local_size
    return 4 * (L - 1) / L * n + n + 2 * n / L


def one_shot_traffic(nbytes: int, local_size: int) -> float:
    """Bytes one rank's one-shot all-reduce reads and writes: the copy-in n read and n written,
    the reduction L n read and n written."""
    return (local_size + 3) * nbytes


def host_traffic(nbytes: int, local_size: int) -> float:
    """The host protocol's traffic at this size (node_window.host_allreduce_on_node)."""
    from ..collectives import ONE_SHOT_BYTES
    if nbytes <= ONE_SHOT_BYTES:
        return one_shot_traffic(nbytes, local_size)
    return window_traffic(nbytes, local_size)


def host_copy_seconds(comm, nbytes: int) -> float:
    """Seconds a copy of `nbytes` (at least COPY_BYTES, scaled back to nbytes) takes on the
    slowest local rank while every local rank copies at once. In each of COPY_ROUNDS rounds every
    local rank leaves a barrier and copies as many times as fill COPY_SECONDS, so that ranks that
    share a core take turns within the round (a single short copy each would run alone while the
    others wait for the CPU, and the rate would count a core per rank); a round takes what its
    slowest rank took, and the fastest round is the rate."""
    from mpi4py import MPI
    length = max(nbytes, COPY_BYTES)
    source = np.ones(length, dtype=np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)
    start = time.perf_counter()
    np.copyto(target, source)
    repeats = np.array([math.ceil(COPY_SECONDS / max(time.perf_counter() - start, 1e-9))])
    comm.node_comm.Allreduce(MPI.IN_PLACE, repeats, op=MPI.MAX)
    rounds = np.empty(COPY_ROUNDS)
    for index in range(COPY_ROUNDS):
        comm.node_comm.Barrier()
        start = time.perf_counter()
        for _ in range(int(repeats[0])):
            np.copyto(target, source)
        rounds[index] = (time.perf_counter() - start) / repeats[0]
    comm.node_comm.Allreduce(MPI.IN_PLACE, rounds, op=MPI.MAX)
    return float(rounds.min()) * nbytes / length


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
        for _ in range(COPY_ROUNDS):
            start = time.perf_counter()
            target.copy_(source)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds[0] = min(times)
    comm.node_comm.Allreduce(MPI.IN_PLACE, seconds, op=MPI.MAX)
    return float(seconds[0]), int((devices == device).sum())


def bound_us(comm, nbytes: int, device: str) -> float:
    """The "bound" row's time in microseconds (collective over the node)."""
    if device == "cuda":
        copy_seconds, ranks_on_gpu = device_copy_seconds(comm, nbytes)
        return ranks_on_gpu * window_traffic(nbytes, comm.local_size) * copy_seconds / (2 * nbytes) * 1e6
    # a copy reads and writes every byte: 2 n bytes in copy_seconds
    return host_traffic(nbytes, comm.local_size) * host_copy_seconds(comm, nbytes) / (2 * nbytes) * 1e6
