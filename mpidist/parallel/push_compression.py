"""Compressed pushes of a parameter server's dense gradient: the compressors of compressors.py in
their point-to-point form (each compressor's push_codec() gives its codec of a range). A worker
encodes each server's range of its gradient on its own (there is no sum between workers to fold
into), keeping the residual of that range; the server decodes the payload back into a gradient
range before it averages the workers' gradients.

- fp16 / bf16: the range in half precision, without error feedback (as the reducer's casts).
- int8: the range as one part of int8 values with a float32 scale per `chunk` (Int8Parts with
  one rank: the same arithmetic, kernels and bits as the all-reduce's), with error feedback.
- top-k: the range's ceil(fraction * n) elements largest in magnitude, as (int32 index, value)
  pairs (topk_codec.py, as the all-reduce's), with error feedback.
- PowerSGD is refused: its factors come from an all-reduce over the ranks (P = sum of M_r Q,
  orthogonalized), which a push has not got, and a server's range cuts weight matrices apart.

With error feedback, what a server decodes plus the worker's residual is, over any number of
steps, the sum of the worker's gradients (tests/test_ps_compression.py).
"""
from __future__ import annotations

import math

import torch

from . import topk_codec
from .int8_parts import Int8Parts


class PushCodec:
    """One range's encoding on a worker (with its residual) and decoding on the server.
    `error_feedback`: whether the residual carries anything (what the checkpoints keep)."""

    error_feedback = False

    def __init__(self, settings, numel: int, dtype, device):
        self.settings, self.numel, self.dtype = settings, numel, dtype
        self.residual = torch.zeros(numel, dtype=dtype, device=device)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The payload of `values` (this range of the gradient), as it travels."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """The gradient range a payload stands for."""
        raise NotImplementedError


class PlainPush(PushCodec):
    def encode(self, values):
        return values

    def decode(self, payload):
        return payload


class CastPush(PushCodec):
    def encode(self, values):
        return values.to(self.settings.wire_dtype)

    def decode(self, payload):
        return payload.to(self.dtype)


class Int8Push(PushCodec):
    error_feedback = True

    def __init__(self, settings, numel, dtype, device):
        super().__init__(settings, numel, dtype, device)
        self.parts = Int8Parts(numel, 1, 0, settings.chunk, dtype, device)

    def encode(self, values):
        return self.parts.quantize(values.contiguous(), self.residual).view(-1)

    def decode(self, payload):
        values = torch.empty(self.numel, dtype=self.dtype, device=payload.device)
        self.parts.dequantize_into(values, payload.view(1, -1))
        return values


class TopKPush(PushCodec):
    error_feedback = True

    def __init__(self, settings, numel, dtype, device):
        super().__init__(settings, numel, dtype, device)
        self.k = min(numel, max(1, math.ceil(settings.fraction * numel)))

    def encode(self, values):
        return topk_codec.encode(values + self.residual, self.residual, self.k)

    def decode(self, payload):
        values = torch.zeros(self.numel, dtype=self.dtype, device=payload.device)
        topk_codec.add_decoded(values, payload, self.k)
        return values
