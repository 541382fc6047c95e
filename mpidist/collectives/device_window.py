"""The node window in GPU memory: the collectives of CUDA buffers on one node without a host copy.

The protocol is node_window.py's, unchanged (slots, slices, flag rounds, growth, the deadline);
this module gives it DeviceMemory and decides where it is used.

- Memory: each local rank allocates its slots on its GPU (cudaMalloc, through CuPy's runtime
  bindings) and exports them with cudaIpcGetMemHandle; the 64-byte handles travel once over MPI
  (an Allgather on the node communicator) and every rank opens the others'
  (cudaIpcOpenMemHandle). They stay open, cached with the window on the channel, until the window
  grows: then the memory is freed and made and exported anew. CUDA IPC works between processes on
  one GPU and between GPUs with peer access.
- Work: mpidist's CUDA kernels (pack for copies, reduce_many_to for the k-way reduction, float32
  accumulation for half types) on the legacy default stream, reading and writing the peers' slots
  directly.
- Ordering: settle() synchronizes that stream before node_window.sync raises this rank's flag, so a
  peer that sees the flag reads finished data. The flags stay in host shared memory: the rounds and
  the deadline naming a silent local rank are the host window's (tested on CPU by
  tests/test_node_window.py, with memory that defers its work until settle() as a stream does).
  This module's own code runs on CPU in tests/test_device_window_standin.py, with CuPy, CUDA
  IPC and the CUDA kernels stood in for in host memory.

Where: the device route's collectives (device_route.py: all-reduce with "hierarchical" or
"auto", broadcast, allgather and reduce-scatter) of CUDA buffers on a communicator that is one
node, unless MPIDIST_DEVICE_WINDOW=0. The local ranks decide together, once per
channel, whether they can (every rank has CuPy and CUDA kernels, the ranks' GPUs are one or
peers, the node has no more ranks than the k-way kernel has sources); where any cannot, all of
them take the staged route instead, and `refusal` says why.
"""
from __future__ import annotations

import numpy as np

from .. import _C, buffers, kernels
from ..buffers import ITEMSIZE, BufferInfo
from ..errors import InvalidArgumentError
from ..runtime import config
from ..runtime.mpi import fault_tolerant, load_mpi
from .common import kernel_op
from .node_window import (
    NodeWindow,
    allgather_on_node,
    allreduce_on_node,
    broadcast_on_node,
    reduce_scatter_on_node,
)

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def missing() -> str | None:
    """Why this rank cannot use the device window (None: it can, as far as it alone can tell)."""
    if config.value("MPIDIST_DEVICE_WINDOW") is False:
        return "MPIDIST_DEVICE_WINDOW=0"
    if fault_tolerant():
        return "a fault-tolerant run (no shared-memory windows: runtime/mpi.py)"
    if not _C.built_with_cuda:
        return "mpidist._C was built without CUDA"
    try:
        import cupy.cuda.runtime  # noqa: F401
    except ImportError as error:
        return f"CuPy, whose CUDA runtime bindings export the window, cannot be imported ({error})"
    return None


class DeviceMemory:
    """Slots in GPU memory shared between the node's ranks through CUDA IPC (a NodeMemory)."""

    steps_in_extension = False  # the extension's steps are host code: the protocol's Python steps run

    def __init__(self, node_comm, device_index: int):
        self.node_comm = node_comm
        self.device_index = device_index
        self.device = f"cuda:{device_index}"
        self.own = None
        self.opened: list = []

    def allocate(self, nbytes: int) -> list:
        """Allocate and export this rank's memory, open the others' (collective over the node)."""
        import cupy
        runtime = cupy.cuda.runtime
        MPI = load_mpi()
        me, size = self.node_comm.Get_rank(), self.node_comm.Get_size()
        with cupy.cuda.Device(self.device_index):
            self.own = runtime.malloc(nbytes)
            handle = np.frombuffer(runtime.ipcGetMemHandle(self.own), dtype=np.uint8)
            handles = np.empty((size, IPC_HANDLE_BYTES), dtype=np.uint8)
            self.node_comm.Allgather([handle, MPI.BYTE], [handles, MPI.BYTE])
            # A process cannot open its own handle; the others' open with peer access enabled.
            self.opened = [runtime.ipcOpenMemHandle(handles[k].tobytes(), runtime.cudaIpcMemLazyEnablePeerAccess)
                           for k in range(size) if k != me]
        bases = list(self.opened)
        bases.insert(me, self.own)
        return bases

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        kernels.copy_ptr(dst, src, nbytes, device=self.device)

    def reduce_and_publish(self, dst: int, sources, nbytes: int, dtype: str, op: str, scale: float, publish) -> None:
        kernels.reduce_many_to_ptr([dst, *publish], sources, nbytes // ITEMSIZE[dtype], dtype, op, scale,
                                   device=self.device)

    def settle(self) -> None:
        kernels.synchronize(self.device)

    def free(self) -> None:
        """Close the peers' memory, then (once every rank has closed this rank's) free its own."""
        if self.own is None:
            return
        import cupy
        with cupy.cuda.Device(self.device_index):
            for base in self.opened:
                cupy.cuda.runtime.ipcCloseMemHandle(base)
            self.opened = []
            self.node_comm.Barrier()
            cupy.cuda.runtime.free(self.own)
        self.own = None


