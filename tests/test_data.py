"""ShardedSampler, the HDF5 digits file and HDF5Dataset shards; cross-rank parts under mpirun."""
import argparse
import collections
import os
import pathlib

import h5py
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.data import DataLoader, DistributedSampler

import mpidist as md
from mpidist import data
from mpidist.data import HDF5Dataset, ShardedSampler, shard_range


@pytest.fixture
def shared_tmp(mpi_world, tmp_path):
    """Rank 0's tmp_path, the same directory on every rank (each rank runs its own pytest)."""
    encoded = np.zeros(4096, dtype=np.uint8)
    if mpi_world.rank == 0:
        raw = os.fsencode(tmp_path)
        encoded[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    mpi_world.mpi.Bcast(encoded, root=0)
    return pathlib.Path(os.fsdecode(encoded.tobytes().rstrip(b"\0")))


@pytest.fixture(scope="module")
def digits_path(tmp_path_factory):
    return data.prepare_digits(tmp_path_factory.mktemp("digits") / "digits.h5")


def all_ranks(n, size, **kwargs):
    return [list(ShardedSampler(n, rank, size, **kwargs)) for rank in range(size)]


# ---- sampler ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,size", [(12, 3), (10, 4), (1, 3), (7, 7), (0, 2), (100, 6)])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_order_is_distributed_samplers(n, size, shuffle, drop_last):
    for epoch in (0, 3):
        for rank in range(size):
            ours = ShardedSampler(n, rank, size, shuffle=shuffle, seed=5, drop_last=drop_last)
            theirs = DistributedSampler(range(n), num_replicas=size, rank=rank, shuffle=shuffle, seed=5,
                                        drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def test_every_index_exactly_once_when_divisible():
    for size in (1, 2, 3, 4, 6):
        shards = all_ranks(12, size, seed=1)
        assert sorted(i for shard in shards for i in shard) == list(range(12))
        assert {len(shard) for shard in shards} == {12 // size}


def test_padding_repeats_the_start_of_the_permutation():
    sampler = ShardedSampler(10, 0, 4, seed=2)
    permutation = sampler.permutation()
    assert len(permutation) == 12 and permutation[10:] == permutation[:2]
    shards = all_ranks(10, 4, seed=2)
    assert {len(shard) for shard in shards} == {3}
    counts = collections.Counter(i for shard in shards for i in shard)
    assert set(counts) == set(range(10))
    assert sorted(i for i, c in counts.items() if c == 2) == sorted(permutation[:2])
    # Fewer rows than ranks: the permutation is repeated as often as needed.
    assert all_ranks(2, 5, shuffle=False) == [[0], [1], [0], [1], [0]]


def test_drop_last_drops_the_tail():
    sampler = ShardedSampler(10, 0, 4, seed=2, drop_last=True)
    shards = all_ranks(10, 4, seed=2, drop_last=True)
    assert {len(shard) for shard in shards} == {2} and len(sampler) == 2
    seen = sorted(i for shard in shards for i in shard)
    assert seen == sorted(set(seen)) == sorted(sampler.permutation())
    assert set(range(10)) - set(seen) == set(torch.randperm(10, generator=torch.Generator().manual_seed(2))[8:].tolist())
    assert all_ranks(3, 5, drop_last=True) == [[]] * 5


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), size=st.integers(1, 9), drop_last=st.booleans(), seed=st.integers(0, 2**31))
def test_shards_are_even_and_cover_what_they_should(n, size, drop_last, seed):
    shards = all_ranks(n, size, seed=seed, drop_last=drop_last)
    assert len({len(shard) for shard in shards}) == 1
    counts = collections.Counter(i for shard in shards for i in shard)
    if drop_last:
        assert max(counts.values(), default=1) == 1 and len(counts) == n - n % size
    else:
        assert set(counts) == set(range(n))
        assert sum(counts.values()) - n == (-n) % size if n else True


def test_epochs_and_seeds_change_the_order_ranks_agree():
    a, b = ShardedSampler(50, 0, 2, seed=3), ShardedSampler(50, 1, 2, seed=3)
    orders = []
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert a.permutation() == b.permutation()
        orders.append(a.permutation())
    assert len({tuple(order) for order in orders}) == 3
    assert ShardedSampler(50, 0, 2, seed=4).permutation() != orders[0]
    assert list(ShardedSampler(50, 0, 2, shuffle=False)) == list(range(0, 50, 2))


def test_resume_mid_epoch_continues_exactly():
    sampler = ShardedSampler(40, 1, 3, seed=9)
    sampler.set_epoch(2)
    full = list(sampler)
    iterator = iter(sampler)
    head = [next(iterator) for _ in range(5)]
    state = sampler.state_dict()
    assert state["position"] == 5 and state["epoch"] == 2

    resumed = ShardedSampler(40, 1, 3)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the same epoch keeps the position
    assert head + list(resumed) == full
    assert list(resumed) == full  # the next pass of the epoch starts from its first index
    resumed.set_epoch(3)
    assert list(resumed) == sampler.indices(3)


def test_resume_after_a_complete_epoch_yields_nothing_more():
    sampler = ShardedSampler(20, 0, 2)
    list(sampler)
    resumed = ShardedSampler(20, 0, 2)
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.remaining() == 0 and list(resumed) == []
    resumed.set_epoch(1)
    assert list(resumed) == sampler.indices(1)


def test_resume_with_a_dataloader():
    def loader(sampler):
        return DataLoader(list(range(30)), batch_size=4, sampler=sampler, generator=torch.Generator())

    sampler = ShardedSampler(30, 0, 2, seed=1)
    expected = [batch.tolist() for batch in loader(sampler)]
    batches = iter(loader(sampler))
    seen = [next(batches).tolist() for _ in range(2)]
    resumed = ShardedSampler(30, 0, 2)
    resumed.load_state_dict(sampler.state_dict())
    assert seen + [batch.tolist() for batch in loader(resumed)] == expected
    # With workers reading ahead, the caller passes the consumed count.
    assert sampler.state_dict(consumed=8)["position"] == 8


def test_sampler_arguments_and_state_are_checked():
    with pytest.raises(md.InvalidArgumentError, match="rank=2 is not a rank of 2"):
        ShardedSampler(10, 2, 2)
    with pytest.raises(md.InvalidArgumentError, match="size must be >= 1"):
        ShardedSampler(10, 0, 0)
    with pytest.raises(md.InvalidArgumentError, match="must be an integer"):
        ShardedSampler(10.0, 0, 1)
    state = ShardedSampler(10, 0, 2).state_dict()
    with pytest.raises(md.InvalidArgumentError, match="size=2 but this sampler has size=3"):
        ShardedSampler(10, 0, 3).load_state_dict(state)
    with pytest.raises(md.InvalidArgumentError, match="outside"):
        ShardedSampler(10, 0, 2).state_dict(consumed=6)


@pytest.mark.mpi(ranks=[2, 3])
def test_sampler_across_ranks(mpi_ranks, mpi_world):
    comm = mpi_world.mpi
    for n in (12, 13):
        sampler = ShardedSampler(n, comm.rank, comm.size, seed=11)
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            mine = np.array(list(sampler), dtype=np.int64)
            everyone = np.empty(mine.size * comm.size, dtype=np.int64)
            comm.Allgather(mine, everyone)
            permutations = np.empty((comm.size, sampler.total_size), dtype=np.int64)
            comm.Allgather(np.array(sampler.permutation(), dtype=np.int64), permutations)
            assert (permutations == permutations[0]).all()
            counts = collections.Counter(everyone.tolist())
            assert set(counts) == set(range(n))
            assert sum(counts.values()) == sampler.total_size
            if n % comm.size == 0:
                assert set(counts.values()) == {1}


# ---- digits file --------------------------------------------------------------------------------

def test_digits_file_layout_and_values(digits_path):
    from sklearn.datasets import load_digits
    digits = load_digits()
    with h5py.File(digits_path, "r") as f:
        train_x, train_y, test_x, test_y = (f[name][()] for name in ("train/x", "train/y", "test/x", "test/y"))
        assert "load_digits" in f.attrs["source"] and "1500" in f.attrs["split"]
        assert list(f.attrs["image_shape"]) == [8, 8]
    assert train_x.shape == (1500, 64) and test_x.shape == (297, 64)
    assert len(train_y) + len(test_y) == 1797
    assert train_x.dtype == np.float32 and train_y.dtype == np.int64
    for x, y in ((train_x, train_y), (test_x, test_y)):
        assert x.min() == 0.0 and x.max() == 1.0
        assert set(y.tolist()) == set(range(10))
    np.testing.assert_array_equal(np.concatenate([train_x, test_x]), (digits.data / 16).astype(np.float32))
    np.testing.assert_array_equal(np.concatenate([train_y, test_y]), digits.target)
    assert os.listdir(os.path.dirname(digits_path)) == ["digits.h5"]  # no temporary file left


def test_failed_prepare_leaves_no_file(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(h5py.Group, "create_dataset", fail)
    with pytest.raises(OSError, match="disk full"):
        data.prepare_digits(tmp_path / "digits.h5")
    assert os.listdir(tmp_path) == []


def test_default_path_and_ensure(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIDIST_DATA_DIR", str(tmp_path / "d"))
    path = data.default_digits_path()
    assert path == str(tmp_path / "d" / "digits.h5")
    assert data.ensure_digits() == path and os.path.exists(path)
    stamp = os.stat(path).st_mtime_ns
    assert data.ensure_digits() == path and os.stat(path).st_mtime_ns == stamp
    monkeypatch.delenv("MPIDIST_DATA_DIR")
    assert data.default_digits_path().endswith(os.path.join("data", "digits.h5"))


def test_prepare_data_command(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    data.add_prepare_data_command(parser.add_subparsers())
    target = tmp_path / "x" / "digits.h5"
    args = parser.parse_args(["prepare-data", "--path", str(target)])
    assert args.run(args) == 0 and target.exists()
    assert args.run(args) == 0 and "exists" in capsys.readouterr().out


# ---- HDF5Dataset --------------------------------------------------------------------------------

def test_shard_range_blocks():
    assert [shard_range(10, r, 3) for r in range(3)] == [range(0, 4), range(4, 7), range(7, 10)]
    assert [len(shard_range(2, r, 4)) for r in range(4)] == [1, 1, 0, 0]


@pytest.mark.parametrize("size", [1, 3, 4, 7])
def test_shards_partition_the_train_set(digits_path, size):
    full = HDF5Dataset(digits_path)
    shards = [HDF5Dataset(digits_path, rank=r, size=size) for r in range(size)]
    assert [row for shard in shards for row in shard.rows] == list(range(1500))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    np.testing.assert_array_equal(np.concatenate([shard.x for shard in shards]), full.x)
    np.testing.assert_array_equal(np.concatenate([shard.y for shard in shards]), full.y)


@pytest.mark.parametrize("preload", [True, False])
def test_a_rank_reads_only_its_rows(digits_path, monkeypatch, preload):
    reads = []
    original = h5py.Dataset.__getitem__

    def recording(self, selection, *args, **kwargs):
        reads.append((self.name, selection))
        return original(self, selection, *args, **kwargs)

    monkeypatch.setattr(h5py.Dataset, "__getitem__", recording)
    shard = HDF5Dataset(digits_path, rank=1, size=3, preload=preload)
    assert shard.rows == range(500, 1000)
    items = [shard[i] for i in range(len(shard))]
    assert reads
    for name, selection in reads:
        assert name in ("/train/x", "/train/y")
        assert isinstance(selection, slice) and 500 <= selection.start < selection.stop <= 1000
    monkeypatch.undo()
    full = HDF5Dataset(digits_path)
    assert all(torch.equal(x, full[500 + i][0]) and torch.equal(y, full[500 + i][1]) for i, (x, y) in enumerate(items))


def test_items_and_dataloader_with_sampler(digits_path):
    dataset = HDF5Dataset(digits_path, split="test")
    x, y = dataset[-1]
    assert x.dtype == torch.float32 and x.shape == (64,) and y.dtype == torch.int64 and y.dim() == 0
    sampler = ShardedSampler(len(dataset), 1, 2, seed=0)
    batches = list(DataLoader(dataset, batch_size=50, sampler=sampler))
    assert sum(len(b[0]) for b in batches) == len(sampler) == 149
    lazy = HDF5Dataset(digits_path, split="test", preload=False)
    workers = list(DataLoader(lazy, batch_size=50, sampler=sampler, num_workers=2))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, workers))
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_dataset_errors(digits_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare-data"):
        HDF5Dataset(tmp_path / "missing.h5")
    with pytest.raises(md.InvalidArgumentError, match="no split 'valid'.*'test', 'train'"):
        HDF5Dataset(digits_path, split="valid")
    with pytest.raises(md.InvalidArgumentError, match="both rank and size"):
        HDF5Dataset(digits_path, rank=0)


@pytest.mark.mpi(ranks=[3])
def test_ensure_digits_on_rank_0_then_shards(mpi_ranks, mpi_world, shared_tmp, monkeypatch):
    comm = mpi_world.mpi
    calls = []
    original = data.prepare_digits
    monkeypatch.setattr(data, "prepare_digits", lambda path: calls.append(path) or original(path))
    path = data.ensure_digits(shared_tmp / "digits.h5", comm=mpi_world)
    assert os.path.exists(path)
    assert comm.allreduce(len(calls)) == 1 and (len(calls) == 1) == (comm.rank == 0)
    shard = HDF5Dataset(path, rank=comm.rank, size=comm.size)
    assert shard.rows == range(500 * comm.rank, 500 * (comm.rank + 1))
    gathered = np.empty((1500, 64), dtype=np.float32)
    comm.Allgather(np.ascontiguousarray(shard.x), gathered)
    np.testing.assert_array_equal(gathered, HDF5Dataset(path).x)

    # A failure on rank 0 is raised on every rank instead of leaving the others waiting.
    def fail(path):
        raise OSError("read-only file system")

    monkeypatch.setattr(data, "prepare_digits", fail)
    expected = OSError if comm.rank == 0 else data.DataPreparationError
    with pytest.raises(expected, match="read-only file system" if comm.rank == 0 else "rank 0 failed"):
        data.ensure_digits(shared_tmp / "other.h5", comm=mpi_world)
