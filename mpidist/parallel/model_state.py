"""Giving every rank one rank's model state (parameters and buffers), in place, whatever the
tensors' strides: what every training mode does at its start, and DataParallel before each
forward for the buffers (coalesced, as torch DDP's).
"""
from __future__ import annotations

import torch

from .flat import shaped_like, tensors_by_kind, unpack_tensors

# The most bytes one coalesced broadcast copies into a buffer of its own (torch DDP's
# broadcast_bucket_size): a larger tensor is broadcast alone, in place.
BROADCAST_BUCKET_BYTES = 250 * 2 ** 20


def broadcast_in_place(comm, tensor: torch.Tensor, root: int = 0) -> None:
    """Give every rank `root`'s values of `tensor`, in place, whatever its strides."""
    if tensor.is_contiguous():
        comm.broadcast(tensor, root=root)
        return
    staging = tensor.contiguous()  # channels_last weights, for example
    comm.broadcast(staging, root=root)
    tensor.copy_(staging)


def broadcast_end_to_end(comm, tensors, root: int = 0) -> None:
    """Give every rank `root`'s values of `tensors` (of one dtype and device), in place, in one
    broadcast of them laid end to end; a tensor alone is broadcast in place."""
    if len(tensors) == 1:
        broadcast_in_place(comm, tensors[0], root)
        return
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    comm.broadcast(flat, root=root)
    if comm.rank != root:
        unpack_tensors(flat, shaped_like(tensors, flat), tensors)


def broadcast_coalesced(comm, tensors, root: int = 0) -> None:
    """Give every rank `root`'s values of `tensors`, in place, in one broadcast per dtype and
    device (up to BROADCAST_BUCKET_BYTES each) instead of one per tensor: a model's buffers are
    many and small (three per batch norm layer), and each broadcast costs a round of the ranks."""
    for kind in tensors_by_kind(tensors):
        bucket, filled = [], 0
        for tensor in kind:
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and filled + nbytes > BROADCAST_BUCKET_BYTES:
                broadcast_end_to_end(comm, bucket, root)
                bucket, filled = [], 0
            bucket.append(tensor)
            filled += nbytes
        broadcast_end_to_end(comm, bucket, root)


def broadcast_module_state(module: torch.nn.Module, comm, root: int = 0) -> None:
    """Give every rank `root`'s parameters and buffers (in place)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            broadcast_in_place(comm, tensor.data, root)
