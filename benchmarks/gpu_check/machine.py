"""The GPU check's first step: the machine's facts (GPU, driver, nvcc, Python, torch, CuPy, NCCL),
and whether it has a GPU that torch sees."""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import sys

from .check import CARRIED_NCCL, first_line, tail

LIBRARIES_PROBE = """
import json
facts = {}
import numpy, torch
facts["numpy"] = numpy.__version__
facts["torch"] = torch.__version__
facts["torch_cuda"] = torch.version.cuda
facts["torch_cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    facts["torch_device"] = torch.cuda.get_device_name(0)
    facts["torch_capability"] = "%d.%d" % torch.cuda.get_device_capability(0)
try:
    import cupy
    facts["cupy"] = cupy.__version__
except Exception as error:
    facts["cupy"] = "cannot import: %s" % error
try:
    from cupy.cuda import nccl
    facts["nccl_cupy"] = nccl.get_version()
except Exception as error:
    facts["nccl_cupy"] = "cannot import: %s" % error
try:
    facts["nccl_torch"] = ".".join(map(str, torch.cuda.nccl.version()))
except Exception as error:
    facts["nccl_torch"] = "unknown: %s" % error
print(json.dumps(facts))
"""


def machine(check):
    facts = check.facts
    facts["python"] = f"{platform.python_version()} ({sys.executable})"
    facts["platform"] = platform.platform()
    facts["gpu"] = gpu_facts(check.command)
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    release = re.search(r"release [^\n]*", check.command([nvcc, "--version"]).stdout) if nvcc else None
    facts["nvcc"] = f"{nvcc}: {release.group(0)}" if release else f"{nvcc or 'not found'}"
    probe = check.python(LIBRARIES_PROBE)
    facts.update(json.loads(probe.stdout) if probe.returncode == 0 else {"torch": f"cannot import: {tail(probe)}"})
    if os.path.exists(CARRIED_NCCL):
        facts["nccl_library"] = check.env()["MPIDIST_NCCL_LIBRARY"]
    if check.dry_run:
        return "passed", f"dry run: {facts['gpu'] or 'no GPU'} (nothing here needs one)"
    if not facts["gpu"]:
        return "failed", "no NVIDIA GPU found (nvidia-smi): run `make gpu-check GPU_DRY_RUN=1` on a machine without one"
    if not facts.get("torch_cuda_available"):
        return "failed", f"torch {facts.get('torch')} sees no GPU (torch.cuda.is_available() is False)"
    return "passed", f"{facts['gpu']['name']}, compute capability {facts['gpu']['compute_cap']}"


def gpu_facts(command):
    """Name, driver, compute capability, memory and the driver's CUDA version of GPU 0, from
    nvidia-smi; None without an NVIDIA GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = command([smi, "--query-gpu=name,driver_version,compute_cap,memory.total", "--format=csv,noheader"], 60)
    if query.returncode != 0 or not query.stdout.strip():
        return None
    name, driver, compute_cap, memory = [part.strip() for part in first_line(query.stdout).split(",")]
    banner = re.search(r"CUDA Version:\s*([\d.]+)", command([smi], 60).stdout)
    return {"name": name, "driver": driver, "compute_cap": compute_cap, "memory": memory,
            "driver_cuda": banner.group(1) if banner else "unknown"}
