"""runtime/leave.py with ULFM's failure detector on: MPI_Finalize runs under the watchdog even when
no rank died (the detector's end in Open MPI's MPI_Finalize can wait forever for a heartbeat), and
without the detector and without a death it is left to mpi4py as before; a rank that has not heard
of a death learns of it from the others' agreement at exit.

The hang itself comes only now and then (benchmarks/faults.py's elastic runs under the detector);
these check the decision, with MPI and the watchdog replaced."""
import pytest


class FakeMPIException(Exception):
    def __init__(self, error_class):
        super().__init__(f"error class {error_class}")
        self.error_class = error_class

    def Get_error_class(self):
        return self.error_class


class FakeWorld:
    """The world as ULFM's agreement sees it: the AND of the other survivors' flags, or the
    error the agreement raises on every survivor."""
    others_flag = 1
    agreement_error = None

    def Get_rank(self):
        return 3

    def Agree(self, flag):
        if self.agreement_error is not None:
            raise FakeMPIException(self.agreement_error)
        return flag & self.others_flag


class FakeMPI:
    COMM_WORLD = FakeWorld()
    Exception = FakeMPIException
    ERR_PROC_FAILED, ERR_REVOKED, ERR_OTHER = 75, 77, 16

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
    monkeypatch.setattr(FakeWorld, "others_flag", 1)
    monkeypatch.setattr(FakeWorld, "agreement_error", None)
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


@pytest.mark.parametrize("others_flag, agreement_error", [(0, None), (1, FakeMPI.ERR_PROC_FAILED),
                                                          (1, FakeMPI.ERR_REVOKED)])
def test_a_rank_that_has_not_heard_of_a_death_learns_of_it_from_the_others(leave, monkeypatch, others_flag,
                                                                           agreement_error):
    # This rank knows no death, but another survivor does (its flag 0 makes the AND 0), or the
    # agreement itself finds a rank that died without contributing: MPI_Finalize then runs under
    # the watchdog here too, as on the ranks that knew.
    monkeypatch.delenv("OMPI_MCA_mpi_ft_detector", raising=False)
    monkeypatch.setattr(leave, "failed_ranks", lambda comm: [])
    monkeypatch.setattr(FakeWorld, "others_flag", others_flag)
    monkeypatch.setattr(FakeWorld, "agreement_error", agreement_error)
    leave.finalize_after_a_death()
    [(_, _, message)] = leave.calls["armed"]
    assert "after a rank of the job died, as another rank knew" in message and leave.calls["finalize"] == 1, message


def test_a_rank_that_knows_of_a_death_tells_the_others_and_another_error_of_the_agreement_is_raised(leave,
                                                                                                    monkeypatch):
    flags = []
    agree = FakeWorld.Agree
    monkeypatch.setattr(FakeWorld, "Agree", lambda self, flag: flags.append(flag) or agree(self, flag))
    monkeypatch.setattr(leave, "failed_ranks", lambda comm: [1])
    leave.finalize_after_a_death()
    assert flags == [0] and leave.calls["finalize"] == 1
    monkeypatch.setattr(leave, "failed_ranks", lambda comm: [])
    monkeypatch.setattr(FakeWorld, "agreement_error", FakeMPI.ERR_OTHER)
    with pytest.raises(FakeMPIException):
        leave.finalize_after_a_death()
    assert flags == [0, 1]
