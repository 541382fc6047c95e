"""runtime/leave.py with ULFM's failure detector on: MPI_Finalize runs under the watchdog even when
no rank died (the detector's end in Open MPI's MPI_Finalize can wait forever for a heartbeat), and
without the detector and without a death it is left to mpi4py as before.

The hang itself comes only now and then (benchmarks/faults.py's elastic runs under the detector);
these check the decision, with MPI and the watchdog replaced."""
import pytest


class FakeWorld:
    def Get_rank(self):
        return 3


class FakeMPI:
    COMM_WORLD = FakeWorld()

    @staticmethod
    def Is_finalized():
        return False


@pytest.fixture
def leave(monkeypatch):
    from mpidist.runtime import leave
    calls = {"finalize": 0, "armed": []}

    class Watchdog:
        class disarmed:  # noqa: N801 (an Event's interface)
            @staticmethod
            def set():
                calls["disarmed"] = True

        @staticmethod
        def arm(limit, status, message):
            calls["armed"].append((limit, status, message))

    def finalize():
        calls["finalize"] += 1

    monkeypatch.setattr(leave, "load_mpi", lambda: FakeMPI)
    monkeypatch.setattr(leave, "_watchdog", Watchdog)
    monkeypatch.setattr(leave, "_mpi_function", lambda name: finalize)
    monkeypatch.setattr(leave, "_requested_status", None)
    monkeypatch.setattr(leave.sys, "last_value", None, raising=False)
    monkeypatch.setenv("MPIDIST_FINALIZE_TIMEOUT", "5")
    leave.calls = calls
    return leave


@pytest.mark.parametrize("value", ["true", "1", "TRUE", "on"])
def test_with_the_detector_on_finalize_runs_under_the_watchdog_without_a_death(leave, monkeypatch, value):
    monkeypatch.setenv("OMPI_MCA_mpi_ft_detector", value)
    monkeypatch.setattr(leave, "failed_ranks", lambda comm: [])
    leave.finalize_after_a_death()
    assert leave.calls["finalize"] == 1 and leave.calls.get("disarmed"), leave.calls
    [(limit, status, message)] = leave.calls["armed"]
    assert (limit, status) == (5, 0)
    assert message.startswith("mpidist: rank 3: MPI_Finalize has not returned 5 s (MPIDIST_FINALIZE_TIMEOUT) with "
                              "ULFM's failure detector on"), message


@pytest.mark.parametrize("value", [None, "false", "0"])
def test_without_the_detector_and_without_a_death_finalize_is_left_to_mpi4py(leave, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("OMPI_MCA_mpi_ft_detector", raising=False)
    else:
        monkeypatch.setenv("OMPI_MCA_mpi_ft_detector", value)
    monkeypatch.setattr(leave, "failed_ranks", lambda comm: [])
    leave.finalize_after_a_death()
    assert leave.calls["finalize"] == 0 and leave.calls["armed"] == [], leave.calls


def test_after_a_death_the_message_names_the_dead_ranks(leave, monkeypatch):
    monkeypatch.delenv("OMPI_MCA_mpi_ft_detector", raising=False)
    monkeypatch.setattr(leave, "failed_ranks", lambda comm: [1])
    leave.finalize_after_a_death()
    [(_, _, message)] = leave.calls["armed"]
    assert "after rank(s) [1] of the job died" in message and leave.calls["finalize"] == 1, message
