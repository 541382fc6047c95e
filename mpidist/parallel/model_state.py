"""Giving every rank one rank's model state (parameters and buffers), in place, whatever the
tensors' strides: what every training mode does at its start, and DataParallel before each
forward for the buffers (coalesced, as torch DDP's).
"""
from __future__ import annotations

import torch

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


def broadcast_coalesced(comm, tensors, root: int = 0) -> None:
    """Give every rank `root`'s values of `tensors`, in place, in one broadcast per dtype and
    device (up to BROADCAST_BUCKET_BYTES each) instead of one per tensor: a model's buffers are
    many and small (three per batch norm layer), and each broadcast costs a round of the ranks."""
    buckets, filling = [], {}  # filling: (dtype, device) -> [the bucket being filled, its bytes]
    for tensor in tensors:
        key, nbytes = (tensor.dtype, tensor.device), tensor.numel() * tensor.element_size()
        if key not in filling or filling[key][1] + nbytes > BROADCAST_BUCKET_BYTES:
            filling[key] = [[], 0]
            buckets.append(filling[key][0])
        filling[key][0].append(tensor)
        filling[key][1] += nbytes
    for bucket in buckets:
        if len(bucket) == 1:
            broadcast_in_place(comm, bucket[0], root)
            continue
        flat = torch.cat([tensor.reshape(-1) for tensor in bucket])
        comm.broadcast(flat, root=root)
        if comm.rank != root:
            for tensor, piece in zip(bucket, flat.split([tensor.numel() for tensor in bucket])):
                tensor.copy_(piece.view_as(tensor))


def broadcast_module_state(module: torch.nn.Module, comm, root: int = 0) -> None:
    """Give every rank `root`'s parameters and buffers (in place)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            broadcast_in_place(comm, tensor.data, root)
