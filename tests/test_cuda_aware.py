"""Whether the MPI library reads GPU memory (mpidist/runtime/cuda_aware.py): each library's answer,
from stub shared libraries that export the query functions as the real ones do, and the variables
that turn GPU support on or off; the probe's decision and its child's environment."""
import ctypes
import json
import os
import subprocess
import sys
import warnings

import pytest

from mpidist.errors import MPIUnavailableError
from mpidist.runtime import cuda_aware
from mpidist.runtime.cuda_aware import CudaSupport, detect, verdict

OPEN_MPI = "Open MPI v4.1.4, package: Open MPI root@host Distribution, ident: 4.1.4"
MPICH = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 12:29:21 CST 2024"
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.28.29 (ANL base 3.4a2)"
MVAPICH2 = "MVAPICH2 Version      :\t2.3.7"
MVAPICH2_GDR = "MVAPICH2-GDR Version      :\t2.3.7"
INTEL = "Intel(R) MPI Library 2021.12 for Linux* OS"

# The query functions as Open MPI (mpiext_cuda.c) and MPICH (mpi_proto.h) declare them.
STUBS = {
    "openmpi_yes": "int MPIX_Query_cuda_support(void) { return 1; }",
    "openmpi_no": "int MPIX_Query_cuda_support(void) { return 0; }",
    # Open MPI 4 built with CUDA, whose libopen-pal turned the support off (no libcuda.so.1)
    "openmpi_off": "int MPIX_Query_cuda_support(void) { return 1; }\n_Bool opal_cuda_support = 0;",
    "openmpi_on": "int MPIX_Query_cuda_support(void) { return 1; }\n_Bool opal_cuda_support = 1;",
    "mpich_yes": "int MPIX_GPU_query_support(int type, int *ok) { *ok = type == 0; return 0; }",
    "mpich_no": "int MPIX_GPU_query_support(int type, int *ok) { *ok = 0; return 0; }",
    "old_mpich": "int MPI_Init(int *argc, char ***argv) { return 0; }",
}


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    """stub(name): a ctypes handle on the shared library built from STUBS[name]."""
    folder = tmp_path_factory.mktemp("stubs")
    built = {}

    def load(name):
        if name not in built:
            source, library = folder / f"{name}.c", folder / f"lib{name}.so"
            source.write_text(STUBS[name] + "\n")
            subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
            built[name] = ctypes.CDLL(str(library))
        return built[name]
    return load


@pytest.fixture
def ucx(tmp_path):
    """A UCX installation with its CUDA transport module: the path of its libucp."""
    (tmp_path / "ucx").mkdir()
    (tmp_path / "ucx" / "libuct_cuda.so.0").write_bytes(b"")
    (tmp_path / "libucp.so.0").write_bytes(b"")
    return str(tmp_path / "libucp.so.0")


def test_open_mpi_answers_with_mpix_query_cuda_support(stub):
    assert detect(OPEN_MPI, [stub("openmpi_yes")], [], {}) == CudaSupport(
        True, "Open MPI's MPIX_Query_cuda_support() = 1")
    found = detect(OPEN_MPI, [stub("openmpi_no")], [], {})
    assert not found.aware and "MPIX_Query_cuda_support() = 0" in found.how and not found.turned_off


def test_open_mpi_4_says_whether_its_cuda_support_is_on_in_this_run(stub):
    assert detect(OPEN_MPI, [stub("openmpi_on")], [], {}).aware
    found = detect(OPEN_MPI, [stub("openmpi_off")], [], {})
    assert not found.aware and "opal_cuda_support = 0" in found.how and "libcuda.so.1" in found.turned_off


def test_open_mpi_built_with_cuda_but_turned_off(stub):
    found = detect(OPEN_MPI, [stub("openmpi_yes")], [], {"OMPI_MCA_opal_cuda_support": "0"})
    assert not found.aware
    assert "OMPI_MCA_opal_cuda_support=0" in found.how and "OMPI_MCA_opal_cuda_support" in found.turned_off
    found = detect(OPEN_MPI, [stub("openmpi_no")], [], {"OMPI_MCA_accelerator": "null"})
    assert not found.aware and "OMPI_MCA_accelerator" in found.turned_off


