"""The buffer adapters: pointer, count, dtype and device of every supported array kind."""
import numpy as np
import pytest
import torch

from mpidist import buffers
from mpidist.errors import MpidistError, NonContiguousError, UnsupportedBufferError, UnsupportedDtypeError

NUMPY_DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8", "int8"]
TORCH_DTYPES = NUMPY_DTYPES + ["bfloat16"]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_adapter(dtype):
    array = np.arange(7, dtype=dtype)
    info = buffers.describe(array)
    assert (info.ptr, info.count, info.dtype, info.device, info.kind) == (
        array.ctypes.data, 7, dtype, "cpu", "numpy")
    assert info.nbytes == array.nbytes and info.itemsize == array.itemsize
    assert not info.is_cuda


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_cpu_adapter(dtype):
    tensor = torch.arange(12).to(getattr(torch, dtype)).reshape(3, 4)
    info = buffers.describe(tensor)
    assert (info.ptr, info.count, info.dtype, info.device, info.kind) == (
        tensor.data_ptr(), 12, dtype, "cpu", "torch")
    assert info.nbytes == tensor.numel() * tensor.element_size()


def test_torch_view_with_offset_points_at_its_first_element():
    base = torch.arange(10, dtype=torch.float32)
    view = base[3:]
    assert buffers.describe(view).ptr == base.data_ptr() + 3 * 4


def test_as_numpy_reads_the_same_memory():
    tensor = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    raw = buffers.as_numpy(buffers.describe(tensor))
    assert raw.dtype == np.uint16
    assert (raw == tensor.view(torch.int16).numpy().view(np.uint16)).all()


def test_empty_and_zero_sized_arrays():
    assert buffers.describe(np.empty(0, dtype=np.float32)).count == 0
    assert buffers.describe(torch.empty(0)).count == 0


@pytest.mark.parametrize("bad", [[1.0, 2.0], (1, 2), 3.0, "text", memoryview(b"ab")])
def test_unsupported_objects_are_refused_by_name(bad):
    with pytest.raises(UnsupportedBufferError, match=type(bad).__qualname__):
        buffers.describe(bad)


@pytest.mark.parametrize("array", [np.zeros(3, dtype=np.complex64), np.zeros(3, dtype=bool),
                                   torch.zeros(3, dtype=torch.complex64), np.zeros(2, dtype=np.uint32)])
def test_unsupported_dtypes_are_refused_by_name(array):
    with pytest.raises(UnsupportedDtypeError) as excinfo:
        buffers.describe(array)
    assert str(array.dtype).replace("torch.", "") in str(excinfo.value)


def test_non_contiguous_inputs_are_refused():
    with pytest.raises(NonContiguousError, match="not C-contiguous"):
        buffers.describe(np.zeros((4, 4))[:, 1])
    with pytest.raises(NonContiguousError, match="not contiguous"):
        buffers.describe(torch.zeros(4, 4).t())


def test_errors_share_one_base_class():
    for error in (UnsupportedBufferError, UnsupportedDtypeError, NonContiguousError):
        assert issubclass(error, MpidistError)


def test_scratch_pool_reuses_memory():
    pool = buffers.ScratchPool()
    like = buffers.describe(np.zeros(4, dtype=np.float32))
    first = pool.get(like, 4000)
    second = pool.get(like, 1000)
    assert second.ptr == first.ptr and second.count == 250 and second.dtype == "float32"
    assert pool.get(like, 1000, slot=1).ptr != first.ptr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_torch_cuda_adapter_and_staging():
    tensor = torch.arange(5, dtype=torch.float32, device="cuda")
    info = buffers.describe(tensor)
    assert info.is_cuda and info.device == "cuda:0" and info.count == 5
    staging = buffers.HostStaging()
    host = staging.stage_in(tensor, info)
    assert list(buffers.as_numpy(host)) == [0, 1, 2, 3, 4]
    buffers.as_numpy(host)[:] = 7
    staging.stage_out(tensor, info, host)
    assert tensor.cpu().tolist() == [7.0] * 5
    # The pinned buffer is reused: no allocation per call.
    assert staging.stage_in(tensor, info).ptr == host.ptr
