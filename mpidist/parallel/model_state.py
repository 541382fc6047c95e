"""Giving every rank one rank's model state (parameters and buffers), in place, whatever the
tensors' strides: what every training mode does at its start.
"""
from __future__ import annotations

import torch


def broadcast_in_place(comm, tensor: torch.Tensor, root: int = 0) -> None:
    """Give every rank `root`'s values of `tensor`, in place, whatever its strides."""
    if tensor.is_contiguous():
        comm.broadcast(tensor, root=root)
        return
    staging = tensor.contiguous()  # channels_last weights, for example
    comm.broadcast(staging, root=root)
    tensor.copy_(staging)


def broadcast_module_state(module: torch.nn.Module, comm, root: int = 0) -> None:
    """Give every rank `root`'s parameters and buffers (in place)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            broadcast_in_place(comm, tensor.data, root)
