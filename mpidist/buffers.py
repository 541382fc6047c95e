"""One adapter per array kind: NumPy, torch (CPU and CUDA) and CuPy.

An adapter turns an array into a BufferInfo (pointer, element count, dtype name, device), so the
collectives and kernels never look at the array library again. It also allocates scratch memory of
the same kind, and HostStaging keeps reusable pinned host buffers for MPI libraries that cannot
read GPU memory.
"""
from __future__ import annotations

import sys
import typing

import numpy as np

from .errors import InvalidArgumentError, NonContiguousError, UnsupportedBufferError, UnsupportedDtypeError

# DTYPES: the element types an array may have to be communicated and reduced, from the dtype
# table of runtime/wire.py.
from .runtime.wire import COLLECTIVE_DTYPES as DTYPES
from .runtime.wire import ITEMSIZE

# torch and cupy are imported where a buffer of theirs is handled: both are optional here (NumPy
# buffers need neither), and importing them takes seconds.


class BufferInfo(typing.NamedTuple):
    """What the communication layer needs to know about one contiguous array.

    A NamedTuple: made on every collective call, and a tuple is the cheapest immutable record.
    """

    ptr: int
    count: int
    dtype: str
    device: str  # "cpu" or "cuda:N"
    kind: str  # "numpy", "torch" or "cupy"

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def device_index(self) -> int:
        return int(self.device.split(":")[1]) if self.is_cuda else -1


def _check_dtype(name: str, kind: str) -> str:
    if name not in DTYPES:
        raise UnsupportedDtypeError(
            f"mpidist does not support {kind} arrays of dtype {name}; supported: {', '.join(DTYPES)}")
    return name


# dtype -> name, filled on first sight: dtype.name costs a microsecond on every call.
_NUMPY_NAMES = {}
_TORCH_NAMES = {}


class NumpyAdapter:
    kind = "numpy"

    @staticmethod
    def matches(obj) -> bool:
        return isinstance(obj, np.ndarray)

    @staticmethod
    def describe(arr) -> BufferInfo:
        # ml_dtypes' bfloat16 registers itself with NumPy under the name "bfloat16".
        dtype = _NUMPY_NAMES.get(arr.dtype)
        if dtype is None:
            # Refused here, so never cached: the kernels and MPI read native byte order only, and
            # a swapped array would be reduced as garbage without a word.
            if not arr.dtype.isnative:
                order = "big-endian" if arr.dtype.byteorder == ">" else "little-endian"
                raise UnsupportedDtypeError(
                    f"NumPy array of dtype {arr.dtype.str!r} is {order}, not this machine's native "
                    f"byte order; pass a.astype(a.dtype.newbyteorder('='))")
            dtype = _NUMPY_NAMES.setdefault(arr.dtype, _check_dtype(arr.dtype.name, "NumPy"))
        if not arr.flags.c_contiguous:
            raise NonContiguousError(
                f"NumPy array of shape {arr.shape} with strides {arr.strides} is not C-contiguous; "
                "pass np.ascontiguousarray(a)")
        return BufferInfo(arr.ctypes.data, arr.size, dtype, "cpu", "numpy")

    @staticmethod
    def empty(nbytes: int, device: str):
        return np.empty(nbytes, dtype=np.uint8)


class TorchAdapter:
    kind = "torch"

    @staticmethod
    def matches(obj) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(obj, torch.Tensor)

    @staticmethod
    def describe(tensor) -> BufferInfo:
        dtype = _TORCH_NAMES.get(tensor.dtype)
        if dtype is None:
            dtype = _TORCH_NAMES.setdefault(tensor.dtype,
                                            _check_dtype(str(tensor.dtype).replace("torch.", ""), "torch"))
        if not tensor.is_contiguous():
            if tensor.layout != sys.modules["torch"].strided:  # sparse: no flat buffer at all
                raise UnsupportedBufferError(
                    f"{tensor.layout} torch tensors are not supported (sparse tensors have no single "
                    "contiguous buffer to communicate); pass tensor.to_dense()")
            raise NonContiguousError(
                f"torch tensor of shape {tuple(tensor.shape)} with strides {tensor.stride()} is not "
                "contiguous; pass tensor.contiguous()")
        # is_cpu / is_cuda are plain flags; tensor.device builds an object on every call.
        if tensor.is_cpu:
            device = "cpu"
        elif tensor.is_cuda:
            device = f"cuda:{tensor.get_device()}"
        else:
            raise UnsupportedBufferError(f"torch tensors on device {tensor.device} are not supported")
        return BufferInfo(tensor.data_ptr(), tensor.numel(), dtype, device, "torch")

    @staticmethod
    def empty(nbytes: int, device: str):
        import torch
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


