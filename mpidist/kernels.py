"""Typed Python face of the kernels in ``mpidist._C``: the fused reductions, casts and copies of
the collectives, and the int8 gradient compressor's quantization (CPU only).

Array-level functions take NumPy arrays, torch tensors or CuPy arrays, check them and run the CPU
or CUDA kernel in place. The ``*_ptr`` forms are the hot path of the collectives: raw addresses,
no array objects and no checks beyond what the extension does itself.

Semantics (both back ends): float16 and bfloat16 are combined in float32 and rounded once to
nearest even; min/max propagate NaN; integer sum/prod wrap around; ``reduce_many`` combines its
sources left to right in one pass, so its result is bitwise reproducible whatever the thread
count. Integer data is never scaled by anything but 1.
"""
from __future__ import annotations

from . import _C
from .buffers import BufferInfo, describe
from .errors import InvalidArgumentError, MpidistError, UnsupportedDtypeError
from .runtime.wire import FLOAT_DTYPES

OPS = ("sum", "min", "max", "prod")
CAST_DTYPES = ("float32", "float16", "bfloat16")

__all__ = [
    "OPS", "reduce", "reduce_scale", "scale", "reduce_many", "reduce_many_to", "pack", "unpack", "cast",
    "int8_row_bytes", "int8_quantize", "int8_sum_requantize", "int8_dequantize",
    "reduce_ptr", "reduce_scale_ptr", "scale_ptr", "reduce_many_ptr", "reduce_many_to_ptr",
    "cuda_available", "built_with_cuda", "cuda_device_count",
    "set_num_threads", "get_num_threads", "cpu_isa", "cpu_isas", "set_cpu_isa",
]

_NO_CUDA = "mpidist._C was built without CUDA; reinstall with MPIDIST_CUDA=1"


# ---- checks -----------------------------------------------------------------------------------

def _check_op(op: str) -> str:
    if op not in OPS:
        raise InvalidArgumentError(f"unknown reduction op {op!r}; valid ops: {', '.join(OPS)}")
    return op


def _check_scale(dtype: str, factor: float, what: str) -> None:
    if dtype not in FLOAT_DTYPES and factor != 1:
        raise UnsupportedDtypeError(
            f"{what} cannot scale {dtype} data by {factor}: integer results would be truncated; "
            "scale only floating-point buffers")


def _same(name_a: str, a: BufferInfo, name_b: str, b: BufferInfo, what: str) -> None:
    for field in ("dtype", "count", "device"):
        if getattr(a, field) != getattr(b, field):
            raise InvalidArgumentError(
                f"{what}: {name_a} and {name_b} differ in {field} "
                f"({getattr(a, field)} vs {getattr(b, field)})")


def _translate(error: ValueError, what: str) -> MpidistError:
    """The mpidist error matching a ValueError raised by the extension."""
    message = f"{what}: {error}"
    if "dtype" in str(error) or "cannot scale" in str(error):
        return UnsupportedDtypeError(message)
    return InvalidArgumentError(message)


# ---- CUDA plumbing ----------------------------------------------------------------------------

def cuda_available() -> bool:
    """True when the extension was built with CUDA and a CUDA device is present."""
    return cuda_device_count() > 0


def built_with_cuda() -> bool:
    """Whether the extension was built with its CUDA kernels (MPIDIST_CUDA=1)."""
    return bool(_C.built_with_cuda)


def cuda_device_count() -> int:
    """The CUDA devices the extension sees; 0 where it was built without CUDA."""
    return int(_C.cuda_device_count()) if _C.built_with_cuda else 0


def _require_cuda() -> None:
    if not _C.built_with_cuda:
        raise MpidistError(_NO_CUDA)


