"""Training checkpoints in HDF5, written atomically and read without pickle.

A checkpoint file holds (``h5ls -r`` shows it all)::

    /                 attrs: format, format_version, step, epoch, ranks, extra (JSON),
                             sampler (JSON), torch_version, created_unix
    /model            attrs: tree (JSON), metadata (JSON); one dataset per state_dict entry
    /optimizer        attrs: tree (JSON); datasets under state/<param index>/<name>
    /rng/<rank>       dataset torch_cpu (uint8 bytes of torch's CPU RNG state),
                      group torch_cuda/<device> (when CUDA was in use),
                      attrs numpy (JSON of NumPy's global MT19937 state), python (JSON of random)

The file is sealed (files.py): its first 512 bytes, which HDF5 skips, hold the size
and SHA-256 of the rest, and loading checks them before HDF5 reads the file. A truncated or
altered file, a file that is not a checkpoint, the state of another model or optimizer (the
optimizer's class is stored too), tensors of absurd shapes or non-numeric types, step or epoch
counters that are not integers of at least 0 and RNG states of the wrong size are each refused,
before anything is loaded, with a CheckpointError naming the file and the problem.

Tensors are datasets, bit for bit, and everything that is not a tensor (optimizer
hyperparameters, the sampler position, ``extra``) is JSON (tree.py): loading a
checkpoint never runs pickle, so a checkpoint from elsewhere cannot execute code.

With a communicator, ``save_checkpoint`` is collective: rank 0 writes the model, optimizer and
sampler (identical on every data-parallel rank) and every rank's RNG state, which it gathers,
so each rank resumes its own dropout stream. Modes where ranks hold different models
(pipeline stages, parameter servers) save one file per rank with ``comm=None``.
BackgroundCheckpoints writes them from a thread of its own, from copies taken when asked.

The package: this module holds what users call (save_checkpoint, load_checkpoint,
latest_checkpoint, checkpoint_path and CHECKPOINT_NAME, the pattern of its names,
BackgroundCheckpoints, CheckpointError); files.py makes files appear
atomically and sealed, tree.py turns a state into datasets and JSON, rng.py gathers and restores
the ranks' random number generators.
"""
from __future__ import annotations

import concurrent.futures
import copy
import json
import os
import re
import time
import warnings
from collections import OrderedDict

import numpy as np

from ..comm import is_initialized, world
from ..errors import CheckpointError
from ..runtime.together import mpi_of, on_every_rank, on_root, share_failure
from . import rng
from .files import atomic_hdf5, read_seal, verified, verify
from .tree import ITEMS, TENSOR, TUPLE, decode, read_tree, write_tree

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path", "CHECKPOINT_NAME",
           "BackgroundCheckpoints", "CheckpointError"]

# torch and h5py are imported in the functions that use them: `mpidist prepare-data` writes
# its HDF5 file without torch, and each takes a noticeable part of a second to import.

FORMAT = "mpidist-checkpoint"
FORMAT_VERSION = 2  # 2: sealed with a checksum, the optimizer's class stored
CHECKPOINT_NAME = re.compile(r"^ckpt-(\d+)-(\d+)\.h5$")


def _rank_of(comm) -> int:
    """This rank in `comm`; without one, in the world (0 before md.init())."""
    mpi = mpi_of(comm)
    if mpi is not None:
        return mpi.Get_rank()
    return world().rank if is_initialized() else 0


# ---- public API ---------------------------------------------------------------------------------

def checkpoint_path(directory, epoch: int, step: int) -> str:
    """``<directory>/ckpt-<epoch:04d>-<step:08d>.h5``, the names ``latest_checkpoint`` finds."""
    return os.path.join(os.fspath(directory), f"ckpt-{epoch:04d}-{step:08d}.h5")


