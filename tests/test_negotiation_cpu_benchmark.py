"""benchmarks/negotiation_cpu.py, shortened, under a real `mpirun -np 2`: every rank reports its
negotiation thread's cycles and CPU time beside its process's (no timing assertions)."""
import json
import os

from conftest import REPO, run_python

SCRIPT = os.path.join(REPO, "benchmarks", "negotiation_cpu.py")


def test_negotiation_cpu_rows(tmp_path):
    out = tmp_path / "rows.json"
    argv = [SCRIPT, "--steps", "20", "--blocks", "3", "--json", str(out)]
    # As `python benchmarks/negotiation_cpu.py` would: its directory first on the path (machine.py).
    code = (f"import sys, runpy; sys.path.insert(0, {os.path.dirname(SCRIPT)!r}); sys.argv = {argv!r}; "
            f"runpy.run_path({SCRIPT!r}, run_name='__main__')")
    result = run_python(code, ranks=2, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["rank"] for row in rows] == [0, 1]
    for row in rows:
        assert row["ranks"] == 2 and row["steps"] == 20 and row["cycles"] >= 0
        # The thread is one of the process's: its CPU time is part of the process's.
        assert 0 <= row["thread_cpu_s"] <= row["process_cpu_s"], row
    assert "| rank | steps/s | negotiation cycles |" in result.stdout
