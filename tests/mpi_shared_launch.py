"""Every multi-rank test runs under an mpirun started here, one launch per rank count for all the
modules marked `mpi_shared_launch`; every test is reported once, whatever its rank count, and
a launch is judged by every rank's reports and by how mpirun itself ended.

pytest-isolate-mpi starts `mpirun -np N pytest <test>` for every multi-rank test and rank count,
and every start gives each rank a fresh interpreter that imports torch: seconds of CPU, more than
most checks cost. The selected multi-rank tests of one rank count in the modules with
`pytestmark = pytest.mark.mpi_shared_launch` run in one launch instead, in the order pytest runs
them; the ranks' processes (MPI, mpidist's state, every module's imports) carry over from one
test to the next and from one module to the next, so a test must not depend on what an earlier
one leaves behind, nor leave behind what a later one would notice. A test marked
`mpi_own_launch` (one that leaves a collective unfinished, say), and every multi-rank test of an
unmarked module, runs in a launch of its own, started the same way.

In the ranks, pytest-isolate-mpi writes each test's reports as it always does, here into a
directory of that test's own; this session reads them and reports each phase (setup, call,
teardown) of a test once: failed if some rank failed, with every failing rank's traceback under
its rank number. Each test keeps its own time limit, the `timeout` of its mpi mark (else
--mpi-default-test-timeout), counted from the end of the test before it, and for the launch's
last test up to mpirun's own exit: past it the launch is stopped, that test fails with the ranks'
output and the tests after it fail as not run. A test fails too when a rank wrote no report for
it, and the launch's last test fails when mpirun exits with a status other than 0 after every
rank reported: a rank that crashes at exit, in a destructor, in a background thread or in
MPI_Finalize after its last assertion. Failed tests do not make a rank's pytest exit non-zero
(their reports say so already), so any such status is news. The ranks' pytest reads the tests'
ids from a file (pytest's `@file` arguments): a launch of every shared module names thousands.

A launch that ends before any rank started a test, its output showing one of Open MPI's launcher
start-up failures (START_UP_FAILURES), is started once more, with a line in the terminal saying
why; should that one fail too, its tests' reports keep the first launch's output. A launch in
which some rank started a test is never started again: that would hide its failures. Each launch
runs with a TMPDIR of its own, which avoids the start-up failure seen in practice (see
START_UP_FAILURES).
"""
import hashlib
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time

import pytest
from _pytest.reports import TestReport

# pytest-isolate-mpi's own pieces, so that a shared launch starts the ranks' pytest exactly as a
# launch of one test does (the options passed on, the ini file's mpirun settings).
from pytest_isolate_mpi._constants import ENVIRONMENT_VARIABLE_TO_HIDE_INNARDS_OF_PLUGIN as IN_RANKS
from pytest_isolate_mpi._constants import MPI_ENV_HINTS, TIME_UNIT_CONVERSION
from pytest_isolate_mpi._plugin import MPIConfiguration
from pytest_isolate_mpi._subsession import assemble_sub_pytest_cmd

MARKER = "mpi_shared_launch"
OWN_LAUNCH = "mpi_own_launch"
REPORTS = "PYTEST_MPI_REPORTS_PATH"  # where pytest-isolate-mpi's ranks write their reports
IN_SHARED_LAUNCH = "MPIDIST_TESTS_SHARED_LAUNCH"
STOP_GRACE_S = 30  # for mpirun to end its ranks once told to

# What Open MPI's launcher prints when it fails to start, before it has started any rank: with
# one of these in a launch's output, and no rank having started a test, the launch is started
# once more. The first is PMIx_server_init's (OpenPMIx help-pmix-server.txt [listener-thread-start])
# when it cannot set up its listener, which includes writing the tool rendezvous files, with
# O_EXCL, into mpirun's session directory $TMPDIR/ompi.<mpirun's pid>. An mpirun that ends
# removes that directory; a killed one (SIGKILL) leaves it behind, and the next mpirun given the
# same pid finds the files and stops with this message (openpmix/openpmix#4022, fixed after the
# PMIx 5 that Open MPI 5 bundles). Each launch here therefore has a TMPDIR of its own, removed
# after it, also when mpirun was killed. The others are PRRTE's (and ORTE's) runtime failing
# before it launched anything: mpirun's own start-up (help-prte-runtime.txt
# [prte_init:startup:internal-failure]) and daemons that never reported back
# (help-errmgr-base.txt [failed-daemon-launch], [failed-daemon]); no rank starts before every
# daemon has reported.
START_UP_FAILURES = (
    "The PMIx server's listener thread failed to start",
    'It looks like "prte_init()" failed',
    "was unable to reliably start one or more daemons",
    "daemon has unexpectedly failed after launch and before communicating back",
)