class CupyAdapter:
    kind = "cupy"

    @staticmethod
    def matches(obj) -> bool:
        cupy = sys.modules.get("cupy")
        return cupy is not None and isinstance(obj, cupy.ndarray)

    @staticmethod
    def describe(arr) -> BufferInfo:
        dtype = _check_dtype(arr.dtype.name, "CuPy")
        if not arr.flags.c_contiguous:
            raise NonContiguousError(f"CuPy array of shape {arr.shape} is not C-contiguous; "
                                     "pass cupy.ascontiguousarray(a)")
        return BufferInfo(arr.data.ptr, arr.size, dtype, f"cuda:{arr.device.id}", "cupy")

    @staticmethod
    def empty(nbytes: int, device: str):
        import cupy
        with cupy.cuda.Device(int(device.split(":")[1])):
            return cupy.empty(nbytes, dtype=cupy.uint8)


ADAPTERS = (NumpyAdapter, TorchAdapter, CupyAdapter)


def adapter_for(obj):
    for adapter in ADAPTERS:
        if adapter.matches(obj):
            return adapter
    raise UnsupportedBufferError(
        f"mpidist cannot communicate an object of type {type(obj).__module__}.{type(obj).__qualname__}; "
        "pass a numpy.ndarray, torch.Tensor or cupy.ndarray")


def describe(obj) -> BufferInfo:
    """Pointer, count, dtype and device of a supported contiguous array."""
    return adapter_for(obj).describe(obj)


def check_writable(obj, what: str) -> None:
    """Refuse a read-only NumPy array (flags.writeable False, e.g. np.frombuffer of a bytes
    object) that a collective is about to write into: MPI and the kernels write through the raw
    pointer, which would change memory NumPy (or Python, for bytes) promised would not change.
    `what` says which argument and why it is written."""
    if isinstance(obj, np.ndarray) and not obj.flags.writeable:
        raise InvalidArgumentError(
            f"{what}, but it is a read-only NumPy array (flags.writeable is False); pass a writable "
            "copy (a.copy())")


def new_array(like, shape):
    """An uninitialized array of the same kind, dtype and device as `like`, of `shape`."""
    if NumpyAdapter.matches(like):
        return np.empty(shape, dtype=like.dtype)
    if TorchAdapter.matches(like):
        import torch
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    import cupy
    with cupy.cuda.Device(like.device.id):
        return cupy.empty(shape, dtype=like.dtype)


def empty_like_bytes(info: BufferInfo, nbytes: int):
    """Scratch memory of `nbytes` bytes of the same kind and on the same device as `info`."""
    return {"numpy": NumpyAdapter, "torch": TorchAdapter, "cupy": CupyAdapter}[info.kind].empty(nbytes, info.device)