def _device_index(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else -1


def _is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def _stream_of(array, info: BufferInfo) -> int:
    """The caller's current stream on the array's device, as an integer handle."""
    if info.kind == "torch":
        import torch  # torch and cupy are optional here, and take seconds to import
        return torch.cuda.current_stream(info.device_index).cuda_stream
    if info.kind == "cupy":
        import cupy
        with cupy.cuda.Device(info.device_index):
            return cupy.cuda.get_current_stream().ptr
    return 0


def _call(name: str, device: str, stream, *args):
    """Runs kernel `name` on the CPU or, for a CUDA device, as cuda_`name` on `stream`. The
    extension checks the op and dtype names itself."""
    try:
        if _is_cuda(device):
            _require_cuda()
            return getattr(_C, "cuda_" + name)(*args, stream=int(stream or 0), device=_device_index(device))
        return getattr(_C, name)(*args)
    except ValueError as error:
        raise _translate(error, name) from None
    except RuntimeError as error:  # a CUDA error, with CUDA's own message
        if isinstance(error, MpidistError):
            raise
        raise MpidistError(f"{name}: {error}") from None


# ---- pointer-level forms (hot path) -----------------------------------------------------------

def reduce_ptr(dst_ptr: int, src_ptr: int, count: int, dtype: str, op: str,
               device: str = "cpu", stream=None) -> None:
    """dst = dst op src over `count` elements at raw addresses."""
    if device == "cpu":  # the collectives' hot path, in one Python frame
        try:
            return _C.reduce(dst_ptr, src_ptr, count, dtype, op)
        except ValueError as error:
            raise _translate(error, "reduce") from None
    _call("reduce", device, stream, dst_ptr, src_ptr, count, dtype, op)


def reduce_scale_ptr(dst_ptr: int, src_ptr: int, count: int, dtype: str, op: str, scale: float,
                     device: str = "cpu", stream=None) -> None:
    """dst = (dst op src) * scale in one pass; integer dtypes accept only scale == 1."""
    _check_scale(dtype, scale, "reduce_scale")
    _call("reduce_scale", device, stream, dst_ptr, src_ptr, count, dtype, op, float(scale))


def scale_ptr(ptr: int, count: int, dtype: str, factor: float, device: str = "cpu", stream=None) -> None:
    """data *= factor for a floating dtype (factor 1 on integers is a no-op)."""
    _check_scale(dtype, factor, "scale")
    if dtype not in FLOAT_DTYPES:
        return
    _call("scale", device, stream, ptr, count, dtype, float(factor))


def reduce_many_ptr(dst_ptr: int, src_ptrs, count: int, dtype: str, op: str,
                    device: str = "cpu", stream=None) -> None:
    """dst = src[0] op src[1] op ... in one pass, left to right; dst may be one of the sources."""
    src_ptrs = [int(p) for p in src_ptrs]
    if not src_ptrs:
        raise InvalidArgumentError("reduce_many needs at least one source")
    _call("reduce_many", device, stream, dst_ptr, src_ptrs, count, dtype, op)


def reduce_many_to_ptr(dst_ptrs, src_ptrs, count: int, dtype: str, op: str, scale: float = 1.0,
                       device: str = "cpu", stream=None) -> None:
    """Every dst = (src[0] op src[1] op ...) * scale, in one pass over memory on the CPU: bitwise
    reduce_many into the first destination, then scale unless scale is 1, then copies. A
    destination may be one of the sources (the same address), never overlap one partially."""
    dst_ptrs, src_ptrs = [int(p) for p in dst_ptrs], [int(p) for p in src_ptrs]
    if not src_ptrs:
        raise InvalidArgumentError("reduce_many_to needs at least one source")
    if not dst_ptrs:
        raise InvalidArgumentError("reduce_many_to needs at least one destination")
    _check_scale(dtype, scale, "reduce_many_to")
    _call("reduce_many_to", device, stream, dst_ptrs, src_ptrs, count, dtype, op, float(scale))


# ---- array-level forms ------------------------------------------------------------------------

def reduce(dst, src, op: str = "sum") -> None:
    """dst = dst op src, element-wise, in place. Same dtype, count and device required."""
    _check_op(op)
    d, s = describe(dst), describe(src)
    _same("dst", d, "src", s, "reduce")
    reduce_ptr(d.ptr, s.ptr, d.count, d.dtype, op, d.device, _stream_of(dst, d) if d.is_cuda else None)


def reduce_scale(dst, src, op: str, scale: float) -> None:
    """dst = (dst op src) * scale in one pass (an average is op="sum", scale=1/n)."""
    _check_op(op)
    d, s = describe(dst), describe(src)
    _same("dst", d, "src", s, "reduce_scale")
    reduce_scale_ptr(d.ptr, s.ptr, d.count, d.dtype, op, scale, d.device,
                     _stream_of(dst, d) if d.is_cuda else None)


def scale(dst, factor: float) -> None:
    """dst *= factor (floating dtypes; integers only accept factor 1)."""
    d = describe(dst)
    scale_ptr(d.ptr, d.count, d.dtype, factor, d.device, _stream_of(dst, d) if d.is_cuda else None)


def reduce_many(dst, srcs, op: str = "sum") -> None:
    """dst = srcs[0] op srcs[1] op ... op srcs[-1], one pass, fixed left-to-right order."""
    _check_op(op)
    srcs = list(srcs)
    if not srcs:
        raise InvalidArgumentError("reduce_many needs at least one source")
    d = describe(dst)
    infos = [describe(s) for s in srcs]
    for i, info in enumerate(infos):
        _same("dst", d, f"srcs[{i}]", info, "reduce_many")
    reduce_many_ptr(d.ptr, [i.ptr for i in infos], d.count, d.dtype, op, d.device,
                    _stream_of(dst, d) if d.is_cuda else None)


def reduce_many_to(dsts, srcs, op: str = "sum", scale: float = 1.0) -> None:
    """Every array of `dsts` = (srcs[0] op srcs[1] op ... op srcs[-1]) * scale, in one pass over
    memory (an averaging all-reduce publishes its result this way). Bitwise what reduce_many into
    dsts[0], then scale, then copies give; a destination may be one of the sources."""
    _check_op(op)
    dsts, srcs = list(dsts), list(srcs)
    if not srcs:
        raise InvalidArgumentError("reduce_many_to needs at least one source")
    if not dsts:
        raise InvalidArgumentError("reduce_many_to needs at least one destination")
    infos = [describe(d) for d in dsts]
    first = infos[0]
    for i, info in enumerate(infos[1:], 1):
        _same("dsts[0]", first, f"dsts[{i}]", info, "reduce_many_to")
    sources = [describe(s) for s in srcs]
    for i, info in enumerate(sources):
        _same("dsts[0]", first, f"srcs[{i}]", info, "reduce_many_to")
    reduce_many_to_ptr([i.ptr for i in infos], [i.ptr for i in sources], first.count, first.dtype, op, scale,
                       first.device, _stream_of(dsts[0], first) if first.is_cuda else None)


def _ranges(big, parts, what: str):
    b = describe(big)
    infos = [describe(p) for p in parts]
    for i, info in enumerate(infos):
        if info.device != b.device:
            raise InvalidArgumentError(f"{what}: part {i} is on {info.device} but the buffer is on {b.device}")
    nbytes = [info.nbytes for info in infos]
    if sum(nbytes) > b.nbytes:
        raise InvalidArgumentError(f"{what}: the parts hold {sum(nbytes)} bytes but the buffer only {b.nbytes}")
    return b, infos, nbytes


def pack(dst, srcs) -> None:
    """Copy the arrays `srcs` back to back into the buffer `dst` (any dtype, enough bytes)."""
    d, infos, nbytes = _ranges(dst, srcs, "pack")
    _call("pack", d.device, _stream_of(dst, d) if d.is_cuda else None, d.ptr, [i.ptr for i in infos], nbytes)


def unpack(src, dsts) -> None:
    """Copy consecutive byte ranges of the buffer `src` into the arrays `dsts`; inverse of pack."""
    s, infos, nbytes = _ranges(src, dsts, "unpack")
    _call("unpack", s.device, _stream_of(src, s) if s.is_cuda else None, s.ptr, [i.ptr for i in infos], nbytes)


def cast(dst, src, scale: float = 1.0) -> None:
    """dst = src * scale converted to dst's dtype (float32 / float16 / bfloat16, round to nearest even)."""
    d, s = describe(dst), describe(src)
    for name, info in (("dst", d), ("src", s)):
        if info.dtype not in CAST_DTYPES:
            raise UnsupportedDtypeError(f"cast: {name} has dtype {info.dtype}; cast supports {', '.join(CAST_DTYPES)}")
    if d.count != s.count or d.device != s.device:
        field = "count" if d.count != s.count else "device"
        raise InvalidArgumentError(
            f"cast: dst and src differ in {field} ({getattr(d, field)} vs {getattr(s, field)})")
    _call("cast", d.device, _stream_of(dst, d) if d.is_cuda else None,
          d.ptr, d.dtype, s.ptr, s.dtype, d.count, float(scale))


# ---- int8 with a scale per chunk (the int8 gradient compressor) -------------------------------

INT8_DTYPES = ("float32", "float64")


def int8_row_bytes(part: int, chunk: int) -> int:
    """Bytes of one int8 payload row: `part` int8 values, then a float32 scale per `chunk` of them."""
    return _C.int8_row_bytes(part, chunk)


def _int8_check(what: str, payload, rows: int, part: int, chunk: int, **floats) -> tuple:
    """The payload's and the float arrays' BufferInfos, once they are CPU arrays of one compute
    dtype and the payload holds `rows` rows."""
    if part < 1 or chunk < 1:
        raise InvalidArgumentError(f"{what}: part ({part}) and chunk ({chunk}) must be >= 1")
    p = describe(payload)
    infos = {name: describe(array) for name, array in floats.items()}
    dtypes = {info.dtype for info in infos.values()}
    if len(dtypes) != 1 or not dtypes <= set(INT8_DTYPES):
        raise UnsupportedDtypeError(f"{what}: {', '.join(infos)} must share one dtype of {', '.join(INT8_DTYPES)}; "
                                    f"got {', '.join(info.dtype for info in infos.values())}")
    for name, info in [("payload", p), *infos.items()]:
        if info.device != "cpu":
            raise InvalidArgumentError(f"{what}: {name} is on {info.device}; the int8 kernels run on the CPU")
    if p.nbytes != rows * int8_row_bytes(part, chunk):
        raise InvalidArgumentError(f"{what}: the payload holds {p.nbytes} bytes, not {rows} rows of "
                                   f"{int8_row_bytes(part, chunk)}")
    return p, infos


def int8_quantize(grad, residual, payload, rows: int, part: int, chunk: int) -> None:
    """Quantizes grad + residual into `payload` (`rows` rows of int8_row_bytes(part, chunk) bytes:
    row r holds elements r * part to (r + 1) * part) and leaves in `residual` what was not sent
    (csrc/quantize.h). grad and residual: CPU float32 or float64, one dtype and length."""
    p, infos = _int8_check("int8_quantize", payload, rows, part, chunk, grad=grad, residual=residual)
    g, r = infos["grad"], infos["residual"]
    if g.count != r.count or rows * part < g.count:
        raise InvalidArgumentError(f"int8_quantize: grad ({g.count}) and residual ({r.count}) must have one length, "
                                   f"at most rows x part ({rows * part})")
    _call("int8_quantize", "cpu", None, g.dtype, g.ptr, r.ptr, g.count, rows, part, chunk, p.ptr)


def int8_sum_requantize(received, rows: int, part: int, chunk: int, residual, out) -> None:
    """One part's sum: the `rows` received payload rows' values, summed in row order, quantized
    into `out` (one row); `residual` (at most `part` elements) gains the sum minus what `out` holds."""
    _int8_check("int8_sum_requantize", out, 1, part, chunk, residual=residual)
    p, infos = _int8_check("int8_sum_requantize", received, rows, part, chunk, residual=residual)
    r = infos["residual"]
    if r.count > part:
        raise InvalidArgumentError(f"int8_sum_requantize: the residual ({r.count}) is longer than a part ({part})")
    _call("int8_sum_requantize", "cpu", None, r.dtype, p.ptr, rows, part, chunk, r.ptr, r.count, describe(out).ptr)


def int8_dequantize(payload, rows: int, part: int, chunk: int, flat) -> None:
    """flat = the payload rows' values times their scales (element r * part + j from row r)."""
    p, infos = _int8_check("int8_dequantize", payload, rows, part, chunk, flat=flat)
    f = infos["flat"]
    if rows * part < f.count:
        raise InvalidArgumentError(f"int8_dequantize: flat ({f.count}) is longer than rows x part ({rows * part})")
    _call("int8_dequantize", "cpu", None, f.dtype, p.ptr, rows, part, chunk, f.ptr, f.count)


# ---- threads ----------------------------------------------------------------------------------

def set_num_threads(n: int) -> None:
    """Threads the CPU kernels use once a call touches 65,536 elements or more over all the
    arrays it reads and writes (a reduce of 21,846 elements, a cast of 32,768), and for copies of
    1 MiB or more (pack, unpack)."""
    if int(n) < 1:
        raise InvalidArgumentError(f"number of threads must be >= 1, got {n}")
    _C.set_num_threads(int(n))


def get_num_threads() -> int:
    """Threads the CPU kernels use: set_num_threads, else OMP_NUM_THREADS, else cores / local ranks."""
    return _C.get_num_threads()


# ---- instruction sets -------------------------------------------------------------------------

def cpu_isa() -> str:
    """Instruction set the CPU loops run ("avx512", "avx2" or "baseline")."""
    return _C.cpu_isa()


def cpu_isas() -> list:
    """Instruction sets this CPU can run the loops with, widest first (the first is the default)."""
    return list(_C.cpu_isas())


def set_cpu_isa(name: str) -> None:
    """Run the CPU loops compiled for `name` (one of cpu_isas()) in this process from now on: to
    measure or test a narrower instruction set on a machine that has a wider one."""
    try:
        _C.set_cpu_isa(name)
    except ValueError as error:
        raise InvalidArgumentError(str(error)) from None


# ---- helpers of the collectives ---------------------------------------------------------------

def cast_ptr(dst_ptr: int, dst_dtype: str, src_ptr: int, src_dtype: str, count: int, scale: float = 1.0,
             device: str = "cpu", stream=None) -> None:
    """dst = src * scale converted between float32, float16 and bfloat16 at raw addresses."""
    _call("cast", device, stream, dst_ptr, dst_dtype, src_ptr, src_dtype, count, float(scale))


def copy_ptr(dst_ptr: int, src_ptr: int, nbytes: int, device: str = "cpu", stream=None) -> None:
    """Copy `nbytes` bytes (the pack kernel with a single range)."""
    _call("pack", device, stream, dst_ptr, [src_ptr], [nbytes])


def synchronize(device: str, stream=None) -> None:
    """Wait for the kernels queued on `stream` of a CUDA device (MPI reads the memory next,
    outside any stream). The default is the stream the pointer-level kernels run on when given
    none: the legacy default stream. A no-op for the CPU."""
    if _is_cuda(device):
        _call("synchronize", device, stream)
