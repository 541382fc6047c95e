"""runtime/losses.py in one process: the summary line of the ranks a job lost, told once and by
the reporting rank alone, and the exit status MPIDIST_EXIT_ON_RANK_LOSS gives (leave.py). The
launches with a rank really killed are tests/test_elastic.py's and tests/test_ps_faults.py's."""
import pytest

from mpidist.errors import InvalidArgumentError
from mpidist.runtime import leave, losses

LOSS = losses.RankLoss("rank 1 of 3 (elastic training)", "epoch=1 steps=7", losses.STARTED + 2.5,
                       "the training since the last commit (epoch=1 steps=6) was done again on the 2 ranks left")


@pytest.fixture
def fresh(monkeypatch):
    """No loss recorded yet, and no exit handler registered by the test."""
    monkeypatch.setattr(losses, "_recorded", [])
    monkeypatch.setattr(losses, "_untold", [])
    monkeypatch.setattr(losses.atexit, "register", lambda function: None)
    monkeypatch.delenv("MPIDIST_EXIT_ON_RANK_LOSS", raising=False)


def test_the_reporting_rank_tells_a_loss_once(fresh, capsys):
    losses.record(LOSS, reports=True)
    losses.tell()
    losses.tell()  # at exit, after the end of training: nothing left to tell
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("mpidist: the job lost rank 1 of 3 (elastic training) at epoch=1 steps=7 ("), lines
    assert " UTC, 2.5 s after the start): the training since the last commit" in lines[0], lines


def test_a_rank_that_does_not_report_tells_nothing(fresh, capsys):
    losses.record(LOSS, reports=False)
    losses.tell()
    assert capsys.readouterr().err == ""


def test_the_summary_says_the_exit_status_it_asks_for(fresh, capsys, monkeypatch):
    monkeypatch.setenv("MPIDIST_EXIT_ON_RANK_LOSS", "3")
    losses.record(LOSS, reports=True)
    losses.tell()
    assert capsys.readouterr().err.rstrip().endswith("; this rank exits with status 3 (MPIDIST_EXIT_ON_RANK_LOSS)")


@pytest.mark.parametrize("lost, requested, variable, status", [
    (True, None, "3", 3),  # the program ends normally
    (True, 0, "3", 3),  # sys.exit(0), or `mpidist train` returning 0
    (True, 2, "3", 2),  # the program's own error status wins
    (True, None, None, 0),  # unset: the program's status
    (False, None, "3", 0)])  # no loss recorded on this rank
def test_the_exit_status_after_a_loss(fresh, monkeypatch, lost, requested, variable, status):
    if variable is not None:
        monkeypatch.setenv("MPIDIST_EXIT_ON_RANK_LOSS", variable)
    if lost:
        losses.record(LOSS, reports=False)
    monkeypatch.setattr(leave.sys, "last_value", None, raising=False)
    monkeypatch.setattr(leave, "_requested_status", requested)
    assert leave.exit_status() == status


@pytest.mark.parametrize("text", ["256", "-1", "abc"])
def test_a_value_that_is_no_exit_status_is_refused_naming_the_variable(fresh, monkeypatch, text):
    monkeypatch.setenv("MPIDIST_EXIT_ON_RANK_LOSS", text)
    with pytest.raises(InvalidArgumentError, match="MPIDIST_EXIT_ON_RANK_LOSS"):
        losses.exit_status_on_loss()
