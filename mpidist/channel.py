"""Channel: what a collective (mpidist/collectives/) runs on, and the memory the collectives keep
on it.

A channel is a Communicator (comm.py) or its asynchronous engine (collectives/engine.py). Every
collective takes one as its first argument. This module sits below the collectives, so that
they can name what they run on; the Communicator that users call collectives on sits above
them and is a Channel. Nothing here starts MPI.
"""
from __future__ import annotations

import abc
import typing

import numpy as np

from . import buffers
from .runtime.mpi import load_mpi


class NodeGroups(typing.NamedTuple):
    """The communicators node-aware collectives run on (mpi4py communicators)."""

    node: typing.Any  # the ranks of this rank's node
    lane: typing.Any  # across nodes, this rank's lane: its local rank on every node; else None
    lanes: int  # how many lanes every node has: the smallest node's rank count


def split_node_groups(mpi, node, num_nodes: int) -> NodeGroups:
    """The NodeGroups of `mpi` whose node communicator is `node` (collective over `mpi`): local
    ranks beyond the smallest node's rank count have no lane, nor has a channel on one node."""
    local_rank, local_size = node.Get_rank(), node.Get_size()
    if num_nodes == 1:
        return NodeGroups(node, None, local_size)
    MPI = load_mpi()
    smallest = np.array([local_size], dtype=np.int64)
    mpi.Allreduce(MPI.IN_PLACE, smallest, op=MPI.MIN)
    lanes = int(smallest[0])
    lane = mpi.Split(local_rank if local_rank < lanes else MPI.UNDEFINED, mpi.Get_rank())
    return NodeGroups(node, None if lane == MPI.COMM_NULL else lane, lanes)


class Channel(abc.ABC):
    """What a collective runs on: its own MPI communicator, the settings the collectives decide
    with, and the memory they keep between calls.

    Set by the subclass:
    mpi, rank, size: the mpi4py communicator the messages travel on, and this rank's place in it.
    num_nodes: how many nodes the channel's ranks are on.
    check_calls: whether the cross-rank call check runs (MPIDIST_CHECK).
    tuning_table, forced_algorithm, fast_path_bounds: what algorithm="auto" decides with, and
    one_shot_bytes: the largest all-reduce the node window's one-shot takes (collectives/select.py:
    auto_choice).

    Kept here for the collectives, each channel its own (an engine's thread must not share its
    communicator's):
    scratch, staging: scratch memory and pinned host buffers (buffers.ScratchPool, HostStaging).
    node_window: the hierarchical all-reduce's shared window (collectives/hierarchical.py), None
    until that algorithm makes it over node_communicators(), or the first checked all-reduce does
    on one node (callcheck.window_for_checks).
    device_window: the node windows in GPU memory of CUDA buffers (collectives/device_window.py),
    None until a collective of one makes them.
    lane_window, gpu_lane: CUDA buffers' all-reduce across nodes in GPU memory (the device route's)
    and the (lane, why) between nodes it was agreed to take (collectives/gpu_lane.py), None until
    then.
    fast_path_scratch, fast_path_plans: float32 room for small float16/bfloat16 all-reduces,
    and what to do by kind of call, of the fast path (collectives/fastpath.py).
    nccl_comm: NCCL's communicator of algorithm="nccl" (collectives/nccl.py), made at its first call.
    The channel frees the windows with itself (free_windows).
    """

    mpi: typing.Any
    rank: int
    size: int
    num_nodes: int
    check_calls: bool
    tuning_table: typing.Optional[tuple]
    forced_algorithm: typing.Optional[str]
    fast_path_bounds: tuple
    one_shot_bytes: int

    def __init__(self):
        self.scratch = buffers.ScratchPool()
        self.staging = buffers.HostStaging()
        self.node_window = None
        self.device_window = None
        self.lane_window = self.gpu_lane = None
        self.fast_path_scratch = None
        self.fast_path_plans = {}
        self.nccl_comm = None

    @abc.abstractmethod
    def is_cuda_aware(self) -> bool:
        """Whether the MPI library reads GPU memory directly (else GPU buffers are staged)."""

    @abc.abstractmethod
    def node_communicators(self) -> NodeGroups:
        """The node and lane communicators of node-aware collectives, made at the first call
        (collective over the channel: every rank asks at the same call) and freed with it."""

    def free_windows(self) -> None:
        """Free the shared windows the collectives made on this channel (collective over it)."""
        for window in (self.node_window, self.device_window, self.lane_window):
            if window is not None:
                window.free()
        self.node_window = self.device_window = self.lane_window = None

    def forget_windows(self) -> None:
        """Drop the windows without freeing them: the channel lost a rank, so no collective can
        run on it; the memory goes at MPI_Finalize."""
        self.node_window = self.device_window = self.lane_window = None
