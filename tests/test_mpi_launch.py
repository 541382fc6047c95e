"""The suite's own launcher (mpi_shared_launch.py): a multi-rank test is green only when every rank
ended well. Each check plants ranks that misbehave after their last report in a small test
project of its own, runs pytest on it as `make test` runs the suite, and reads the outcome of
every test from its JUnit XML; a project's modules run in one pytest session, as the suite's do,
and their shared tests of one rank count in one launch, so each planted misbehaviour has a project
of its own. The launches that fail to start run under a stand-in for mpirun that prints Open MPI's
start-up failure and exits before starting any rank, as mpirun does when its PMIx server cannot
start. And every module of the suite's multi-rank tests takes part in the shared launch."""
import ast
import glob
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

# Without Hypothesis's plugin, as the suite's ranks run (conftest.py): the projects' tests have
# no use for it, and it costs every pytest start (each rank of each launch) a share of a second.
PYTEST_INI = """
[pytest]
addopts = -p no:randomly -p no:cacheprovider -p no:hypothesispytest --mpi-default-test-timeout=120
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

# Its limit counts from the launch's start: the ranks' pytest starts (without torch) well within it.
@pytest.mark.mpi(ranks=[2], timeout=6)
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


# Stands in for mpirun and logs each launch, its command and the tests its @file names: the first
# launch of test_restarted.py, and every one of test_never_starts.py, print what mpirun prints when
# its PMIx server cannot start and exit as it does, before starting any rank; every other launch is
# the real mpirun's.
FAKE_MPIRUN = """#!/bin/sh
for last; do :; done
tests=""
case "$last" in @*) tests=$(cat "${{last#@}}" | tr '\\n' ' ') ;; esac
echo "$* $tests" >> {log}
case "$* $tests" in
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
    """The outcomes of three projects (run_project), one per planted misbehaviour, merged: the
    test ids are unique across them."""
    outcomes, failures, output = {}, {}, ""
    for name, modules in (("exit", {"test_shared.py": SHARED, "test_own.py": OWN}), ("hang", {"test_hang.py": HANG}),
                          ("good", {"test_good.py": GOOD})):
        files = {"conftest.py": CONFTEST, "pytest.ini": PYTEST_INI, **modules}
        project_outcomes, project_failures, project_output = run_project(tmp_path_factory.mktemp(name), files)
        outcomes.update(project_outcomes)
        failures.update(project_failures)
        output += project_output
    return outcomes, failures, output


def run_counted_project(project, modules):
    """The outcome of a project whose launches run under FAKE_MPIRUN (run_project), with the
    command line and tests of each launch and the runs of each test (COUNTED)."""
    fake, mpirun = project / "fake-mpirun", shutil.which("mpirun")
    assert mpirun is not None, "no mpirun on PATH"
    fake.write_text(FAKE_MPIRUN.format(log=project / "launches", mpirun=mpirun))
    fake.chmod(0o755)
    outcome = run_project(project, {"conftest.py": CONFTEST, "pytest.ini": PYTEST_INI.replace("= mpirun", f"= {fake}"),
                                    **modules})
    launches = (project / "launches").read_text().splitlines()
    runs = (project / "runs").read_text().splitlines()
    return outcome, launches, runs


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """A project of a shared module whose first launch fails to start and an unshared one whose
    launches never start (run_counted_project)."""
    return run_counted_project(tmp_path_factory.mktemp("restarted"), {
        "test_restarted.py": RESTARTED, "test_never_starts.py": NEVER_STARTS})


@pytest.fixture(scope="module")
def rank_ran(tmp_path_factory):
    """A project whose ranks print the start-up failure after starting the test (run_counted_project)."""
    return run_counted_project(tmp_path_factory.mktemp("rank-ran"), {"test_rank_ran.py": RANK_RAN})


SECOND_SHARED = COUNTED + """
pytestmark = pytest.mark.mpi_shared_launch

@pytest.mark.mpi(ranks=[2, 3])
def test_in_the_second_module(mpi_ranks):
    count_run()
"""

FIRST_SHARED = SECOND_SHARED.replace("second", "first")


@pytest.fixture(scope="module")
def two_shared_modules(tmp_path_factory):
    """Two shared modules and an unshared one, with tests of 2 and 3 ranks (run_counted_project)."""
    return run_counted_project(tmp_path_factory.mktemp("two-shared"), {
        "test_first.py": FIRST_SHARED, "test_second.py": SECOND_SHARED, "test_never_starts.py": NEVER_STARTS})


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
    assert "2 failed, 3 passed" in output, output  # the project of GOOD
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


def test_a_launch_in_which_a_rank_ran_a_test_is_not_started_again(rank_ran):
    (outcomes, failures, output), launches, runs = rank_ran
    assert outcomes["test_prints_the_start_up_failure[2]"] == "failed", output
    assert "ranks [0, 1] wrote no report" in failures["test_prints_the_start_up_failure[2]"], output
    assert len([launch for launch in launches if "test_rank_ran.py" in launch]) == 1, launches
    assert sorted(run for run in runs if run.startswith("test_rank_ran")) == ["test_rank_ran 0", "test_rank_ran 1"]
    assert "test_rank_ran.py on 2 ranks" not in output, output


def test_the_shared_modules_tests_of_one_rank_count_run_in_one_launch(two_shared_modules):
    (outcomes, failures, output), launches, runs = two_shared_modules
    assert {key: value for key, value in outcomes.items() if "never" not in key} == {
        "test_in_the_first_module[2]": "passed", "test_in_the_first_module[3]": "passed",
        "test_in_the_second_module[2]": "passed", "test_in_the_second_module[3]": "passed"}, output
    shared = sorted(launch.split("-np ")[1].split()[0] for launch in launches if "test_first.py" in launch)
    assert shared == ["2", "3"], launches
    assert all("test_second.py" in launch for launch in launches if "test_first.py" in launch), launches
    assert not [launch for launch in launches if "test_second.py" in launch and "test_first.py" not in launch]
    assert sorted(runs) == sorted(f"test_{module} {rank}" for module in ("first", "second")
                                  for size in (2, 3) for rank in range(size)), runs


def marks(decorators):
    """The names of the pytest marks among `decorators` (or a pytestmark's value): "mpi" for
    @pytest.mark.mpi(ranks=...), "mpi_shared_launch" for pytest.mark.mpi_shared_launch."""
    names = set()
    for node in decorators:
        for part in ast.walk(node):
            if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Attribute) and part.value.attr == "mark":
                names.add(part.attr)
    return names


def test_every_module_of_multi_rank_tests_shares_the_launch():
    """A module of multi-rank tests outside the shared launch starts one launch per test and rank
    count, each importing torch in every rank; a test that cannot share (it leaves a collective
    unfinished, ends a rank, needs an environment of its own) is marked mpi_own_launch instead."""
    unshared = []
    for path in sorted(glob.glob(os.path.join(TESTS, "test_*.py"))):
        module = ast.parse(open(path).read())
        multi_rank = any("mpi" in marks(node.decorator_list) for node in ast.walk(module)
                         if isinstance(node, (ast.FunctionDef, ast.ClassDef)))
        module_marks = set().union(*(marks([node.value]) for node in module.body if isinstance(node, ast.Assign)
                                     and any(getattr(target, "id", None) == "pytestmark" for target in node.targets)))
        if multi_rank and "mpi_shared_launch" not in module_marks:
            unshared.append(os.path.basename(path))
    assert unshared == [], f"multi-rank tests outside the shared launch: {unshared}"
