"""raise_together (mpidist/runtime/together.py): where some ranks pass an error, every rank raises
the same one, naming the failing ranks; checked against each rank's expected message written
out by hand, and with pickle unusable (no failure crosses the wire pickled).

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order."""
import pickle

import pytest

import mpidist as md
from mpidist.comm import broadcast_json
from mpidist.errors import CheckpointError
from mpidist.runtime.together import raise_together

pytestmark = pytest.mark.mpi_shared_launch
RANKS = pytest.mark.mpi(ranks=[2, 3])


class LocalOnlyError(Exception):
    """A class only this module knows: other ranks cannot raise it by its name."""


def refuse_pickle(*args, **kwargs):
    raise AssertionError("raise_together must not pickle")


@pytest.fixture
def world(mpi_world):
    """MPI's world, where pickling (mpi4py's own pickle, which its lowercase calls use) fails."""
    from mpi4py import MPI
    MPI.pickle.__init__(refuse_pickle, refuse_pickle)
    yield mpi_world.mpi
    MPI.pickle.__init__(pickle.dumps, pickle.loads)


@RANKS
def test_pickling_fails_under_the_fixture(mpi_ranks, world):
    with pytest.raises(AssertionError, match="must not pickle"):
        world.allgather("a text")


@RANKS
def test_no_failure_returns_on_every_rank(mpi_ranks, world):
    assert raise_together(world, None, "nothing") is None


@RANKS
def test_one_ranks_error_is_raised_on_every_rank(mpi_ranks, world):
    problem = CheckpointError("disk full") if world.Get_rank() == 1 else None
    with pytest.raises(CheckpointError) as raised:
        raise_together(world, problem, "writing x")
    assert str(raised.value) == "writing x failed: rank 1: disk full"
    assert raised.value.__cause__ is problem


@RANKS
def test_different_errors_name_each_rank_under_the_lowest_ones_class(mpi_ranks, world):
    rank = world.Get_rank()
    problem = None if rank == 0 else KeyError("k") if rank == 1 else ValueError(f"bad {rank}")
    with pytest.raises(KeyError) as raised:
        raise_together(world, problem, "reading")
    expected = "reading failed: rank 1: 'k'" + ("; rank 2: ValueError: bad 2" if mpi_ranks == 3 else "")
    assert raised.value.args == (expected,)


@RANKS
def test_equal_errors_are_grouped(mpi_ranks, world):
    rank = world.Get_rank()
    problem = ValueError("same") if rank != 1 else ValueError("other")
    with pytest.raises(ValueError) as raised:
        raise_together(world, problem, "checking")
    others = "ranks 0, 2" if mpi_ranks == 3 else "rank 0"
    assert str(raised.value) == f"checking failed: {others}: same; rank 1: other"


@RANKS
def test_a_given_class_and_message_are_raised(mpi_ranks, world):
    problem = OSError("gone") if world.Get_rank() == 0 else None
    with pytest.raises(md.InvalidArgumentError, match=r"^\[\('OSError', 'gone'\), None"):
        raise_together(world, problem, "x", md.InvalidArgumentError, message=repr)


@RANKS
def test_a_class_other_ranks_cannot_name_becomes_mpidist_error(mpi_ranks, world):
    problem = LocalOnlyError("mine") if world.Get_rank() == mpi_ranks - 1 else None
    with pytest.raises(md.MpidistError) as raised:
        raise_together(world, problem, "work")
    assert type(raised.value) is md.MpidistError
    assert str(raised.value) == f"work failed: rank {mpi_ranks - 1}: LocalOnlyError: mine"


@RANKS
def test_broadcast_json_of_what_json_cannot_encode_names_the_root_and_why_on_every_rank(mpi_ranks, mpi_world):
    root = mpi_ranks - 1
    with pytest.raises(md.InvalidArgumentError, match=rf"^layout sends JSON only \(no pickle\); rank {root} passed an "
                                                      r"object JSON cannot encode: Object of type object is not JSON"):
        broadcast_json(mpi_world, {"x": object()} if mpi_world.rank == root else None, root, "layout")
