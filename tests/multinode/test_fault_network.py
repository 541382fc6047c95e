"""benchmarks/faults.py's network scenario across the emulated nodes, one run: a rank of the second
node has a share of its node's packets dropped (a packet filter, nft) for a few seconds during a
step; TCP resends them, the job goes on and ends with the undisturbed cross-node run's weights bit
for bit, and the campaign takes the filter away again. Only link-loss is sampled here: a link
down for tens of seconds (link-down) or for good (link-cut) takes minutes (docs/faults.md).

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


@pytest.mark.timeout(600)
def test_a_link_dropping_packets_slows_the_job_and_changes_nothing(tmp_path):
    out = tmp_path / "faults"
    result = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "faults.py"), "--runs", "1",
                             "--scenarios", "link-loss", "--out", str(out), "--work", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=540, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    [record] = [json.loads(line) for line in open(f"{out}.jsonl")]
    assert record["injected"] and record["completed"] and not record["hang"] and not record["wrong"], record
    assert record["spec"]["rank"] >= int(os.environ["MPIDIST_MN_SLOTS"]), record  # a rank of the second node
    assert record["link"]["dropped_packets"] > 0, record  # the filter was there, and dropped some
    node2 = open(os.path.join(os.environ["MPIDIST_MN_DIR"], "node2.pid")).read().strip()
    left = subprocess.run(["nsenter", "-t", node2, "--net", "--", "nft", "list", "ruleset"], capture_output=True,
                          text=True, check=True).stdout
    assert "mpidist_fault" not in left, left  # and is gone
