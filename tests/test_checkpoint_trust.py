"""Files from elsewhere are never trusted blindly: checkpoints cut short, with bytes changed, of
another model or optimizer, or with absurd contents, and tuning files with nonsense in them, are
refused with an error naming the file and the problem (on every rank), load nothing, and never
make a resumed run start over the last good checkpoint.

Damaged files are real checkpoints that mpidist wrote, then edited byte by byte; files with
absurd contents are edited with h5py and sealed again, as a tool that knows the seal would.
The multi-rank tests of one world size run in one launch (mpi_shared_launch.py)."""
import json
import os
import random
import re
import shutil

import h5py
import numpy as np
import pytest
import torch
from conftest import run_python
from test_data import digits_path, shared_tmp  # noqa: F401  (fixtures)
from torch import nn

from mpidist.checkpoint import CheckpointError, checkpoint_path, latest_checkpoint, load_checkpoint, save_checkpoint
from mpidist.checkpoint.files import SEAL_BYTES, seal
from mpidist.cli.train_pipeline import common_checkpoint
from mpidist.collectives.node_window import ONE_SHOT_BYTES
from mpidist.collectives.select import load_tuning_table, read_tuning_file
from mpidist.data import HDF5Dataset
from mpidist.errors import MpidistError

pytestmark = pytest.mark.mpi_shared_launch