def register(config):
    """Registers the side of this process: the session that starts launches, or a rank of one.

    Call it after pytest-isolate-mpi has registered its plugin (it does in pytest_configure):
    pluggy calls the hooks of the plugin registered last first, and this session's
    pytest_runtest_protocol must come before that plugin's, which would launch each test alone.
    """
    if not os.environ.get(IN_RANKS):
        launcher = SharedLaunch(config)
        config.pluginmanager.register(launcher, "mpidist-shared-launch")
        protocols = config.hook.pytest_runtest_protocol.get_hookimpls()
        first = [impl for impl in protocols if not (impl.hookwrapper or impl.wrapper)][-1]
        assert first.plugin is launcher, f"pytest_runtest_protocol of {first.plugin_name} runs first"
    elif os.environ.get(IN_SHARED_LAUNCH):
        config.pluginmanager.register(SharedLaunchRank(), "mpidist-shared-launch-rank")


def launch_key(item):
    """(ranks, OpenMP threads) of a test that shares the shared modules' launch, that plus the
    module and the test's own id for one that runs alone; None for a test that is not a
    multi-rank one."""
    mark = item.get_closest_marker("mpi")
    if mark is None or item.config.getoption("--no-mpi-isolation"):
        return None
    callspec = getattr(item, "callspec", None)
    ranks = callspec.params.get("mpi_ranks", 1) if callspec is not None else 1
    key = (ranks, mark.kwargs.get("threads"))
    if item.get_closest_marker(MARKER) is None or item.get_closest_marker(OWN_LAUNCH) is not None:
        return key + (item.path, item.nodeid)
    return key


def time_limit(item) -> float:
    """Seconds the test may take in its launch, as pytest-isolate-mpi reads them."""
    mark = item.get_closest_marker("mpi")
    seconds = mark.kwargs.get("timeout", item.config.getoption("--mpi-default-test-timeout"))
    if seconds is None:
        return math.inf
    unit = mark.kwargs.get("unit", item.config.getoption("--mpi-default-test-timeout-unit"))
    return TIME_UNIT_CONVERSION[unit](seconds)


def reports_directory(root: str, nodeid: str) -> str:
    return os.path.join(root, hashlib.sha256(nodeid.encode()).hexdigest()[:32])


def stop(launch):
    """Ends mpirun and its ranks: mpirun ends them when terminated; killed, it would leave them
    running (each rank is a process group of its own)."""
    if launch.poll() is not None:
        return
    launch.terminate()
    try:
        launch.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        launch.kill()
        launch.wait()


def start_up_failure(items, directory, stopped_in, exit_status, output):
    """The launcher start-up failure (START_UP_FAILURES) that ended the launch of `items` in
    `directory` before any rank started a test, or None.

    A rank that starts a test makes that test's reports directory first (SharedLaunchRank), so a
    launch with none of them has run no test, whatever else it did."""
    if stopped_in is not None or not exit_status:
        return None
    if any(os.path.isdir(reports_directory(directory, item.nodeid)) for item in items):
        return None
    text = " ".join(" ".join(content for _, content in output).split())  # help texts wrap their lines
    return next((failure for failure in START_UP_FAILURES if failure in text), None)


