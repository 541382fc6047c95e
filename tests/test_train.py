"""`mpidist train`, the main job, started the way users start it: mpirun -np 2 mpidist train."""
import os
import re

from conftest import run_python

TRAIN = "from mpidist.cli import main; raise SystemExit(main({args!r}))"


def train(tmp_path, *extra, ranks=2):
    args = ["train", "--no-progress", "--checkpoint-dir", str(tmp_path / "ck"), "--data", str(tmp_path / "d.h5"),
            *extra]
    result = run_python(TRAIN.format(args=args), ranks=ranks, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_train_reaches_95_percent_and_resumes(tmp_path):
    output = train(tmp_path, "--epochs", "12")
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", output).group(1))
    assert accuracy >= 0.95, output
    assert len(os.listdir(tmp_path / "ck")) == 12
    resumed = train(tmp_path, "--epochs", "13", "--resume")
    assert "resumed from" in resumed and "ckpt-0012-" in resumed
    assert any(name.startswith("ckpt-0013-") for name in os.listdir(tmp_path / "ck"))