def test_open_mpi_over_ucx_with_cuda_transports(stub, ucx):
    found = detect(OPEN_MPI, [stub("openmpi_no")], ["/lib/libc.so.6", ucx], {})
    assert found.aware and "UCX" in found.how and "libuct_cuda" in found.how
    for tls in ("tcp,sm,self", "^cuda_copy"):
        found = detect(OPEN_MPI, [stub("openmpi_no")], [ucx], {"UCX_TLS": tls})
        assert not found.aware and "cuda_copy" in found.turned_off, tls
    for tls in ("rc,cuda_copy,cuda_ipc", "^cuda_ipc", "all", ""):
        assert detect(OPEN_MPI, [stub("openmpi_no")], [ucx], {"UCX_TLS": tls}).aware, tls


def test_open_mpi_with_ucx_without_cuda_transports(stub, ucx):
    os.remove(os.path.join(os.path.dirname(ucx), "ucx", "libuct_cuda.so.0"))
    assert not detect(OPEN_MPI, [stub("openmpi_no")], [ucx], {}).aware


def test_mpich_answers_with_mpix_gpu_query_support(stub):
    assert detect(MPICH, [stub("mpich_yes")], [], {}) == CudaSupport(True, "MPICH's MPIX_GPU_query_support(CUDA) = 1")
    assert not detect(MPICH, [stub("mpich_no")], [], {}).aware
    found = detect(MPICH, [stub("mpich_no")], [], {"MPIR_CVAR_ENABLE_GPU": "0"})
    assert not found.aware and "MPIR_CVAR_ENABLE_GPU" in found.turned_off
    found = detect(MPICH, [stub("old_mpich")], [], {})
    assert not found.aware and "without MPIX_GPU_query_support" in found.how


def test_cray_mpich_needs_mpich_gpu_support_enabled(stub):
    assert detect(CRAY, [stub("old_mpich")], [], {"MPICH_GPU_SUPPORT_ENABLED": "1"}).aware
    gtl = "/opt/cray/pe/lib64/libmpi_gtl_cuda.so.0"
    found = detect(CRAY, [stub("old_mpich")], [gtl], {})
    assert not found.aware and found.turned_off == "set MPICH_GPU_SUPPORT_ENABLED=1" and gtl in found.how
    found = detect(CRAY, [stub("old_mpich")], [], {"MPICH_GPU_SUPPORT_ENABLED": "0"})
    assert not found.aware and not found.turned_off


def test_mvapich2_needs_mv2_use_cuda(stub):
    assert detect(MVAPICH2_GDR, [stub("old_mpich")], [], {"MV2_USE_CUDA": "1"}).aware
    found = detect(MVAPICH2_GDR, [stub("old_mpich")], [], {})
    assert not found.aware and found.turned_off == "set MV2_USE_CUDA=1"
    found = detect(MVAPICH2, [stub("old_mpich")], [], {"MV2_USE_CUDA": "0"})
    assert not found.aware and not found.turned_off


def test_intel_mpi_needs_i_mpi_offload(stub):
    assert detect(INTEL, [stub("old_mpich")], [], {"I_MPI_OFFLOAD": "1"}).aware
    assert not detect(INTEL, [stub("old_mpich")], [], {"I_MPI_OFFLOAD": "0"}).aware
    assert not detect(INTEL, [stub("old_mpich")], [], {}).aware


def test_an_unknown_library_is_not_cuda_aware(stub):
    found = detect("Some MPI 1.0", [stub("openmpi_yes")], [], {})
    assert not found.aware and "Some MPI 1.0" in found.how and "MPIDIST_CUDA_AWARE=1" in found.how


def test_mpidist_cuda_aware_overrides_detection(monkeypatch):
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "yes")
    assert cuda_aware.library_support() == CudaSupport(True, "MPIDIST_CUDA_AWARE=yes")
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "0")
    assert cuda_aware.library_support() == CudaSupport(False, "MPIDIST_CUDA_AWARE=0")


# ---- the probe -----------------------------------------------------------------------------

