"""Horovod's gradient compression classes (hvd.Compression.none, fp16, bf16) for allreduce,
reducescatter and DistributedOptimizer, and the dtype a compression sends a tensor in.
"""
from __future__ import annotations

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


class Compression:
    """Gradient compression for DistributedOptimizer and allreduce (Horovod's classes)."""

    class none(_Cast):  # noqa: N801 - Horovod's names
        wire = None

    class fp16(_Cast):  # noqa: N801
        wire = "fp16"

    class bf16(_Cast):  # noqa: N801
        wire = "bf16"


def dtype_on_wire(tensor, compression):
    """The dtype `compression` sends `tensor` in, or None to send it as it is."""
    dtype = COMPRESSION_DTYPES.get(getattr(compression, "wire", None))
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return dtype
    return None