def trained(seed=0, optimizer_class=torch.optim.Adam):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    optimizer = optimizer_class(model.parameters(), lr=0.01)
    model(torch.rand(4, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


def states(model, optimizer):
    """Copies of everything a load could change: weights, optimizer state, every generator."""
    return (json.dumps({k: v.tolist() for k, v in model.state_dict().items()}),
            repr(optimizer.state_dict()), torch.get_rng_state().clone(), np.random.get_state(legacy=True)[1].copy(),
            random.getstate())


def assert_unchanged(before, after):
    assert before[0] == after[0], "the weights changed"
    assert before[1] == after[1], "the optimizer state changed"
    assert torch.equal(before[2], after[2]) and (before[3] == after[3]).all() and before[4] == after[4], \
        "a generator changed"


@pytest.fixture
def good(tmp_path):
    """A checkpoint written by mpidist, and its bytes."""
    model, optimizer = trained()
    path = save_checkpoint(tmp_path / "good.h5", model, optimizer, step=3, epoch=1)
    return path, open(path, "rb").read()


def refuses(path, match, optimizer_class=torch.optim.Adam):
    """Loading `path` into a fresh model and optimizer raises a CheckpointError naming the file and
    matching `match`, and changes nothing."""
    model, optimizer = trained(seed=1, optimizer_class=optimizer_class)
    before = states(model, optimizer)
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path, model, optimizer)
    assert str(path) in str(raised.value), raised.value
    assert raised.match(match)
    assert_unchanged(before, states(model, optimizer))


# ---- damaged files ------------------------------------------------------------------------------

CUTS = {"into_the_seal": lambda n: 100, "after_the_seal": lambda n: SEAL_BYTES,
        "into_hdf5_superblock": lambda n: SEAL_BYTES + 40, "half": lambda n: n // 2, "last_byte": lambda n: n - 1}


@pytest.mark.parametrize("cut", CUTS)
def test_a_truncated_checkpoint_is_refused(tmp_path, good, cut):
    path, data = good
    damaged = tmp_path / "cut.h5"
    damaged.write_bytes(data[:CUTS[cut](len(data))])
    refuses(damaged, "truncated|damaged")


FLIPS = {"hdf5_signature": lambda n: SEAL_BYTES + 1, "hdf5_superblock": lambda n: SEAL_BYTES + 20,
         "middle": lambda n: n // 2, "weights_near_the_end": lambda n: n - 300, "seal_digest": lambda n: 60}


@pytest.mark.parametrize("where", FLIPS)
def test_a_checkpoint_with_a_byte_changed_is_refused(tmp_path, good, where):
    path, data = good
    changed = bytearray(data)
    changed[FLIPS[where](len(data))] ^= 0x5A
    damaged = tmp_path / "flipped.h5"
    damaged.write_bytes(bytes(changed))
    refuses(damaged, "damaged|seal")


def test_every_byte_changed_anywhere_is_refused_without_crashing(tmp_path, good):
    """A sample of positions over the whole file: HDF5 itself would crash on some (a damaged
    attribute's heap) and load others silently changed (raw data has no checksum)."""
    path, data = good
    damaged = tmp_path / "flipped.h5"
    for position in range(0, len(data), 97):
        changed = bytearray(data)
        changed[position] ^= 0xFF
        damaged.write_bytes(bytes(changed))
        with pytest.raises(CheckpointError, match="flipped.h5"):
            load_checkpoint(damaged, *trained(seed=1))


def test_empty_files_directories_and_other_files_are_refused(tmp_path):
    (tmp_path / "empty.h5").write_bytes(b"")
    refuses(tmp_path / "empty.h5", "is empty")
    (tmp_path / "a_directory.h5").mkdir()
    refuses(tmp_path / "a_directory.h5", "is a directory")
    (tmp_path / "text.h5").write_text("epoch,loss\n1,0.5\n")
    refuses(tmp_path / "text.h5", "is a file without mpidist's checkpoint seal")
    with h5py.File(tmp_path / "plain.h5", "w") as f:
        f["weights"] = np.ones(3)
    refuses(tmp_path / "plain.h5", "is not an mpidist checkpoint")
    refuses(tmp_path / "missing.h5", "cannot read checkpoint .*No such file")



# A checkpoint that mpidist wrote before checkpoints were sealed (format version 1); files.json
# says how it was made and what a load of it gives.
DATA = os.path.join(os.path.dirname(__file__), "data")
VERSION_1 = os.path.join(DATA, "ckpt-0001-00000003.h5")
with open(os.path.join(DATA, "files.json")) as handle:
    VERSION_1_EXPECTED = json.load(handle)[os.path.basename(VERSION_1)]["expected"]


def stored_datasets(path):
    """Every dataset of the HDF5 file at `path`, read with h5py alone: {name: its bytes, dtype, shape}."""
    datasets = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: datasets.__setitem__(name, as_bits(item[()]))
                     if isinstance(item, h5py.Dataset) else None)
    return datasets


def loaded_datasets(model, optimizer):
    """What a load put in the model, the optimizer state and torch's generator, under the names of
    the datasets it came from."""
    tensors = {f"model/{name}": value for name, value in model.state_dict().items()}
    tensors.update({f"optimizer/state/{index}/{key}": value
                    for index, state in optimizer.state_dict()["state"].items() for key, value in state.items()})
    tensors["rng/0/torch_cpu"] = torch.get_rng_state()
    return {name: as_bits(tensor.numpy()) for name, tensor in tensors.items()}


def as_bits(array):
    return array.tobytes(), str(array.dtype), array.shape


def test_a_checkpoint_from_before_the_seal_still_loads_with_a_warning(tmp_path):
    """What loads is what the file holds, bit for bit; the file's values are those of the machine
    that wrote it (files.json), so they are read from it, never computed again here."""
    shutil.copy(VERSION_1, tmp_path)
    path = str(tmp_path / os.path.basename(VERSION_1))
    assert latest_checkpoint(tmp_path) == path
    with h5py.File(path, "r") as f:
        assert f.attrs["format_version"] == VERSION_1_EXPECTED["format_version"]
    stored = stored_datasets(path)
    assert sorted(stored) == VERSION_1_EXPECTED["datasets"]
    # Other values everywhere before the load: weights of seed 1, another learning rate and betas.
    model, optimizer = trained(seed=1, optimizer_class=lambda p, lr: torch.optim.Adam(p, lr=0.5, betas=(0.5, 0.5)))
    with pytest.warns(UserWarning, match="without checkpoint checksums .format version 1.: loaded without checking"):
        assert load_checkpoint(path, model, optimizer) == VERSION_1_EXPECTED["load_checkpoint_returns"]
    loaded = loaded_datasets(model, optimizer)
    assert sorted(loaded) == sorted(stored)
    assert [name for name in stored if loaded[name] != stored[name]] == [], "these differ from the file"
    expected_groups = VERSION_1_EXPECTED["param_groups"]
    groups = [{key: group[key] for key in expected} for group, expected in
              zip(optimizer.state_dict()["param_groups"], expected_groups, strict=True)]
    assert json.loads(json.dumps(groups)) == expected_groups


def test_an_unsealed_checkpoint_of_a_sealed_format_is_refused(tmp_path):
    path = tmp_path / "unsealed.h5"
    shutil.copy(VERSION_1, path)
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = 2
    refuses(path, "format version 2 without its seal: damaged at its start")

# ---- another model or optimizer -----------------------------------------------------------------

def test_the_state_of_another_model_is_refused(tmp_path):
    other = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 5))
    path = save_checkpoint(tmp_path / "shapes.h5", other, torch.optim.Adam(other.parameters()))
    refuses(path, r"another model \(other shapes: 2 \(2.weight \[5, 8\] here, \[4, 8\] in the model, 2.bias")
    renamed = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(4, 4))
    path = save_checkpoint(tmp_path / "extra.h5", renamed, torch.optim.Adam(renamed.parameters()))
    refuses(path, r"entries the model lacks: 2 \(3.weight, 3.bias\)")
    smaller = nn.Sequential(nn.Linear(16, 8))
    path = save_checkpoint(tmp_path / "missing.h5", smaller, torch.optim.Adam(smaller.parameters()))
    refuses(path, r"entries the model has and the file lacks: 2 \(2.weight, 2.bias\)")


