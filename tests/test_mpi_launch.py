"""The suite's own launcher (mpi_shared_launch.py): a multi-rank test is green only when every rank
ended well. Each check plants ranks that misbehave after their last report in a small test
project of its own, runs pytest on it as `make test` runs the suite, and reads the outcome of
every test from its JUnit XML; the project's modules run in one pytest session, as the suite's do."""
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ElementTree

import pytest
from conftest import REPO

TESTS = os.path.join(REPO, "tests")

CONFTEST = f"""
import sys
sys.path.insert(0, {TESTS!r})
import mpi_shared_launch

def pytest_sessionstart(session):
    mpi_shared_launch.register(session.config)
"""

PYTEST_INI = """
[pytest]
addopts = -p no:randomly -p no:cacheprovider --mpi-default-test-timeout=120
mpi_executable = mpirun
mpi_option_for_processes = -np
mpi_command_line_args = --oversubscribe --bind-to none
markers =
    mpi_shared_launch: shared
    mpi_own_launch: own
"""

# Rank 1 ends its process with `status` once everything else is done (after pytest wrote every
# report), before MPI is finalized; or, with `hang_s`, it sleeps that long first.
PLANT = """
import atexit, os, time
import pytest

def end_rank_one_later(status=3, hang_s=0):
    from mpi4py import MPI
    if MPI.COMM_WORLD.rank == 1:
        atexit.register(lambda: (time.sleep(hang_s), os._exit(status)))
"""

SHARED = PLANT + """
pytestmark = pytest.mark.mpi_shared_launch

@pytest.mark.mpi(ranks=[2])
def test_first(mpi_ranks):
    pass

@pytest.mark.mpi(ranks=[2])
def test_second_plants(mpi_ranks):
    end_rank_one_later()
"""

OWN = PLANT + """
@pytest.mark.mpi(ranks=[2])
def test_own_plants(mpi_ranks):
    end_rank_one_later()
"""

HANG = PLANT + """
pytestmark = pytest.mark.mpi_shared_launch

@pytest.mark.mpi(ranks=[2], timeout=10)
def test_hangs_after_report(mpi_ranks):
    end_rank_one_later(status=0, hang_s=600)
"""

GOOD = """
import pytest
pytestmark = pytest.mark.mpi_shared_launch

@pytest.mark.mpi(ranks=[2, 3])
def test_passes(mpi_ranks):
    pass

@pytest.mark.mpi(ranks=[2, 3])
def test_fails_on_the_last_rank(mpi_ranks):
    from mpi4py import MPI
    assert MPI.COMM_WORLD.rank != MPI.COMM_WORLD.size - 1, "planted failure"

@pytest.mark.mpi(ranks=[3])
def test_after_a_failure(mpi_ranks):
    pass
"""


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Runs pytest, as `make test` does, on a project of every planted module; returns
    ({test id: outcome}, {test id: failure text}, pytest's output)."""
    project = tmp_path_factory.mktemp("planted")
    files = {"conftest.py": CONFTEST, "pytest.ini": PYTEST_INI, "test_shared.py": SHARED, "test_own.py": OWN,
             "test_hang.py": HANG, "test_good.py": GOOD}
    for name, source in files.items():
        (project / name).write_text(textwrap.dedent(source))
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_", "OMPI_COMM_WORLD"))}
    result = subprocess.run([sys.executable, "-m", "pytest", "--junitxml", str(project / "junit.xml"), str(project)],
                            cwd=project, env=env, capture_output=True, text=True, timeout=600)
    outcomes, failures = {}, {}
    for case in ElementTree.parse(project / "junit.xml").iter("testcase"):
        key = case.get("name")
        assert key not in outcomes, f"{key} reported twice: {result.stdout}"
        failed = [child for child in case if child.tag in ("failure", "error")]
        outcomes[key] = "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
        failures[key] = "".join(child.get("message", "") + (child.text or "") for child in failed)
    return outcomes, failures, result.stdout + result.stderr


def test_a_rank_that_fails_after_its_last_report_fails_the_test(planted):
    outcomes, failures, output = planted
    assert outcomes["test_first[2]"] == "passed", output
    for planted_test in ("test_second_plants[2]", "test_own_plants[2]"):
        assert outcomes[planted_test] == "failed", output
        assert "mpirun exited with status 3 after every rank had reported" in failures[planted_test], output


def test_a_launch_that_outlives_its_last_deadline_fails(planted):
    outcomes, failures, output = planted
    assert outcomes["test_hangs_after_report[2]"] == "failed", output
    assert "after every rank had reported it: the launch did not end in time" in failures["test_hangs_after_report[2]"]


def test_each_test_counted_once_and_failing_ranks_named(planted):
    outcomes, failures, output = planted
    assert {key: value for key, value in outcomes.items() if "plants" not in key and "hangs" not in key} == {
        "test_first[2]": "passed", "test_passes[2]": "passed", "test_passes[3]": "passed",
        "test_fails_on_the_last_rank[2]": "failed", "test_fails_on_the_last_rank[3]": "failed",
        "test_after_a_failure[3]": "passed"}, output
    assert "5 failed, 4 passed" in output, output
    assert "_ rank 2 _" in failures["test_fails_on_the_last_rank[3]"], output
    assert "_ rank 0 _" not in failures["test_fails_on_the_last_rank[3]"], output
