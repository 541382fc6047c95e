"""benchmarks/faults.py, one run of three fast scenarios (an elastic rank killed under ULFM, an
exception on one rank, SIGUSR1 to mpirun), on 3 ranks of `mpidist train`: each fault is injected,
the job does what docs/faults.md says, nothing hangs, the resumed runs end with the undisturbed
run's weights bit for bit, the newest checkpoints load; a second call finds every run recorded
and runs none again."""
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

SCENARIOS = ["elastic-kill", "exception", "sigusr1"]


def run_campaign(out, work):
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "faults.py"), "--runs", "1", "--ranks", "3",
                           "--epochs", "2", "--scenarios", ",".join(SCENARIOS), "--out", str(out), "--work", str(work)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)


@pytest.mark.timeout(960)  # seven launches of `mpidist train`: about 2 minutes on a quiet machine
def test_a_sample_of_the_campaign_injects_each_fault_and_nothing_hangs_or_goes_wrong(tmp_path):
    out = tmp_path / "faults"
    result = run_campaign(out, tmp_path / "work")
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in open(f"{out}.jsonl")]
    assert sorted(r["scenario"] for r in records) == sorted(SCENARIOS)
    for record in records:
        assert record["injected"] and record["completed"] and not record["hang"] and not record["wrong"], record
        assert record["detect_s"] < record["recover_s"] and record["named"], record
    summary = json.load(open(f"{out}.json"))["scenarios"]
    for name in SCENARIOS:
        row = summary[name]
        assert (row["runs"], row["completed_as_documented"], row["hangs"], row["wrong"],
                row["unloadable_checkpoints"]) == (1, 1, 0, 0, 0), row
    for name in ("exception", "sigusr1"):  # they end (or stop) the job, and --resume continues
        record = next(r for r in records if r["scenario"] == name)
        assert record["checkpoint_loadable"] is not False and record["relaunch_status"] == 0, record
    assert "| elastic-kill | 1 | 1 | 1 | 0 | 0 | 0 |" in open(f"{out}.md").read()
    again = run_campaign(out, tmp_path / "work")
    assert again.returncode == 0 and again.stdout == "", again.stdout + again.stderr
    assert len(open(f"{out}.jsonl").readlines()) == len(SCENARIOS)


def test_until_crosses_midnight():
    """--until names the next time the UTC clock reads it: 00:30 given at 23:00 is 90 minutes away."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import faults
    eleven_pm = 1796000000 - 1796000000 % 86400 + 23 * 3600
    assert faults.next_utc_time("00:30", eleven_pm) - eleven_pm == 90 * 60
    assert faults.next_utc_time("23:30", eleven_pm) - eleven_pm == 30 * 60
    assert faults.next_utc_time("23:00", eleven_pm) - eleven_pm == 24 * 3600
