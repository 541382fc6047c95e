"""runtime/nccl_library.py on the CPU: which library MPIDIST_NCCL_LIBRARY loads, the refusals of a
missing file, of a library that is not NCCL and of NCCL older than 2.30 (on every rank), and the
binding's calls, against fake libnccl builds compiled here with gcc (each exports what its test
names; the real NCCL is checked by `make gpu-check`)."""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest

import mpidist as md
from mpidist.buffers import BufferInfo
from mpidist.collectives import nccl
from mpidist.collectives.callcheck import resolve_algorithm
from mpidist.runtime import nccl_library

pytestmark = pytest.mark.mpi_shared_launch

CUDA_BUFFER = BufferInfo(0, 1 << 20, "float32", "cuda:0", "torch")

# A fake NCCL: ncclGetVersion answers VERSION; the id is bytes 0..127; init fails with error 3,
# named by ncclGetErrorString; the all-reduce of float32 sums (ncclSum = 0, ncclFloat32 = 7)
# doubles on the host, as two ranks of equal values would, and refuses anything else.
FAKE_SOURCE = r"""
#include <stddef.h>
int ncclGetVersion(int* version) { *version = VERSION; return 0; }
#ifndef NOT_WHOLE
int ncclGetUniqueId(char* id) { for (int i = 0; i < 128; i++) id[i] = (char)i; return 0; }
typedef struct { char internal[128]; } ncclUniqueId;
int ncclCommInitRank(void** comm, int nranks, ncclUniqueId id, int rank) {
  return (nranks == 2 && rank == 1 && id.internal[127] == 127) ? 3 : 5;
}
int ncclAllReduce(const void* send, void* recv, size_t count, int dtype, int op, void* comm, void* stream) {
  if (dtype != 7 || op != 0 || stream != NULL) return 4;
  for (size_t i = 0; i < count; i++) ((float*)recv)[i] = 2 * ((const float*)send)[i];
  return 0;
}
int ncclCommDestroy(void* comm) { return 0; }
const char* ncclGetErrorString(int result) { return result == 3 ? "internal error" : "other"; }
#endif
"""


def fake_nccl(folder, version: int, whole: bool = True, symbol: str = "ncclGetVersion") -> str:
    """Compile a fake libnccl.so.2 into `folder` (NOT_WHOLE: ncclGetVersion only; `symbol`
    renames ncclGetVersion, for a library that is not NCCL)."""
    if shutil.which("gcc") is None:
        pytest.fail("these tests compile fake NCCL libraries with gcc, which is missing")
    source, library = folder / "fake_nccl.c", folder / f"libnccl-{version}-{whole}-{symbol}.so.2"
    source.write_text(FAKE_SOURCE.replace("ncclGetVersion", symbol))
    subprocess.run(["gcc", "-shared", "-fPIC", f"-DVERSION={version}", *([] if whole else ["-DNOT_WHOLE"]),
                    "-o", str(library), str(source)], check=True, capture_output=True)
    return str(library)


@pytest.fixture
def use(monkeypatch):
    def use(path):
        monkeypatch.setenv("MPIDIST_NCCL_LIBRARY", str(path))
    return use


def test_the_variable_chooses_the_library(tmp_path, use):
    path = fake_nccl(tmp_path, 23007)
    use(path)
    library = nccl_library.load()
    assert (library.path, library.version) == (path, 23007)
    assert nccl_library.describe() == f"2.30.7 ({path})"
    assert nccl.version() == 23007 and nccl_library.problem() is None


@pytest.mark.parametrize("version", [22905, 21800])
def test_an_older_nccl_is_refused(tmp_path, use, version):
    path = fake_nccl(tmp_path, version)
    use(path)
    shown = f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    with pytest.raises(md.InvalidArgumentError, match=rf"{path} is NCCL {shown}; mpidist needs NCCL 2\.30\.0 or newer "
                                                      r"\(chosen by MPIDIST_NCCL_LIBRARY\)"):
        nccl_library.load()