def test_verdict_of_the_probe():
    assert verdict(0, "intact\n", "") is None
    crashed = verdict(-11, "", "")
    assert "crashed (SIGSEGV)" in crashed and "MPIDIST_CUDA_AWARE=0" in crashed
    wrong = verdict(0, "wrong: byte 3 is 0, sent 3\n", "")
    assert "delivered wrong data (wrong: byte 3 is 0, sent 3)" in wrong and "MPIDIST_CUDA_AWARE=0" in wrong
    failed = verdict(1, "", "Traceback (most recent call last):\nRuntimeError: cuMemcpy failed")
    assert "exit status 1: RuntimeError: cuMemcpy failed" in failed
    assert "hung" in verdict(None, "", "")
    assert verdict(0, "", "") is not None  # the child must say "intact"


def test_verdict_of_a_child_that_really_crashes():
    # What a library that dereferences a device pointer in host code does: the child dies of SIGSEGV.
    child = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.string_at(0)"], capture_output=True, text=True)
    assert "crashed (SIGSEGV)" in verdict(child.returncode, child.stdout, child.stderr)


def test_the_probe_s_child_starts_mpi_on_its_own():
    environ = {"PATH": "/usr/bin", "OPAL_PREFIX": "/opt/ompi", "PMIX_RANK": "1", "PMI_FD": "5",
               "OMPI_COMM_WORLD_RANK": "1", "OMPI_MCA_ess_base_vpid": "1", "OMPI_MCA_orte_hnp_uri": "x",
               "OMPI_MCA_opal_cuda_support": "1", "OMPI_MCA_btl": "self,vader", "OMPI_ALLOW_RUN_AS_ROOT": "1"}
    assert cuda_aware.probe_environment(environ) == {
        "PATH": "/usr/bin", "OPAL_PREFIX": "/opt/ompi", "OMPI_MCA_opal_cuda_support": "1",
        "OMPI_MCA_btl": "self,vader", "OMPI_ALLOW_RUN_AS_ROOT": "1"}


def test_the_probe_reports_a_child_that_cannot_use_the_gpu():
    # No GPU here: the real child fails to make its device buffer, and says how.
    message = cuda_aware.probe(0)
    assert message is not None and "failed (exit status 1" in message and "MPIDIST_CUDA_AWARE=0" in message


def test_a_failed_probe_stops_the_cuda_aware_route(monkeypatch):
    monkeypatch.delenv("MPIDIST_CUDA_AWARE", raising=False)
    monkeypatch.setattr(cuda_aware, "library_support", lambda: CudaSupport(True, "Open MPI's answer"))
    monkeypatch.setattr(cuda_aware, "_probe_once", lambda device: "the send crashed (SIGSEGV); set MPIDIST_CUDA_AWARE=0")
    with pytest.raises(MPIUnavailableError, match=r"crashed \(SIGSEGV\).*MPIDIST_CUDA_AWARE=0.*Open MPI's answer"):
        cuda_aware.mpi_library_cuda_aware()
    monkeypatch.setattr(cuda_aware, "_probe_once", lambda device: None)
    assert cuda_aware.mpi_library_cuda_aware() is True


def test_the_override_skips_the_probe_and_a_turned_off_library_warns(monkeypatch):
    def no_probe(device):
        raise AssertionError("probed")
    monkeypatch.setattr(cuda_aware, "_probe_once", no_probe)
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "1")
    assert cuda_aware.mpi_library_cuda_aware() is True
    monkeypatch.setattr(cuda_aware, "library_support", lambda: CudaSupport(
        False, "MVAPICH2-GDR, but MV2_USE_CUDA is unset", "set MV2_USE_CUDA=1"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cuda_aware.mpi_library_cuda_aware() is False
    assert any("set MV2_USE_CUDA=1" in str(warning.message) for warning in caught)


def test_mpidist_info_says_how_it_knows():
    result = subprocess.run([sys.executable, "-m", "mpidist.cli", "info", "--json"], capture_output=True, text=True,
                            env={**os.environ, "MPIDIST_CUDA_AWARE": "", "OMPI_MCA_opal_cuda_support": ""})
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    # Open MPI from PyPI is built without CUDA.
    assert facts["cuda_aware_mpi"] is False
    assert facts["cuda_aware_mpi_how"].startswith("Open MPI's MPIX_Query_cuda_support() = 0"), facts