def can_open(node_comm, device_index: int) -> str | None:
    """Whether every local rank can use the device window with every other (collective over the
    node; the same answer on every rank): None, or why not."""
    MPI = load_mpi()
    reason = missing()
    size = node_comm.Get_size()
    if reason is None and size > _C.cuda_max_sources:
        reason = f"{size} ranks on the node, more than the k-way kernel's {_C.cuda_max_sources} sources"
    mine = np.array([device_index, 0 if reason is None else 1], dtype=np.int64)
    every = np.empty((size, 2), dtype=np.int64)
    node_comm.Allgather([mine, MPI.INT64_T], [every, MPI.INT64_T])
    others = sorted(set(every[:, 0].tolist()) - {device_index})
    if reason is None and others:
        import cupy
        strangers = [d for d in others if not cupy.cuda.runtime.deviceCanAccessPeer(device_index, d)]
        if strangers:
            reason = f"cuda:{device_index} has no peer access to cuda:{strangers}"
    verdict = np.array([0 if reason is None else 1], dtype=np.int64)
    node_comm.Allreduce(MPI.IN_PLACE, verdict, op=MPI.MAX)
    if verdict[0] == 0:
        return None
    unable = [k for k in range(size) if every[k, 1]]
    return reason or f"local ranks {unable} cannot (no peer access, or CuPy or CUDA kernels missing there)"


class DeviceWindows:
    """A channel's device window (made at its first use, on every local rank at the same call)
    or the reason there is none."""

    def __init__(self):
        self.window = None
        self.refusal = None

    def get(self, channel, info: BufferInfo):
        """The window for CUDA buffer `info`, or None where the staged route must be taken."""
        if self.refusal is not None:
            return None
        if self.window is None:
            node = channel.node_communicators().node
            if channel.size == 1 or node.Get_size() < channel.size:
                self.refusal = "the communicator spans nodes" if channel.size > 1 else "one rank"
                return None
            self.refusal = can_open(node, info.device_index)
            if self.refusal is not None:
                return None
            self.window = NodeWindow(node, DeviceMemory(node, info.device_index), alternates=node.Get_size() > 2)
        check_gpu(channel, info)
        return self.window

    def free(self) -> None:
        if self.window is not None:
            self.window.free()
            self.window = None


def check_gpu(channel, info: BufferInfo) -> None:
    """Refuse CUDA buffer `info` where it lies on another GPU than `channel`'s device window (made
    on this rank's GPU at the window's first use). The collectives call it before the call check,
    which shares the refusal (callcheck.share_refusal): the other ranks raise with this one
    instead of waiting for it in the window's first round."""
    windows = channel.device_window
    window = None if windows is None else windows.window
    if info.is_cuda and window is not None and info.device_index != window.memory.device_index:
        raise InvalidArgumentError(
            f"rank {channel.rank}'s buffer is on {info.device}, this communicator's device window on that rank on "
            f"cuda:{window.memory.device_index}: a rank's GPU buffers must all be on one GPU")


def keep_off(channel, reason: str) -> None:
    """Keep `channel`'s CUDA buffers out of the window, `reason` its refusal (device_route.keep_off:
    `mpidist bench`'s routes beside the device route)."""
    channel.device_window = DeviceWindows()
    channel.device_window.refusal = reason


def window_for(channel, info: BufferInfo):
    """The device window of `channel` for CUDA buffer `info`, or None (a CPU buffer, or the staged
    route)."""
    if not info.is_cuda:
        return None
    if channel.device_window is None:
        channel.device_window = DeviceWindows()
    return channel.device_window.get(channel, info)


# The collectives in the window (the device route's, device_route.py): each returns False, having
# done nothing, where the buffer takes another way; the caller's stream is synchronized before the
# window reads the buffer, and the window has settled when they return.

def allreduce(channel, array, info: BufferInfo, op: str) -> bool:
    window = window_for(channel, info)
    if window is None:
        return False
    buffers.synchronize(array, info)
    allreduce_on_node(window, info, kernel_op(op), 1.0 / channel.size if op == "avg" else 1.0)
    return True


def broadcast(channel, array, info: BufferInfo, root: int) -> bool:
    window = window_for(channel, info)
    if window is None:
        return False
    buffers.synchronize(array, info)
    broadcast_on_node(window, info, root)  # one node: local ranks are the channel's ranks
    return True


def allgather(channel, array, info: BufferInfo, out, chunks) -> bool:
    """`chunks`: (offset, count) of each rank's rows in the array `out`, in elements."""
    window = window_for(channel, info)
    if window is None:
        return False
    buffers.synchronize(array, info)
    out_info = buffers.describe(out)
    offset, count = chunks[channel.rank]
    if count:
        kernels.copy_ptr(out_info.ptr + offset * out_info.itemsize, info.ptr, count * out_info.itemsize,
                         device=out_info.device)
    allgather_on_node(window, out_info, chunks)
    return True


def reduce_scatter(channel, array, info: BufferInfo, out, chunks, op: str) -> bool:
    """This rank's chunk (`chunks`: (offset, count) per rank, in elements) into the array `out`."""
    window = window_for(channel, info)
    if window is None:
        return False
    buffers.synchronize(array, info)
    reduce_scatter_on_node(window, info, chunks, buffers.describe(out), kernel_op(op),
                           1.0 / channel.size if op == "avg" else 1.0)
    return True
