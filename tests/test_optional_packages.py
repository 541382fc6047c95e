"""`mpidist train` without the packages it needs beyond mpidist's own: one line per package,
from rank 0, naming the package and the pip command that installs it; no traceback."""
from conftest import run_python

# torch hidden on every rank, scikit-learn on rank 1 only, by a finder that answers their imports
# as Python does for a package that is not installed; the digits file is missing, so scikit-learn
# is needed.
HIDDEN_TRAIN = """
import os, sys
HIDDEN = {{"torch"}} | ({{"sklearn"}} if os.environ["OMPI_COMM_WORLD_RANK"] == "1" else set())

class HidePackages:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, HidePackages())
from mpidist.cli import main
raise SystemExit(main(["train", "--no-progress", "--data", {data!r}, "--checkpoint-dir", {checkpoints!r}]))
"""


def test_missing_packages_are_named_once_with_their_install_command(tmp_path):
    code = HIDDEN_TRAIN.format(data=str(tmp_path / "digits.h5"), checkpoints=str(tmp_path / "ck"))
    result = run_python(code, ranks=2, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert lines.count("mpidist: error: mpidist train needs torch (2 of 2 ranks cannot import torch): "
                       "pip install 'mpidist[torch]'") == 1, result.stderr
    assert lines.count("mpidist: error: mpidist train needs scikit-learn (1 of 2 ranks cannot import sklearn): "
                       "pip install 'mpidist[data]'") == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "digits.h5").exists() and not (tmp_path / "ck").exists()
