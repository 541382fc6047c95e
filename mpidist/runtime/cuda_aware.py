"""Whether the MPI library reads GPU memory: each library's own answer, the variables that turn its
GPU support on, and a probe that a library said to read GPU memory really does.

detect() decides from what the library exports (MPIX_Query_cuda_support, MPIX_GPU_query_support),
the libraries loaded beside it (UCX's CUDA transports, Cray's GPU transfer library) and the
environment, all handed to it; library_support() hands it those of this process, after
MPIDIST_CUDA_AWARE, which overrides. probe() runs a small device-to-device send and receive in a
child process, where a library that crashes on a device pointer takes only the child down, and
verdict() turns the child's outcome into an error message or None. mpi_library_cuda_aware() is
what a Communicator asks at its first GPU buffer: detection, then the probe where detection
(not the override) says the library reads GPU memory.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import signal
import subprocess
import sys
import warnings

from ..errors import MPIUnavailableError
from . import config
from .mpi import load_mpi, loaded_libraries, loaded_mpi_libraries

# MPIX_GPU_query_support's type argument for CUDA (MPICH's mpi_proto.h: MPIX_GPU_SUPPORT_CUDA).
MPIX_GPU_SUPPORT_CUDA = 0
# The bytes the probe sends; a pattern, so a receive that copies nothing or garbage differs.
PROBE_BYTES = bytes(range(256)) * 4
WAY_OUT = "set MPIDIST_CUDA_AWARE=0 to stage GPU buffers through host memory instead"
# Variables with which a launcher (mpirun, Hydra, srun) tells a rank where its job is; the
# probe's child must start MPI on its own, so they are left out of its environment. Open MPI's
# other OMPI_MCA_* settings (a user's choice of components, opal_cuda_support) are kept.
LAUNCH_VARIABLES = ("PMIX_", "PMI_", "PRTE_", "OMPI_MCA_ess", "OMPI_MCA_orte_", "OMPI_MCA_pmix",
                    "OMPI_MCA_prte", "OMPI_MCA_num_procs", "OMPI_MCA_initial_wdir",
                    "OMPI_MCA_shmem_RUNTIME_QUERY_hint")
PROBE_TIMEOUT = 120.0  # seconds: the child imports torch and starts MPI


@dataclasses.dataclass(frozen=True)
class CudaSupport:
    aware: bool  # GPU buffers go to MPI as they are
    how: str  # how that was decided, for `mpidist info`
    turned_off: str = ""  # the library can read GPU memory, but a variable keeps it from it: what to set


def _is_on(text) -> bool:
    return (text or "").strip().lower() in config.TRUE_WORDS


def _is_off(text) -> bool:
    return (text or "").strip().lower() in config.FALSE_WORDS


def _symbol(libraries, name):
    for library in libraries:
        function = getattr(library, name, None)
        if function is not None:
            return function
    return None


def _flag(libraries, name):
    """The value of the bool variable `name` that one of `libraries` exports, or None."""
    for library in libraries:
        try:
            return bool(ctypes.c_bool.in_dll(library, name).value)
        except ValueError:  # not exported by this one
            continue
    return None


def _gpu_query(libraries):
    """MPIX_GPU_query_support(CUDA)'s answer, or None where no library exports it."""
    query = _symbol(libraries, "MPIX_GPU_query_support")
    if query is None:
        return None
    supported = ctypes.c_int(0)
    query(ctypes.c_int(MPIX_GPU_SUPPORT_CUDA), ctypes.byref(supported))
    return bool(supported.value)


def _ucx_cuda(loaded_paths) -> str:
    """The CUDA transport module of the UCX loaded in this process ('' where there is none)."""
    for path in loaded_paths:
        if os.path.basename(path).startswith("libucp.so"):
            modules = os.path.join(os.path.dirname(path), "ucx")
            names = sorted(os.listdir(modules)) if os.path.isdir(modules) else []
            found = [name for name in names if name.startswith("libuct_cuda.so")]
            if found:
                return os.path.join(modules, found[0])
    return ""


