"""The GPU check's report: results.json (every fact, step and single check, the benchmark rows and
the targets) and summary.md, rewritten after every step, and the run's one-line result."""
from __future__ import annotations

import dataclasses
import json
import os

from .junit import is_peer

MIB = 1 << 20


def failures(check) -> list:
    """What failed: the failed steps, and any launch with a failed check of mpidist's (not a
    peer's), whatever step ran it."""
    failed = [s.name for s in check.steps if s.status == "failed"]
    failed += [f"{launch['ranks']} ranks, {launch['route']}" for launch in check.launches
               if launch["problem"] or not all(c["ok"] or is_peer(c) for c in launch["checks"])]
    return failed


def write(check, finished: bool) -> list:
    """results.json and summary.md as they stand; returns what failed."""
    failed = failures(check)
    results = {"started": check.started, "finished": finished, "dry_run": check.dry_run,
               "passed": finished and not failed, "facts": check.facts,
               "steps": [dataclasses.asdict(s) for s in check.steps], "launches": check.launches,
               "targets": check.targets, "benchmark": check.benchmark_rows,
               "allreduce_benchmark": check.allreduce_rows}
    with open(os.path.join(check.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(check.out, "summary.md"), "w") as f:
        f.write(summary_markdown(results))
    return failed


def finish(check) -> int:
    """The final report and the result in a line; 1 if anything failed."""
    failed = write(check, finished=True)
    skipped = [s.name for s in check.steps if s.status == "skipped"]
    passed = [s.name for s in check.steps if s.status == "passed"]
    print(f"gpu-check: {verdict(not failed, check.targets)}: {len(passed)} steps passed, "
          f"{len(failed)} failed{' (' + '; '.join(failed) + ')' if failed else ''}, {len(skipped)} skipped"
          f"{' (' + '; '.join(skipped) + ')' if skipped else ''}; results in {check.out}", flush=True)
    return 1 if failed else 0


def verdict(passed: bool, targets: list) -> str:
    """The run's one-line result: "FAILED", or "passed" with the speed targets it missed counted
    (a missed target fails the run only with --require-targets)."""
    if not passed:
        return "FAILED"
    missed = sum(target["holds"] is False for target in targets)
    return f"passed, {missed} target{'s' if missed > 1 else ''} missed" if missed else "passed"


def summary_markdown(results: dict) -> str:
    result = verdict(results["passed"], results["targets"]) if results["finished"] else "unfinished (cut short?)"
    lines = [f"# mpidist GPU check{' (dry run, no GPU)' if results['dry_run'] else ''}", "",
             f"Result: **{result}** (started {results['started']})", ""]
    lines += facts_table(results["facts"])
    lines += ["", "## Checks", "", "| step | result | seconds | detail |", "| --- | --- | --- | --- |"]
    for step in results["steps"]:
        detail = step["detail"].replace("|", "/").replace("\n", " ")
        lines.append(f"| {step['name']} | {step['status']} | {step['seconds']} | {detail[:1500]} |")
    for launch in results["launches"]:
        lines += launch_lines(launch)
    lines += targets_table(results["targets"])
    lines += allreduce_table(results.get("allreduce_benchmark"))
    lines += kernels_table(results["benchmark"])
    return "\n".join(lines) + "\n"


def facts_table(facts: dict) -> list:
    gpu = facts.get("gpu") or {}
    info = facts.get("mpidist_info", {})
    return ["| | |", "| --- | --- |",
            f"| GPU | {gpu.get('name', 'none')} (compute capability {gpu.get('compute_cap', '-')}, "
            f"{gpu.get('memory', '-')}) |",
            f"| driver | {gpu.get('driver', '-')} (CUDA {gpu.get('driver_cuda', '-')}) |",
            f"| nvcc | {facts.get('nvcc', '-')} |",
            f"| torch | {facts.get('torch', '-')} (CUDA {facts.get('torch_cuda', '-')}) |",
            f"| CuPy | {facts.get('cupy', '-')} |",
            f"| NCCL | CuPy's {facts.get('nccl_cupy', '-')}, torch's {facts.get('nccl_torch', '-')}"
            f"{', MPIDIST_NCCL_LIBRARY=' + facts['nccl_library'] if facts.get('nccl_library') else ''}; ran: "
            f"{facts.get('nccl_runs', '-')} |",
            f"| Python | {facts.get('python', '-')} |",
            f"| MPI library | {facts.get('mpi_library', '-')} (mpi4py {facts.get('mpi4py', '-')}"
            f"{', from ' + facts['mpi_installed_from_wheel'] if facts.get('mpi_installed_from_wheel') else ''}"
            f"{', carried in ' + facts['mpi_carried'] if facts.get('mpi_carried') else ''}) |",
            f"| launcher | {facts.get('launcher', '-')} N |",
            f"| CUDA-aware MPI | {info.get('cuda_aware_mpi', '-')} ({info.get('cuda_aware_mpi_how', '-')}) |"]


def launch_lines(launch: dict) -> list:
    """A launch's heading (its checks passed on every rank, of all) and its failed checks."""
    failed = [c for c in launch["checks"] if not c["ok"]]
    lines = ["", f"### {launch['ranks']} ranks, {launch['route']}: {len(launch['checks']) - len(failed)} of "
                 f"{len(launch['checks'])} checks passed{'; ' + launch['problem'] if launch['problem'] else ''}"]
    return lines + [f"- {'FAILED (a peer: not counted)' if is_peer(c) else 'FAILED'} {c['name']}: "
                    f"{' '.join(c['detail'][:500].split())}" for c in failed]


def targets_table(targets: list) -> list:
    if not targets:
        return []
    lines = ["", "## Speed targets", "", "| target | met | measured |", "| --- | --- | --- |"]
    for target in targets:
        holds = {True: "met", False: "**missed**", None: "not measured"}[target["holds"]]
        lines.append(f"| {target['target']} | {holds} | {target['detail']} |")
    return lines


def allreduce_table(rows) -> list:
    if not rows:
        return []
    lines = ["", "## All-reduce of CUDA buffers by route (mpidist bench allreduce --device cuda)", "",
             "bound: the device window's reads and writes of device memory at the measured copy bandwidth.",
             "", "| ranks | dtype | MiB | algorithm | time us | busbw GB/s | wrong |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        ranks = f"{row['ranks']} {row['setting']}" if row.get("setting") else row["ranks"]
        lines.append(f"| {ranks} | {row['dtype']} | {row['bytes'] / MIB:g} | {row['algorithm']} | "
                     f"{row['time_us']:.1f} | {row['busbw_gbs']:.2f} | {row['wrong']} |")
    return lines


def kernels_table(rows) -> list:
    if not rows:
        return []
    lines = ["", "## Kernel benchmark", "",
             "GB/s count every byte read and written; torch: the same result by torch's own ops; copy: "
             "a device-to-device copy of the buffer (read + write); vs torch: median of torch's time over "
             "ours in the same round [95% CI].", "",
             "| kernel | dtype | MiB | GB/s | torch GB/s | copy GB/s | / copy | vs torch |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['kernel']} | {row['dtype']} | {row['bytes'] / MIB:g} | {row['gbs']:.1f} | "
                     f"{row['library_gbs']:.1f} | {row['copy_gbs']:.1f} | {row['gbs'] / row['copy_gbs']:.2f} | "
                     f"{row['vs_library']:.2f} [{row['vs_library_low']:.2f}, {row['vs_library_high']:.2f}] |")
    return lines