class SharedLaunch:
    """This session's side: starts a launch at the first test of its group, reports every test."""

    def __init__(self, config):
        self.config = config
        self.mpirun = MPIConfiguration(mpi_executable=config.getini("mpi_executable"),
                                       mpi_option_for_processes=config.getini("mpi_option_for_processes"),
                                       mpi_command_line_args=config.getini("mpi_command_line_args"))
        self.reports = {}  # nodeid: the reports of a test whose launch has run

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        key = launch_key(item)
        if key is None:
            return None
        if item.nodeid not in self.reports:
            items = item.session.items
            self.launch([other for other in items[items.index(item):] if launch_key(other) == key], key[0])
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        reports = self.reports.pop(item.nodeid)
        # The test ran in the ranks; tear down here what the next item does not share. Its report
        # is logged only when it failed or the ranks gave none: one teardown report per test.
        setupstate = item.session._setupstate
        call = pytest.CallInfo.from_call(lambda: setupstate.teardown_exact(nextitem), when="teardown")
        teardown = TestReport.from_item_and_call(item, call)
        if teardown.failed or not any(report.when == "teardown" for report in reports):
            reports.append(teardown)
        for report in reports:
            ihook.pytest_runtest_logreport(report=report)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_set_timer(self, item):
        # pytest-timeout's timer in this session would count a whole launch against its first
        # test; the launch keeps every test's own limit instead (and the ranks their pytest-timeout).
        return True if launch_key(item) is not None else None

    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_cancel_timer(self, item):
        return True if launch_key(item) is not None else None

    def launch(self, items, ranks):
        """Runs `items` under one `mpirun -np ranks` and keeps every test's reports; starts the launch
        once more when it ended before any rank started a test, with a launcher start-up failure."""
        if any(os.getenv(hint) for hint in MPI_ENV_HINTS):
            pytest.exit("forked MPI tests cannot be run in an MPI environment", pytest.ExitCode.USAGE_ERROR)
        option = self.config.option
        pytest_command = assemble_sub_pytest_cmd(option, items[0].nodeid)[:-1]
        first = []  # the output of a first launch that never started, for the reports of the second
        for again in (False, True):
            # ignore_cleanup_errors: a killed mpirun's ranks may still be ending in the directory.
            with tempfile.TemporaryDirectory(prefix="mpidist-launch-", ignore_cleanup_errors=True) as directory:
                tests = os.path.join(directory, "tests")
                with open(tests, "w") as file:
                    file.writelines(f"{item.nodeid}\n" for item in items)
                command = self.mpirun.extend_command_for_parallel_execution(pytest_command + [f"@{tests}"], ranks)
                if option.verbose_mpi:
                    print(f"dispatching command: {command} ({len(items)} tests)")
                stopped_in, exit_status, output = self.run(command, items, ranks, directory)
                reason = None if again else start_up_failure(items, directory, stopped_in, exit_status, output)
                if reason is None:
                    self.collect(items, ranks, directory, stopped_in, exit_status, output + first)
                    return
            first = [(f"{title} of a first launch, which ended before any rank started a test ({reason})", text)
                     for title, text in output]
            modules = list(dict.fromkeys(item.location[0] for item in items))
            more = f" and {len(modules) - 1} more modules" if len(modules) > 1 else ""
            self.say(f"{modules[0]}{more} on {ranks} ranks: the launch ended before any rank started a test "
                     f"({reason}); starting it once more")

    def run(self, command, items, ranks, directory):
        """One launch in `directory`; returns (the test whose time ran out or None, mpirun's exit status
        or None when it was stopped, [(title, captured output)])."""
        threads = items[0].get_closest_marker("mpi").kwargs.get("threads")
        capture = self.config.option.capture != "no"
        # A TMPDIR of the launch's own holds mpirun's session directory (see START_UP_FAILURES).
        tmpdir = os.path.join(directory, "tmp")
        os.mkdir(tmpdir)
        env = dict(os.environ, **{IN_RANKS: "1", IN_SHARED_LAUNCH: "1", REPORTS: directory, "TMPDIR": tmpdir})
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        with open(os.path.join(directory, "stdout"), "w+") as stdout, \
                open(os.path.join(directory, "stderr"), "w+") as stderr:
            process = subprocess.Popen(command, env=env, cwd=self.config.rootpath,
                                       stdout=stdout if capture else None, stderr=stderr if capture else None)
            try:
                stopped_in = self.wait(process, items, ranks, directory)
            finally:
                stop(process)
            stdout.seek(0)
            stderr.seek(0)
            output = [("Captured stdout", stdout.read()), ("Captured stderr", stderr.read())]
        return stopped_in, None if stopped_in is not None else process.returncode, output

    def say(self, line):
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line, file=sys.stderr)

    @staticmethod
    def wait(process, items, ranks, directory):
        """Waits for the launch test by test; returns the test whose time ran out, or None."""
        for item in items:
            last = item is items[-1]  # the launch's exit counts as part of its last test
            own = reports_directory(directory, item.nodeid)
            deadline = time.monotonic() + time_limit(item)
            while process.poll() is None:
                if not last and all(os.path.exists(os.path.join(own, str(rank))) for rank in range(ranks)):
                    break
                if time.monotonic() > deadline:
                    return item
                time.sleep(0.1)
        return None

    def collect(self, items, ranks, directory, stopped_in, exit_status, output):
        """Reads every rank's reports of every test and keeps one report per phase of each test.

        A test fails when a rank wrote no report for it or its time ran out; the launch's last
        test fails too when mpirun ended with a status other than 0 (`exit_status`) although
        every rank reported every test."""
        ended_in = None  # the first test some rank did not finish
        for item in items:
            reports, silent = [], []
            for rank in range(ranks):
                try:
                    with open(os.path.join(reports_directory(directory, item.nodeid), str(rank)), "rb") as file:
                        reports += pickle.load(file)
                except (FileNotFoundError, EOFError, pickle.UnpicklingError):
                    silent.append(rank)
            problem, sections = None, output
            if ended_in is not None:
                problem, sections = f"Not run: the launch ended in {ended_in.nodeid}.", []
            elif stopped_in is item:
                problem = (f"Timeout occurred for {item.nodeid}: exceeded run time limit of {time_limit(item)} s"
                           + (f" (ranks {silent} wrote no report)." if silent else
                              ", after every rank had reported it: the launch did not end in time."))
            elif silent:
                problem = f"At least one MPI process has exited prematurely: ranks {silent} wrote no report."
            elif item is items[-1] and exit_status:
                problem = (f"mpirun exited with status {exit_status} after every rank had reported every test of "
                           "its launch, this the last: a rank failed after its last test (at exit, in a destructor, "
                           "a background thread or MPI_Finalize).")
            if problem is not None and silent and ended_in is None:
                ended_in = item
            self.reports[item.nodeid] = merge(item, reports, problem, sections if problem else [])


