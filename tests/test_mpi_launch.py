"""The suite's own launcher (mpi_shared_launch.py): a multi-rank test is green only when every rank
ended well. Each check plants ranks that misbehave after their last report in a small test
project of its own, runs pytest on it as `make test` runs the suite, and reads the outcome of
every test from its JUnit XML; the project's modules run in one pytest session, as the suite's do.
The launches that fail to start run under a stand-in for mpirun that prints Open MPI's start-up
failure and exits before starting any rank, as mpirun does when its PMIx server cannot start."""
import os
import shutil
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


# Stands in for mpirun and logs each launch: the first launch of test_restarted.py, and every one
# of test_never_starts.py, print what mpirun prints when its PMIx server cannot start and exit
# as it does, before starting any rank; every other launch is the real mpirun's.
FAKE_MPIRUN = """#!/bin/sh
echo "$*" >> {log}
case "$*" in
  *test_restarted.py*) [ "$(grep -c test_restarted.py {log})" = 1 ] && fail=1 ;;
  *test_never_starts.py*) fail=1 ;;
esac
if [ -n "$fail" ]; then
  echo "--------------------------------------------------------------------------" >&2
  echo "The PMIx server's listener thread failed to start. We cannot" >&2
  echo "continue." >&2
  echo "--------------------------------------------------------------------------" >&2
  exit 1
fi
exec {mpirun} "$@"
"""

# Each rank that runs a test of these adds a line to the file `runs` beside them.
COUNTED = """
import os
import pytest
from mpi4py import MPI

def count_run():
    with open(os.path.join(os.path.dirname(__file__), "runs"), "a") as runs:
        runs.write(f"{__name__} {MPI.COMM_WORLD.rank}\\n")
"""

RESTARTED = COUNTED + """
pytestmark = pytest.mark.mpi_shared_launch

@pytest.mark.mpi(ranks=[2])
def test_runs_in_the_second_launch(mpi_ranks):
    count_run()
"""

NEVER_STARTS = COUNTED + """
@pytest.mark.mpi(ranks=[2])
def test_never_runs(mpi_ranks):
    count_run()
"""

# Once both ranks run the test, each prints the listener failure on its standard error (past
# pytest's capture) and ends: the launch's output and status are those of a launch that failed to
# start, no rank wrote a report, yet the test ran.
RANK_RAN = COUNTED + """
pytestmark = pytest.mark.mpi_shared_launch

@pytest.mark.mpi(ranks=[2])
def test_prints_the_start_up_failure(mpi_ranks, capfd):
    count_run()
    with capfd.disabled():
        os.write(2, b"The PMIx server's listener thread failed to start. We cannot\\ncontinue.\\n")
    os._exit(1)
"""


def run_project(project, files):
    """Runs pytest, as `make test` does, on a project of `files` ({name: source}); returns
    ({test id: outcome}, {test id: failure text}, pytest's output)."""
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


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The outcome of a project of every planted module (run_project)."""
    return run_project(tmp_path_factory.mktemp("planted"), {
        "conftest.py": CONFTEST, "pytest.ini": PYTEST_INI, "test_shared.py": SHARED, "test_own.py": OWN,
        "test_hang.py": HANG, "test_good.py": GOOD})


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """The outcome of a project whose launches run under FAKE_MPIRUN (run_project), with the
    command line of each launch and the runs of each test (COUNTED)."""
    project = tmp_path_factory.mktemp("restarted")
    fake, mpirun = project / "fake-mpirun", shutil.which("mpirun")
    assert mpirun is not None, "no mpirun on PATH"
    fake.write_text(FAKE_MPIRUN.format(log=project / "launches", mpirun=mpirun))
    fake.chmod(0o755)
    outcome = run_project(project, {
        "conftest.py": CONFTEST, "pytest.ini": PYTEST_INI.replace("= mpirun", f"= {fake}"),
        "test_restarted.py": RESTARTED, "test_never_starts.py": NEVER_STARTS, "test_rank_ran.py": RANK_RAN})
    launches = (project / "launches").read_text().splitlines()
    runs = (project / "runs").read_text().splitlines()
    return outcome, launches, runs


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


def test_a_launch_that_failed_to_start_is_started_once_more(restarted):
    (outcomes, failures, output), launches, runs = restarted
    assert outcomes["test_runs_in_the_second_launch[2]"] == "passed", output
    assert len([launch for launch in launches if "test_restarted.py" in launch]) == 2, launches
    assert sorted(run for run in runs if run.startswith("test_restarted")) == [
        "test_restarted 0", "test_restarted 1"], runs
    assert ("test_restarted.py on 2 ranks: the launch ended before any rank started a test (The PMIx server's "
            "listener thread failed to start); starting it once more") in output, output


def test_a_launch_that_fails_to_start_twice_keeps_both_outputs(restarted):
    (outcomes, failures, output), launches, runs = restarted
    assert outcomes["test_never_runs[2]"] == "failed", output
    assert len([launch for launch in launches if "test_never_starts.py" in launch]) == 2, launches
    assert not [run for run in runs if run.startswith("test_never_starts")], runs
    assert ("test_never_starts.py on 2 ranks: the launch ended before any rank started a test (The PMIx server's "
            "listener thread failed to start); starting it once more") in output, output
    failure = failures["test_never_runs[2]"]
    assert "ranks [0, 1] wrote no report" in failure, failure
    # pytest's JUnit XML keeps a failed test's captured sections apart from its failure text.
    assert "of a first launch, which ended before any rank started a test (The PMIx server's listener thread" \
        in output, output


def test_a_launch_in_which_a_rank_ran_a_test_is_not_started_again(restarted):
    (outcomes, failures, output), launches, runs = restarted
    assert outcomes["test_prints_the_start_up_failure[2]"] == "failed", output
    assert "ranks [0, 1] wrote no report" in failures["test_prints_the_start_up_failure[2]"], output
    assert len([launch for launch in launches if "test_rank_ran.py" in launch]) == 1, launches
    assert sorted(run for run in runs if run.startswith("test_rank_ran")) == ["test_rank_ran 0", "test_rank_ran 1"]
    assert "test_rank_ran.py on 2 ranks" not in output, output
