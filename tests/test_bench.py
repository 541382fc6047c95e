"""`mpidist bench` and `mpidist tune` under a real `mpirun -np 2`, plus their pure helpers."""
import json

import pytest
from conftest import run_python

from mpidist.cli.bench import ROW_KEYS, parse_size, parse_sizes, timing_order
from mpidist.cli.tune import decision_table, one_shot_bound

CLI = "import sys; from mpidist.cli import main; sys.exit(main(sys.argv[1:]))"


def test_sizes_read_like_nccl_tests():
    assert parse_sizes("8, 1K,4KiB,1M,2G") == [8, 1024, 4096, 1024 ** 2, 2 * 1024 ** 3]
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size("12Q")


def test_candidates_run_shuffled_per_iteration_and_gloo_in_a_loop_of_its_own():
    """Every candidate runs once per iteration, in an order that changes between iterations (the
    same on every rank: it depends on the iteration alone); gloo, whose threads go on running
    after its calls, comes after every other candidate's last call, so it is timed next to none."""
    active = ["ring", "gloo", "tree", "mpi", "hierarchical", "auto"]
    order = timing_order(active, 12)
    assert order == timing_order(list(active), 12)
    assert sorted(order) == sorted((iteration, index) for iteration in range(12) for index in range(len(active)))
    gloo = active.index("gloo")
    first_gloo = [index for _, index in order].index(gloo)
    assert all(index == gloo for _, index in order[first_gloo:]) and len(order[first_gloo:]) == 12
    others = [[index for iteration, index in order[:first_gloo] if iteration == k] for k in range(12)]
    assert all(sorted(calls) == [0, 2, 3, 4, 5] for calls in others)
    assert len({tuple(calls) for calls in others}) > 1  # shuffled, not one fixed order


def test_one_shot_bound_ends_where_the_one_shot_first_loses():
    """Up to the geometric mean of its last win and its first loss; 0 if it loses at once, the
    largest size if never; only sizes measured both ways count."""
    sliced = {8: 10.0, 4096: 12.0, 65536: 30.0, 1 << 20: 200.0}
    assert one_shot_bound({8: 5.0, 4096: 6.0, 65536: 40.0, 1 << 20: 100.0}, sliced) == 16384
    assert one_shot_bound({8: 11.0, 4096: 6.0}, sliced) == 0
    assert one_shot_bound({8: 5.0, 4096: 6.0, 65536: 20.0, 1 << 20: 150.0, 1 << 22: 1.0}, sliced) == 1 << 20


def test_decision_table_takes_the_fastest_per_size_and_merges_neighbours():
    rows = [dict(bytes=b, algorithm=a, time_us=t, wrong=w) for b, a, t, w in [
        (8, "tree", 5, 0), (8, "ring", 9, 0), (1024, "tree", 7, 0), (1024, "ring", 8, 0),
        (65536, "tree", 50, 0), (65536, "ring", 30, 0), (1 << 20, "ring", 400, 0), (1 << 20, "tree", 1, 3)]]
    assert decision_table(rows) == [{"max_bytes": 8192, "algorithm": "tree"},
                                    {"max_bytes": None, "algorithm": "ring"}]


def cli_under_mpirun(tmp_path, *args, env=None):
    script = tmp_path / "cli.py"
    script.write_text(CLI)
    return run_python(f"import sys; sys.argv = ['mpidist'] + {list(args)!r}; exec(open({str(script)!r}).read())",
                      ranks=2, env=env, timeout=240)