class ScratchPool:
    """Reusable scratch buffers per (device, slot): grown when too small, never freed per call."""

    def __init__(self):
        self._buffers = {}

    def get(self, like: BufferInfo, nbytes: int, slot: int = 0) -> BufferInfo:
        key = (like.device, like.kind if like.is_cuda else "cpu", slot)
        held = self._buffers.get(key)
        if held is None or held[1] < nbytes:
            # Round up so that slowly growing messages do not reallocate every call.
            size = max(nbytes, 64, int((held[1] if held else 0) * 1.5))
            array = empty_like_bytes(like if like.is_cuda else BufferInfo(0, 0, "uint8", "cpu", "numpy"), size)
            held = (array, size)
            self._buffers[key] = held
        base = describe(held[0])
        return BufferInfo(base.ptr, nbytes // like.itemsize, like.dtype, like.device, base.kind)


class HostStaging:
    """Pinned host buffers that stand in for GPU buffers when MPI is not CUDA-aware.

    One buffer per slot, grown as needed and then reused, so a staged collective allocates
    nothing in the steady state.
    """

    def __init__(self):
        self._pinned = {}

    def host_buffer(self, nbytes: int, slot: int = 0):
        held = self._pinned.get(slot)
        if held is None or held.numel() < nbytes:
            import torch
            size = max(nbytes, int(held.numel() * 1.5) if held is not None else 0)
            pin = torch.cuda.is_available()
            held = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            self._pinned[slot] = held
        return held[:nbytes]

    def stage_in(self, array, info: BufferInfo, slot: int = 0):
        """Copy a GPU array into a pinned host buffer; returns that host buffer as a BufferInfo."""
        host = self.host_buffer(info.nbytes, slot)
        copy_device_to_host(host.data_ptr(), array, info)
        return BufferInfo(host.data_ptr(), info.count, info.dtype, "cpu", "torch")

    def stage_out(self, array, info: BufferInfo, host: BufferInfo):
        copy_host_to_device(array, info, host.ptr)


def synchronize(array, info: BufferInfo) -> None:
    """Wait until the work queued on the array's current CUDA stream has finished: MPI reads and
    writes GPU memory outside any stream."""
    if info.kind == "cupy":
        import cupy
        with cupy.cuda.Device(info.device_index):
            cupy.cuda.get_current_stream().synchronize()
    else:
        import torch
        torch.cuda.current_stream(info.device_index).synchronize()


def copy_device_to_host(host_ptr: int, array, info: BufferInfo) -> None:
    if info.kind == "cupy":
        import cupy
        cupy.cuda.runtime.memcpy(host_ptr, info.ptr, info.nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
    else:
        import torch
        flat = array.reshape(-1).view(torch.uint8)
        host = torch.frombuffer(_host_memory(host_ptr, info.nbytes), dtype=torch.uint8)
        host.copy_(flat)


def copy_host_to_device(array, info: BufferInfo, host_ptr: int) -> None:
    if info.kind == "cupy":
        import cupy
        cupy.cuda.runtime.memcpy(info.ptr, host_ptr, info.nbytes, cupy.cuda.runtime.memcpyHostToDevice)
    else:
        import torch
        host = torch.frombuffer(_host_memory(host_ptr, info.nbytes), dtype=torch.uint8)
        array.reshape(-1).view(torch.uint8).copy_(host)


def mpi_spec(info: BufferInfo, offset: int = 0, count: int | None = None):
    """The [memory, MPI.BYTE] message of elements [offset, offset + count) of a described buffer:
    MPI moves bytes, mpidist's kernels do the arithmetic."""
    from mpi4py import MPI  # here, not at import: this floor must not initialize MPI
    if count is None:
        count = info.count - offset
    if count == 0:
        return [None, 0, MPI.BYTE]
    itemsize = ITEMSIZE[info.dtype]
    return [MPI.buffer.fromaddress(info.ptr + offset * itemsize, count * itemsize), MPI.BYTE]


def _host_memory(ptr: int, nbytes: int):
    from mpi4py import MPI  # here, not at import: this floor must not initialize MPI
    return MPI.buffer.fromaddress(ptr, nbytes)


def as_numpy(info: BufferInfo) -> np.ndarray:
    """A NumPy view of host memory described by `info` (bfloat16 viewed as uint16)."""
    if info.is_cuda:
        raise UnsupportedBufferError("as_numpy needs host memory, got a CUDA buffer")
    dtype = np.uint16 if info.dtype == "bfloat16" else np.dtype(info.dtype)
    if info.count == 0:
        return np.empty(0, dtype=dtype)
    return np.frombuffer(_host_memory(info.ptr, info.nbytes), dtype=dtype)