def _ucx_tls_without_cuda(tls: str) -> bool:
    """Whether UCX_TLS leaves out cuda_copy, the UCX transport that reads and writes GPU memory."""
    entries = [entry.strip() for entry in tls.split(",") if entry.strip()]
    if not entries:
        return False
    if entries[0].startswith("^"):
        return bool({entries[0][1:], *entries[1:]} & {"cuda", "cuda_copy"})
    return not {"all", "cuda", "cuda_copy"} & set(entries)


def _open_mpi(libraries, loaded_paths, environ) -> CudaSupport:
    query = _symbol(libraries, "MPIX_Query_cuda_support")
    answer = bool(query()) if query is not None else False
    switch = environ.get("OMPI_MCA_opal_cuda_support")
    # Open MPI 4's answer is how it was built; its libopen-pal's opal_cuda_support says whether
    # the support is on in this run (off when OMPI_MCA_opal_cuda_support=0, or libcuda.so.1 could
    # not be loaded).
    running = _flag(libraries, "opal_cuda_support")
    if answer and _is_off(switch):
        return CudaSupport(False, f"Open MPI's MPIX_Query_cuda_support() = 1, but OMPI_MCA_opal_cuda_support={switch}",
                           "unset OMPI_MCA_opal_cuda_support (or set it to 1)")
    if answer and running is False:
        return CudaSupport(False, "Open MPI's MPIX_Query_cuda_support() = 1, but its CUDA support is off in this run "
                           "(opal_cuda_support = 0: it could not load libcuda.so.1)",
                           "make the CUDA driver's libcuda.so.1 loadable (LD_LIBRARY_PATH)")
    if answer:
        return CudaSupport(True, "Open MPI's MPIX_Query_cuda_support() = 1")
    said = "Open MPI's MPIX_Query_cuda_support() = 0" if query is not None else "Open MPI without MPIX_Query_cuda_support"
    accelerator = environ.get("OMPI_MCA_accelerator", "")
    if accelerator and ("cuda" not in accelerator or accelerator.startswith("^")):
        return CudaSupport(False, f"{said}, with OMPI_MCA_accelerator={accelerator}",
                           "unset OMPI_MCA_accelerator so that Open MPI can choose its cuda component")
    ucx = _ucx_cuda(loaded_paths)
    if not ucx:
        return CudaSupport(False, said)
    # Built without CUDA itself, Open MPI hands device pointers to UCX (pml ucx), which moves them.
    tls = environ.get("UCX_TLS", "")
    if _ucx_tls_without_cuda(tls):
        return CudaSupport(False, f"{said}; its UCX has CUDA transports ({ucx}), but UCX_TLS={tls} leaves them out",
                           "add cuda_copy,cuda_ipc to UCX_TLS (or unset it)")
    return CudaSupport(True, f"{said}, but its UCX moves GPU memory (CUDA transports: {ucx})")


def _cray_mpich(libraries, loaded_paths, environ) -> CudaSupport:
    switch = environ.get("MPICH_GPU_SUPPORT_ENABLED")
    if _is_on(switch):
        return CudaSupport(True, f"Cray MPICH with MPICH_GPU_SUPPORT_ENABLED={switch}")
    gtl = [path for path in loaded_paths if "libmpi_gtl_cuda" in os.path.basename(path)]
    if gtl or _gpu_query(libraries):
        return CudaSupport(False, f"Cray MPICH with its GPU transfer library ({gtl[0] if gtl else 'linked'}), but "
                           f"MPICH_GPU_SUPPORT_ENABLED is {switch or 'unset'}", "set MPICH_GPU_SUPPORT_ENABLED=1")
    return CudaSupport(False, "Cray MPICH without MPICH_GPU_SUPPORT_ENABLED=1 (and without libmpi_gtl_cuda: load "
                       "the craype-accel-nvidia* module to link it)")


def _mvapich2(version, environ) -> CudaSupport:
    switch = environ.get("MV2_USE_CUDA")
    if _is_on(switch):
        return CudaSupport(True, f"MVAPICH2 with MV2_USE_CUDA={switch}")
    if "GDR" in version.upper():
        return CudaSupport(False, f"MVAPICH2-GDR, but MV2_USE_CUDA is {switch or 'unset'}", "set MV2_USE_CUDA=1")
    return CudaSupport(False, "MVAPICH2 reads GPU memory only when built with CUDA (MVAPICH2-GDR) and run with "
                       "MV2_USE_CUDA=1")