def latest_checkpoint(directory, comm=None):
    """The path of the newest intact checkpoint in ``directory``; None when there is none.

    Among the files named ``ckpt-<epoch>-<step>.h5`` it is the one written last (the time sealed
    in the file; then the highest step and epoch), so after a fresh run into a directory that
    still holds an earlier run's files, resuming continues the fresh run. A file that is not an
    mpidist checkpoint, or whose content does not match the checksum sealed in it (truncated,
    damaged), is skipped with a warning naming it and the problem: the newest intact one is
    returned. Temporary files of unfinished writes never match. Where checkpoint files are there
    and none is intact, a CheckpointError says so, naming the newest and its problem: a caller
    that took None for "start from scratch" would write its fresh run's checkpoints over them.

    The path is a str that also records the check (files.Verified): ``load_checkpoint``
    of it in this process does not read the file's bytes again while the file is unchanged.

    With ``comm`` (every rank must call) rank 0 looks and every rank gets its answer, or raises
    its error, so all ranks resume from the same file. Only rank 0 checked it: the other ranks'
    paths are plain, and ``load_checkpoint`` checks the file on each of them.
    """
    if mpi_of(comm) is None:
        return _find_latest(os.fspath(directory))

    def look():
        try:
            return _find_latest(os.fspath(directory)), None
        except CheckpointError as exc:
            return None, str(exc)

    mine = on_root(comm, look, f"looking for checkpoints in {directory}", CheckpointError)
    found, problem = mpi_of(comm).bcast(mine, root=0)
    if problem is not None:
        raise on_every_rank(CheckpointError(problem))
    # bcast answers rank 0 with a copy too, in which the record of the check became the plain path
    return found if mine is None else mine[0]


def _find_latest(directory):
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return None
    found, refused = [], []
    for name in names:
        match = CHECKPOINT_NAME.match(name)
        if match:
            path = os.path.join(directory, name)
            try:
                found.append((float(read_seal(path)["created_unix"]), int(match.group(2)), int(match.group(1)), path))
            except CheckpointError as exc:
                refused.append(_skip(exc))
    for *_, path in sorted(found, reverse=True):
        try:
            return verified(path)
        except CheckpointError as exc:
            refused.insert(0, _skip(exc))
    if refused:
        raise CheckpointError(f"{directory} holds {len(refused)} checkpoint file(s) and none is intact "
                              f"({refused[0]}); restore a good one, or move them away to start from scratch")
    return None


def _skip(problem: CheckpointError) -> CheckpointError:
    warnings.warn(f"skipping it: {problem}", stacklevel=4)
    return problem


def save_checkpoint(path, model, optimizer=None, step: int = 0, epoch: int = 0, sampler=None, extra=None,
                    comm=None) -> str:
    """Write a checkpoint to ``path`` atomically; returns the path.

    Stores ``model.state_dict()``, ``optimizer.state_dict()``, ``sampler.state_dict()``,
    ``step``, ``epoch``, the JSON-serializable dict ``extra`` and the RNG states (torch CPU and
    CUDA, NumPy's global generator, Python's ``random``). With ``comm`` (mpidist Communicator
    or mpi4py communicator) every rank must call: rank 0 writes, including every rank's RNG
    state, and the call returns on all ranks once the file is in place; if writing fails, every
    rank raises. ``sampler`` is a sampler or its state dict: with DataLoader workers pass
    ``sampler.state_dict(consumed=batches_done * batch_size)``.
    """
    mpi = mpi_of(comm)
    rng_states = rng.gather(mpi)

    def write():
        import torch
        header = {"extra": _to_json({} if extra is None else extra, "extra")}
        if sampler is not None:
            state = sampler if isinstance(sampler, dict) else sampler.state_dict()
            header["sampler"] = _to_json(state, "sampler state")
        with atomic_hdf5(path, sealed=True) as f:
            f.attrs["format"] = FORMAT
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["step"] = int(step)
            f.attrs["epoch"] = int(epoch)
            f.attrs["ranks"] = len(rng_states)
            f.attrs["torch_version"] = str(torch.__version__)
            f.attrs["created_unix"] = time.time()
            for key, text in header.items():
                f.attrs[key] = text
            if model is not None:
                state = model.state_dict()
                group = f.create_group("model")
                write_tree(group, dict(state))
                metadata = getattr(state, "_metadata", None)
                if metadata is not None:
                    group.attrs["metadata"] = json.dumps(metadata)
            if optimizer is not None:
                group = f.create_group("optimizer")
                write_tree(group, optimizer.state_dict())
                group.attrs["class"] = _optimizer_class(optimizer).__name__
            for rank, snapshot in enumerate(rng_states):
                rng.write(f.create_group(f"rng/{rank}"), snapshot)
        return path

    on_root(comm, write, f"writing checkpoint {path}", CheckpointError)
    return os.fspath(path)


def _optimizer_class(optimizer) -> type:
    """The optimizer class whose state ``optimizer.state_dict()`` is: a ZeroRedundancyOptimizer's
    (and a BackgroundCheckpoints copy's) is its ``optimizer_class``."""
    return getattr(optimizer, "optimizer_class", type(optimizer))