def test_the_state_of_another_optimizer_is_refused(tmp_path):
    model, sgd = trained(optimizer_class=lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9))
    path = save_checkpoint(tmp_path / "sgd.h5", model, sgd)
    refuses(path, "holds the state of a SGD optimizer, not of this Adam")
    groups = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[2].parameters()}])
    path = save_checkpoint(tmp_path / "groups.h5", model, groups)
    refuses(path, "its optimizer state does not fit this optimizer .*different number of parameter groups")


# ---- absurd contents, sealed again ----------------------------------------------------------------

def edited(path, edit):
    """`path` edited with h5py by `edit(file)`, then sealed again."""
    with h5py.File(path, "r+") as f:
        edit(f)
    seal(path)
    return path


def replace(f, name, data, **attrs):
    del f[name]
    f.create_dataset(name, data=data)
    f[name].attrs.update(attrs)


ABSURD = {
    "negative_step": (lambda f: f.attrs.__setitem__("step", -1), "its step counter -1 is not an integer of at least 0"),
    "fractional_epoch": (lambda f: f.attrs.__setitem__("epoch", 2.5),
                         "its epoch counter 2.5 is not an integer of at least 0"),
    "text_step": (lambda f: f.attrs.__setitem__("step", "3"), "its step counter '3' is not an integer"),
    "strings_for_weights": (lambda f: replace(f, "model/0.weight", np.array([["x"] * 16] * 8, dtype=object),
                                              torch_dtype="float32"),
                            "good.h5: /model/0.weight holds object values, not numbers"),
    "integers_for_weights": (lambda f: replace(f, "model/0.weight", np.zeros((8, 16), dtype=np.int32),
                                               torch_dtype="int32"),
                             r"another model \(other kinds of values: 1 \(0.weight int32 here, float32 in the model\)\)"),
    "huge_dims": (lambda f: (f["optimizer/state/0"].__delitem__("exp_avg"),
                             f.create_dataset("optimizer/state/0/exp_avg", shape=(1 << 40,), dtype=np.float32,
                                              chunks=(1 << 16,)),
                             f["optimizer/state/0/exp_avg"].attrs.__setitem__("torch_dtype", "float32")),
                  r"exp_avg: its shape \[1099511627776\] claims 4398046511104 bytes, the file stores 0"),
    "wrong_torch_dtype": (lambda f: f["model/0.bias"].attrs.__setitem__("torch_dtype", "float64"),
                          "torch_dtype float64 does not fit its float32 values"),
    "unknown_torch_dtype": (lambda f: f["model/0.bias"].attrs.__setitem__("torch_dtype", "float33"),
                            r"another model \(other kinds of values: 1 \(0.bias float33 here, float32 in the model\)\)"),
    "rng_of_the_wrong_size": (lambda f: replace(f, "rng/0/torch_cpu", np.zeros(100, dtype=np.uint8)),
                              "the RNG states saved for rank 0 do not fit the generators .*size 5056"),
    "numpy_position_outside": (lambda f: f["rng/0"].attrs.__setitem__(
        "numpy", json.dumps({**json.loads(f["rng/0"].attrs["numpy"]), "pos": 5000})),
        "NumPy's MT19937 position 5000 is outside its 624 keys"),
    "python_state_too_short": (lambda f: f["rng/0"].attrs.__setitem__(
        "python", json.dumps({**json.loads(f["rng/0"].attrs["python"]), "state": [1, 2, 3]})),
        "state vector is the wrong size"),
}


