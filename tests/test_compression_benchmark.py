"""benchmarks/compression.py: its arguments are checked, and a tiny run of its ranks on this
machine (--local, no emulated nodes) writes complete rows: the test loss at every evaluation,
the final weights' distance from none's, torch's PowerSGD hook registered as it is over gloo and
over the "mpidist" backend (no timing assertions)."""
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from compression import HISTORY_KEYS, ROW_KEYS, parse_args  # noqa: E402

SCRIPT = os.path.join(REPO, "benchmarks", "compression.py")


@pytest.mark.parametrize("argv, message", [
    (["--compressions", "none,zip"], "compression 'zip' is unknown"),
    (["--compressions", "powersgd:0"], "PowerSGD rank=0"),
    (["--compressions", "ddp-powersgd:x"], "ddp-powersgd:x: give ddp-powersgd:<rank>"),
    (["--compressions", "ddp-mpidist-powersgd:0"], "ddp-mpidist-powersgd:0: give ddp-mpidist-powersgd:<rank>"),
    (["--layouts", "2by2"], "--layouts 2by2: give NODESxRANKS_PER_NODE"),
    (["--layouts", "0x2"], "--layouts 0x2: give NODESxRANKS_PER_NODE"),
    (["--steps", "5", "--start", "5"], "--start 5: give 0 <= start < --steps"),
    (["--batch", "0"], "--batch must be >= 1"),
])
def test_bad_arguments_are_refused_by_name(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_args(["--local", *argv])
    assert message in capsys.readouterr().err


CONFIGURATIONS = ["none", "fp16", "powersgd:1", "int8", "ddp-powersgd:1", "ddp-mpidist-powersgd:1"]
TORCH_HOOK = "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny --local run of two ranks, its JSON's run and its markdown, for the tests below."""
    output = tmp_path_factory.mktemp("compression") / "compression"
    result = subprocess.run([sys.executable, SCRIPT, "--local", "--layouts", "1x2", "--hidden", "32", "--steps", "4",
                             "--start", "2", "--eval-every", "2", "--compressions", ",".join(CONFIGURATIONS),
                             "--output", str(output)], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    [run] = json.loads(output.with_suffix(".json").read_text())["runs"]
    return run, output.with_suffix(".md").read_text()


def test_a_tiny_local_run_writes_every_configuration(tiny_run):
    run, _ = tiny_run
    assert (run["nodes"], run["ranks_per_node"]) == (1, 2)
    assert [row["configuration"] for row in run["rows"]] == CONFIGURATIONS


def test_every_row_has_every_field(tiny_run):
    run, _ = tiny_run
    for row in run["rows"]:
        assert set(row) == set(ROW_KEYS)
        assert row["steps"] == 4 and row["step_ms"] > 0
        assert row["bytes_per_step"] is None  # no emulated link to count them on
        assert 0 <= row["final_accuracy"] <= 1


def test_the_test_loss_is_kept_at_every_evaluation(tiny_run):
    run, _ = tiny_run
    for row in run["rows"]:
        assert all(len(entry) == len(HISTORY_KEYS) for entry in row["history"])
        assert [entry[0] for entry in row["history"]] == [2, 4]
        assert all(entry[3] > 0 for entry in row["history"])
        assert row["final_loss"] == row["history"][-1][3]


def test_the_ddp_peers_hold_torchs_own_hook(tiny_run):
    """Registered as users register it: DDP holds powerSGD_hook itself, no wrapper around it."""
    run, _ = tiny_run
    hooks = {row["configuration"]: row["comm_hook"] for row in run["rows"]}
    assert hooks == {name: TORCH_HOOK if name.startswith("ddp-") else None for name in CONFIGURATIONS}


def test_every_compressor_moves_the_weights_away_from_none(tiny_run):
    run, _ = tiny_run
    distances = {row["configuration"]: (row["distance_from_none_relative"], row["distance_from_none_max_abs"])
                 for row in run["rows"]}
    assert distances.pop("none") == (0, 0)
    assert all(relative > 0 and max_abs > 0 for relative, max_abs in distances.values()), distances


def test_the_ddp_peers_start_from_the_same_plain_steps(tiny_run):
    """Before PowerSGD starts its steps are plain all-reduces, ours and DDP's over either
    backend: the same model from the same weights on the same batches, up to the all-reduces'
    rounding."""
    run, _ = tiny_run
    rows = {row["configuration"]: row for row in run["rows"]}
    first_loss = rows["none"]["history"][0][3]
    for name in ("powersgd:1", "ddp-powersgd:1", "ddp-mpidist-powersgd:1"):
        assert rows[name]["history"][0][3] == pytest.approx(first_loss, rel=1e-5)


def test_the_markdown_has_a_table_row_per_configuration(tiny_run):
    _, markdown = tiny_run
    assert "## 1 nodes x 2 ranks per node" in markdown and "load average" in markdown
    assert "final test loss" in markdown and "weights vs none: relative L2" in markdown
    assert all(f"| {configuration} |" in markdown for configuration in CONFIGURATIONS)


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
