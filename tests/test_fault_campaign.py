"""benchmarks/faults.py, one run of four fast scenarios (an elastic rank killed under ULFM, an
exception on one rank, SIGUSR1 to mpirun, a parameter-server worker killed under ULFM), on 3
ranks of `mpidist train`: each fault is injected, the job does what docs/faults.md says, nothing
hangs, nothing goes wrong, the newest checkpoints load; a second call finds every run and
reference recorded and runs none again.

What the campaign decides, the tests here check on their own where they can: the resumed runs'
final checkpoints, read with h5py, hold the reference run's weights bit for bit; the parameter
server's accuracies (its run's and its references') are those of the weights in their final
checkpoints, computed here in float64 NumPy from the files; a reference's work is the gradients
its last checkpoint counts; the killed worker's run lost no more than that worker's share of the
work; and the campaign's rule rejects a run below its references' spread.
"""
import glob
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from conftest import REPO

SCENARIOS = ["elastic-kill", "exception", "sigusr1", "ps-async-kill"]
REFERENCES = 2  # undisturbed parameter-server runs per length: the fewest that have a spread
# The campaign (twelve launches of `mpidist train`: about 3 minutes on a quiet machine) runs in the
# first test that needs it.
pytestmark = pytest.mark.timeout(960)


def run_campaign(out, work):
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "faults.py"), "--runs", "1", "--ranks", "3",
                           "--epochs", "2", "--references", str(REFERENCES), "--scenarios", ",".join(SCENARIOS),
                           "--out", str(out), "--work", str(work)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    """The campaign's files: out (prefix of .jsonl, .json, .md), work (the runs' directories),
    the records of its runs and references, and the result of a second call."""
    base = tmp_path_factory.mktemp("campaign")
    out, work = base / "faults", base / "work"
    result = run_campaign(out, work)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in open(f"{out}.jsonl")]
    again = run_campaign(out, work)
    return {"out": out, "work": work, "again": again, "records_before_again": len(records),
            "runs": {r["scenario"]: r for r in records if "scenario" in r},
            "references": [r for r in records if "reference" in r]}


def digits_accuracy(checkpoint) -> tuple:
    """The test accuracy of the MLP of `mpidist train` in `checkpoint`, in float64 NumPy, from
    the files alone (h5py), and one test item's share of it."""
    from mpidist.data import default_digits_path
    with h5py.File(checkpoint, "r") as f:
        layers = [(f[f"model/{i}.weight"][()].astype(np.float64), f[f"model/{i}.bias"][()].astype(np.float64))
                  for i in (0, 2, 4)]
    with h5py.File(default_digits_path(), "r") as f:
        x, y = f["test/x"][()].astype(np.float64), f["test/y"][()]
    for i, (weight, bias) in enumerate(layers):
        x = x @ weight.T + bias
        if i < len(layers) - 1:
            x = np.maximum(x, 0)
    return float(np.mean(x.argmax(axis=1) == y)), 1 / len(y)


def model_weights(checkpoint: str) -> dict:
    with h5py.File(checkpoint, "r") as f:
        return {name: f[f"model/{name}"][()] for name in f["model"]}


def newest(directory) -> str:
    return sorted(glob.glob(os.path.join(directory, "*.h5")))[-1]


def test_a_sample_of_the_campaign_injects_each_fault_and_nothing_hangs_or_goes_wrong(campaign):
    runs = campaign["runs"]
    assert sorted(runs) == sorted(SCENARIOS)
    for record in runs.values():
        assert record["injected"] and record["completed"] and not record["hang"] and not record["wrong"], record
        assert record["detect_s"] < record["recover_s"] and record["named"], record
    summary = json.load(open(f"{campaign['out']}.json"))["scenarios"]
    for name in SCENARIOS:
        row = summary[name]
        assert (row["runs"], row["completed_as_documented"], row["hangs"], row["wrong"],
                row["unloadable_checkpoints"]) == (1, 1, 0, 0, 0), row
    for name in ("exception", "sigusr1"):  # they end (or stop) the job, and --resume continues
        assert runs[name]["checkpoint_loadable"] is not False and runs[name]["relaunch_status"] == 0, runs[name]
    assert "| elastic-kill | 1 | 1 | 1 | 0 | 0 | 0 |" in open(f"{campaign['out']}.md").read()


def test_a_second_call_runs_nothing_again(campaign):
    again = campaign["again"]
    assert again.returncode == 0 and again.stdout == "", again.stdout + again.stderr
    assert len(open(f"{campaign['out']}.jsonl").readlines()) == campaign["records_before_again"]


def reference_directory(campaign, record):
    return campaign["work"] / f"reference-{record['reference']}-seed{record['reference_seed']}-epochs" \
        f"{record['training_epochs']}" / "checkpoints"


