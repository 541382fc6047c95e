"""Resuming reads a checkpoint's bytes for its SHA-256 once: latest_checkpoint checks the newest
file and load_checkpoint loads it without hashing it again, while a file changed since the
check (written in place, replaced) is hashed again and refused when damaged."""
import time

import pytest
import torch
from torch import nn

from mpidist import checkpoint_files
from mpidist.checkpoint import CheckpointError, checkpoint_path, latest_checkpoint, load_checkpoint, save_checkpoint


def trained(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.rand(2, 6)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture
def digests(monkeypatch):
    """The paths checkpoint_files hashed, in order, from now on (nothing counts as checked)."""
    hashed = []
    real = checkpoint_files._digest

    def counted(path):
        hashed.append(str(path))
        return real(path)

    monkeypatch.setattr(checkpoint_files, "_digest", counted)
    monkeypatch.setattr(checkpoint_files, "_last_intact", None, raising=False)
    return hashed


def test_resuming_hashes_the_newest_checkpoint_once(tmp_path, digests):
    model, optimizer = trained()
    save_checkpoint(checkpoint_path(tmp_path, 1, 3), model, optimizer, step=3, epoch=1)
    del digests[:]  # the seal's own digest
    latest = latest_checkpoint(tmp_path)
    fresh, fresh_optimizer = trained(seed=1)
    assert load_checkpoint(latest, fresh, fresh_optimizer) == {"step": 3, "epoch": 1, "extra": {}}
    assert digests == [latest]
    for mine, saved in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(mine, saved)


def test_a_file_changed_after_its_check_is_hashed_again_and_refused(tmp_path, digests):
    model, optimizer = trained()
    path = save_checkpoint(checkpoint_path(tmp_path, 1, 3), model, optimizer, step=3, epoch=1)
    assert latest_checkpoint(tmp_path) == path
    time.sleep(0.05)  # past the file system's timestamp granularity
    with open(path, "r+b") as f:  # the same file, the same size, one byte flipped
        f.seek(-200, 2)
        byte = f.read(1)
        f.seek(-200, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    del digests[:]
    with pytest.raises(CheckpointError, match="is damaged: its content does not match the SHA-256"):
        load_checkpoint(path, *trained(seed=1))
    assert digests == [path]


def test_an_identical_copy_elsewhere_is_hashed_itself(tmp_path, digests):
    model, optimizer = trained()
    first = save_checkpoint(tmp_path / "a.h5", model, optimizer, step=1)
    second = tmp_path / "b.h5"
    second.write_bytes(open(first, "rb").read())
    del digests[:]
    for path in (first, str(second), first):
        checkpoint_files.verify(path)
    assert digests == [first, str(second), first]
