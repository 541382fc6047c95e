"""benchmarks/zero.py under a real `mpirun -np 2` with a tiny model: the rows are complete, the
sharded Adam ends with the plain Adam's parameters and holds less state per rank (no timing
assertions)."""
import json
import os

from conftest import REPO, run_python


def test_zero_benchmark_rows_and_correctness(tmp_path):
    out = tmp_path / "rows.json"
    script = os.path.join(REPO, "benchmarks", "zero.py")
    code = (f"import sys, runpy; sys.argv = [{script!r}, '--params', '20K', '--steps', '3', '--rounds', '2', "
            f"'--warmup', '1', '--json', {str(out)!r}]; runpy.run_path({script!r}, run_name='__main__')")
    result = run_python(code, ranks=2, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    plain, zero = json.loads(out.read_text())
    assert (plain["candidate"], zero["candidate"]) == ("adam", "zero adam")
    assert plain["correct"] is zero["correct"] is True and zero["max_rel_diff_vs_adam"] <= 1e-5
    # Adam keeps two float32 moments of every element and a float32 step count per tensor (4
    # linear layers: 8 tensors).
    assert plain["state_bytes_per_rank"] == 2 * 4 * plain["params"] + 4 * 8
    assert zero["state_bytes_per_rank"] < plain["state_bytes_per_rank"]
    assert zero["state_vs_adam"] == zero["state_bytes_per_rank"] / plain["state_bytes_per_rank"]
    for row in (plain, zero):
        assert row["samples_per_s"] > 0 and len(row["samples_per_s_rounds"]) == 2 and row["optimizer_ms"] > 0
