"""benchmarks/fast_path_python.py, shortened, under a real `mpirun -np 2`: every candidate reports
and went through the fast path (no timing assertions)."""
import json
import os

from conftest import REPO, run_python

SCRIPT = os.path.join(REPO, "benchmarks", "fast_path_python.py")


def test_fast_path_python_rows(tmp_path):
    out = tmp_path / "rows.json"
    argv = [SCRIPT, "--sizes", "4K,1M", "--calls", "50", "--json", str(out)]
    code = f"import sys, runpy; sys.argv = {argv!r}; runpy.run_path({SCRIPT!r}, run_name='__main__')"
    result = run_python(code, ranks=2, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())
    expected = [("the stub alone", 0)] + [(f"comm.allreduce, {kind}, check {check}", nbytes)
                                          for nbytes in (4096, 1 << 20) for check in ("off", "on")
                                          for kind in ("numpy", "torch")]
    assert [(row["candidate"], row["bytes"]) for row in rows] == expected
    assert all(row["ns_per_call"] > 0 for row in rows)