def test_a_missing_file_is_refused(tmp_path, use):
    use(tmp_path / "nowhere" / "libnccl.so.2")
    assert nccl_library.problem() == (f"the NCCL library {tmp_path}/nowhere/libnccl.so.2 does not exist "
                                      "(chosen by MPIDIST_NCCL_LIBRARY)")
    assert nccl_library.describe().startswith("none: the NCCL library")


def test_a_file_that_is_no_library_is_refused(tmp_path, use):
    text = tmp_path / "libnccl.so.2"
    text.write_text("not a shared library\n")
    use(text)
    with pytest.raises(md.InvalidArgumentError, match=rf"the NCCL library {text} cannot be loaded \("):
        nccl_library.load()


def test_a_library_that_is_not_nccl_is_refused(tmp_path, use):
    path = fake_nccl(tmp_path, 23007, symbol="cudaGetVersion")
    use(path)
    with pytest.raises(md.InvalidArgumentError, match=f"{path} is not NCCL: it has no ncclGetVersion"):
        nccl_library.load()


def test_a_library_lacking_the_calls_is_refused(tmp_path, use):
    path = fake_nccl(tmp_path, 23007, whole=False)
    use(path)
    with pytest.raises(md.InvalidArgumentError, match=r"\(NCCL 2\.30\.7\) lacks ncclGetUniqueId, ncclCommInitRank, "
                                                      "ncclAllReduce, ncclCommDestroy, ncclGetErrorString"):
        nccl_library.load()


def test_algorithm_nccl_refuses_with_the_reason(tmp_path, use):
    use(fake_nccl(tmp_path, 22905))
    channel = type("Channel", (), {"num_nodes": 1, "size": 2, "forced_algorithm": None, "tuning_table": None})
    with pytest.raises(md.InvalidArgumentError, match=r"algorithm='nccl' needs NCCL: .* is NCCL 2\.29\.5"):
        resolve_algorithm("nccl", CUDA_BUFFER, channel)


def test_the_binding_passes_ids_and_arguments(tmp_path, use):
    """The id comes back as the library wrote it, init's error is raised with NCCL's words, and the
    all-reduce gets its pointers, count, dtype and op (the fake doubles float32 sums)."""
    use(fake_nccl(tmp_path, 23100))
    library = nccl_library.load()
    unique_id = library.get_unique_id()
    assert unique_id == bytes(range(128))
    assert nccl.decode_unique_id(nccl.encode_unique_id(unique_id)) == unique_id
    with pytest.raises(RuntimeError, match=r"ncclCommInitRank failed: NCCL error 3 \(internal error\)"):
        library.NcclCommunicator(2, unique_id, 1)
    comm = nccl_library.NcclCommunicator.__new__(nccl_library.NcclCommunicator)
    comm.library, comm.comm = library, ctypes.c_void_p(1)
    send, recv = np.arange(5, dtype=np.float32), np.zeros(5, dtype=np.float32)
    comm.allReduce(send.ctypes.data, recv.ctypes.data, 5, nccl_library.NCCL_FLOAT32, nccl_library.NCCL_SUM, 0)
    assert (recv == 2 * send).all()
    with pytest.raises(RuntimeError, match=r"ncclAllReduce failed: NCCL error 4 \(other\)"):
        comm.allReduce(send.ctypes.data, recv.ctypes.data, 5, nccl_library.NCCL_FLOAT16, nccl_library.NCCL_SUM, 0)


@pytest.mark.mpi(ranks=[2, 3])
def test_a_communicator_refused_is_an_error_on_every_rank(mpi_ranks, own_comm, tmp_path, use):
    """The bootstrap over MPI with the fake NCCL: rank 0's id reaches every rank, whose
    communicator cannot be made here (no GPU, no CuPy, or the fake's refusal): every rank raises,
    naming every rank, and the communicator works on."""
    use(fake_nccl(tmp_path, 23007))
    with pytest.raises(Exception, match=rf"making the NCCL communicator for the test failed: ranks "
                                        rf"{', '.join(map(str, range(mpi_ranks)))}"):
        nccl.communicator_over(own_comm.mpi, 0, "the test")
    assert (own_comm.allreduce(np.ones(8)) == mpi_ranks).all()
