"""Shared test helpers.

Multi-rank tests use pytest-isolate-mpi: `@pytest.mark.mpi(ranks=[2, 3])` plus an `mpi_ranks`
argument runs the test under `mpirun -np N` once per N and reports every rank's traceback. In the
modules marked `mpi_shared_launch` one launch per N runs all of their tests of N ranks
(mpi_shared_launch.py).
Inside the ranks, pytest-timeout (pyproject.toml) dumps all stacks and exits a hung rank, and
the plugin's --mpi-default-test-timeout kills the whole launch as a last resort.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import mpi_shared_launch
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tests/multinode runs inside the emulated cluster only (tests/multinode/cluster.sh sets
# MPIDIST_MN_NODES; `make test-multinode`): its tests need the cluster's nodes.
collect_ignore = [] if os.environ.get("MPIDIST_MN_NODES") else ["multinode"]

# The tests expect algorithm="auto"'s built-in tables, whatever `mpidist tune` wrote on this
# machine (tests of the tuning file pass their own path).
os.environ["MPIDIST_TUNING_FILE"] = os.path.join(REPO, "tests", "no-such-dir", "tuning.json")

# The MPI test processes import mpi4py (initializing MPI) before mpidist can set its default
# leaving out Open MPI's UCX one-sided component (runtime/mpi.py), which prints an error at the
# first shared window when no UCX network is present. They inherit this environment.
os.environ.setdefault("OMPI_MCA_osc", "^ucx")
# Open MPI's libfabric transport (btl ofi) looks for a fabric at every MPI_Init and waits a second
# before it gives up when there is none; the suite starts MPI hundreds of times, one after another,
# on one machine, where the shared-memory and TCP transports carry everything.
os.environ.setdefault("OMPI_MCA_btl", "^ofi")

# Every multi-rank test starts one pytest per rank (pytest-isolate-mpi), and Hypothesis's pytest
# plugin costs each of them about 2 s of start-up (a 2-rank launch took 16.8 s of CPU with it in
# the ranks, 12.3 s without, on a 2-core machine). The ranks do not need it: the one multi-rank property test
# (test_collectives.py) runs on its own derandomized settings. The ranks inherit this setting.
#
# pytest-timeout dumps a hung rank's stacks from a Python thread, which needs the GIL: a rank stuck
# in native code that holds it would stay silent until the launch is killed (400 s). The ranks
# therefore also run pytest's faulthandler watchdog, which dumps every thread's stack without the
# GIL a minute after pytest-timeout would have, then ends the rank (and with it the launch).
RANK_WATCHDOG_S = 300
if "PYTEST_ISOLATE_MPI_IS_FORKED" not in os.environ:
    _addopts = os.environ.get("PYTEST_ADDOPTS", "")
    if "no:hypothesispytest" not in _addopts:
        _addopts = (f"{_addopts} -p no:hypothesispytest -o faulthandler_timeout={RANK_WATCHDOG_S} "
                    "-o faulthandler_exit_on_timeout=true").strip()
        os.environ["PYTEST_ADDOPTS"] = _addopts


@pytest.hookimpl(tryfirst=True)  # before pytest's own, which reads basetemp
def pytest_configure(config):
    # pytest-isolate-mpi passes the verbosity on to the ranks' pytest as "-" + "v" * verbosity,
    # which for `pytest -q` (verbosity -1) is a bare "-" that the ranks reject, failing every
    # multi-rank test. Quiet runs therefore report at the default verbosity.
    if config.option.verbose < 0:
        config.option.verbose = 0
    # Temporary directories. By default each pytest session numbers its own beside the others'
    # (/tmp/pytest-of-<user>/pytest-<n>) and deletes all but the newest three; the ranks' sessions
    # of pytest-isolate-mpi, started per test, cache their directory for the next ones, so one
    # session deleted directories that later ranks (and this session) were still given. Instead
    # this session makes one directory for the whole run, and each rank session one inside it,
    # all removed when this session ends.
    if config.option.basetemp is not None:
        return
    if "PYTEST_ISOLATE_MPI_IS_FORKED" not in os.environ:
        run_directory = tempfile.mkdtemp(prefix="mpidist-tests-")
        os.environ["MPIDIST_TESTS_TMP"] = run_directory  # inherited by the ranks' sessions
        config.option.basetemp = os.path.join(run_directory, "main")
        config.add_cleanup(lambda: shutil.rmtree(run_directory, ignore_errors=True))
    elif "MPIDIST_TESTS_TMP" in os.environ:
        config.option.basetemp = tempfile.mkdtemp(prefix="rank-", dir=os.environ["MPIDIST_TESTS_TMP"])


def pytest_sessionstart(session):
    # Here rather than in pytest_configure: after pytest-isolate-mpi has registered its plugin.
    mpi_shared_launch.register(session.config)


def run_python(code: str, *, ranks: int = 0, env=None, timeout: int = 120, args=(), mpirun_options=()):
    """Run `code` in a fresh interpreter with `args`, under `mpirun -np ranks` (and
    `mpirun_options`) when ranks > 0."""
    cmd = [sys.executable, "-c", code, *args]
    if ranks:
        cmd = ["mpirun", *mpirun_options, "--oversubscribe", "--bind-to", "none", "-np", str(ranks)] + cmd
    full_env = dict(os.environ)
    for hint in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PYTEST_ISOLATE_MPI_IS_FORKED"):
        full_env.pop(hint, None)
    full_env.update(env or {})
    # A TMPDIR of its own, as the suite's launches have (mpi_shared_launch.py): an mpirun killed
    # by a timeout leaves its session directory there, which must not meet a later mpirun.
    with tempfile.TemporaryDirectory(prefix="run-", dir=os.environ.get("MPIDIST_TESTS_TMP")) as tmp:
        if "TMPDIR" not in (env or {}):
            full_env["TMPDIR"] = tmp
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)


def make_array(kind: str, values: np.ndarray, dtype: str):
    """values (float64 NumPy) as a `kind` ("numpy"/"torch") array of `dtype`, rounded to it."""
    import torch
    tensor = torch.from_numpy(np.array(values, copy=True)).to(getattr(torch, dtype))
    if kind == "torch":
        return tensor
    assert dtype != "bfloat16", "NumPy has no bfloat16"
    return tensor.numpy()


def to_float64(array) -> np.ndarray:
    import torch
    if isinstance(array, torch.Tensor):
        return array.to(torch.float64).numpy()
    return np.asarray(array, dtype=np.float64)


def raw_bytes(array) -> bytes:
    import torch
    if isinstance(array, torch.Tensor):
        return array.contiguous().view(torch.uint8).numpy().tobytes() if array.numel() else b""
    return np.ascontiguousarray(array).tobytes()


@pytest.fixture
def mpi_world():
    import mpidist as md
    return md.init()


@pytest.fixture
def own_comm():
    """A Communicator of the test's own over MPI's world, freed after it. Tests that start an
    asynchronous engine, turn the call check off or need neither done use it, so that the world
    communicator (mpi_world) stays as the later tests of a shared launch expect."""
    from mpi4py import MPI

    import mpidist as md
    comm = md.Communicator(MPI.COMM_WORLD)
    yield comm
    comm.free()
