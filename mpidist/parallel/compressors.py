"""Gradient compression: the settings of each compressor (PowerSGD, int8 with a scale per chunk,
top-k, the float16 / bfloat16 casts) and the spelling `mpidist train --compression` takes.

A compressor is a small immutable settings object, and one interface for its two uses:
bucket_exchange() gives the reducer's exchange of one gradient bucket (bucket_exchanges.py; None
for the casts and no compression, whose buckets the reducer's own all-reduce carries, a cast's in
`wire_dtype`), and push_codec() a parameter server's codec of one range of a pushed gradient
(push_compression.py; check_push() refuses a compressor without one, as check() refuses
parameters it cannot send).

Error feedback (PowerSGD, int8, top-k): before compressing, a bucket adds to its gradient the
residual of the step before, and keeps as the new residual what it meant to send minus what its
share of the result is. So nothing is lost, only delayed: over any number of steps, the sum of
the results plus every rank's residual is the sum of every rank's gradients. Every rank gets the
same bits: each reduces the same exchanged data in rank order, and PowerSGD orthogonalizes the
same all-reduced matrix on every rank.

Each one's exchange in full: docs/compression.md, "How they exchange". In short: PowerSGD
(Vogels et al., as torch's powerSGD_hook defines it) sends each weight matrix M as P = M Q and
Q = M^T P (two all-reduces), its residual M - P Q_rank^T; int8 sends one int8 part per rank
(all-to-all), each owner sums its part in float32 in rank order and requantizes it, and every
rank gathers the sums (allgather), on nodes of several ranks after a sum within each node, so
that only the node sums travel between nodes; top-k allgathers each rank's (index, value)
pairs (topk_codec.py); fp16 / bf16 are the reducer's casts, without error feedback.
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import InvalidArgumentError
from .bucket_exchanges import Int8Bucket, PowerSGDBucket, TopKBucket
from .push_compression import CastPush, Int8Push, PlainPush, TopKPush

__all__ = ["Compressor", "NoCompression", "Cast", "PowerSGD", "Int8", "TopK", "parse_compression"]

CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Compressor:
    """The settings of a gradient compression. `wire_dtype`: the dtype a cast sends the bucket in
    (None for the others). `bucket_exchange_class`: the exchange of a bucket, for a compression that
    exchanges its buckets itself (None: the reducer's own all-reduce carries them);
    `push_codec_class`: the codec of a push range (None: pushes cannot be compressed so)."""

    name = "none"
    wire_dtype = None
    bucket_exchange_class = None
    push_codec_class = None

    def check(self, params) -> None:
        """Refuse parameters this compression cannot send (it compresses floating point)."""
        for index, param in enumerate(params):
            if not param.dtype.is_floating_point:
                raise InvalidArgumentError(f"compression={str(self)!r} compresses floating-point gradients; "
                                           f"parameter {index} is {param.dtype}")

    def bucket_exchange(self, params, comm, algorithm):
        """The exchange of the bucket of `params` on `comm` (a BucketExchange, with this rank's
        state of the bucket), or None where the reducer's own all-reduce carries the bucket."""
        kind = self.bucket_exchange_class
        return None if kind is None else kind(self, params, comm, algorithm)

    def check_push(self) -> None:
        """Refuse a compression that cannot compress a parameter server's push (on every rank: the
        ranks' settings agree)."""
        if self.push_codec_class is None:
            raise InvalidArgumentError(f"compression={self!r} has no push form; give none, fp16, bf16, int8 "
                                       "or topk:<fraction>")

    def push_codec(self, numel: int, dtype, device="cpu"):
        """The codec of one range of `numel` elements of `dtype` of a pushed gradient (check_push
        first)."""
        return self.push_codec_class(self, numel, dtype, device)

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class NoCompression(Compressor):
    """Gradients go as they are."""

    name = "none"
    push_codec_class = PlainPush

    def check(self, params) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Cast(Compressor):
    """The bucket travels in float16 or bfloat16 and comes back in the gradients' dtype."""

    dtype_name: str = "fp16"
    push_codec_class = CastPush

    def __post_init__(self):
        if self.dtype_name not in CAST_DTYPES:
            raise InvalidArgumentError(f"compression cast {self.dtype_name!r}: choose 'fp16' or 'bf16'")

    @property
    def name(self) -> str:
        return self.dtype_name

    @property
    def wire_dtype(self):
        return CAST_DTYPES[self.dtype_name]


@dataclasses.dataclass(frozen=True)
class PowerSGD(Compressor):
    """Rank-`rank` PowerSGD with error feedback (module docstring); the arguments mean what
    torch's PowerSGDState's matrix_approximation_rank, start_powerSGD_iter,
    min_compression_rate, use_error_feedback, warm_start, orthogonalization_epsilon and
    random_seed mean."""

    rank: int = 1
    start_iter: int = 10
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    epsilon: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise InvalidArgumentError(f"PowerSGD rank={self.rank!r}: give a whole number >= 1")
        if not isinstance(self.start_iter, int) or self.start_iter < 0:
            raise InvalidArgumentError(f"PowerSGD start_iter={self.start_iter!r}: give a whole number >= 0")
        if not self.min_compression_rate > 0:
            raise InvalidArgumentError(f"PowerSGD min_compression_rate={self.min_compression_rate!r}: give a "
                                       "number > 0")
        if not self.epsilon >= 0:
            raise InvalidArgumentError(f"PowerSGD epsilon={self.epsilon!r}: give a number >= 0")

    @property
    def name(self) -> str:
        return f"powersgd:{self.rank}"

    bucket_exchange_class = PowerSGDBucket

    def check_push(self) -> None:
        raise InvalidArgumentError(
            f"compression={str(self)!r} cannot compress a parameter server's push: PowerSGD's factors come "
            "from an all-reduce over the ranks, and a push goes from one worker to one server; use int8, "
            "topk:<fraction> or fp16 / bf16 (or md.DataParallel for PowerSGD)")


@dataclasses.dataclass(frozen=True)
class Int8(Compressor):
    """Int8 values with one float32 scale per `chunk` elements, summed in float32."""

    chunk: int = 1024

    def __post_init__(self):
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise InvalidArgumentError(f"int8 chunk={self.chunk!r}: give a whole number >= 1")

    name = "int8"

    bucket_exchange_class = Int8Bucket
    push_codec_class = Int8Push


@dataclasses.dataclass(frozen=True)
class TopK(Compressor):
    """The `fraction` of each bucket's elements largest in magnitude, as (index, value) pairs."""

    fraction: float = 0.01

    def __post_init__(self):
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) \
                or not 0 < self.fraction <= 1:
            raise InvalidArgumentError(f"top-k fraction={self.fraction!r}: give a number in (0, 1]")

    @property
    def name(self) -> str:
        return f"topk:{self.fraction:g}"

    bucket_exchange_class = TopKBucket
    push_codec_class = TopKPush


