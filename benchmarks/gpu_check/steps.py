"""The GPU check's steps, in one list, STEPS: its --help text, its run order and its report (a
row per step, in this order) all come from it; and the command line that runs them."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import textwrap
from typing import Callable

from . import build, launches, machine, mpi, speed
from .check import CUDA_MPI, REPO, GpuCheck


@dataclasses.dataclass(frozen=True)
class StepSpec:
    name: str
    description: str
    run: Callable  # run(check) -> (status, detail)
    ends_the_run: bool = False  # when it fails, every later step is skipped


STEPS = [
    StepSpec("machine", "GPU, driver, CUDA, nvcc, torch, CuPy, NCCL, Python; the run stops without a GPU that "
             "torch sees", machine.machine, ends_the_run=True),
    StepSpec("wheels", "the wheels of benchmarks/gpu-wheels.txt that this Python lacks, installed from the wheels "
             "folder (`make gpu-wheels`) into build/gpu-site, without touching the Python's own packages",
             build.install_wheels),
    StepSpec("MPI library and launcher", "the MPI library mpi4py loads and the launcher on PATH (mpirun, "
             "mpiexec) that belongs to it", mpi.mpi_library),
    StepSpec("build mpidist._C", "built with CUDA for this GPU's architecture only (CPU-only, or as built, in a "
             "dry run); the run stops when it fails", build.build, ends_the_run=True),
    StepSpec("mpidist info", "whether the MPI library is CUDA-aware, and how mpidist knows", mpi.info),
    StepSpec("CUDA-aware MPI carried with the tree", "where the library is not CUDA-aware, the Open MPI of "
             "`make cuda-mpi` (.cuda-mpi) takes its place, launcher included, for every later step",
             mpi.carried_mpi),
    StepSpec("CUDA-aware MPI probe: a device-to-device send and receive", "where the library is CUDA-aware, the "
             "bytes sent from GPU memory through it must arrive (mpidist/runtime/cuda_aware.py)", mpi.probe),
    StepSpec("2 ranks, device window: collectives, training modes and Horovod's behaviours",
             "tests/gpu/ in every rank of an mpirun of 2 ranks sharing the GPU through the node window in GPU "
             "memory: every all-reduce algorithm, broadcast, allgather and reduce_scatter on torch and CuPy GPU "
             "arrays, the torch.distributed backend, the training modes and Horovod's behaviours against "
             "references, algorithm=\"nccl\" as a peer; in a dry run, the same on NumPy and torch CPU arrays",
             functools.partial(launches.through_the_device_window, ranks=2)),
    StepSpec("4 ranks, device window: collectives, training modes and Horovod's behaviours", "the same on 4 ranks",
             functools.partial(launches.through_the_device_window, ranks=4)),
    StepSpec("mpidist bench allreduce --device cuda, 2 ranks", "4 KiB to 1 GiB, float32: the device window, the "
             "staged route, the CUDA-aware route where there is one, NCCL where it runs, and the bound; the "
             f"targets from 64 MiB on: the window >= {speed.STAGED_FACTOR}x the staged route, >= "
             f"{speed.BOUND_FRACTION} of the bound, and at least NCCL's bus bandwidth where NCCL ran",
             functools.partial(speed.allreduce_benchmark, ranks=2)),
    StepSpec("mpidist bench allreduce --device cuda, 4 ranks", "the same on 4 ranks, to 256 MiB",
             functools.partial(speed.allreduce_benchmark, ranks=4)),
    StepSpec("mpidist bench allreduce --device cuda, 2 ranks under MPS", "the window and NCCL on 2 ranks again with "
             "the GPU shared through an MPS daemon of the run's own, where the machine has nvidia-cuda-mps-control",
             speed.allreduce_benchmark_mps),
    StepSpec("CUDA tests of tests/", "the tests of tests/ that need a GPU (kernels against torch, host staging, "
             "Adasum) in one pytest run; on a GPU a skipped test is a failure", launches.cuda_tests),
    StepSpec("2 ranks, host staging: collectives", "the collectives of tests/gpu/ on 2 ranks through host "
             "staging (MPIDIST_DEVICE_WINDOW=0)", launches.through_host_staging),
    StepSpec("2 ranks, CUDA-aware MPI: collectives", "the same straight from GPU memory, where `mpidist info` "
             "reports a CUDA-aware MPI", launches.through_cuda_aware_mpi),
    StepSpec("kernel benchmark", "benchmarks/kernels.py --device cuda, 1 MiB to 1 GiB, against the "
             "device-to-device copy and torch's own ops (on the CPU at 4 KiB in a dry run)", speed.kernel_benchmark),
    StepSpec("speed targets", f"reduce and reduce_scale reach {speed.COPY_FRACTION} of the copy's bandwidth from 64 "
             "MiB on (float32, bfloat16), bfloat16 reduce is at least as fast as torch's add_, and the all-reduce "
             "targets above; a missed target fails the run only with --require-targets", speed.judge_targets),
]


def run(check: GpuCheck, steps=STEPS) -> int:
    """Every step in order, then the report; the exit status."""
    stopped = None  # the failed step that ends the run
    for spec in steps:
        if stopped:
            check.step(spec.name, lambda: ("skipped", f"the run stopped: \"{stopped}\" failed"))
            continue
        if check.step(spec.name, functools.partial(spec.run, check)).status == "failed" and spec.ends_the_run:
            stopped = spec.name
    return check.finish()


def help_text(steps=STEPS) -> str:
    def paragraph(text: str, indent: str = "") -> str:
        return textwrap.fill(text, 100, subsequent_indent=indent, break_on_hyphens=False)
    return "\n".join([
        paragraph("The steps, in this order (on a GPU; a dry run runs what needs no GPU and reports the rest "
                  "skipped):"),
        *(paragraph(f"{number}. {spec.name}: {spec.description}", "    ") for number, spec in enumerate(steps, 1)),
        "",
        paragraph("The device window's launches and benchmarks come first, what has run on a GPU before last, so "
                  "that a run cut short by --budget has done the newer checks. It writes results.json, summary.md, "
                  "gpu-check.log and the benchmarks' JSON and PNG to --out, and exits 1 if any check failed (a "
                  "missed speed target too, with --require-targets).")])


def default_out(dry_run: bool) -> str:
    if os.environ.get("OUT"):
        return os.environ["OUT"]
    return os.path.join(REPO, "build", "gpu-check-dry-run") if dry_run else os.path.join(REPO, "benchmarks", "results",
                                                                                         "gpu-check")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpu_check", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=help_text(),
        description="Do mpidist's CUDA paths work on this NVIDIA GPU, and are its kernels as fast as they should be? "
                    "(docs/gpu-check.md)")
    parser.add_argument("--dry-run", action="store_true", help="run what needs no GPU; report the rest skipped")
    parser.add_argument("--out", help="results folder (default: $OUT, else benchmarks/results/gpu-check, "
                                      "or build/gpu-check-dry-run for a dry run)")
    parser.add_argument("--wheels", default=os.path.join(REPO, "build", "gpu-wheels"),
                        help="folder of the wheels of benchmarks/gpu-wheels.txt (`make gpu-wheels`)")
    parser.add_argument("--require-targets", action="store_true", help="a missed speed target fails the run too")
    parser.add_argument("--cuda-mpi", default=CUDA_MPI,
                        help="the CUDA-aware Open MPI to use where the machine's is not (`make cuda-mpi`)")
    parser.add_argument("--budget", type=float, help="seconds the whole run may take: no step starts after "
                                                     "them, and a command still running then is stopped")
    args = parser.parse_args(argv)
    check = GpuCheck(os.path.abspath(args.out or default_out(args.dry_run)), os.path.abspath(args.wheels),
                     args.dry_run, args.require_targets, os.path.abspath(args.cuda_mpi), args.budget)
    return run(check)


__doc__ = (__doc__ or "") + "\n" + help_text()  # the module's own help lists the steps as --help does
