"""The GPU check's benchmarks and their speed targets: `mpidist bench allreduce --device cuda` by
route (the device window, the staged route, the CUDA-aware route where there is one, NCCL where
it runs, and the bound), again under MPS where the machine has it, and benchmarks/kernels.py
against the device-to-device copy and torch's own ops."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from .check import REPO, tail

MIB = 1 << 20
BENCH_SIZES = {"cuda": ["1M", "4M", "16M", "64M", "256M", "1G"], "cpu": ["4K"]}
BENCH_DTYPES = ["float32", "bfloat16", "float16"]
# By ranks: 4 ranks on one GPU stop at 256 MiB to keep the run within a lent machine's minutes.
ALLREDUCE_BENCH_SIZES = {2: "4K,1M,64M,256M,1G", 4: "4K,1M,64M,256M"}
ALLREDUCE_BENCH_DTYPES = "float32"
# Under MPS the ranks' kernels share the GPU at once instead of taking turns: the small sizes show
# the fixed cost of a call, the device window against NCCL where NCCL runs.
MPS_BENCH = ["--sizes", "4K,1M,64M,256M", "--dtype", "float32", "--algorithms",
             "hierarchical,staged:hierarchical,nccl,bound"]
STAGED_FACTOR = 20  # the device window's all-reduce against the staged route, from 64 MiB
BOUND_FRACTION = 0.5  # ... and against the bound
TARGET_FROM_BYTES = 64 * MIB
COPY_FRACTION = 0.8
BENCH_TIMEOUT = 240


def kernel_benchmark(check):
    path = os.path.join(check.out, f"kernels-{check.device}.json")
    args = [sys.executable, os.path.join(REPO, "benchmarks", "kernels.py"), "--device", check.device,
            "--sizes", *BENCH_SIZES[check.device], "--dtypes", *BENCH_DTYPES, "--json", path]
    args += ["--reps", "3"] if check.dry_run else ["--reps", "20", "--plot", path.replace(".json", ".png")]
    result = check.command(args, timeout=420)
    if result.returncode != 0 or not os.path.exists(path):
        return "failed", f"benchmarks/kernels.py failed: {tail(result)}"
    with open(path) as f:
        check.benchmark_rows = json.load(f)
    if not check.benchmark_rows:
        return "failed", "benchmarks/kernels.py wrote no rows"
    check.targets += evaluate_targets(check.benchmark_rows)
    where = "dry run: on the CPU at 4 KiB, " if check.dry_run else ""
    return "passed", f"{where}{len(check.benchmark_rows)} rows"


def allreduce_benchmark(check, ranks: int, name: str = "", options=None, env=None, setting: str = ""):
    """`mpidist bench allreduce --device cuda` on `ranks` ranks, its rows judged against the
    targets; `setting` names a run under other conditions in the targets' names."""
    if check.dry_run:
        return "skipped", "dry run: no GPU"
    if check.launcher is None:
        return "skipped", "no launcher for the MPI library (see the step \"MPI library and launcher\")"
    path = os.path.join(check.out, f"bench-allreduce-cuda-{ranks}ranks{name}.json")
    options = options or ["--sizes", ALLREDUCE_BENCH_SIZES[ranks], "--dtype", ALLREDUCE_BENCH_DTYPES]
    args = [*check.launcher, str(ranks), sys.executable, "-m", "mpidist.cli", "bench", "allreduce", "--device",
            "cuda", *options, "--iters", "5", "--warmup", "1", "--json", path]
    result = check.command(args, timeout=BENCH_TIMEOUT, env=env or check.env(MPIDIST_TIMEOUT="60",
                                                                              NCCL_MULTI_RANK_GPU_ENABLE="1"))
    with open(path.replace(".json", ".txt"), "w") as f:
        f.write(result.stdout + result.stderr)
    if not os.path.exists(path):
        return "failed", f"mpidist bench wrote no rows: {tail(result)}"
    with open(path) as f:
        rows = json.load(f)
    check.allreduce_rows += [dict(row, setting=setting) for row in rows] if setting else rows
    check.targets += allreduce_targets(rows, setting)
    wrong = [f"{r['algorithm']} {r['dtype']} {r['bytes']}" for r in rows if r["wrong"]]
    if wrong or result.returncode:
        return "failed", f"wrong results in {wrong}" if wrong else f"exit {result.returncode}: {tail(result)}"
    return "passed", f"{len(rows)} rows: {sorted({r['algorithm'] for r in rows})}"


def allreduce_benchmark_mps(check):
    """The 2-rank benchmark again with the GPU shared through an MPS daemon of this run's own."""
    if check.dry_run:
        return "skipped", "dry run: no GPU"
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return "skipped", "no nvidia-cuda-mps-control on PATH"
    folder = tempfile.mkdtemp(prefix="gpu-check-mps-")
    mps = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(folder, "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": os.path.join(folder, "log")}
    for path in mps.values():
        os.makedirs(path)
    started = check.command([control, "-d"], timeout=30, env=check.env(**mps))
    if started.returncode != 0:
        return "skipped", f"the MPS daemon did not start: {tail(started)}"
    try:
        return allreduce_benchmark(check, 2, "-mps", MPS_BENCH, setting="under MPS",
                                   env=check.env(MPIDIST_TIMEOUT="60", NCCL_MULTI_RANK_GPU_ENABLE="1", **mps))
    finally:
        subprocess.run([control], input="quit\n", text=True, env=check.env(**mps), timeout=30, capture_output=True)