def _intel_mpi(environ) -> CudaSupport:
    switch = environ.get("I_MPI_OFFLOAD", "")
    if switch.strip().isdigit() and int(switch) >= 1:
        return CudaSupport(True, f"Intel MPI with I_MPI_OFFLOAD={switch}")
    return CudaSupport(False, f"Intel MPI reads GPU memory only with I_MPI_OFFLOAD=1 (it is {switch or 'unset'})")


def _mpich(libraries, environ) -> CudaSupport:
    answer = _gpu_query(libraries)
    source = "MPIX_GPU_query_support(CUDA)"
    if answer is None:
        query = _symbol(libraries, "MPIX_Query_cuda_support")
        answer, source = (bool(query()) if query is not None else None), "MPIX_Query_cuda_support()"
    if answer:
        return CudaSupport(True, f"MPICH's {source} = 1")
    if answer is None:
        return CudaSupport(False, "MPICH without MPIX_GPU_query_support (older than MPICH 4)")
    switch = environ.get("MPIR_CVAR_ENABLE_GPU")
    if _is_off(switch):
        return CudaSupport(False, f"MPICH's {source} = 0, with MPIR_CVAR_ENABLE_GPU={switch}",
                           "unset MPIR_CVAR_ENABLE_GPU (or set it to 1) if this MPICH was built with CUDA")
    return CudaSupport(False, f"MPICH's {source} = 0")


def detect(version: str, libraries, loaded_paths, environ) -> CudaSupport:
    """Whether the MPI library whose MPI_Get_library_version is `version` reads GPU memory.
    `libraries`: the loaded MPI libraries (ctypes handles: their exported functions are asked);
    `loaded_paths`: the shared libraries loaded in the process; `environ`: the environment."""
    upper = version.upper()
    if upper.startswith("OPEN MPI"):
        return _open_mpi(libraries, loaded_paths, environ)
    if "CRAY MPICH" in upper:
        return _cray_mpich(libraries, loaded_paths, environ)
    if "MVAPICH2" in upper:
        return _mvapich2(version, environ)
    if "INTEL(R) MPI" in upper or "INTEL MPI" in upper:
        return _intel_mpi(environ)
    if "MPICH" in upper or "MVAPICH" in upper:
        return _mpich(libraries, environ)
    name = version.strip().splitlines()[0] if version.strip() else "this MPI library"
    return CudaSupport(False, f"{name}: no known way to ask it whether it reads GPU memory "
                       "(MPIDIST_CUDA_AWARE=1 says it does)")


def library_support() -> CudaSupport:
    """Whether the MPI library of this process reads GPU memory: MPIDIST_CUDA_AWARE=0/1 when
    set, else detect() (this starts MPI)."""
    forced = config.value("MPIDIST_CUDA_AWARE")
    if forced is not None:
        return CudaSupport(forced, f"MPIDIST_CUDA_AWARE={os.environ['MPIDIST_CUDA_AWARE'].strip()}")
    MPI = load_mpi()
    loaded = loaded_libraries()
    handles = []
    # libopen-pal: Open MPI 4's run-time switch of its CUDA support
    for path in loaded_mpi_libraries() + [p for p in loaded if os.path.basename(p).startswith("libopen-pal")]:
        try:
            handles.append(ctypes.CDLL(path))
        except OSError:
            continue
    return detect(MPI.Get_library_version(), handles, loaded, os.environ)


