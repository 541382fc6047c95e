"""TEMPORARY NumPy stand-in for the fused kernels of mpidist._C (replaced by the extension)."""
import ctypes

import numpy as np

from .buffers import BufferInfo, as_numpy

OPS = ("sum", "min", "max", "prod")
_UFUNC = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


def _load(ptr, count, dtype):
    raw = as_numpy(BufferInfo(ptr, count, dtype, "cpu", "numpy"))
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32), raw
    if dtype == "float16":
        return raw.astype(np.float32), raw
    return raw, raw


def _store(raw, values, dtype):
    if dtype == "bfloat16":
        bits = values.astype(np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(values)
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
        raw[...] = rounded
    else:
        raw[...] = values


def reduce_ptr(dst_ptr, src_ptr, count, dtype, op, device="cpu", stream=None):
    dst, dst_raw = _load(dst_ptr, count, dtype)
    src, _ = _load(src_ptr, count, dtype)
    _store(dst_raw, _UFUNC[op](dst, src), dtype)


def reduce_many_ptr(dst_ptr, src_ptrs, count, dtype, op, device="cpu", stream=None):
    values = [_load(p, count, dtype)[0].copy() for p in src_ptrs]
    acc = values[0]
    for v in values[1:]:
        acc = _UFUNC[op](acc, v)
    _, dst_raw = _load(dst_ptr, count, dtype)
    _store(dst_raw, acc, dtype)


def scale_ptr(ptr, count, dtype, factor, device="cpu", stream=None):
    values, raw = _load(ptr, count, dtype)
    _store(raw, values * np.asarray(factor, dtype=values.dtype), dtype)


def cast_ptr(dst_ptr, dst_dtype, src_ptr, src_dtype, count, scale=1.0, device="cpu", stream=None):
    values, _ = _load(src_ptr, count, src_dtype)
    _, raw = _load(dst_ptr, count, dst_dtype)
    _store(raw, values.astype(np.float32) * np.float32(scale) if scale != 1.0 else values, dst_dtype)


def copy_ptr(dst_ptr, src_ptr, nbytes, device="cpu", stream=None):
    ctypes.memmove(dst_ptr, src_ptr, nbytes)


def synchronize(device):
    pass