def _to_json(value, what: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} must be JSON-serializable (checkpoints use no pickle): {exc}") from exc


def load_checkpoint(path, model=None, optimizer=None, sampler=None, restore_rng: bool = True, comm=None) -> dict:
    """Load a checkpoint written by ``save_checkpoint`` into the given objects; returns
    ``{"step", "epoch", "extra"}``. Each rank reads the file itself, and checks its bytes against
    the seal first, except where ``path`` is what ``latest_checkpoint`` returned on this rank and
    the file is unchanged since it was checked there.

    The model and optimizer are loaded with their own ``load_state_dict`` (strict: missing or
    unexpected entries raise). With ``restore_rng`` each rank restores the RNG state saved for
    its rank (``comm``'s rank, else mpidist's world rank when initialized, else 0); a rank that
    had no state saved (the job grew) takes rank 0's.

    Every failure is a ``CheckpointError`` naming the file and what does not fit. With ``comm``
    the call is collective (every rank must call): if loading fails on any rank (a file that is
    not on every node, a model of another shape), every rank raises the same error
    (``share_failure``), naming the ranks that failed unless all did, so no rank trains on while
    others stopped.
    """
    path = os.fspath(path)
    result = failure = None
    try:
        result = _load(path, model, optimizer, sampler, restore_rng, comm)
    except OSError as exc:  # h5py's errors for missing, truncated or corrupt files
        failure = CheckpointError(f"cannot read checkpoint {path}: {exc}")
    except CheckpointError as exc:
        failure = exc
    except Exception as exc:  # what no check above foresaw: still every rank's error, naming the file
        failure = CheckpointError(f"cannot load checkpoint {path}: {type(exc).__name__}: {exc}")
    share_failure(comm, failure, f"loading {path}", CheckpointError)
    return result


def _load(path, model, optimizer, sampler, restore_rng, comm) -> dict:
    import h5py
    sealed = verify(path)["sealed"]
    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not an mpidist checkpoint")
        version = int(f.attrs["format_version"])
        if version > FORMAT_VERSION:
            raise CheckpointError(f"{path} has format version {version}; this mpidist reads up to {FORMAT_VERSION}")
        if not sealed and version >= 2:  # sealed since version 2: its user block was damaged
            raise CheckpointError(f"{path} is a checkpoint of format version {version} without its seal: damaged "
                                  "at its start")
        if not sealed and _rank_of(comm) == 0:
            warnings.warn(f"{path} was written by an mpidist without checkpoint checksums (format version "
                          f"{version}): loaded without checking its bytes; the next checkpoint is sealed",
                          stacklevel=3)
        result = {"step": _counter(path, f.attrs, "step"), "epoch": _counter(path, f.attrs, "epoch"),
                  "extra": json.loads(f.attrs["extra"])}
        # Everything is read and checked before anything is loaded, and the optimizer (whose own
        # load checks its groups before it changes anything) is loaded first: a refused file
        # changes nothing.
        parts = []
        if model is not None:
            _require(f, "model", path)
            tree = json.loads(f["model"].attrs["tree"])
            _require_same_entries(path, _saved_datasets(path, tree, f["model"]), model.state_dict())
            state = decode(tree, f["model"])
            if "metadata" in f["model"].attrs:
                state = OrderedDict(state)
                state._metadata = json.loads(f["model"].attrs["metadata"])
            parts.append(("model", model, state))
        if optimizer is not None:
            _require(f, "optimizer", path)
            saved_class, own_class = f["optimizer"].attrs.get("class"), _optimizer_class(optimizer).__name__
            if saved_class != own_class and (version >= 2 or saved_class is not None):  # version 1 kept no class
                raise CheckpointError(f"{path} holds the state of a {saved_class} optimizer, not of this {own_class}")
            parts.insert(0, ("optimizer", optimizer, read_tree(f["optimizer"])))
        if sampler is not None:
            if "sampler" not in f.attrs:
                raise CheckpointError(f"{path} holds no sampler state")
            parts.append(("sampler", sampler, json.loads(f.attrs["sampler"])))
        saved_rng = None
        if restore_rng and "rng" in f:
            rank = str(_rank_of(comm))
            rank = rank if rank in f["rng"] else "0"
            try:
                saved_rng = rng.read(f["rng"][rank])
            except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as exc:
                raise CheckpointError(f"{path}: the RNG states saved for rank {rank} do not fit the generators "
                                      f"({type(exc).__name__}: {exc})") from exc
    for part, target, state in parts:
        _load_part(path, part, target, state)
    if saved_rng is not None:
        rng.restore(saved_rng)
    return result


