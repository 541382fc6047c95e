"""benchmarks/small_allreduce.py, shortened, under a real `mpirun -np 3`: every candidate reports,
and a wrong mpidist result makes the command fail (no timing assertions)."""
import json
import os

from conftest import REPO, run_python

SCRIPT = os.path.join(REPO, "benchmarks", "small_allreduce.py")
CANDIDATES = ["mpi4py sum", "mpi4py sum + divide", "mpidist sum", "mpidist avg", "mpidist torch sum",
              "mpidist torch avg", "mpidist node sum", "mpidist node torch sum", "hvd torch sum"]


def run_benchmark(out, before="", args=(), ranks=3, check="0"):
    argv = [SCRIPT, "--counts", "1,33", "--calls", "20", "--rounds", "2", "--json", str(out), *args]
    code = f"import sys, runpy; {before}sys.argv = {argv!r}; runpy.run_path({SCRIPT!r}, run_name='__main__')"
    return run_python(code, ranks=ranks, env={"MPIDIST_CHECK": check}, timeout=120)


def test_small_allreduce_rows(tmp_path):
    out = tmp_path / "rows.json"
    result = run_benchmark(out)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())
    assert [(row["candidate"], row["count"]) for row in rows] == [(c, n) for n in (1, 33) for c in CANDIDATES]
    for row in rows:
        assert row["ranks"] == 3 and row["mpidist_check"] == "0"
        assert row["time_us"] > 0 and len(row["time_us_rounds"]) == 2


def test_small_allreduce_reports_a_wrong_result(tmp_path):
    # mpidist.allreduce made to add one after reducing: the check after the timed calls catches it.
    wrong = ("import mpidist; real = mpidist.allreduce; "
             "mpidist.allreduce = lambda a, **kw: real(a, **kw).__iadd__(1); ")
    result = run_benchmark(tmp_path / "rows.json", before=wrong)
    assert result.returncode != 0
    assert "WRONG: mpidist sum, 1 elements" in result.stdout, result.stdout + result.stderr


def test_chosen_candidates_only_with_the_call_check_on(tmp_path):
    """--candidates runs those named, in the order of the table; with the call check on, the
    mpidist candidates' results are still checked (the first checked all-reduce makes the node
    window, and the calls after it check in it)."""
    out = tmp_path / "rows.json"
    result = run_benchmark(out, args=["--candidates", "mpidist avg,mpi4py sum"], ranks=2, check="1")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())
    assert [(row["candidate"], row["count"], row["mpidist_check"]) for row in rows] == \
        [(c, n, "1") for n in (1, 33) for c in ("mpi4py sum", "mpidist avg")]


def test_an_unknown_candidate_is_a_usage_error(tmp_path):
    result = run_benchmark(tmp_path / "rows.json", args=["--candidates", "mpidist sum,gloo"], ranks=0)
    assert result.returncode == 2
    assert "unknown candidates ['gloo']" in result.stderr, result.stderr