def test_bench_allreduce_rows_are_right_and_complete(tmp_path):
    out, png = tmp_path / "rows.json", tmp_path / "rows.png"
    result = cli_under_mpirun(tmp_path, "bench", "allreduce", "--sizes", "8,4K,40000", "--dtype", "float32,bfloat16",
                              "--iters", "3", "--warmup", "1", "--json", str(out), "--plot", str(png))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "busbw_gbs" in result.stdout and "#wrong" in result.stdout
    rows = json.loads(out.read_text())
    assert png.stat().st_size > 1000
    algorithms = {row["algorithm"] for row in rows}
    assert {"mpi", "gloo", "auto", "hierarchical", "ring"} <= algorithms
    # 3 sizes x 2 dtypes x (7 of ours + mpi + gloo + the bound), unless gloo lacks bfloat16 here.
    assert len(rows) >= 3 * 2 * 9
    for row in rows:
        assert tuple(row) == ROW_KEYS
        assert row["wrong"] == 0, row
        assert row["ranks"] == 2 and row["collective"] == "allreduce"
        assert row["bytes"] == row["count"] * (4 if row["dtype"] == "float32" else 2)
        # the bound of 8 bytes is nanoseconds: rounded to microseconds' thousandths it may be 0
        assert row["time_us"] >= 0 if row["algorithm"] == "bound" else row["time_us"] > 0
        assert row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] * 2 * (2 - 1) / 2, rel=1e-3, abs=1e-4)
    bounds = {(row["dtype"], row["bytes"]): row["time_us"] for row in rows if row["algorithm"] == "bound"}
    assert sorted(bounds) == sorted((dtype, size) for dtype in ("bfloat16", "float32") for size in (8, 4096, 40000))
    assert bounds["float32", 8] <= bounds["float32", 4096] <= bounds["float32", 40000] > 0


@pytest.mark.parametrize("collective,factor", [("broadcast", 1.0), ("allgather", 0.5), ("reduce_scatter", 0.5)])
def test_bench_other_collectives(tmp_path, collective, factor):
    out = tmp_path / "rows.json"
    result = cli_under_mpirun(tmp_path, "bench", collective, "--sizes", "64,40000", "--iters", "2",
                              "--warmup", "1", "--algorithms", "mpidist,mpi", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())
    assert {row["algorithm"] for row in rows} == {"mpidist", "mpi"} and len(rows) == 4
    for row in rows:
        assert row["wrong"] == 0, row
        assert row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] * factor, rel=1e-3, abs=1e-4)


