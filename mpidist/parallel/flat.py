"""Tensors laid end to end in one flat buffer: grouping by kind, views of the buffer shaped like
the tensors, packing into it and unpacking out of it (with mpidist's fused kernels), and tensors
over memory torch does not own (shared windows). The gradient buckets, ZeRO and parameter
averaging all reduce such buffers.
"""
from __future__ import annotations

import ctypes

import torch

from .. import kernels


def tensors_by_kind(tensors) -> list:
    """`tensors` in lists of one dtype and device, in order of first appearance (a flat buffer
    holds one kind of element)."""
    kinds = {}
    for tensor in tensors:
        kinds.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    return list(kinds.values())


def shaped_like(params, flat: torch.Tensor):
    """Views of `flat` shaped like `params` (contiguous), laid end to end."""
    parts = flat.split([p.numel() for p in params])
    return [part.view(p.shape) for part, p in zip(parts, params)]


def pack_tensors(flat: torch.Tensor, parts, tensors) -> None:
    """Gather `tensors` into `flat` (`parts`: shaped_like views of it): in one kernel call when
    they are contiguous and none is already its part; torch copies the others, whatever their
    strides (the kernel takes contiguous memory only)."""
    if all(t.is_contiguous() and t is not part for t, part in zip(tensors, parts)):
        kernels.pack(flat, tensors)
        return
    for tensor, part in zip(tensors, parts):
        if tensor is not part:
            part.copy_(tensor)


def unpack_tensors(flat: torch.Tensor, parts, tensors) -> None:
    """Scatter `flat` back into `tensors` (the inverse of pack_tensors)."""
    if all(t.is_contiguous() for t in tensors):
        kernels.unpack(flat, tensors)
        return
    for tensor, part in zip(tensors, parts):
        tensor.copy_(part)


def tensor_at(address: int, numel: int, dtype: torch.dtype, owner) -> torch.Tensor:
    """A CPU tensor over memory this process does not own through torch (a shared window).

    The tensor, and every view of it, keeps `owner` (what frees the memory) alive: a gradient
    that is a view of a shared slot stays valid after its DataParallel is gone."""
    memory = (ctypes.c_char * (numel * dtype.itemsize)).from_address(address)
    memory.owner = owner  # torch.frombuffer keeps `memory` alive for as long as the storage
    return torch.frombuffer(memory, dtype=dtype, count=numel)