def test_the_parameter_server_job_has_its_references_per_seed_for_two_and_one_epochs(campaign):
    assert sorted((r["reference_seed"], r["training_epochs"]) for r in campaign["references"]) == \
        [(seed, epochs) for seed in range(REFERENCES) for epochs in (1, 2)]


def test_the_resumed_runs_end_with_the_reference_weights_read_from_their_checkpoints(campaign):
    reference = model_weights(newest(campaign["work"] / "reference-data" / "checkpoints"))
    for name in ("exception", "sigusr1"):
        resumed = model_weights(newest(campaign["work"] / f"{name}-0" / "checkpoints"))
        assert resumed.keys() == reference.keys() and all(np.array_equal(resumed[k], reference[k]) for k in reference)


def test_the_parameter_server_run_has_the_accuracy_of_its_final_weights(campaign):
    accuracy, item = digits_accuracy(campaign["work"] / "ps-async-kill-0" / "checkpoints" / "ps-final.h5")
    assert abs(accuracy - campaign["runs"]["ps-async-kill"]["accuracy"]) <= item  # float64 here, float32 there


def test_the_references_have_the_accuracies_of_their_final_weights(campaign):
    for record in campaign["references"]:
        accuracy, item = digits_accuracy(reference_directory(campaign, record) / "ps-final.h5")
        assert abs(accuracy - record["accuracy"]) <= item, record


def test_a_reference_work_is_the_gradients_its_last_checkpoint_counts(campaign):
    """In async mode every step's gradient is applied: the last checkpoint, of the last update,
    counts them all per worker."""
    for record in campaign["references"]:
        with h5py.File(newest(reference_directory(campaign, record) / "ps"), "r") as f:
            assert sum(json.loads(f.attrs["extra"])["applied"].values()) == record["work"], record


def test_the_killed_workers_run_lost_at_most_that_workers_share_of_the_work(campaign):
    workers = 2  # of 3 ranks, rank 0 serves
    assert 0 < campaign["runs"]["ps-async-kill"]["lost_share"] <= 1 / workers


def faults_module():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import faults
    return faults


def test_a_parameter_server_run_below_its_references_spread_after_as_much_work_is_wrong():
    """Two seeds' references at 0.6 and 0.7 with 100 steps of work, 0.9 and 0.95 with 200: a run
    with 100 may go down to 0.5, one with 150 to 0.675, one with 200 to 0.85 (with 0.15 below the
    references, as the campaign once allowed, 0.80 would have passed)."""
    faults = faults_module()
    references = [{"reference_seed": seed, "work": work, "accuracy": accuracy}
                  for seed, work, accuracy in ((0, 100, 0.6), (0, 200, 0.9), (1, 100, 0.7), (1, 200, 0.95))]
    verdicts = [faults.accuracy_verdict(accuracy, work, references, 0.01)["wrong"]
                for accuracy, work in ((0.51, 100), (0.49, 100), (0.68, 150), (0.67, 150), (0.86, 200), (0.84, 200),
                                       (0.80, 200))]
    assert verdicts == [False, True, False, True, False, True, True]


def test_a_parameter_server_run_with_no_accuracy_is_wrong():
    faults = faults_module()
    references = [{"reference_seed": seed, "work": 200, "accuracy": 0.9} for seed in (0, 1)]
    assert faults.accuracy_verdict(None, 200, references, 0.01)["wrong"]


def test_the_rule_s_false_alarms_are_the_references_it_calls_wrong_against_the_other_seeds():
    """Three seeds at 0.90, 0.91 and 0.70 for all the work: judged against the other two, 0.70 is
    below 0.90 - 0.01 and wrong, the others are within (0.70 - 0.21 and 0.70 - 0.20); with two
    seeds there is no spread to judge one by, and nothing is counted."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import fault_accuracy
    references = [{"reference_seed": seed, "work": work, "accuracy": accuracy}
                  for seed, accuracy in enumerate((0.90, 0.91, 0.70)) for work in (100, 200)]
    assert fault_accuracy.undisturbed_below_bound(references, 0.01) == (2, 6)
    assert fault_accuracy.undisturbed_below_bound(references[:4], 0.01) == (0, 0)


def test_until_crosses_midnight():
    """--until names the next time the UTC clock reads it: 00:30 given at 23:00 is 90 minutes away."""
    faults = faults_module()
    eleven_pm = 1796000000 - 1796000000 % 86400 + 23 * 3600
    assert faults.next_utc_time("00:30", eleven_pm) - eleven_pm == 90 * 60
    assert faults.next_utc_time("23:30", eleven_pm) - eleven_pm == 30 * 60
    assert faults.next_utc_time("23:00", eleven_pm) - eleven_pm == 24 * 3600
