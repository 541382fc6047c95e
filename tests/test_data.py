"""ShardedSampler, the HDF5 digits file and HDF5Dataset shards; cross-rank parts under mpirun."""
import collections
import os
import pathlib

import h5py
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

import mpidist as md
from mpidist import data
from mpidist.data import HDF5Dataset, ShardedSampler, shard_range

pytestmark = pytest.mark.mpi_shared_launch


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


def torch_order(n, rank, size, epoch=0, **kwargs):
    """The reference: DistributedSampler's indices for this rank and epoch."""
    sampler = DistributedSampler(range(n), num_replicas=size, rank=rank, **kwargs)
    sampler.set_epoch(epoch)
    return list(sampler)


def write_rows(path, count, y=None):
    """An HDF5 file whose train/x row i is [i, i + 0.5] and train/y[i] is i (or the given y)."""
    with h5py.File(path, "w") as f:
        f["train/x"] = np.arange(count, dtype=np.float32)[:, None] + np.array([0, 0.5], dtype=np.float32)
        f["train/y"] = np.arange(count, dtype=np.int64) if y is None else y
    return path


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


def test_peeking_at_a_batch_does_not_skip_any_of_the_epoch():
    for rank in range(3):
        sampler = ShardedSampler(25, rank, 3, seed=7)
        loader = DataLoader(list(range(25)), batch_size=2, sampler=sampler, generator=torch.Generator())
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            next(iter(loader))  # a look at one batch, e.g. to check shapes
            expected = torch_order(25, rank, 3, epoch, seed=7)
            assert [i for batch in loader for i in batch.tolist()] == expected
            assert sampler.remaining() == len(sampler) == len(expected)
            partial = iter(sampler)
            next(partial), next(partial)
            assert list(sampler) == expected


@pytest.mark.parametrize("changed", [{"size": 3}, {"size": 1}, {"size": 7}, {"dataset_len": 31},
                                     {"drop_last": True}, {"shuffle": False}])
def test_resume_at_an_epoch_boundary_with_another_world(changed):
    saved = ShardedSampler(30, 1, 4, seed=5)  # 8 indices per rank, padded
    saved.set_epoch(2)
    at_start = saved.state_dict()
    list(saved)
    complete = saved.state_dict()
    assert (at_start["position"], complete["position"]) == (0, 8)
    new = {"dataset_len": 30, "size": 4, "shuffle": True, "drop_last": False, **changed}
    for rank in range(new["size"]):
        def expected(epoch):
            return torch_order(new["dataset_len"], rank, new["size"], epoch, shuffle=new["shuffle"], seed=5,
                               drop_last=new["drop_last"])

        def fresh():
            return ShardedSampler(new["dataset_len"], rank, new["size"], shuffle=new["shuffle"],
                                  drop_last=new["drop_last"])

        # Saved at the start of epoch 2: all of epoch 2, on this sampler's shards.
        resumed = fresh()
        resumed.load_state_dict(at_start)
        assert (resumed.seed, resumed.epoch) == (5, 2)
        resumed.set_epoch(2)
        assert list(resumed) == expected(2)
        # Saved after epoch 2 was complete: nothing more of it, then epoch 3.
        resumed = fresh()
        resumed.load_state_dict(complete)
        assert resumed.state_dict()["position"] == len(resumed)  # this sampler's complete count
        resumed.set_epoch(2)  # the same epoch keeps the position, as in the usual loop
        assert resumed.remaining() == 0 and list(resumed) == []
        resumed.set_epoch(3)
        assert list(resumed) == expected(3)


def test_resume_mid_epoch_with_another_world_is_refused():
    saved = ShardedSampler(30, 1, 4, seed=5)
    iterator = iter(saved)
    next(iterator), next(iterator)
    state = saved.state_dict()
    with pytest.raises(md.InvalidArgumentError,
                       match="size=4 but this sampler has size=3; the saved position 2 of 8 in epoch 0"):
        ShardedSampler(30, 1, 3).load_state_dict(state)
    with pytest.raises(md.InvalidArgumentError, match="dataset_len=30 but this sampler has dataset_len=29"):
        ShardedSampler(29, 1, 4).load_state_dict(state)
    with pytest.raises(md.InvalidArgumentError, match="drop_last=False but this sampler has drop_last=True"):
        ShardedSampler(30, 1, 4, drop_last=True).load_state_dict(state)
    with pytest.raises(md.InvalidArgumentError, match="position 9 is outside 0..8"):
        ShardedSampler(30, 1, 3).load_state_dict({**state, "position": 9})


def test_sampler_arguments_and_state_are_checked():
    with pytest.raises(md.InvalidArgumentError, match="rank=2 is not a rank of 2"):
        ShardedSampler(10, 2, 2)
    with pytest.raises(md.InvalidArgumentError, match="size must be >= 1"):
        ShardedSampler(10, 0, 0)
    with pytest.raises(md.InvalidArgumentError, match="must be an integer"):
        ShardedSampler(10.0, 0, 1)
    state = ShardedSampler(10, 0, 2).state_dict(consumed=2)
    with pytest.raises(md.InvalidArgumentError, match="size=2 but this sampler has size=3"):
        ShardedSampler(10, 0, 3).load_state_dict(state)
    with pytest.raises(md.InvalidArgumentError, match="outside"):
        ShardedSampler(10, 0, 2).state_dict(consumed=6)