def mpi_library_cuda_aware(probe_device: int = 0) -> bool:
    """Whether GPU buffers go to MPI as they are. A library that could read GPU memory but is
    kept from it gets a warning that says what to set; one that detection says reads GPU memory
    must pass the probe on GPU `probe_device` (once per process), else MPIUnavailableError says
    what happened and that MPIDIST_CUDA_AWARE=0 avoids it. MPIDIST_CUDA_AWARE=1 skips the probe."""
    support = library_support()
    if support.turned_off:
        warnings.warn(f"GPU buffers are staged through host memory: {support.how}; to hand them to MPI directly, "
                      f"{support.turned_off}", stacklevel=2)
    if support.aware and not support.how.startswith("MPIDIST_CUDA_AWARE"):
        failure = _probe_once(probe_device)
        if failure:
            raise MPIUnavailableError(f"{failure} ({support.how})")
    return support.aware


@functools.lru_cache(maxsize=None)  # the library does not change during a run
def _probe_once(device: int):
    return probe(device)


# ---- the probe ---------------------------------------------------------------------------------

def probe_environment(environ=None) -> dict:
    """The environment of the probe's child: the caller's, less what tells a rank of a job where
    its launcher is."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items()
            if not name.startswith(LAUNCH_VARIABLES) and (name.startswith("OMPI_MCA_") or not name.startswith("OMPI_"))
            or name in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")}


def probe(device: int) -> str | None:
    """Send PROBE_BYTES from one buffer on GPU `device` to another through the MPI library, in a
    child process; None when they arrive intact, else what went wrong (verdict())."""
    command = [sys.executable, "-m", "mpidist.runtime.cuda_aware", str(device)]
    try:
        child = subprocess.run(command, env=probe_environment(), capture_output=True, text=True,
                               timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return verdict(None, "", "")
    return verdict(child.returncode, child.stdout, child.stderr)


def verdict(returncode, stdout: str, stderr: str) -> str | None:
    """What the probe's child says: None when the bytes arrived intact ("intact" printed and exit
    status 0), else a message naming the failure and the way out. `returncode` None: it hung."""
    if returncode == 0 and stdout.strip().splitlines()[-1:] == ["intact"]:
        return None
    if returncode is None:
        what = f"hung (no answer in {PROBE_TIMEOUT:.0f} s)"
    elif returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        what = f"crashed ({name})"
    elif stdout.strip().startswith("wrong"):
        what = f"delivered wrong data ({stdout.strip().splitlines()[0]})"
    else:
        last = (stderr.strip().splitlines() or stdout.strip().splitlines() or ["no output"])[-1]
        what = f"failed (exit status {returncode}: {last})"
    return (f"the MPI library is taken to read GPU memory, but a {len(PROBE_BYTES)}-byte send and receive between "
            f"two GPU buffers {what}; {WAY_OUT}")


def _device_buffers(device: int):
    """Two GPU buffers of PROBE_BYTES's length on GPU `device`, the first holding PROBE_BYTES,
    made by torch or, where it is missing, CuPy; and a function that reads one back as bytes."""
    try:
        import torch
    except ImportError:
        import cupy
        import numpy

        with cupy.cuda.Device(device):
            sent = cupy.asarray(numpy.frombuffer(PROBE_BYTES, dtype=numpy.uint8))
            received = cupy.zeros_like(sent)
        cupy.cuda.Device(device).synchronize()
        return sent, received, lambda array: bytes(cupy.asnumpy(array).tobytes())
    sent = torch.tensor(list(PROBE_BYTES), dtype=torch.uint8, device=f"cuda:{device}")
    received = torch.zeros_like(sent)
    torch.cuda.synchronize(device)
    return sent, received, lambda array: bytes(array.cpu().numpy().tobytes())


def _probe_child(device: int) -> None:
    """The probe's child: start MPI, send PROBE_BYTES between two GPU buffers on COMM_SELF,
    print "intact" or where the bytes differ."""
    MPI = load_mpi()
    sent, received, read = _device_buffers(device)
    MPI.COMM_SELF.Sendrecv(sent, dest=0, recvbuf=received, source=0)
    got = read(received)  # the copy to the host waits for the receive's device work
    if got == PROBE_BYTES:
        print("intact")
    else:
        first = next(index for index, (a, b) in enumerate(zip(got, PROBE_BYTES)) if a != b)
        print(f"wrong: byte {first} is {got[first]}, sent {PROBE_BYTES[first]}")


if __name__ == "__main__":
    _probe_child(int(sys.argv[1]))
