"""benchmarks/training.py under a real `mpirun -np 2` with a tiny model: the JSON rows are
complete and DataParallel ends with the same parameters as torch DDP (no timing assertions)."""
import json
import os
import sys

from conftest import REPO, run_python

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from training import ROW_KEYS, layer_sizes, parse_count  # noqa: E402


def test_layer_sizes_hit_the_parameter_count():
    assert parse_count("3M") == 3_000_000 and parse_count("20K") == 20_000
    assert layer_sizes(3_000_000, 4) == [1024, 1024, 1024, 1024, 10]


def test_training_benchmark_rows_and_correctness(tmp_path):
    out = tmp_path / "rows.json"
    script = os.path.join(REPO, "benchmarks", "training.py")
    code = (f"import sys, runpy; sys.argv = [{script!r}, '--params', '20K', '--steps', '3', '--rounds', '2', "
            f"'--warmup', '1', '--buckets', '25,0.01', '--views', '--json', {str(out)!r}]; "
            f"runpy.run_path({script!r}, run_name='__main__')")
    result = run_python(code, ranks=2, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())
    assert [(row["candidate"], row["bucket_mb"], row["gradient_as_bucket_view"]) for row in rows] == [
        ("mpidist", 25.0, False), ("mpidist", 0.01, False), ("mpidist", 25.0, True), ("mpidist", 0.01, True),
        ("ddp", None, False), ("ddp", None, True), ("local", None, False), ("lockstep", None, False),
        ("single", None, False)]
    for row in rows:
        assert set(row) == set(ROW_KEYS)
        assert row["samples_per_s"] > 0 and len(row["samples_per_s_rounds"]) == 2
        assert row["ranks"] == (1 if row["candidate"] == "single" else 2)
    for row in rows[:6]:
        assert row["correct"] is True, row
        assert row["max_rel_diff_vs_ddp"] <= 1e-5
    # vs_ddp compares with DDP of the same gradient_as_bucket_view setting.
    assert abs(rows[2]["vs_ddp"] - rows[2]["samples_per_s"] / rows[5]["samples_per_s"]) < 1e-2
    assert rows[0]["buckets"] == 1 and rows[1]["buckets"] > 1
    assert rows[1]["comm_ms"] > 0 and rows[1]["exposed_wait_ms"] > 0
    local, lockstep, single = rows[6:]
    assert lockstep["exposed_wait_ms"] >= 0 and lockstep["comm_ms"] is None
    assert local["exposed_wait_ms"] is None and single["exposed_wait_ms"] is None
    assert all(row["correct"] is None for row in rows[6:])
