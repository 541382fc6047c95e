"""Resuming reads a checkpoint's bytes for its SHA-256 once: latest_checkpoint checks the newest
file and returns its path as a record of that check (mpidist.checkpoint.files.Verified), and
load_checkpoint of that record loads it without hashing it again, while a file changed since the
check (written in place, replaced) is hashed again and refused when damaged. A plain path, or a
record that crossed to another process, is always hashed."""
import os
import pickle
import time

import pytest
import torch
from test_data import shared_tmp  # noqa: F401  (fixture)
from torch import nn

from mpidist.checkpoint import CheckpointError, checkpoint_path, latest_checkpoint, load_checkpoint, save_checkpoint
from mpidist.checkpoint import files as checkpoint_files
from mpidist.cli.train_pipeline import common_checkpoint

pytestmark = pytest.mark.mpi_shared_launch


def trained(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.rand(2, 6)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture
def digests(monkeypatch):
    """The paths checkpoint_files hashed, in order, from now on."""
    hashed = []
    real = checkpoint_files._digest

    def counted(path):
        hashed.append(str(path))
        return real(path)

    monkeypatch.setattr(checkpoint_files, "_digest", counted)
    return hashed


def flip_a_byte(path):
    """The same file, the same size, one byte of the weights' region changed, past the file
    system's timestamp granularity."""
    time.sleep(0.05)
    with open(path, "r+b") as f:
        f.seek(-200, 2)
        byte = f.read(1)
        f.seek(-200, 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_resuming_hashes_the_newest_checkpoint_once(tmp_path, digests):
    model, optimizer = trained()
    save_checkpoint(checkpoint_path(tmp_path, 1, 3), model, optimizer, step=3, epoch=1)
    del digests[:]  # the seal's own digest
    latest = latest_checkpoint(tmp_path)
    assert isinstance(latest, str) and os.fspath(latest) is latest  # a path wherever a path goes
    fresh, fresh_optimizer = trained(seed=1)
    assert load_checkpoint(latest, fresh, fresh_optimizer) == {"step": 3, "epoch": 1, "extra": {}}
    assert digests == [latest]
    for mine, saved in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(mine, saved)
    # The same file by a plain path is hashed: only the record says it was checked.
    load_checkpoint(str(latest), *trained(seed=1))
    assert digests == [latest, latest]


def test_a_file_changed_after_its_check_is_hashed_again_and_refused(tmp_path, digests):
    model, optimizer = trained()
    path = save_checkpoint(checkpoint_path(tmp_path, 1, 3), model, optimizer, step=3, epoch=1)
    latest = latest_checkpoint(tmp_path)
    assert latest == path
    flip_a_byte(path)
    del digests[:]
    fresh, fresh_optimizer = trained(seed=1)
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(CheckpointError, match="is damaged: its content does not match the SHA-256"):
        load_checkpoint(latest, fresh, fresh_optimizer)
    assert digests == [path]
    assert all(torch.equal(now, then) for now, then in zip(fresh.parameters(), before))  # nothing loaded


def test_a_file_replaced_after_its_check_is_hashed_again_and_loaded_as_it_is_now(tmp_path, digests):
    model, optimizer = trained()
    path = save_checkpoint(checkpoint_path(tmp_path, 1, 3), model, optimizer, step=3, epoch=1)
    latest = latest_checkpoint(tmp_path)
    save_checkpoint(path, *trained(seed=2), step=4, epoch=1)  # renamed over it: another inode
    del digests[:]
    assert load_checkpoint(latest, *trained(seed=1))["step"] == 4
    assert digests == [path]


def test_a_record_is_this_process_s_only(tmp_path, digests):
    model, optimizer = trained()
    first = save_checkpoint(tmp_path / "a.h5", model, optimizer, step=1)
    second = tmp_path / "b.h5"
    second.write_bytes(open(first, "rb").read())
    del digests[:]
    record = checkpoint_files.verified(first)
    assert record == first and digests == [first]
    checkpoint_files.verify(record)
    assert digests == [first]
    # An identical copy elsewhere is hashed itself, and so is the record pickled (for another rank).
    checkpoint_files.verify(str(second))
    sent = pickle.loads(pickle.dumps(record))
    assert type(sent) is str and sent == first
    checkpoint_files.verify(sent)
    assert digests == [first, str(second), first]


@pytest.mark.mpi(ranks=[2, 3])
def test_every_rank_hashes_the_file_it_resumes_from_once(mpi_ranks, mpi_world, shared_tmp, tmp_path,  # noqa: F811
                                                        digests):
    # With comm, rank 0 checks the file it chooses; the others get its path and check it when they
    # load it.
    comm = mpi_world.mpi
    model, optimizer = trained()
    path = save_checkpoint(checkpoint_path(shared_tmp, 1, 3), model, optimizer, step=3, epoch=1, comm=mpi_world)
    del digests[:]
    latest = latest_checkpoint(shared_tmp, comm=mpi_world)
    assert latest == path
    assert digests == ([path] if comm.rank == 0 else [])
    assert load_checkpoint(latest, *trained(seed=1), comm=mpi_world)["step"] == 3
    assert digests == [path]

    # The pipeline's resume: each rank's own directory, the newest epoch every rank has. Rank 1
    # has a later one that the others lack: it loads the common one, which it has not checked yet.
    mine = tmp_path / "own"
    for epoch in (1, 2) if comm.rank == 1 else (1,):
        save_checkpoint(checkpoint_path(mine, epoch, 3 * epoch), *trained(seed=comm.rank), step=3 * epoch,
                        epoch=epoch)
    del digests[:]
    found = common_checkpoint(mine, mpi_world)
    assert found == checkpoint_path(mine, 1, 3)
    load_checkpoint(found, *trained(seed=5), comm=mpi_world)
    newest = checkpoint_path(mine, 2, 6)
    assert digests == ([newest, found] if comm.rank == 1 else [found])
