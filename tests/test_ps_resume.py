"""A parameter server stopped and resumed, and stopped by its own ranks: arguments refused on some
ranks only, and an error in a server's update, raise on every rank at once.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order;
those that stop the parameter server with an error come last."""
import pytest
import torch
from test_ps import make_model

import mpidist as md

pytestmark = pytest.mark.mpi_shared_launch

LR = 0.1


# Each is given only to the last rank; the others are given valid arguments.
@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("bad, refusal", [
    (lambda size: dict(mode="bogus"), "mode='bogus'"),
    (lambda size: dict(servers=[0, 0]), "the servers must be distinct ranks"),
    (lambda size: dict(servers=size), "leaves no worker"),
    (lambda size: dict(version=-1), "version must be an integer >= 0"),
], ids=["unknown_mode", "repeated_server", "no_worker_left", "negative_version"])
def test_arguments_refused_on_one_rank_are_refused_on_every_rank_at_once(mpi_world, monkeypatch, bad, refusal):
    """The other ranks do not wait for the refusing rank (a wait would end in a DeadlineError
    after MPIDIST_TIMEOUT): they raise its error, naming it."""
    monkeypatch.setenv("MPIDIST_TIMEOUT", "20")
    comm = mpi_world
    culprit = comm.size - 1
    model = make_model(0)
    given = bad(comm.size) if comm.rank == culprit else {}
    named = refusal if comm.rank == culprit else \
        rf"rank {culprit} refused its arguments to the parameter server: .*{refusal}"
    with pytest.raises(md.InvalidArgumentError, match=named):
        md.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=LR), comm=comm, **given)
