"""The GPU check's pytest runs: the rank tests of tests/gpu/ in real mpirun launches of ranks sharing
the GPU (one launch per rank count and route, pytest in every rank, each rank writing its JUnit
report), and the CUDA tests of tests/ in one pytest run."""
from __future__ import annotations

import os
import sys
import tempfile

from .check import tail
from .junit import is_peer, judge_tests, merge_ranks, nccl_outcome, passed_on_every_rank, read_junit
from .mpi import pytest_mpi_options

LAUNCH_TIMEOUT = 240
RANK_TESTS = "tests/gpu"
# The tests of tests/ that need a GPU, in one pytest run. The two tests of a build without CUDA
# or a machine without a GPU ("without" in their names) cannot run here and are left out.
CUDA_TESTS = ["tests/test_kernels.py", "tests/test_buffers.py", "tests/test_adasum.py"]
CUDA_TEST_SELECTION = "cuda and not without"
# Each route: the environment changes of its launches, what --expect-cuda-aware says of the MPI
# library, and the rank tests' other options (tests/gpu/conftest.py). NCCL is a peer in the device
# window's launches, where NCCL_MULTI_RANK_GPU_ENABLE lets 2.30 and later run ranks sharing a GPU.
DEVICE_WINDOW = ({"MPIDIST_CUDA_AWARE": "0", "MPIDIST_DEVICE_WINDOW": None, "NCCL_MULTI_RANK_GPU_ENABLE": "1"},
                 "no", ["--device-window", "yes", "--nccl"])
HOST_STAGING = ({"MPIDIST_CUDA_AWARE": "0", "MPIDIST_DEVICE_WINDOW": "0"}, "no", ["--skip-training"])
CUDA_AWARE = ({"MPIDIST_CUDA_AWARE": None, "MPIDIST_DEVICE_WINDOW": "0"}, "yes", ["--skip-training"])


def through_the_device_window(check, ranks: int):
    """Every rank test on `ranks` ranks through the node window in GPU memory (CUDA IPC), NCCL as
    a peer; in a dry run, the same tests on CPU buffers. The training modes and Horovod's
    behaviours run in these launches only: on the other routes they passed on the H100 before the
    window existed (benchmarks/results/gpu-check-h100/), and a lent machine's minutes are few."""
    if check.dry_run:
        status, detail = launch(check, ranks, "CPU buffers", {}, None)
        return status, f"dry run, CPU buffers: {detail}"
    return launch(check, ranks, "device window", *DEVICE_WINDOW)


def through_host_staging(check):
    """The collectives on 2 ranks through pinned host memory (4 ranks of host staging passed on
    the H100 too)."""
    if check.dry_run:
        return "skipped", "dry run: no GPU buffers to stage (the device window's steps ran the tests on CPU buffers)"
    return launch(check, 2, "host staging", *HOST_STAGING)


def through_cuda_aware_mpi(check):
    """The collectives on 2 ranks straight from GPU memory, where the MPI library is CUDA-aware."""
    if check.dry_run:
        return "skipped", "dry run: no GPU buffers"
    if not check.facts.get("mpidist_info", {}).get("cuda_aware_mpi"):
        return "skipped", "mpidist info reports this MPI library is not CUDA-aware"
    return launch(check, 2, "CUDA-aware MPI", *CUDA_AWARE)


def launch(check, ranks: int, route: str, changes: dict, expect_aware, more=()):
    """One mpirun of `ranks` ranks running the rank tests, judged from every rank's report."""
    if check.launcher is None:
        return "failed", "no launcher for the MPI library (see the step \"MPI library and launcher\")"
    folder = tempfile.mkdtemp(prefix=f"gpu-check-{ranks}ranks-")
    args = [*check.launcher, str(ranks), sys.executable, "-m", "pytest", RANK_TESTS, "-v", "-p", "no:cacheprovider",
            "-p", "no:hypothesispytest", f"--junitxml={os.path.join(folder, 'rank{rank}.xml')}",
            "--device", check.device, "--expect-ranks", str(ranks), *more]
    if expect_aware:
        args += ["--expect-cuda-aware", expect_aware]
    # A rank whose peer died waits this long, not the default five minutes, before it says so.
    result = check.command(args, timeout=LAUNCH_TIMEOUT, env=check.env(MPIDIST_TIMEOUT="60", **changes))
    found = merge_ranks(folder, ranks, result.returncode)
    found.update(ranks=ranks, route=route)
    check.launches.append(found)
    if "--nccl" in more:
        check.facts.setdefault("nccl_runs", {})[f"{ranks} ranks"] = nccl_outcome(found["checks"])
    failed = [c for c in found["checks"] if not c["ok"] and not is_peer(c)]
    if failed:
        shown = "; ".join(f"{c['name']}: {c['detail'][:300]}" for c in failed[:5])
        others = f" (and {len(failed) - 5} more, see results.json)" if len(failed) > 5 else ""
        return "failed", f"{len(failed)} of {len(found['checks'])} checks failed: {shown}{others}"
    if found["problem"]:
        return "failed", found["problem"] + (f": {tail(result)}" if result.returncode else "")
    if not found["checks"]:
        return "failed", f"the ranks reported no checks: {tail(result)}"
    return "passed", passed_on_every_rank(found["checks"])


def cuda_tests(check):
    """The CUDA tests of tests/ (kernels against torch, host staging, Adasum) in one pytest run."""
    junit = os.path.join(tempfile.mkdtemp(prefix="gpu-check-"), "cuda-tests.xml")
    args = [sys.executable, "-m", "pytest", *CUDA_TESTS, "-k", CUDA_TEST_SELECTION, "-p", "no:cacheprovider",
            f"--junitxml={junit}", "-q", *pytest_mpi_options(check.launcher)]
    result = check.command(args, timeout=420)
    if not os.path.exists(junit):
        return "failed", f"pytest wrote no report (exit {result.returncode}): {tail(result)}"
    return judge_tests(read_junit(junit), check.dry_run, result.returncode)