def _counter(path, attrs, name: str) -> int:
    value = attrs[name]
    value = value.item() if isinstance(value, np.generic) else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{path}: its {name} counter {value!r} is not an integer of at least 0")
    return int(value)


def _require(f, name, path):
    if name not in f:
        raise CheckpointError(f"{path} holds no {name} state")


def _saved_datasets(path, tree, group) -> dict:
    """The model state's entries as saved: each tensor's dataset (shape and type, nothing read),
    None for an entry that is not a tensor."""
    if not isinstance(tree, dict) or {TENSOR, TUPLE, ITEMS} & set(tree):
        raise CheckpointError(f"{path}: its model state is not a dictionary of named entries")
    return {name: group[node[TENSOR]] if isinstance(node, dict) and TENSOR in node else None
            for name, node in tree.items()}


def _require_same_entries(path, saved: dict, expected: dict) -> None:
    """Refuse, in one line naming the file, a saved model state with other entries, shapes or
    kinds of values (floating point, integer, boolean, complex) than the model's (torch's own
    refusal lists every key, over many lines; it casts between kinds without a word)."""
    import torch

    def some(names):
        return f"{len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"

    def kind(dtype):
        return "complex" if dtype.is_complex else "floating point" if dtype.is_floating_point else (
            "boolean" if dtype == torch.bool else "integer")

    tensors = {name: expected[name] for name in expected
               if saved.get(name) is not None and isinstance(expected[name], torch.Tensor)}
    missing = [name for name in expected if name not in saved]
    unexpected = [name for name in saved if name not in expected]
    reshaped = [f"{name} {list(saved[name].shape)} here, {list(tensor.shape)} in the model"
                for name, tensor in tensors.items() if tuple(saved[name].shape) != tuple(tensor.shape)]
    saved_kinds = {name: getattr(torch, str(saved[name].attrs.get("torch_dtype")), None) for name in tensors}
    other_kinds = [f"{name} {saved[name].attrs.get('torch_dtype')} here, {str(tensor.dtype).removeprefix('torch.')} "
                   "in the model" for name, tensor in tensors.items()
                   if not isinstance(saved_kinds[name], torch.dtype) or kind(saved_kinds[name]) != kind(tensor.dtype)]
    problems = [f"{what}: {some(names)}" for what, names in (("entries the model has and the file lacks", missing),
                                                             ("entries the model lacks", unexpected),
                                                             ("other shapes", reshaped),
                                                             ("other kinds of values", other_kinds)) if names]
    if problems:
        raise CheckpointError(f"{path} holds the state of another model ({'; '.join(problems)})")


def _load_part(path, part: str, target, state) -> None:
    """``target.load_state_dict(state)``; a refusal becomes one line naming the file and the part."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        reason = " ".join(str(exc).split())
        raise CheckpointError(f"{path}: its {part} state does not fit this {part} ({reason})") from exc


class BackgroundCheckpoints:
    """Checkpoints written by a thread of their own from copies of the weights and the optimizer
    state, so that the parameter server goes on answering its workers while a file is written.
    One write at a time, in order; a failed write raises at the next save() or at close()."""

    def __init__(self):
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpidist-checkpoint")
        self._pending = None

    def save(self, path, model, optimizer, **fields) -> None:
        snapshot = (_Snapshot(copy.deepcopy(model.state_dict())),
                    _Snapshot(copy.deepcopy(optimizer.state_dict()), _optimizer_class(optimizer)))
        self._finish_pending()
        self._pending = self._writer.submit(save_checkpoint, path, *snapshot, **fields)

    def close(self) -> None:
        try:
            self._finish_pending()
        finally:
            self._writer.shutdown()

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()  # the earlier write's error, if any, is this rank's now


class _Snapshot:
    """Something with the state_dict() save_checkpoint asks for: a copy taken earlier, and for an
    optimizer's the class it is the state of."""

    def __init__(self, state, optimizer_class=None):
        self._state = state
        self.optimizer_class = optimizer_class

    def state_dict(self):
        return self._state
