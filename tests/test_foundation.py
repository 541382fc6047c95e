"""A single process is a world of size 1; the extension, `mpidist info` and the start-up errors."""
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import run_python


def test_single_process_is_a_world_of_size_one():
    result = run_python(
        "import numpy as np, mpidist as md\n"
        "md.init(); md.init()\n"  # idempotent
        "assert (md.rank(), md.size(), md.local_rank(), md.local_size()) == (0, 1, 0, 1)\n"
        "a = np.arange(5.0)\n"
        "for algorithm in ('ring','tree','recursive_halving','recursive_doubling','reduce_bcast','mpi','auto'):\n"
        "    assert (md.allreduce(a.copy(), op='avg', algorithm=algorithm) == a).all()\n"
        "assert (md.broadcast(a.copy()) == a).all()\n"
        "assert (md.allgather(a) == a).all() and (md.reduce_scatter(a) == a).all()\n"
        "assert (md.allreduce_async(a.copy()).wait() == a).all()\n"
        "print('ok')\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_use_before_init_is_a_clear_error():
    result = run_python(
        "import numpy as np, mpidist as md\n"
        "for call in (md.rank, md.size, md.local_rank, lambda: md.allreduce(np.zeros(2))):\n"
        "    try:\n"
        "        call()\n"
        "    except md.NotInitializedError as exc:\n"
        "        assert 'mpidist.init()' in str(exc)\n"
        "    else:\n"
        "        raise SystemExit('no error')\n"
        "print('ok')\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_importing_leaves_mpi_uninitialized():
    # MPI starts in init(), after mpidist has set its defaults for MPI's options (comm.load_mpi).
    result = run_python(
        "import sys, mpidist, mpidist.torch, mpidist.parallel.data_parallel\n"
        "print('mpi4py.MPI' in sys.modules)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_missing_mpi4py_is_a_clear_error():
    result = run_python(
        "import sys; sys.modules['mpi4py'] = None\n"  # what a machine without mpi4py sees
        "import mpidist as md\n"
        "try:\n"
        "    md.init()\n"
        "except md.MPIUnavailableError as exc:\n"
        "    print(exc)\n")
    assert result.returncode == 0, result.stderr
    assert "mpidist needs mpi4py and an MPI library" in result.stdout


def test_extension_imports_and_reports_its_build():
    import mpidist._C as ext
    assert isinstance(ext.built_with_cuda, bool)


def _info(ranks=0, env=None):
    result = run_python("from mpidist.cli import main; raise SystemExit(main(['info', '--json']))",
                        ranks=ranks, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_info_without_mpirun():
    facts = _info()
    import mpidist._C as ext
    from mpi4py import MPI
    assert facts["ranks"] == 1 and facts["nodes"] == 1 and facts["ranks_per_node"] == [1]
    assert facts["extension_built_with_cuda"] == ext.built_with_cuda
    assert facts["mpi_library"] == MPI.Get_library_version().rstrip("\x00\n ").splitlines()[0]
    assert "ring" in facts["algorithms"] and "recursive_halving" in facts["algorithms"]
    assert facts["numpy"] == np.__version__
    assert isinstance(facts["cuda_aware_mpi"], bool)


def test_info_under_mpirun_with_emulated_nodes():
    facts = _info(ranks=4, env={"MPIDIST_RANKS_PER_NODE": "2"})
    assert facts["ranks"] == 4 and facts["nodes"] == 2 and facts["ranks_per_node"] == [2]


def test_info_text_report():
    result = run_python("from mpidist.cli import main; raise SystemExit(main(['info']))", ranks=2)
    assert result.returncode == 0, result.stderr
    assert "ranks" in result.stdout and "mpi library" in result.stdout
    assert result.stdout.count("mpi library") == 1  # printed by rank 0 only


def test_info_runs_without_torch():
    # torch is a dependency of training only: `mpidist info` must work where it is missing
    result = run_python("import sys; sys.modules['torch'] = None\n"  # what a machine without torch sees
                        "from mpidist.cli import main; raise SystemExit(main(['info', '--json']))", ranks=2)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["ranks"] == 2 and facts["torch"] == "not installed"


def test_cuda_aware_override(monkeypatch):
    from mpidist.runtime.cuda_aware import mpi_library_cuda_aware
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "1")
    assert mpi_library_cuda_aware() is True
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "0")
    assert mpi_library_cuda_aware() is False


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bad_ranks_per_node_is_refused(value):
    result = run_python("import mpidist as md; md.init()", env={"MPIDIST_RANKS_PER_NODE": value})
    assert result.returncode != 0
    assert f"MPIDIST_RANKS_PER_NODE={value!r} must be a positive integer" in result.stderr


def test_version_option_prints_the_installed_version():
    from importlib.metadata import version
    result = subprocess.run([sys.executable, "-m", "mpidist.cli", "--version"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"mpidist {version('mpidist')}\n"
