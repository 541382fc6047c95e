"""The device route (routes.py): CUDA buffers kept in GPU memory. Inside a node the ranks meet in
the node window in GPU memory (device_window.py); an all-reduce across nodes reduces each node's
buffers in such a window and runs the GPU lane between the nodes (gpu_lane.py). The ranks decide
together whether they can, once per channel (device_window.can_open, gpu_lane.agreed_lane);
where they cannot, the collective takes the staged route (staging.py), an all-reduce with the
algorithm it was given: "hierarchical", or for "auto" the table's choice.

It carries the CUDA buffers of all-reduce's "hierarchical" and "auto" (callcheck.resolve_algorithm)
and of broadcast, allgather and reduce-scatter.
"""
from __future__ import annotations

from ..buffers import BufferInfo
from . import device_window, gpu_lane, staging


def check_gpu(channel, info: BufferInfo, collective: str) -> None:
    """Refuse a buffer on another GPU than this rank's windows: the node window's for every
    collective, the GPU lane's for all-reduce, the one collective it carries. With the call check
    off (MPIDIST_CHECK=0) nothing shares the refusal, and the other ranks wait for this one until
    MPIDIST_TIMEOUT: the route's first exchange could not carry it cheaply (the window's flags
    only count rounds, and the lane between nodes may be NCCL's)."""
    device_window.check_gpu(channel, info)
    if collective == "allreduce":
        gpu_lane.check_gpu(channel, info)


def allreduce(channel, array, info: BufferInfo, op: str, algorithm: str) -> None:
    if not (device_window.allreduce(channel, array, info, op) or gpu_lane.allreduce(channel, array, info, op)):
        staging.allreduce(channel, array, info, op, algorithm)


def broadcast(channel, array, info: BufferInfo, root: int) -> None:
    if not device_window.broadcast(channel, array, info, root):
        staging.broadcast(channel, array, info, root)


def allgather(channel, array, info: BufferInfo, out, chunks) -> None:
    if not device_window.allgather(channel, array, info, out, chunks):
        staging.allgather(channel, array, info, out, chunks)


def reduce_scatter(channel, array, info: BufferInfo, out, chunks, op: str) -> None:
    if not device_window.reduce_scatter(channel, array, info, out, chunks, op):
        staging.reduce_scatter(channel, array, info, out, chunks, op)


def keep_off(channel, reason: str) -> None:
    """Send `channel`'s CUDA buffers the staged way (or to a CUDA-aware MPI), inside the nodes and
    between them: `mpidist bench`'s routes beside this one."""
    device_window.keep_off(channel, reason)
    channel.gpu_lane = ("staged", reason)
