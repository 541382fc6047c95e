"""Horovod's gradient compression classes (hvd.Compression.none, fp16, bf16) for allreduce,
reducescatter and DistributedOptimizer, mpidist's compressors with error feedback under the
same roof for DistributedOptimizer (hvd.Compression.int8, powersgd(rank), topk(fraction)), and
the dtype a compression sends a tensor in.
"""
from __future__ import annotations

from ..errors import InvalidArgumentError
from ..parallel import compressors
from ..parallel.reducer import COMPRESSION_DTYPES


class _Cast:
    """Horovod's compressor interface: compress(tensor) -> (tensor, ctx), decompress(tensor, ctx).
    `wire` is what mpidist's own all-reduces (DistributedOptimizer, allreduce) send: None, "fp16"
    or "bf16" (DataParallel's compression names)."""

    wire = None

    @classmethod
    def compress(cls, tensor):
        # As Horovod: only floating-point tensors are cast; ctx is the dtype to cast back to.
        if cls.wire is None or not tensor.dtype.is_floating_point:
            return tensor, None
        return tensor.to(COMPRESSION_DTYPES[cls.wire]), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class _WithErrorFeedback:
    """One of mpidist's compressors (parallel/compressors.py) as a Horovod compression: `wire`
    is the compressor, which DistributedOptimizer's buckets run with their error feedback. It
    keeps state between steps, so a tensor alone (compress(), hvd.allreduce) is refused."""

    wire = compressors.NoCompression()

    @classmethod
    def compress(cls, tensor):
        raise InvalidArgumentError(f"compression {cls.wire} keeps error feedback between steps: it runs in "
                                   "DistributedOptimizer (and md.DataParallel), not on a tensor alone")


def _with_error_feedback(compressor):
    return type(f"Compression.{compressor}", (_WithErrorFeedback,), {"wire": compressor})


class Compression:
    """Gradient compression for DistributedOptimizer and allreduce (Horovod's classes), and
    mpidist's compressors with error feedback for DistributedOptimizer: int8, powersgd(rank,
    ...), topk(fraction) (keyword arguments as compressors.PowerSGD's and TopK's)."""

    class none(_Cast):  # noqa: N801 - Horovod's names
        wire = None

    class fp16(_Cast):  # noqa: N801
        wire = "fp16"

    class bf16(_Cast):  # noqa: N801
        wire = "bf16"

    int8 = _with_error_feedback(compressors.Int8())

    @staticmethod
    def powersgd(rank=1, **options):
        return _with_error_feedback(compressors.PowerSGD(rank=rank, **options))

    @staticmethod
    def topk(fraction=0.01):
        return _with_error_feedback(compressors.TopK(fraction=fraction))


def cast_only(compression, what: str):
    """The cast `compression` sends in (None, "fp16" or "bf16"), for `what`, which exchanges
    tensors one call at a time: a compression with error feedback is refused there."""
    wire = getattr(compression, "wire", None)
    if isinstance(wire, compressors.Compressor):
        raise InvalidArgumentError(f"{what} with compression {wire}: a compression with error feedback runs in "
                                   "DistributedOptimizer's gradient buckets; here choose hvd.Compression.none, fp16 "
                                   "or bf16")
    return wire


def dtype_on_wire(tensor, compression):
    """The dtype `compression` sends `tensor` in, or None to send it as it is."""
    dtype = COMPRESSION_DTYPES.get(cast_only(compression, "allreduce / reducescatter"))
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return dtype
    return None
