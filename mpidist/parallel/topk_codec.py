"""Top-k's encoding, written once for the reducer's bucket exchange (compressors.TopKBucket's
allgather) and a parameter server's push (push_compression.TopKPush): the k elements of a
gradient largest in magnitude as a byte payload of k int32 indices followed by their k values,
with error feedback (what is not sent stays in the residual).
"""
from __future__ import annotations

import torch

from .int8_parts import bytes_as

DIRECT_TOPK_NUMEL = 1 << 16  # largest_magnitudes runs torch.topk over all of a gradient this small
SAMPLE_STRIDE = 61  # its sample's stride, which rarely divides a row: the sample follows no column


def largest_magnitudes(flat, k: int):
    """The indices (int64, in no order) of the k elements of `flat` largest in magnitude: the set
    torch.topk(flat.abs(), k) gives (up to ties), without its cost over millions of elements.
    topk runs over candidates: those at least a threshold that about 2k pass, read off a strided
    sample. The top k are at least the k-th largest, so if k or more pass they are all among
    them; if fewer pass (a sample unlike the rest), topk runs over every element."""
    magnitudes = flat.abs()
    if magnitudes.numel() > DIRECT_TOPK_NUMEL and 4 * k <= magnitudes.numel():
        sample = magnitudes[::SAMPLE_STRIDE]
        threshold = torch.kthvalue(sample, max(1, sample.numel() - 2 * k // SAMPLE_STRIDE)).values
        candidates = torch.nonzero(magnitudes >= threshold).squeeze(1)
        if candidates.numel() >= k:
            return candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]
    return torch.topk(magnitudes, k, sorted=False).indices


def encode(had, residual, k: int):
    """The payload of the k elements of `had` (the gradient plus the residual of the step before)
    largest in magnitude; `residual` becomes what was not sent."""
    indices = largest_magnitudes(had, k)
    values = had[indices]
    residual.copy_(had)
    residual[indices] = 0
    return torch.cat([indices.to(torch.int32).view(torch.uint8), values.view(torch.uint8)])


def add_decoded(into, payload, k: int) -> None:
    """Add the k values a payload carries to `into` at their indices."""
    indices = bytes_as(payload[:4 * k], torch.int32).long()
    into.index_add_(0, indices, bytes_as(payload[4 * k:], into.dtype))
