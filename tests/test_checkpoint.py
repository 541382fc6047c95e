"""HDF5 checkpoints: bitwise round trips, no pickle, atomic writes, exact resume, collective save.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order."""
import json
import os
import pickle
import random
import time

import h5py
import numpy as np
import pytest
import torch
from conftest import run_python
from test_data import digits_path, shared_tmp  # noqa: F401  (fixtures)
from torch import nn
from torch.utils.data import DataLoader

from mpidist.checkpoint import CheckpointError, checkpoint_path, latest_checkpoint, load_checkpoint, save_checkpoint
from mpidist.checkpoint import tree as checkpoint_tree
from mpidist.data import HDF5Dataset, ShardedSampler

pytestmark = pytest.mark.mpi_shared_launch


class Net(nn.Module):
    """float32 and bfloat16 layers, BatchNorm buffers (int64 counter) and dropout."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(64, 32)
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.3)
        self.second = nn.Linear(32, 10).to(torch.bfloat16)

    def forward(self, x):
        hidden = self.drop(torch.relu(self.norm(self.first(x))))
        return self.second(hidden.to(torch.bfloat16)).float()


OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2, betas=(0.8, 0.99)),
    "adamw-amsgrad": lambda params: torch.optim.AdamW(params, lr=1e-2, amsgrad=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
}


def trained(optimizer_name, steps=3, seed=0):
    torch.manual_seed(seed)
    model = Net()
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(torch.rand(8, 64)), torch.randint(0, 10, (8,))).backward()
        optimizer.step()
    return model, optimizer


def assert_bitwise_equal(a, b, where="state"):
    """Nested state dicts equal: same structure, Python values, tensor dtypes, shapes and bits."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist(), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}/{i}")
    else:
        assert a == b and type(a) is type(b), where


# ---- round trips --------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_round_trip_is_bitwise(tmp_path, optimizer_name):
    model, optimizer = trained(optimizer_name)
    sampler = ShardedSampler(100, 1, 4, seed=3)
    sampler.set_epoch(2)
    next(iter(sampler))
    path = save_checkpoint(tmp_path / "c.h5", model, optimizer, step=7, epoch=2, sampler=sampler,
                           extra={"loss": 0.25, "note": "x"})

    fresh_model, fresh_optimizer = trained(optimizer_name, steps=1, seed=1)
    fresh_sampler = ShardedSampler(100, 1, 4)
    info = load_checkpoint(path, fresh_model, fresh_optimizer, fresh_sampler)
    assert info == {"step": 7, "epoch": 2, "extra": {"loss": 0.25, "note": "x"}}
    assert_bitwise_equal(model.state_dict(), fresh_model.state_dict())
    assert_bitwise_equal(optimizer.state_dict(), fresh_optimizer.state_dict())
    assert fresh_sampler.state_dict() == sampler.state_dict()
    assert fresh_model.second.weight.dtype == torch.bfloat16


def test_layout_bfloat16_as_uint16_and_json_hyperparameters(tmp_path):
    model, optimizer = trained("adam")
    path = save_checkpoint(tmp_path / "c.h5", model, optimizer, step=1)
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == "mpidist-checkpoint"
        weight = f["model/second.weight"]
        assert weight.dtype == np.uint16 and weight.attrs["torch_dtype"] == "bfloat16"
        assert f["model/first.weight"].dtype == np.float32
        assert f["model/norm.num_batches_tracked"].attrs["torch_dtype"] == "int64"
        assert f["optimizer/state/3/exp_avg"].shape == (32,)
        groups = json.loads(f["optimizer"].attrs["tree"])["param_groups"]
        assert groups[0]["lr"] == 1e-2 and groups[0]["betas"] == {"__tuple__": [0.8, 0.99]}
        assert f["rng/0/torch_cpu"].dtype == np.uint8
        assert json.loads(f["rng/0"].attrs["python"])["version"] == 3


def test_no_pickle_on_save_or_load(tmp_path, monkeypatch):
    model, optimizer = trained("sgd-momentum")

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle or torch.save/torch.load was used")

    for module, names in ((pickle, ("dumps", "loads", "dump", "load")), (torch, ("save", "load"))):
        for name in names:
            monkeypatch.setattr(module, name, forbidden)
    path = save_checkpoint(tmp_path / "c.h5", model, optimizer, sampler=ShardedSampler(10, 0, 1))
    fresh_model, fresh_optimizer = trained("sgd-momentum", steps=1, seed=1)
    load_checkpoint(path, fresh_model, fresh_optimizer, ShardedSampler(10, 0, 1))
    assert_bitwise_equal(model.state_dict(), fresh_model.state_dict())


