"""benchmarks/distributed_backend.py, shortened, under a real `mpirun -np 2`: every candidate
reports, and the trainings and all-reduces it times are checked (no timing assertions); and
benchmarks/distributed_backend_layers.py, shortened, reports every layer."""
import json
import os

from conftest import REPO, run_python

SCRIPT = os.path.join(REPO, "benchmarks", "distributed_backend.py")


def test_distributed_backend_benchmark_rows(tmp_path):
    out = tmp_path / "rows.json"
    code = (f"import sys, runpy; sys.argv = [{SCRIPT!r}, '--params', '20K', '--batch', '8', '--steps', '2', "
            f"'--rounds', '2', '--warmup', '1', '--counts', '1,300', '--calls', '5', '--json', {str(out)!r}]; "
            f"runpy.run_path({SCRIPT!r}, run_name='__main__')")
    result = run_python(code, ranks=2, env={"MPIDIST_CHECK": "0"}, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())
    training = [row for row in rows if row["question"] == "training"]
    assert [row["candidate"] for row in training] == ["ddp mpidist", "ddp gloo", "mpidist DataParallel",
                                                      "ddp mpidist, background thread"]
    assert all(row["correct"] and row["samples_per_s"] > 0 and row["ranks"] == 2 for row in training)
    allreduces = [row for row in rows if row["question"] == "allreduce"]
    assert len(allreduces) == 2 * 2 * 3  # two phases, two sizes, three candidates
    assert all(row["correct"] and row["time_us"] > 0 for row in allreduces)
    assert {row["phase"] for row in allreduces} == {"before any async_op", "after DDP (async_op)"}


LAYERS_SCRIPT = os.path.join(REPO, "benchmarks", "distributed_backend_layers.py")


def test_distributed_backend_layers_rows(tmp_path):
    out = tmp_path / "layers.json"
    result = run_python(f"import sys, runpy; sys.argv = [{LAYERS_SCRIPT!r}, '--calls', '20', '--repeat', '1', "
                        f"'--json', {str(out)!r}]; runpy.run_path({LAYERS_SCRIPT!r}, run_name='__main__')", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())
    layers = {(row["phase"], row["layer"]) for row in rows}
    for phase in ("before any async_op", "after an async_op"):
        assert {(phase, "mpidist Communicator.allreduce"), (phase, "dist.all_reduce"),
                (phase, "dist.all_reduce, a Python group that does nothing")} <= layers
    assert ("after an async_op", "dist.all_reduce(async_op=True).get_future().wait()") in layers
    assert ("after an async_op", "dist.all_reduce(async_op=True).wait(), run at once (one node)") in layers
    assert all(row["cpu_us_per_call"] > 0 for row in rows)
