"""benchmarks/faults.py's network scenarios across the emulated nodes, one run each.

link-loss: a rank of the second node has a share of its node's packets dropped (a packet filter,
nft) for a few seconds during a step; TCP resends them, the job goes on and ends with the
undisturbed cross-node run's weights bit for bit, and the campaign takes the filter away again.
link-cut: the second node's link goes down for good during a step; the job must end by itself
(the ranks' deadline names the silent ranks, mpirun with TCP keepalive names the lost node), and
`--resume` from the newest checkpoint must end with the undisturbed run's weights. link-down (a
link down for up to 10 s) is left to the campaign.

Collected only inside the emulated cluster (tests/conftest.py): `make test-multinode`, as root."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("nft") is None,
                                reason="link-loss needs nftables' nft (apt-get install -y nftables)")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The campaign's scratch directory, shared: the undisturbed cross-node run is made once."""
    return tmp_path_factory.mktemp("work")


def one_run(scenario: str, work, tmp_path) -> dict:
    out = tmp_path / "faults"
    result = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "faults.py"), "--runs", "1",
                             "--scenarios", scenario, "--out", str(out), "--work", str(work)],
                            capture_output=True, text=True, timeout=540, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    [record] = [json.loads(line) for line in open(f"{out}.jsonl")]
    return record


@pytest.mark.timeout(600)
def test_a_link_dropping_packets_slows_the_job_and_changes_nothing(work, tmp_path):
    record = one_run("link-loss", work, tmp_path)
    assert record["injected"] and record["completed"] and not record["hang"] and not record["wrong"], record
    assert record["spec"]["rank"] >= int(os.environ["MPIDIST_MN_SLOTS"]), record  # a rank of the second node
    assert record["link"]["dropped_packets"] > 0, record  # the filter was there, and dropped some
    node2 = open(os.path.join(os.environ["MPIDIST_MN_DIR"], "node2.pid")).read().strip()
    left = subprocess.run(["nsenter", "-t", node2, "--net", "--", "nft", "list", "ruleset"], capture_output=True,
                          text=True, check=True).stdout
    assert "mpidist_fault" not in left, left  # and is gone


@pytest.mark.timeout(600)
def test_a_link_cut_for_good_ends_the_job_and_resume_continues_exactly(work, tmp_path):
    record = one_run("link-cut", work, tmp_path)
    assert record["injected"] and not record["hang"], record
    assert record["completed"] and not record["wrong"], record  # ended by itself; the resumed run as undisturbed
    assert record["checkpoint_loadable"] is not False, record
    assert record["spec"]["rank"] >= int(os.environ["MPIDIST_MN_SLOTS"]), record  # a rank of the second node
    assert ("PRTE has lost communication with a remote daemon" in record["detected_by"]
            or "no answer from rank" in record["detected_by"]), record