PHASES = ("setup", "call", "teardown")


def merge(item, reports, problem, sections):
    """One report per phase from every rank's reports of `item`: failed if some rank failed (with
    each failing rank's traceback under its number) or if `problem` is given (in the call phase,
    with the launch's output in `sections`); skipped if no rank failed and some rank skipped."""
    merged = []
    for when in PHASES:
        phase = [report for report in reports if report.when == when]
        failures = [report for report in phase if report.failed]
        text = [f"{'_' * 20} rank {getattr(report, 'rank', '?')} {'_' * 20}\n{report.longreprtext}"
                for report in failures]
        if when == "call" and problem is not None:
            text.append(problem)
        if not phase and not text:
            continue
        skips = [report for report in phase if report.skipped]
        if text:
            outcome, longrepr = "failed", "\n\n".join(text)
        elif skips:
            outcome, longrepr = "skipped", skips[0].longrepr
        else:
            outcome, longrepr = "passed", None
        report = TestReport(nodeid=item.nodeid, location=item.location, keywords=dict.fromkeys(item.keywords, 1),
                            outcome=outcome, longrepr=longrepr, when=when,
                            duration=max((report.duration for report in phase), default=0.0))
        report.sections = [(f"{title} (rank {getattr(each, 'rank', '?')})", content)
                           for each in (failures or phase) for title, content in each.sections]
        if when == "call" and problem is not None:
            report.sections += [section for section in sections if section[1]]
        merged.append(report)
    return merged


class SharedLaunchRank:
    """A rank's side: pytest-isolate-mpi writes each test's reports into a directory of its own,
    and failed tests leave the rank's exit status 0 (their reports carry them)."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item):
        shared = os.environ[REPORTS]
        own = reports_directory(shared, item.nodeid)
        os.makedirs(own, exist_ok=True)
        os.environ[REPORTS] = own
        try:
            return (yield)
        finally:
            os.environ[REPORTS] = shared

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        if session.exitstatus == pytest.ExitCode.TESTS_FAILED:
            session.exitstatus = pytest.ExitCode.OK