@pytest.mark.parametrize("case", ABSURD)
def test_absurd_contents_are_refused_and_load_nothing(good, case):
    edit, match = ABSURD[case]
    refuses(edited(good[0], edit), match)


def test_non_finite_weights_load_as_they_were_saved(tmp_path):
    """mpidist does not promise finite weights: a model may keep -inf in a mask, and a run that
    diverged resumes as it was (the loss shows it), so NaN and Inf round-trip."""
    model, optimizer = trained()
    with torch.no_grad():
        model[0].weight[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    path = save_checkpoint(tmp_path / "inf.h5", model, optimizer)
    fresh, fresh_optimizer = trained(seed=1)
    load_checkpoint(path, fresh, fresh_optimizer)
    assert torch.equal(fresh[0].weight.isnan(), model[0].weight.isnan())
    assert torch.equal(fresh[0].weight.nan_to_num(), model[0].weight.nan_to_num())


# ---- resuming ----------------------------------------------------------------------------------

def test_resume_skips_a_damaged_newest_checkpoint_and_refuses_when_none_is_intact(tmp_path):
    model, optimizer = trained()
    older = save_checkpoint(checkpoint_path(tmp_path, 1, 10), model, optimizer, step=10, epoch=1)
    newest = save_checkpoint(checkpoint_path(tmp_path, 2, 20), model, optimizer, step=20, epoch=2)
    data = bytearray(open(newest, "rb").read())
    data[len(data) // 2] ^= 1
    open(newest, "wb").write(bytes(data))
    with pytest.warns(UserWarning, match=f"skipping it: checkpoint {newest} is damaged"):
        assert latest_checkpoint(tmp_path) == older
    open(older, "r+b").truncate(os.path.getsize(older) - 10)
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match=f"{tmp_path} holds 2 checkpoint file"
                                                                         r"\(s\) and none is intact \(checkpoint "
                                                                         f"{newest} is damaged"):
        latest_checkpoint(tmp_path)


TRAIN = "from mpidist.cli import main; raise SystemExit(main({args!r}))"


def test_train_resume_falls_back_past_a_damaged_newest_and_never_starts_over_damaged_ones(tmp_path):
    """`mpidist train --resume` (one process): a damaged newest checkpoint is skipped with a
    warning naming it, and the run continues from the one before; with every checkpoint damaged,
    even --resume=auto refuses (status 2) and leaves the files as they were."""
    directory = tmp_path / "ck"

    def train(*extra):
        args = ["train", "--no-progress", "--checkpoint-dir", str(directory), "--data", str(tmp_path / "d.h5"),
                "--batch-size", "256", *extra]
        return run_python(TRAIN.format(args=args), timeout=300)

    first = train("--epochs", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    older, newest = sorted(directory.iterdir())
    flip(newest, position=-200)
    resumed = train("--epochs", "2", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"skipping it: checkpoint {newest} is damaged" in resumed.stderr
    assert f"resumed from {older} (epoch 1," in resumed.stdout
    assert "epoch 2/2" in resumed.stdout and "final test accuracy" in resumed.stdout
    for path in (older, newest):
        flip(path, position=-200)
    damaged = {path: path.read_bytes() for path in (older, newest)}
    refused = train("--epochs", "3", "--resume=auto")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"{directory} holds 2 checkpoint file(s) and none is intact" in refused.stderr.splitlines()[-1]
    assert {path: path.read_bytes() for path in directory.iterdir()} == damaged


def flip(path, position):
    data = bytearray(path.read_bytes())
    data[position] ^= 1
    path.write_bytes(bytes(data))


# ---- tuning files ------------------------------------------------------------------------------

GOOD_TABLE = [{"max_bytes": 4095, "algorithm": "mpi"}, {"max_bytes": None, "algorithm": "ring"}]
NONSENSE_TUNING = {
    "not_json": ("{'2': ring", "Expecting property name"),
    "a_list": ("[]", "not a JSON object of tables"),
    "not_a_rank_count": (json.dumps({"two": GOOD_TABLE}), "'two' is not a rank count"),
    "zero_ranks": (json.dumps({"0": GOOD_TABLE}), "'0' is not a rank count"),
    "a_table_that_is_a_number": (json.dumps({"2": 5}), "the table for 2 ranks: a table is a non-empty list of rows"),
    "empty_table": (json.dumps({"2": []}), "the table for 2 ranks: a table is a non-empty list"),
    "unknown_algorithm": (json.dumps({"2": [{"max_bytes": None, "algorithm": "butterfly"}]}),
                          "row 0: unknown algorithm 'butterfly'"),
    "negative_size": (json.dumps({"2": [{"max_bytes": -5, "algorithm": "mpi"}, GOOD_TABLE[1]]}),
                      "row 0: max_bytes -5 is not a whole number of bytes"),
    "fractional_size": (json.dumps({"2": [{"max_bytes": 1.5, "algorithm": "mpi"}, GOOD_TABLE[1]]}),
                        "row 0: max_bytes 1.5 is not a whole number of bytes"),
    "unsorted": (json.dumps({"2": [{"max_bytes": 4095, "algorithm": "mpi"}, {"max_bytes": 1023, "algorithm": "tree"},
                                   GOOD_TABLE[1]]}), "row 1: max_bytes 1023 is not above the previous row's 4095"),
    "no_unbounded_last_row": (json.dumps({"2": GOOD_TABLE[:1]}), "row 0: max_bytes 4095: the last row, and only"),
    "unbounded_row_first": (json.dumps({"2": [GOOD_TABLE[1], GOOD_TABLE[0]]}), "row 0: max_bytes None: the last row"),
    "another_rank_counts_table_malformed": (json.dumps({"2": GOOD_TABLE, "8": [{"algorithm": "ring"}]}),
                                            "the table for 8 ranks: row 0 is not an object with max_bytes"),
    "one_shot_bound_not_a_count": (json.dumps({"2": GOOD_TABLE, "one_shot_bytes": {"2": "64K"}}),
                                   "its one_shot_bytes is not an object of byte counts by rank count"),
    "one_shot_bound_negative": (json.dumps({"one_shot_bytes": {"2": -1}}), "its one_shot_bytes is not an object"),
}


@pytest.mark.parametrize("case", NONSENSE_TUNING)
def test_a_tuning_file_with_nonsense_is_ignored_with_a_warning_naming_it(tmp_path, monkeypatch, case):
    from mpi4py import MPI
    text, problem = NONSENSE_TUNING[case]
    path = tmp_path / "tuning.json"
    path.write_text(text)
    monkeypatch.setenv("MPIDIST_TUNING_FILE", str(path))
    with pytest.raises(ValueError, match=problem):
        read_tuning_file()
    with pytest.warns(UserWarning, match=f"ignoring the tuning file {path}: .*{problem}"):
        assert load_tuning_table(MPI.COMM_SELF, 1) == (None, ONE_SHOT_BYTES)  # the built-in table
    path.write_text(json.dumps({"1": GOOD_TABLE, "one_shot_bytes": {"1": 1000, "2": 2000}}))
    assert load_tuning_table(MPI.COMM_SELF, 1) == (((4096, "mpi"), (float("inf"), "ring")), 1000)
    assert load_tuning_table(MPI.COMM_SELF, 2)[1] == ONE_SHOT_BYTES, "across nodes the one-shot does not run"


# ---- data files ----------------------------------------------------------------------------------

def test_a_damaged_or_absurd_data_file_is_refused_naming_it(tmp_path, digits_path):  # noqa: F811
    """HDF5 keeps no checksum of a data file's values, but a file whose structure is damaged, or
    that holds no rows of numbers, is refused naming it (the ranks of `mpidist train` share
    the error: test_train.py); the damaged names of splits once escaped as a TypeError."""
    def refused(path, match, split="train"):
        with pytest.raises(MpidistError, match=match) as raised:
            HDF5Dataset(path, split)
        assert str(path) in str(raised.value)

    (tmp_path / "empty.h5").write_bytes(b"")
    refused(tmp_path / "empty.h5", "cannot be read as HDF5")
    (tmp_path / "directory.h5").mkdir()
    refused(tmp_path / "directory.h5", "cannot be read as HDF5")
    with h5py.File(tmp_path / "strings.h5", "w") as f:
        f["train/x"] = np.array([["a", "b"]] * 3, dtype=object)
        f["train/y"] = np.zeros(3, dtype=np.int64)
        f["test/x"] = np.zeros((3, 2), dtype=np.float32)
        f["test/y"] = np.int64(1)
    refused(tmp_path / "strings.h5", "train/x has dtype object; inputs must be numbers")
    refused(tmp_path / "strings.h5", "test/y is a scalar, not rows", split="test")
    data = open(digits_path, "rb").read()
    names = [match.start() + i for word in (b"train", b"test") for match in re.finditer(word, data)
             for i in range(len(word))]
    assert names
    for position in names:
        changed = bytearray(data)
        changed[position] ^= 0xFF
        (tmp_path / "flipped.h5").write_bytes(bytes(changed))
        for split in ("train", "test"):
            try:
                HDF5Dataset(tmp_path / "flipped.h5", split)
            except MpidistError as exc:
                assert "flipped.h5" in str(exc), (position, exc)


# ---- several ranks ------------------------------------------------------------------------------

@pytest.mark.mpi(ranks=[2, 3])
def test_every_rank_raises_the_same_error_naming_the_file(mpi_ranks, mpi_world, shared_tmp):  # noqa: F811
    comm = mpi_world.mpi
    model, optimizer = trained()
    intact = save_checkpoint(checkpoint_path(shared_tmp, 1, 10), model, optimizer, step=10, epoch=1, comm=mpi_world)
    damaged = checkpoint_path(shared_tmp, 2, 20)
    if comm.rank == 0:
        data = bytearray(open(intact, "rb").read())
        data[len(data) // 2] ^= 1
        open(damaged, "wb").write(bytes(data))
    comm.Barrier()
    fresh, fresh_optimizer = trained(seed=1)
    before = states(fresh, fresh_optimizer)
    with pytest.raises(CheckpointError, match=f"^checkpoint {damaged} is damaged: its content does not match"):
        load_checkpoint(damaged, fresh, fresh_optimizer, comm=mpi_world)
    assert_unchanged(before, states(fresh, fresh_optimizer))
    # Rank 0 chooses the newest intact one for every rank.
    assert latest_checkpoint(shared_tmp, comm=mpi_world) == intact
    # Damage that only one rank sees (a copy of its own, as on node-local storage): every rank stops.
    own = shutil.copy(intact, shared_tmp / f"copy-{comm.rank}.h5")
    if comm.rank == 1:
        data = bytearray(open(own, "rb").read())
        data[-100] ^= 1
        open(own, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"failed on rank\(s\) \[1\]: checkpoint \S+copy-1.h5 is damaged"):
        load_checkpoint(own, *trained(seed=1), comm=mpi_world)
    # The pipeline's ranks look in directories of their own: one with none intact stops every rank.
    own_directory = shared_tmp / f"stage-{comm.rank}"
    os.makedirs(own_directory)
    shutil.copy(damaged if comm.rank == 1 else intact, checkpoint_path(own_directory, 1, 10))
    with pytest.raises(CheckpointError, match=r"failed on rank\(s\) \[1\]: \S+stage-1 holds 1 checkpoint file\(s\) "
                                              "and none is intact"):
        common_checkpoint(own_directory, mpi_world)
    # None intact: every rank raises rank 0's error, naming the directory and the newest file.
    comm.Barrier()
    if comm.rank == 0:
        open(intact, "r+b").truncate(SEAL_BYTES + 8)
    comm.Barrier()
    with pytest.raises(CheckpointError, match=f"^{shared_tmp} holds 2 checkpoint file.*none is intact "
                                              f"\\(checkpoint {damaged} is damaged"):
        latest_checkpoint(shared_tmp, comm=mpi_world)
