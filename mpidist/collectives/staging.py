"""GPU buffers and MPI libraries that cannot read GPU memory: the buffer a collective works on
(the array itself, or a pinned host copy), and copies between described buffers."""
from __future__ import annotations

import contextlib
import ctypes

from .. import buffers, kernels
from ..buffers import BufferInfo


@contextlib.contextmanager
def staged(channel, array, info: BufferInfo, host_only: bool = False):
    """The buffer the algorithm should work on: the array itself, or a pinned host copy when
    the array lives on a GPU and the MPI library cannot read GPU memory (or the algorithm
    works in host memory only: `host_only`)."""
    if info.is_cuda and (host_only or not channel.is_cuda_aware()):
        host = channel.staging.stage_in(array, info)
        yield host
        channel.staging.stage_out(array, info, host)
        return
    if info.is_cuda:
        buffers.synchronize(array, info)
    yield info


def copy_buffer(dst: BufferInfo, src: BufferInfo) -> None:
    if src.nbytes == 0 or dst.ptr == src.ptr:
        return
    if src.is_cuda:
        kernels.copy_ptr(dst.ptr, src.ptr, src.nbytes, device=src.device)
        kernels.synchronize(src.device)
    else:
        ctypes.memmove(dst.ptr, src.ptr, src.nbytes)