SPELLINGS = "none, fp16, bf16, int8, powersgd:<rank>, topk:<fraction>"


def parse_compression(text: str) -> Compressor:
    """The compressor `text` names: "none", "fp16", "bf16", "int8", "powersgd:<rank>" (rank 1
    without it), "topk:<fraction>" (0.01 without it)."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"compression={text!r}: give one of {SPELLINGS}, or a compressor")
    name, _, setting = text.strip().lower().partition(":")
    try:
        if name in ("none", "fp16", "bf16", "int8") and setting:
            raise InvalidArgumentError(f"{name} takes no setting")
        if name == "none":
            return NoCompression()
        if name in CAST_DTYPES:
            return Cast(name)
        if name == "int8":
            return Int8()
        if name == "powersgd":
            return PowerSGD(rank=_number(setting, int, "rank") if setting else 1)
        if name == "topk":
            return TopK(fraction=_number(setting, float, "fraction") if setting else 0.01)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"compression {text!r}: {exc}") from None
    raise InvalidArgumentError(f"compression {text!r} is unknown; choose {SPELLINGS}")


def _number(text, kind, what):
    try:
        return kind(text)
    except ValueError:
        raise InvalidArgumentError(f"its {what} {text!r} is not a number") from None


def resolve_compression(compression) -> Compressor:
    """A Compressor for `compression`: None, a spelling (parse_compression) or a Compressor."""
    if compression is None:
        return NoCompression()
    if isinstance(compression, Compressor):
        return compression
    return parse_compression(compression)
