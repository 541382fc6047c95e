"""The GPU check's MPI steps: the library mpi4py loads and the launcher that belongs to it, what
`mpidist info` finds, the CUDA-aware Open MPI carried with the tree (`make cuda-mpi`) where the
library is not CUDA-aware, and mpidist's probe of a CUDA-aware library."""
from __future__ import annotations

import json
import os
import shutil
import sys

from .build import WHEEL_LIST, pip_install, read_wheel_list
from .check import SITE, first_line, tail

MPI_PROBE = """
import json, mpi4py
from mpi4py import MPI
print(json.dumps({"mpi4py": mpi4py.__version__, "mpi_standard": "%d.%d" % MPI.Get_version(),
                  "mpi_library": MPI.Get_library_version().replace("\\x00", "").strip().splitlines()[0]}))
"""


def mpi_library(check):
    found = check.python(MPI_PROBE)
    if found.returncode != 0:
        libmpi = [w for w in read_wheel_list(WHEEL_LIST) if w["libmpi"]]
        if check.dry_run or not libmpi:
            return "failed", f"mpi4py loads no MPI library: {tail(found)}"
        # The image's mpi4py without an MPI library of its own: the carried one.
        check.mpi_prefix = os.path.join(SITE, "mpi")
        pip_install(check, [w["requirement"] for w in libmpi], check.mpi_prefix)
        found = check.python(MPI_PROBE)
        if found.returncode != 0:
            return "failed", f"mpi4py loads no MPI library, not even the carried {libmpi[0]['requirement']}: {tail(found)}"
        check.facts["mpi_installed_from_wheel"] = libmpi[0]["requirement"]
    library = json.loads(found.stdout)
    check.facts.update(library)
    family = mpi_family(library["mpi_library"])
    launchers = {}
    path = check.env()["PATH"]
    for name in ("mpirun", "mpiexec"):
        where = shutil.which(name, path=path)
        if where:
            launchers[name] = {"path": where, "version": first_line(check.command([where, "--version"], 30).stdout)}
    check.facts["launchers"] = launchers
    chosen = [info for info in launchers.values() if launcher_family(info["version"]) == family]
    if not chosen:
        return "failed", (f"mpi4py loads {library['mpi_library']!r}, but no mpirun/mpiexec on PATH belongs to it "
                          f"(found: {launchers or 'none'})")
    check.launcher = launch_prefix(chosen[0]["path"], family)
    check.facts["launcher"] = " ".join(check.launcher)
    return "passed", f"{library['mpi_library']} (mpi4py {library['mpi4py']}); launcher: {' '.join(check.launcher)} N"


def info(check):
    # What the library itself detects: a forced MPIDIST_CUDA_AWARE of the caller is left out.
    result = check.command([sys.executable, "-m", "mpidist.cli", "info", "--json"],
                           env=check.env(MPIDIST_CUDA_AWARE=None))
    if result.returncode != 0:
        return "failed", f"mpidist info failed: {tail(result)}"
    found = json.loads(result.stdout[result.stdout.index("{"):])
    check.facts["mpidist_info"] = found
    return "passed", (f"cuda_aware_mpi={found['cuda_aware_mpi']} ({found.get('cuda_aware_mpi_how', '-')}), "
                      f"mpi library {found['mpi_library']}")


def carried_mpi(check):
    """Where the library is not CUDA-aware: the carried CUDA-aware Open MPI instead, its
    launcher and what mpidist detects in it."""
    if check.facts.get("mpidist_info", {}).get("cuda_aware_mpi"):
        return "skipped", "the machine's MPI library is CUDA-aware"
    if not os.path.exists(os.path.join(check.cuda_mpi, "bin", "mpirun")):
        return "skipped", f"no carried MPI in {check.cuda_mpi} (`make cuda-mpi` builds it)"
    machine = (check.launcher, dict(check.facts))
    check.carried = True
    check.facts["mpi_carried"] = check.cuda_mpi
    status, detail = mpi_library(check)
    if status == "passed":
        status, detail = info(check)
    if status != "passed":  # the later steps go on with the machine's MPI library
        check.carried, (check.launcher, check.facts) = False, machine
        return status, f"the carried MPI in {check.cuda_mpi}: {detail}"
    if check.dry_run:
        # Without a CUDA driver Open MPI turns its CUDA support off: built with it is what counts.
        built = "MPIX_Query_cuda_support() = 1" in check.facts["mpidist_info"].get("cuda_aware_mpi_how", "")
        return ("passed" if built else "failed"), f"{check.cuda_mpi} (dry run: the launch uses it): {detail}"
    if not check.facts["mpidist_info"]["cuda_aware_mpi"]:
        check.carried, (check.launcher, check.facts) = False, machine
        return "failed", f"the carried MPI in {check.cuda_mpi} is not CUDA-aware: {detail}"
    return "passed", f"{check.cuda_mpi}: {detail}"


def probe(check):
    """mpidist's probe of a CUDA-aware library: a device-to-device send and receive."""
    if not check.facts.get("mpidist_info", {}).get("cuda_aware_mpi"):
        return "skipped", "the MPI library is not CUDA-aware"
    if check.dry_run:
        return "skipped", "no GPU to probe"
    result = check.python("import json; from mpidist.runtime.cuda_aware import probe; print(json.dumps(probe(0)))",
                          timeout=180, env=check.env(MPIDIST_CUDA_AWARE=None))
    if result.returncode != 0:
        return "failed", f"the probe did not run: {tail(result)}"
    failure = json.loads(result.stdout.strip().splitlines()[-1])
    return ("failed", failure) if failure else ("passed", "the bytes sent from GPU memory arrived intact")


def mpi_family(library: str) -> str:
    """"openmpi" or "mpich" (MPICH and its derivatives: Intel MPI, MVAPICH, Cray MPICH)."""
    lower = library.lower()
    return "openmpi" if "open mpi" in lower else "mpich"


def launcher_family(version: str):
    lower = version.lower()
    if "open mpi" in lower or "openrte" in lower or "prte" in lower:
        return "openmpi"
    if any(word in lower for word in ("hydra", "mpich", "intel", "mvapich")):
        return "mpich"
    return None


def launch_prefix(launcher: str, family: str) -> list:
    """The command line before the rank count: the ranks share the node's cores and GPU."""
    if family == "openmpi":
        return [launcher, "--oversubscribe", "--bind-to", "none", "-np"]
    return [launcher, "-n"]


def pytest_mpi_options(prefix) -> list:
    """pytest-isolate-mpi's launcher settings (pyproject.toml's are Open MPI's) for this launcher."""
    if not prefix:
        return []
    return ["-o", f"mpi_executable={prefix[0]}", "-o", f"mpi_command_line_args={' '.join(prefix[1:-1])}",
            "-o", f"mpi_option_for_processes={prefix[-1]}"]
