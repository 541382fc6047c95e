"""benchmarks/ps.py under a real `mpirun -np 4` with tiny models: every configuration ends with
all-reduce's weights, and the bytes each worker moves per step are those the protocol implies,
counted here from the batches themselves (no timing assertions)."""
import json
import os
import sys

import torch
from conftest import REPO, run_python

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from ps import ROW_KEYS, Scenario, checks, parse_args  # noqa: E402

# The embedding model (all five configurations) and the MLP with Adam (server-bound-mlp): the
# other two models differ from these only in their optimizer or sizes.
QUICK = ["--models", "embedding,server-bound-mlp", "--params", "20K", "--rows", "1K", "--dim", "8", "--batch", "8",
         "--server-bound-batch", "4", "--steps", "2", "--rounds", "1", "--warmup", "1"]


def test_ps_benchmark_rows_bytes_and_correctness(tmp_path):
    out = tmp_path / "rows.json"
    script = os.path.join(REPO, "benchmarks", "ps.py")
    code = (f"import sys, runpy; sys.argv = [{script!r}, *{QUICK!r}, '--json', {str(out)!r}]; "
            f"runpy.run_path({script!r}, run_name='__main__')")
    result = run_python(code, ranks=4, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())
    assert [(row["scenario"], row["config"], row["batch_per_worker"]) for row in rows] == [
        ("embedding", "allreduce", 8), ("embedding", "ps-1", 8), ("embedding", "ps-2", 8), ("embedding", "sparse-ps", 8),
        ("embedding", "sparse-ps-2", 8), ("server-bound-mlp", "allreduce", 4), ("server-bound-mlp", "ps-1", 4),
        ("server-bound-mlp", "ps-2", 4)]
    args = parse_args(QUICK)
    for row in rows:
        assert set(row) == set(ROW_KEYS)
        assert row["correct"] is True and row["max_rel_diff"] <= 1e-5, row
        assert row["samples_per_s"] > 0 and row["workers"] == 2 and row["worker_cpu_ms"] > 0
        assert (row["server_cpu_ms"] is None) == (row["servers"] == 0)
        gradient = 4 * row["params"]  # float32
        if row["servers"] == 0:  # an all-reduce over 2 ranks sends 2 (p - 1) / p = 1 gradient from each
            assert row["bytes_per_step"] == gradient
        elif not row["sparse"]:  # the whole gradient pushed, the whole weights pulled
            assert row["bytes_per_step"] == 2 * gradient
    # Sparse: the head's dense gradient and weights, and for the table each distinct id of the
    # batch (int64) sent twice (asking for its row, pushing its gradient) and its row of `dim`
    # floats moved twice (pulled, gradient pushed).
    head = 4 * sum(p.numel() for p in Scenario("embedding", args, rank=2).build(sparse=False).head.parameters())
    per_worker = []
    for rank in (2, 3):
        pool = Scenario("embedding", args, rank=rank).pool
        distinct = [torch.unique(pool[i][0]).numel() for i in range(args.warmup, args.warmup + args.steps)]
        per_worker.append(2 * head + sum(2 * n * (8 + 4 * args.dim) for n in distinct) / args.steps)
    for config in ("sparse-ps", "sparse-ps-2"):
        row = next(r for r in rows if r["config"] == config)
        assert abs(row["bytes_per_step"] - sum(per_worker) / 2) <= 1, (row, per_worker)
    for line in checks(rows):
        assert line in result.stdout


def row(scenario, config, servers, samples, moved, worker_cpu=1.0, server_cpu=None):
    return {"scenario": scenario, "config": config, "servers": servers, "samples_per_s": samples,
            "bytes_per_step": moved, "worker_cpu_ms": worker_cpu, "server_cpu_ms": server_cpu}


def test_checks_state_each_target_and_when_it_applies():
    rows = [row("mlp", "allreduce", 0, 100, 10), row("mlp", "ps-1", 1, 50, 20, 5.0, 2.0),
            row("mlp", "ps-2", 2, 60, 20, 5.0, 1.0),
            row("embedding", "allreduce", 0, 10, 4000), row("embedding", "sparse-ps", 1, 30, 100),
            row("server-bound", "allreduce", 0, 10, 10), row("server-bound", "ps-1", 1, 10, 20, 1.0, 9.0),
            row("server-bound", "ps-2", 2, 15, 20, 1.0, 5.0)]
    lines = checks(rows)
    assert lines[0].endswith("40x (100 against 4,000 bytes) -> met")
    assert lines[1].endswith("3.00x all-reduce's samples/s -> met")
    assert lines[2].endswith("1.67x the best PS (ps-2) -> met")
    assert "the server is not the bottleneck here" in lines[3] and lines[3].startswith("mlp: 2 servers give 1.20x")
    assert lines[4].startswith("server-bound: 2 servers >= 1.6x") and lines[4].endswith("1.50x -> NOT met")
    assert len(lines) == 5
