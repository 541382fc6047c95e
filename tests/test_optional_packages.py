"""`mpidist train` and `bench` without the packages they need beyond mpidist's own: one line per
package, from rank 0, naming the package and the pip command that installs it; no traceback,
and nothing run."""
from conftest import run_python

# A finder that answers the imports of the packages in `hidden` (a set, per rank) as Python does
# for a package that is not installed, then the command `args`.
HIDING_RUN = """
import os, sys
HIDDEN = {hidden}

class HidePackages:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, HidePackages())
from mpidist.cli import main
raise SystemExit(main({args!r}))
"""


def run_hiding(hidden: str, args):
    result = run_python(HIDING_RUN.format(hidden=hidden, args=args), ranks=2, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result


def test_train_names_missing_packages_once_with_their_install_command(tmp_path):
    # torch hidden on every rank, scikit-learn on rank 1 only; the digits file is missing, so
    # scikit-learn is needed.
    hidden = '{"torch"} | ({"sklearn"} if os.environ["OMPI_COMM_WORLD_RANK"] == "1" else set())'
    result = run_hiding(hidden, ["train", "--no-progress", "--data", str(tmp_path / "digits.h5"),
                                 "--checkpoint-dir", str(tmp_path / "ck")])
    lines = result.stderr.splitlines()
    assert lines.count("mpidist: error: mpidist train needs torch (2 of 2 ranks cannot import torch): "
                       "pip install 'mpidist[torch]'") == 1, result.stderr
    assert lines.count("mpidist: error: mpidist train needs scikit-learn (1 of 2 ranks cannot import sklearn): "
                       "pip install 'mpidist[data]'") == 1, result.stderr
    assert not (tmp_path / "digits.h5").exists() and not (tmp_path / "ck").exists()


def test_bench_names_matplotlib_before_it_measures(tmp_path):
    result = run_hiding('{"matplotlib"}', ["bench", "allreduce", "--sizes", "8", "--iters", "2",
                                           "--plot", str(tmp_path / "plot.png")])
    assert result.stderr.splitlines().count(
        "mpidist: error: mpidist bench needs matplotlib (2 of 2 ranks cannot import matplotlib): "
        "pip install 'mpidist[bench]'") == 1, result.stderr
    assert "busbw" not in result.stdout and not (tmp_path / "plot.png").exists(), result.stdout