def check_sampler_across_ranks(mpi_world):
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
    with h5py.File(digits_path, "r") as f:
        order = np.concatenate([f["train/index"][()], f["test/index"][()]])
    np.testing.assert_array_equal(order, np.random.default_rng(0).permutation(1797))
    np.testing.assert_array_equal(np.concatenate([train_x, test_x]), (digits.data[order] / 16).astype(np.float32))
    np.testing.assert_array_equal(np.concatenate([train_y, test_y]), digits.target[order])
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
    from mpidist.cli import build_parser
    target = tmp_path / "x" / "digits.h5"
    args = build_parser().parse_args(["prepare-data", "--path", str(target)])
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
    assert {len(shard) for shard in shards} == {-(-1500 // size)}
    assert sorted(set(row for shard in shards for row in shard.rows)) == list(range(1500))
    # x and y hold each rank's own block once, so together they are the whole split.
    np.testing.assert_array_equal(np.concatenate([shard.x for shard in shards]), full.x)
    np.testing.assert_array_equal(np.concatenate([shard.y for shard in shards]), full.y)


def test_shard_rows_are_padded_or_trimmed_blocks(tmp_path):
    path = write_rows(tmp_path / "rows.h5", 10)
    assert [HDF5Dataset(path, rank=r, size=3).rows for r in range(3)] == [range(0, 4), (4, 5, 6, 4), (7, 8, 9, 7)]
    assert [HDF5Dataset(path, rank=r, size=3, drop_last=True).rows for r in range(3)] == [
        range(0, 3), range(4, 7), range(7, 10)]
    path = write_rows(tmp_path / "two.h5", 2)
    assert [list(HDF5Dataset(path, rank=r, size=5).rows) for r in range(5)] == [[0], [1], [0], [1], [0]]
    assert [len(HDF5Dataset(path, rank=r, size=5, drop_last=True)) for r in range(5)] == [0] * 5


@pytest.mark.parametrize("count", [0, 1, 2, 7, 10, 11])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("preload", [True, False])
def test_hdf5_shards_are_even_like_distributed_sampler(tmp_path, count, drop_last, preload):
    path = write_rows(tmp_path / "rows.h5", count)
    for size in range(1, 6):
        shards = [HDF5Dataset(path, rank=r, size=size, drop_last=drop_last, preload=preload) for r in range(size)]
        assert [len(shard) for shard in shards] == [len(torch_order(count, r, size, drop_last=drop_last))
                                                     for r in range(size)]
        for rank, shard in enumerate(shards):
            rows = list(shard.rows)
            assert len(rows) == len(shard)
            # Item i is the file's row rows[i] ...
            for i, row in enumerate(rows):
                x, y = shard[i]
                assert torch.equal(x, torch.tensor([row, row + 0.5])) and y.item() == row
            # ... and a rank holds only rows of its own block, or one borrowed row if it has none.
            block = shard_range(count, rank, size)
            assert set(rows) <= set(block) if block else rows in ([], [rank % max(count, 1)])
        counts = collections.Counter(row for shard in shards for row in shard.rows)
        if drop_last:
            assert max(counts.values(), default=1) == 1 and len(counts) == count - count % size
        else:
            assert set(counts) == set(range(count))


@pytest.mark.parametrize("preload", [True, False])
@pytest.mark.parametrize("split,rank,size,own", [
    ("train", 1, 3, range(500, 1000)),
    ("test", 1, 2, range(149, 297)),  # a block one row short, padded with its first row
    ("test", 298, 300, range(1, 2)),  # an empty block (297 rows, 300 ranks): borrows row 298 % 297
])
def test_a_rank_reads_only_its_rows(digits_path, monkeypatch, preload, split, rank, size, own):
    reads = []
    original = h5py.Dataset.__getitem__

    def recording(self, selection, *args, **kwargs):
        reads.append((self.name, selection))
        return original(self, selection, *args, **kwargs)

    monkeypatch.setattr(h5py.Dataset, "__getitem__", recording)
    shard = HDF5Dataset(digits_path, split, rank=rank, size=size, preload=preload)
    assert len(shard) == -(-shard.total_rows // size) and sorted(set(shard.rows)) == list(own)
    items = [shard[i] for i in range(len(shard))]
    assert reads
    for name, selection in reads:
        assert name in (f"/{split}/x", f"/{split}/y")
        assert isinstance(selection, slice) and own.start <= selection.start < selection.stop <= own.stop
    monkeypatch.undo()
    full = HDF5Dataset(digits_path, split)
    assert all(torch.equal(x, full[row][0]) and torch.equal(y, full[row][1]) for row, (x, y) in zip(shard.rows, items))


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


@pytest.mark.parametrize("preload", [True, False])
def test_labels_keep_their_kind(tmp_path, preload):
    targets = np.array([0.7, 1.5, -2.25])
    floats = HDF5Dataset(write_rows(tmp_path / "f.h5", 3, y=targets), preload=preload)
    labels = [floats[i][1] for i in range(3)]
    assert all(y.dtype == torch.float32 and y.dim() == 0 for y in labels)
    assert torch.equal(torch.stack(labels), torch.from_numpy(targets.astype(np.float32)))  # 0.7 stays 0.7
    assert next(iter(DataLoader(floats, batch_size=3)))[1].dtype == torch.float32
    ints = HDF5Dataset(write_rows(tmp_path / "i.h5", 3, y=np.array([3, 1, 2], dtype=np.int32)), preload=preload)
    assert [(y.dtype, y.dim(), y.item()) for _, y in (ints[i] for i in range(3))] == [
        (torch.int64, 0, 3), (torch.int64, 0, 1), (torch.int64, 0, 2)]
    for y in (np.array([True, False, True]), np.array([b"a", b"b", b"c"])):
        path = write_rows(tmp_path / "bad.h5", 3, y=y)
        with pytest.raises(md.InvalidArgumentError, match="train/y has dtype .*; labels must be integers"):
            HDF5Dataset(path, preload=preload)


def test_dataset_errors(digits_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="digits.h5 does not exist; make the digits file with `mpidist prepare-data`"):
        HDF5Dataset(tmp_path / data.DIGITS_FILENAME)
    with pytest.raises(md.InvalidArgumentError, match="no split 'valid'.*'test', 'train'"):
        HDF5Dataset(digits_path, split="valid")
    with pytest.raises(md.InvalidArgumentError, match="both rank and size"):
        HDF5Dataset(digits_path, rank=0)


def test_a_missing_file_that_is_not_the_digits_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.h5 does not exist") as error:
        HDF5Dataset(tmp_path / "missing.h5")
    assert "prepare-data" not in str(error.value) and "digits" not in str(error.value)


@pytest.fixture
def odd_file(tmp_path):
    path = tmp_path / "odd.h5"
    with h5py.File(path, "w") as f:
        f["flat"] = np.zeros((4, 2))
        f["no_y/x"] = np.zeros((4, 2))
        f["no_y/index"] = np.arange(4)
        f["short/x"] = np.zeros((10, 2))
        f["short/y"] = np.zeros(9, dtype=np.int64)
    return path


def test_a_split_that_is_a_dataset(odd_file):
    with pytest.raises(md.InvalidArgumentError, match="'flat' is a dataset, not a split"):
        HDF5Dataset(odd_file, split="flat")


def test_a_split_without_y(odd_file):
    with pytest.raises(md.InvalidArgumentError, match=r"split 'no_y' has no dataset 'y' \(it holds \['index', 'x'\]\)"):
        HDF5Dataset(odd_file, split="no_y")


def test_x_and_y_of_different_lengths(odd_file):
    with pytest.raises(md.InvalidArgumentError, match="short/x has 10 rows but short/y has 9"):
        HDF5Dataset(odd_file, split="short")


def check_hdf5_shards_have_equal_length_on_every_rank(mpi_world, shared_tmp):
    comm = mpi_world.mpi
    path = shared_tmp / "rows.h5"
    if comm.rank == 0:
        write_rows(path, 11)  # 6/5 rows on 2 ranks, 4/4/3 on 3
    comm.Barrier()
    for options in ({}, {"drop_last": True}):  # the default (drop_last=False) first
        shard = HDF5Dataset(path, rank=comm.rank, size=comm.size, **options)
        batches = sum(1 for _ in DataLoader(shard, batch_size=1))
        # In data-parallel training every batch is an all-reduce: one batch more on one rank hangs.
        assert len(set(comm.allgather((len(shard), batches)))) == 1
        everyone = [row for rows in comm.allgather(list(shard.rows)) for row in rows]
        assert len(set(everyone)) == (11 - 11 % comm.size if shard.drop_last else 11)


def check_ensure_digits_on_rank_0_then_shards(mpi_world, shared_tmp, monkeypatch):
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


@pytest.mark.mpi(ranks=[2, 3])
def test_sampler_and_shards_across_ranks(mpi_ranks, mpi_world, shared_tmp, monkeypatch):
    """The checks of one world size in one launch: each launch starts every rank's interpreter
    (torch included), which costs more than the checks themselves. They share rank 0's tmp_path,
    each with files of its own names."""
    check_sampler_across_ranks(mpi_world)
    check_hdf5_shards_have_equal_length_on_every_rank(mpi_world, shared_tmp)
    if mpi_ranks == 3:
        with monkeypatch.context() as patch:
            check_ensure_digits_on_rank_0_then_shards(mpi_world, shared_tmp, patch)
