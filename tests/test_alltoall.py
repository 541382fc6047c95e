"""Communicator.alltoall (collectives/alltoall.py): rows exchanged by rank as a direct reference
computes them, on NumPy and torch arrays, and wrong calls turned into errors on every rank."""
import numpy as np
import pytest
import torch

import mpidist as md

pytestmark = pytest.mark.mpi_shared_launch


def sent_by(rank, size, splits_of):
    """Rank `rank`'s rows: row i holds 1000 * rank + i, twice (a row shape of (2,))."""
    rows = sum(splits_of(rank))
    return np.repeat(1000.0 * rank + np.arange(rows), 2).reshape(rows, 2)


def expected_at(rank, size, splits_of):
    """What `rank` receives: from each sender k, block `rank` of k's rows, in rank order."""
    blocks = []
    for k in range(size):
        offsets = np.concatenate([[0], np.cumsum(splits_of(k))])
        blocks.append(sent_by(k, size, splits_of)[offsets[rank]:offsets[rank + 1]])
    return np.concatenate(blocks)


@pytest.mark.mpi(ranks=[2, 3])
def test_alltoall(mpi_ranks, mpi_world, monkeypatch):
    """The checks of one world size in one launch (each launch starts torch on every rank)."""
    check_uneven_splits_match_the_reference(mpi_ranks, mpi_world)
    check_equal_blocks_of_a_torch_tensor(mpi_ranks, mpi_world)
    check_wrong_splits_on_one_rank_fail_every_rank(mpi_ranks, mpi_world)
    check_rows_that_differ_raise_on_every_rank(mpi_world)
    with monkeypatch.context() as patch:
        check_rows_that_differ_raise_without_the_call_check(mpi_world, patch)


def check_uneven_splits_match_the_reference(size, comm):
    def splits_of(k):
        return [(k + j) % 3 for j in range(size)]  # zero-row blocks included

    received, received_rows = comm.alltoall(sent_by(comm.rank, size, splits_of), splits_of(comm.rank))
    np.testing.assert_array_equal(received, expected_at(comm.rank, size, splits_of))
    assert received_rows.tolist() == [splits_of(k)[comm.rank] for k in range(size)]


def check_equal_blocks_of_a_torch_tensor(size, comm):
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        def rows_of(k):
            return torch.arange(2 * size * 3).reshape(2 * size, 3) + 100 * k

        received, received_rows = comm.alltoall(rows_of(comm.rank).to(dtype))
        expected = torch.cat([rows_of(k)[2 * comm.rank:2 * comm.rank + 2] for k in range(size)]).to(dtype)
        assert isinstance(received, torch.Tensor) and received.dtype == dtype
        assert torch.equal(received, expected)
        assert received_rows.tolist() == [2] * size


def check_wrong_splits_on_one_rank_fail_every_rank(size, comm):
    wrong = [1] * (size + 1) if comm.rank == 0 else [1] * size  # rank 0: one count too many
    if comm.rank == 0:
        with pytest.raises(md.InvalidArgumentError, match="one row count >= 0 per rank"):
            comm.alltoall(np.ones((size, 2)), wrong)
    else:
        with pytest.raises(md.MismatchError, match=r"ranks \[0\] refused their arguments"):
            comm.alltoall(np.ones((size, 2)), wrong)
    with pytest.raises(md.InvalidArgumentError, match="evenly"):  # refused on every rank alike
        comm.alltoall(np.ones((size + 1, 2)))
    with pytest.raises(md.InvalidArgumentError, match="at least one dimension"):
        comm.alltoall(np.array(1.0))
    received, _ = comm.alltoall(np.full((size, 1), float(comm.rank)))  # still usable
    assert received.ravel().tolist() == [float(k) for k in range(size)]


def check_rows_that_differ_raise_on_every_rank(comm):
    width = 2 if comm.rank == 0 else 3
    with pytest.raises(md.MismatchError, match=r"row shape \(shape\[1:\]\): ranks \[0\] have \(2,\)"):
        comm.alltoall(np.ones((comm.size, width)))
    with pytest.raises(md.MismatchError, match="dtype"):
        comm.alltoall(np.ones((comm.size, 2), dtype=np.float32 if comm.rank == 0 else np.float64))


def check_rows_that_differ_raise_without_the_call_check(comm, monkeypatch):
    # MPIDIST_CHECK=0: the row counts' exchange still carries each rank's bytes per row.
    monkeypatch.setattr(comm, "check_calls", False)
    width = 2 if comm.rank == 0 else 3
    with pytest.raises(md.MismatchError, match=r"bytes per row by rank \[16, 24"):
        comm.alltoall(np.ones((comm.size, width)))
