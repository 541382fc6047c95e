"""benchmarks/compression.py: its arguments are checked, and a tiny run of its ranks on this
machine (--local, no emulated nodes) writes complete rows (no timing assertions)."""
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from compression import ROW_KEYS, parse_args  # noqa: E402

SCRIPT = os.path.join(REPO, "benchmarks", "compression.py")


@pytest.mark.parametrize("argv, message", [
    (["--compressions", "none,zip"], "compression 'zip' is unknown"),
    (["--compressions", "powersgd:0"], "PowerSGD rank=0"),
    (["--compressions", "ddp-powersgd:x"], "ddp-powersgd:x: give ddp-powersgd:<rank>"),
    (["--layouts", "2by2"], "--layouts 2by2: give NODESxRANKS_PER_NODE"),
    (["--layouts", "0x2"], "--layouts 0x2: give NODESxRANKS_PER_NODE"),
    (["--steps", "5", "--start", "5"], "--start 5: give 0 <= start < --steps"),
    (["--batch", "0"], "--batch must be >= 1"),
])
def test_bad_arguments_are_refused_by_name(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_args(["--local", *argv])
    assert message in capsys.readouterr().err


def test_a_tiny_local_run_writes_every_configuration(tmp_path):
    output = tmp_path / "compression"
    configurations = ["none", "powersgd:1", "int8", "ddp-powersgd:1"]
    result = subprocess.run([sys.executable, SCRIPT, "--local", "--layouts", "1x2", "--hidden", "32", "--steps", "4",
                             "--start", "2", "--eval-every", "2", "--compressions", ",".join(configurations),
                             "--output", str(output)], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads(output.with_suffix(".json").read_text())
    [run] = results["runs"]
    assert (run["nodes"], run["ranks_per_node"]) == (1, 2)
    rows = run["rows"]
    assert [row["configuration"] for row in rows] == configurations
    for row in rows:
        assert set(row) == set(ROW_KEYS)
        assert row["steps"] == 4 and row["step_ms"] > 0
        assert row["bytes_per_step"] is None  # no emulated link to count them on
        assert [step for step, _, _ in row["accuracy_history"]] == [2, 4]
        assert 0 <= row["final_accuracy"] <= 1
    # Before PowerSGD starts its steps are plain all-reduces, ours and DDP's over gloo: the same
    # model from the same weights on the same batches (up to an image whose prediction the
    # all-reduces' rounding flips).
    first_accuracies = [row["accuracy_history"][0][2] for row in rows if "powersgd" in row["configuration"]]
    for accuracy in first_accuracies:
        assert abs(accuracy - rows[0]["accuracy_history"][0][2]) <= 1 / 297 + 1e-12
    markdown = output.with_suffix(".md").read_text()
    assert "## 1 nodes x 2 ranks per node" in markdown and "load average" in markdown
    assert all(f"| {configuration} |" in markdown for configuration in configurations)


def test_int8_compute_benchmark_writes_both_rows(tmp_path):
    """benchmarks/int8_compute.py on a tiny model: a row for torch's operations and one for the
    kernels, each with a positive CPU time per round."""
    output = tmp_path / "int8.json"
    result = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "int8_compute.py"), "--hidden", "40",
                             "--chunk", "16", "--steps", "2", "--rounds", "2", "--output", str(output)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| torch operations |" in result.stdout and "| mpidist._C kernels |" in result.stdout
    measured = json.loads(output.read_text())["cpu_seconds_per_step"]
    assert sorted(measured) == ["mpidist._C kernels", "torch operations"]
    assert all(len(rounds) == 2 and min(rounds) > 0 for rounds in measured.values())