def test_tune_writes_a_table_that_auto_then_uses(tmp_path):
    table_file = tmp_path / "tuning.json"
    table_file.write_text(json.dumps({"7": [{"max_bytes": None, "algorithm": "ring"}]}))
    env = {"MPIDIST_TUNING_FILE": str(table_file)}
    result = cli_under_mpirun(tmp_path, "tune", "--sizes", "8,4K", "--iters", "3", "--warmup", "1", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    tables = json.loads(table_file.read_text())
    assert tables["7"] == [{"max_bytes": None, "algorithm": "ring"}], "other rank counts are kept"
    assert tables["2"][-1]["max_bytes"] is None
    assert all(row["algorithm"] in ("ring", "tree", "recursive_halving", "recursive_doubling",
                                    "reduce_bcast", "hierarchical", "mpi") for row in tables["2"])
    # A table that picks "tree" everywhere changes auto's answer on every rank, at the sizes it
    # measured (beyond them the cost model fitted to the same run decides: test_cost_model.py).
    assert tables["model"]["measured"]["2"]["largest"] == 4096
    tables["2"] = [{"max_bytes": None, "algorithm": "tree"}]
    table_file.write_text(json.dumps(tables))
    code = """
import numpy as np, mpidist as md
from mpidist.collectives.select import choose_allreduce
comm = md.init()
assert choose_allreduce(2048, 2) != "tree"
assert choose_allreduce(2048, 2, comm.tuning_table) == "tree"
assert (md.allreduce(np.ones(5)) == 2).all()
print("tuned", comm.rank)
"""
    result = run_python(code, ranks=2, env=env)
    assert result.returncode == 0 and result.stdout.count("tuned") == 2, result.stdout + result.stderr
    # A malformed entry is reported and ignored: auto falls back to the built-in table.
    table_file.write_text(json.dumps({"2": [{"max_bytes": None, "algorithm": "butterfly"}]}))
    result = run_python("import mpidist as md; assert md.init().tuning_table is None; print('fallback')",
                        ranks=2, env=env)
    assert result.returncode == 0 and result.stdout.count("fallback") == 2, result.stdout + result.stderr
    assert "ignoring the tuning file" in result.stderr


# Arguments that make no measurement, and the usage error that names them: refused as nccl-tests
# and OSU refuse theirs, not measured as a 4-byte row or a time of no iterations.
REFUSALS = {
    "zero size": (["bench", "allreduce", "--sizes", "0"], "argument --sizes: must be positive numbers of bytes, got 0"),
    "negative size": (["bench", "allreduce", "--sizes", "-5"], "argument --sizes: must be positive numbers of bytes, got -5"),
    "size of no whole element": (["bench", "allreduce", "--sizes", "8,7"],
                                 "argument --sizes: 7 is not a multiple of 4 bytes, the size of one float32 element"),
    "size of no whole element of the second dtype": (
        ["bench", "allreduce", "--sizes", "12", "--dtype", "float32,float64"],
        "argument --sizes: 12 is not a multiple of 8 bytes, the size of one float64 element"),
    "no iterations": (["bench", "allreduce", "--iters", "0"], "argument --iters: must be at least 1, got 0"),
    "negative warmup": (["bench", "allreduce", "--warmup", "-1"], "argument --warmup: must be 0 or more, got -1"),
    "unknown algorithm": (["bench", "allreduce", "--algorithms", "ring,foo"],
                          "argument --algorithms: unknown algorithm 'foo' for allreduce"),
    "algorithm of another collective": (["bench", "broadcast", "--algorithms", "ring"],
                                        "argument --algorithms: unknown algorithm 'ring' for broadcast"),
    "unknown dtype": (["bench", "allreduce", "--dtype", "complex64"], "argument --dtype: unknown dtype complex64"),
    "cuda for another collective": (["bench", "broadcast", "--device", "cuda"],
                                    "argument --device: cuda measures allreduce only"),
    "tune of no size": (["tune", "--sizes", "0"], "argument --sizes: must be positive numbers of bytes, got 0"),
}

# Each rank runs every refused command line in turn: its exit status, what it printed on standard
# error, and whether MPI had started by then.
RUN_REFUSALS = """
import contextlib, io, json, sys
from mpidist.cli import main
results = {}
for case, argv in json.loads(sys.argv[1]).items():
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            main(argv)
            status = None
        except SystemExit as exit:
            status = exit.code
    results[case] = {"status": status, "stderr": stderr.getvalue(), "mpi_started": "mpi4py.MPI" in sys.modules}
print(json.dumps(results), flush=True)
"""


@pytest.fixture(scope="module")
def refusals_under_mpirun():
    """{case: [rank 0's result, rank 1's]} of every refusal under one `mpirun -np 2`."""
    argvs = {case: argv for case, (argv, _) in REFUSALS.items()}
    result = run_python(RUN_REFUSALS, ranks=2, args=[json.dumps(argvs)])
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(ranks) == 2, result.stdout + result.stderr
    # The launcher's rank 0 is the one that prints: find it by what it printed.
    ranks.sort(key=lambda results: not any(r["stderr"] for r in results.values()))
    return {case: [ranks[0][case], ranks[1][case]] for case in REFUSALS}


@pytest.mark.parametrize("case", REFUSALS)
def test_bench_refusal_is_printed_once_naming_the_problem(refusals_under_mpirun, case):
    printer, other = refusals_under_mpirun[case]
    assert printer["stderr"].startswith("usage: mpidist ") and other["stderr"] == ""
    assert ": error: " + REFUSALS[case][1] in printer["stderr"].splitlines()[-1], printer["stderr"]


@pytest.mark.parametrize("case", REFUSALS)
def test_bench_refusal_exits_with_status_2(refusals_under_mpirun, case):
    # Rank 0's status is the job's; the others leave quietly (status 0) so as not to end it first.
    assert [rank["status"] for rank in refusals_under_mpirun[case]] == [2, 0]


@pytest.mark.parametrize("case", REFUSALS)
def test_bench_refusal_comes_before_mpi_starts(refusals_under_mpirun, case):
    assert [rank["mpi_started"] for rank in refusals_under_mpirun[case]] == [False, False]


def test_bench_refusal_under_mpirun_ends_the_job_with_status_2_and_one_message(tmp_path):
    result = cli_under_mpirun(tmp_path, "bench", "allreduce", "--sizes", "0")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("mpidist bench: error: argument --sizes: must be positive") == 1, result.stderr


def test_the_cpu_bound_counts_the_host_protocols_traffic():
    """One-shot (up to ONE_SHOT_BYTES): n in, L n read and n written by the reduction; sliced
    above: bench_bound.window_traffic, 4.5 n on four ranks."""
    from mpidist.cli import bench_bound
    from mpidist.collectives.node_window import ONE_SHOT_BYTES
    assert bench_bound.host_traffic(ONE_SHOT_BYTES, 4) == 7 * ONE_SHOT_BYTES
    assert bench_bound.host_traffic(2 * ONE_SHOT_BYTES, 4) == 4.5 * 2 * ONE_SHOT_BYTES