def test_rng_states_are_restored(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.normal()  # leaves a cached Gaussian in NumPy's legacy state
    path = save_checkpoint(tmp_path / "c.h5", None)
    expected = (torch.rand(4), np.random.normal(size=3), random.random())
    torch.manual_seed(9)
    np.random.seed(9)
    random.seed(9)
    load_checkpoint(path)
    got = (torch.rand(4), np.random.normal(size=3), random.random())
    assert torch.equal(got[0], expected[0]) and (got[1] == expected[1]).all() and got[2] == expected[2]
    torch.manual_seed(9)
    load_checkpoint(path, restore_rng=False)
    assert not torch.equal(torch.rand(4), expected[0])


def test_refuses_what_it_cannot_store_or_read(tmp_path):
    model, optimizer = trained("adam")
    with pytest.raises(CheckpointError, match="extra must be JSON-serializable"):
        save_checkpoint(tmp_path / "a.h5", model, extra={"bad": object()})
    optimizer.state[model.first.weight]["custom"] = object()
    with pytest.raises(CheckpointError, match="cannot store object at state/0/custom"):
        save_checkpoint(tmp_path / "b.h5", model, optimizer)
    assert os.listdir(tmp_path) == []
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = 1
    with pytest.raises(CheckpointError, match="not an mpidist checkpoint"):
        load_checkpoint(tmp_path / "other.h5", model)
    path = save_checkpoint(tmp_path / "c.h5", model)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_checkpoint(path, model, optimizer)
    with pytest.raises(CheckpointError, match="no sampler state"):
        load_checkpoint(path, sampler=ShardedSampler(10, 0, 1))


def test_latest_checkpoint_is_the_newest_readable_one(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    model = nn.Linear(2, 2)
    # An earlier run got to step 120; a fresh run into the same directory then wrote steps 90, 100.
    for epoch, step in ((1, 120), (0, 90), (1, 100)):
        save_checkpoint(checkpoint_path(tmp_path, epoch, step), model, step=step, epoch=epoch)
        time.sleep(0.01)
    assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-0001-00000100.h5")
    open(str(tmp_path / "ckpt-0002-00000500.h5") + ".tmp-host-123", "w").close()
    open(tmp_path / "notes.h5", "w").close()
    with open(checkpoint_path(tmp_path, 3, 900), "w") as corrupt:
        corrupt.write("not HDF5")
    with pytest.warns(UserWarning, match="skipping .*ckpt-0003-00000900.h5"):
        assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-0001-00000100.h5")
    with pytest.raises(CheckpointError, match="ckpt-0003-00000900.h5 is a file without mpidist.s checkpoint seal"):
        load_checkpoint(checkpoint_path(tmp_path, 3, 900), model)


# ---- atomic writes ------------------------------------------------------------------------------

def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer = trained("adam")
    path = save_checkpoint(tmp_path / "c.h5", model, optimizer, step=1)
    before = open(path, "rb").read()
    written = []
    original = checkpoint_tree.write_tensor

    def write_two_then_fail(group, name, tensor):
        if len(written) == 2:
            raise OSError("no space left on device")
        written.append(name)
        original(group, name, tensor)

    monkeypatch.setattr(checkpoint_tree, "write_tensor", write_two_then_fail)
    with torch.no_grad():
        model.first.weight.add_(1)
    with pytest.raises(OSError, match="no space left"):
        save_checkpoint(path, model, optimizer, step=2)
    assert len(written) == 2
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["c.h5"]
    restored, restored_optimizer = trained("adam", steps=1, seed=1)
    assert load_checkpoint(path, restored, restored_optimizer)["step"] == 1


def test_a_crash_mid_write_leaves_the_previous_checkpoint(tmp_path):
    code = f"""
import os, torch
from mpidist import checkpoint
from mpidist.checkpoint import tree as checkpoint_tree
model = torch.nn.Linear(256, 256)
checkpoint.save_checkpoint({str(tmp_path)!r} + "/ckpt-0000-00000001.h5", model, step=1)
original = checkpoint_tree.write_tensor
def crash(group, name, tensor):
    original(group, name, tensor)
    group.file.flush()
    os._exit(7)  # the process dies with the new file half written
checkpoint_tree.write_tensor = crash
with torch.no_grad():
    model.weight.zero_()
checkpoint.save_checkpoint({str(tmp_path)!r} + "/ckpt-0000-00000001.h5", model, step=2)
"""
    result = run_python(code)
    assert result.returncode == 7, result.stderr
    names = sorted(os.listdir(tmp_path))
    assert names[0] == "ckpt-0000-00000001.h5" and names[1].startswith("ckpt-0000-00000001.h5.tmp-")
    assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-0000-00000001.h5")
    model = nn.Linear(256, 256)
    with torch.no_grad():
        model.weight.zero_()
    assert load_checkpoint(tmp_path / "ckpt-0000-00000001.h5", model)["step"] == 1
    assert model.weight.abs().sum() > 0
    # The next write into the directory removes what the killed writer left.
    save_checkpoint(tmp_path / "ckpt-0000-00000003.h5", model, step=3)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0000-00000001.h5", "ckpt-0000-00000003.h5"]


# ---- exact resume -------------------------------------------------------------------------------

def train(model, optimizer, sampler, loader, step, epoch, stop, save_at=None, path=None):
    """Train until `stop` steps; numpy and random feed the input noise, torch feeds dropout."""
    while step < stop:
        sampler.set_epoch(epoch)
        for x, y in loader:
            noise = torch.from_numpy(np.random.normal(0, 0.01, size=x.shape).astype(np.float32))
            x = x + noise * random.random()
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            step += 1
            if step == save_at:
                save_checkpoint(path, model, optimizer, step=step, epoch=epoch, sampler=sampler)
            if step == stop:
                return
        epoch += 1


def setup_run(path, seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    dataset = HDF5Dataset(path)
    sampler = ShardedSampler(len(dataset), rank=1, size=2, seed=4)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, generator=torch.Generator())
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), sampler, loader


@pytest.mark.parametrize("save_at", [10, 24])  # mid-epoch, and at the end of epoch 0 (24 batches)
def test_resume_is_bitwise_identical(tmp_path, digits_path, save_at):  # noqa: F811
    steps = 30
    model, optimizer, sampler, loader = setup_run(digits_path, seed=0)
    train(model, optimizer, sampler, loader, step=0, epoch=0, stop=steps)

    model_a, optimizer_a, sampler_a, loader_a = setup_run(digits_path, seed=0)
    path = tmp_path / "ckpt.h5"
    train(model_a, optimizer_a, sampler_a, loader_a, step=0, epoch=0, stop=save_at, save_at=save_at, path=path)

    # A fresh start: other weights, other RNG states, new sampler and loader.
    model_b, optimizer_b, sampler_b, loader_b = setup_run(digits_path, seed=123)
    info = load_checkpoint(path, model_b, optimizer_b, sampler_b)
    assert info["step"] == save_at
    train(model_b, optimizer_b, sampler_b, loader_b, step=info["step"], epoch=info["epoch"], stop=steps)
    assert_bitwise_equal(model.state_dict(), model_b.state_dict())
    assert_bitwise_equal(optimizer.state_dict(), optimizer_b.state_dict())


# ---- several ranks ------------------------------------------------------------------------------

@pytest.mark.mpi(ranks=[2])
def test_collective_save_each_rank_resumes_its_own_rng(mpi_ranks, mpi_world, shared_tmp, monkeypatch):  # noqa: F811
    comm = mpi_world.mpi
    torch.manual_seed(0)
    model = Net()
    torch.manual_seed(100 + comm.rank)
    np.random.seed(100 + comm.rank)
    path = checkpoint_path(shared_tmp, 0, 5)
    save_checkpoint(path, model, step=5, comm=mpi_world)
    assert os.listdir(shared_tmp) == ["ckpt-0000-00000005.h5"]
    expected = torch.rand(3), np.random.rand(3)
    torch.manual_seed(0)
    np.random.seed(0)
    fresh = Net()
    assert load_checkpoint(path, fresh, comm=mpi_world)["step"] == 5
    assert torch.equal(torch.rand(3), expected[0]) and (np.random.rand(3) == expected[1]).all()
    assert_bitwise_equal(model.state_dict(), fresh.state_dict())
    theirs = np.empty(3, dtype=np.float32)
    comm.Sendrecv(expected[0].numpy(), dest=1 - comm.rank, recvbuf=theirs, source=1 - comm.rank)
    assert not np.array_equal(theirs, expected[0].numpy())  # each rank got its own stream back

    # Writing fails on rank 0: every rank raises, none waits forever, no file appears.
    monkeypatch.setattr(checkpoint_tree, "write_tensor", lambda *args: (_ for _ in ()).throw(OSError("quota")))
    expected_error = OSError if comm.rank == 0 else CheckpointError
    with pytest.raises(expected_error, match="quota" if comm.rank == 0 else "rank 0 failed writing checkpoint"):
        save_checkpoint(checkpoint_path(shared_tmp, 0, 6), model, step=6, comm=mpi_world)
    comm.Barrier()
    assert latest_checkpoint(shared_tmp) == path


@pytest.mark.mpi(ranks=[2, 3])
def test_ranks_resume_from_rank_0s_choice_or_all_stop(mpi_ranks, mpi_world, shared_tmp, tmp_path):  # noqa: F811
    comm = mpi_world.mpi
    torch.manual_seed(0)
    model = Net()
    path = save_checkpoint(checkpoint_path(shared_tmp, 1, 10), model, step=10, comm=mpi_world)
    # Rank 0's directory decides, whatever the others see in theirs (here: nothing).
    mine = shared_tmp if comm.rank == 0 else tmp_path
    assert latest_checkpoint(mine, comm=mpi_world) == path
    # A rank that cannot load stops every rank with the same error, naming it and the file.
    wrong = Net() if comm.rank != 1 else nn.Linear(3, 3)
    with pytest.raises(CheckpointError, match=r"failed on rank\(s\) \[1\]: .*ckpt-0001-00000010.h5 holds the state "
                                              r"of another model \(entries the model has and the file lacks: 2 "
                                              r"\(weight, bias\); entries the model lacks: "):
        load_checkpoint(path, wrong, comm=mpi_world)
    assert load_checkpoint(path, Net(), comm=mpi_world)["step"] == 10


SAVE_ON_RANK_0_ONLY = """
import sys, torch, mpidist as md
from mpidist.checkpoint import save_checkpoint
comm = md.init()
if comm.rank == 0:  # a Horovod habit: only rank 0 saves
    try:
        save_checkpoint(PATH, torch.nn.Linear(2, 2), comm=comm)
    except md.MismatchError as exc:
        print("refused:", exc, flush=True)
        sys.exit(3)
"""


def test_a_collective_save_called_by_one_rank_fails_instead_of_hanging(tmp_path):
    code = f"PATH = {str(tmp_path / 'c.h5')!r}\n" + SAVE_ON_RANK_0_ONLY
    result = run_python(code, ranks=2, env={"MPIDIST_TIMEOUT": "3"}, timeout=120)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "every rank must call it when comm is given" in result.stdout
    assert not (tmp_path / "c.h5").exists()


def test_background_checkpoints_write_the_state_of_the_moment_they_were_asked(tmp_path):
    from mpidist.checkpoint import BackgroundCheckpoints
    model = nn.Linear(300, 200)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 300)).sum().backward()
    optimizer.step()
    expected_weights = {k: v.clone() for k, v in model.state_dict().items()}
    expected_momentum = optimizer.state_dict()["state"][0]["momentum_buffer"].clone()
    writer = BackgroundCheckpoints()
    writer.save(tmp_path / "a.h5", model, optimizer, step=3, epoch=1, extra={"version": 3})
    with torch.no_grad():  # changed while the file is being written
        model.weight.add_(1.0)
        optimizer.state_dict()["state"][0]["momentum_buffer"].add_(1.0)
    (tmp_path / "file").write_text("")
    writer.save(tmp_path / "file" / "b.h5", model, optimizer, step=4)  # fails in the background
    with pytest.raises(OSError, match="file"):  # the write's own error, raised here
        writer.close()
    loaded = nn.Linear(300, 200)
    loaded_optimizer = torch.optim.SGD(loaded.parameters(), lr=0.1, momentum=0.9)
    state = load_checkpoint(tmp_path / "a.h5", loaded, loaded_optimizer, restore_rng=False)
    assert state == {"step": 3, "epoch": 1, "extra": {"version": 3}}
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected_weights[name])
    assert torch.equal(loaded_optimizer.state_dict()["state"][0]["momentum_buffer"], expected_momentum)