def judge_targets(check):
    measured = [t for t in check.targets if t["holds"] is not None]
    missed = [t for t in measured if not t["holds"]]
    if not measured:
        why = "dry run: the targets apply from 64 MiB on a GPU" if check.dry_run else "no benchmark rows to judge"
        return ("skipped" if check.dry_run else "failed"), why
    status = "failed" if missed and check.require_targets else "passed"
    return status, targets_met(check.targets)


def targets_met(targets: list) -> str:
    """Every speed target with its measured values, met or missed (the missed first, so that a
    cut detail keeps them), then those not measured."""
    measured = [t for t in targets if t["holds"] is not None]
    missed = [t for t in measured if not t["holds"]]
    unmeasured = [t["target"] for t in targets if t["holds"] is None]
    listed = [f"{'MISSED' if not t['holds'] else 'met'}: {t['target']} ({t['detail']})"
              for t in missed + [t for t in measured if t["holds"]]]
    return f"{len(measured) - len(missed)} of {len(measured)} measured targets met; " + "; ".join(listed) + (
        f"; not measured: {', '.join(unmeasured)}" if unmeasured else "")


def evaluate_targets(rows: list) -> list:
    """The speed targets, judged on benchmarks/kernels.py's rows of 64 MiB and more. holds is None
    where no row was measured."""
    big = [r for r in rows if r["bytes"] >= TARGET_FROM_BYTES]
    targets = []
    for dtype in ("float32", "bfloat16"):
        for kernel in ("reduce", "reduce_scale"):
            mine = sorted((r for r in big if r["kernel"] == kernel and r["dtype"] == dtype), key=lambda r: r["bytes"])
            ratios = [(r["bytes"], r["gbs"] / r["copy_gbs"]) for r in mine]
            targets.append({
                "target": f"{kernel} {dtype} >= {COPY_FRACTION} x device-to-device copy bandwidth from 64 MiB",
                "holds": all(ratio >= COPY_FRACTION for _, ratio in ratios) if ratios else None,
                "detail": ", ".join(f"{size // MIB} MiB: {ratio:.2f}" for size, ratio in ratios) or "not measured"})
    mine = sorted((r for r in big if r["kernel"] == "reduce" and r["dtype"] == "bfloat16"), key=lambda r: r["bytes"])
    targets.append({
        "target": "reduce bfloat16 >= torch add_ from 64 MiB (median paired ratio >= 1)",
        "holds": all(r["vs_library"] >= 1.0 for r in mine) if mine else None,
        "detail": ", ".join(f"{r['bytes'] // MIB} MiB: {r['vs_library']:.2f} [{r['vs_library_low']:.2f}, "
                            f"{r['vs_library_high']:.2f}]" for r in mine) or "not measured"})
    return targets


def allreduce_targets(rows: list, setting: str = "") -> list:
    """The device window's targets on `mpidist bench allreduce --device cuda` rows of one launch,
    64 MiB and more: >= STAGED_FACTOR x the staged route, >= BOUND_FRACTION of the bound, and at
    least NCCL's bus bandwidth where NCCL ran. holds is None where a row is missing."""
    big = [r for r in rows if r["bytes"] >= TARGET_FROM_BYTES]
    time_of = {(r["algorithm"], r["dtype"], r["bytes"]): r["time_us"] for r in big}
    ranks = rows[0]["ranks"] if rows else 0
    targets = []
    for dtype in sorted({r["dtype"] for r in big}):
        sizes = sorted({r["bytes"] for r in big if r["dtype"] == dtype})
        for peer, wanted, name in (("staged:hierarchical", STAGED_FACTOR, f">= {STAGED_FACTOR}x the staged route"),
                                   ("bound", BOUND_FRACTION, f">= {BOUND_FRACTION} of the bound"),
                                   ("nccl", 1.0, ">= NCCL's bus bandwidth")):
            ratios = [(size, time_of[(peer, dtype, size)] / time_of[("hierarchical", dtype, size)]) for size in sizes
                      if (peer, dtype, size) in time_of and ("hierarchical", dtype, size) in time_of]
            targets.append({
                "target": f"all-reduce {dtype}, {ranks} ranks on one GPU{' ' + setting if setting else ''}, "
                          f"device window {name} from 64 MiB",
                "holds": all(ratio >= wanted for _, ratio in ratios) if ratios else None,
                "detail": ", ".join(f"{size // MIB} MiB: {ratio:.2f}" for size, ratio in ratios) or "not measured"})
    return targets
