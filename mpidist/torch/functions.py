"""Horovod's functions over whole objects: broadcast_parameters and broadcast_optimizer_state
(model and optimizer state from one rank), broadcast_object and allgather_object (pickled, as
Horovod's and mpi4py's lower-case methods: for the job's own ranks, which trust each other).
"""
from __future__ import annotations

import pickle

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..parallel.model_state import broadcast_in_place
from ..runtime import wire
from ..runtime.together import raise_together
from .join import collective_comm
from .mpi_ops import broadcast_
from .optimizer import local_step
from .process_sets import root_in
from .timeline import traced


@traced("BROADCAST")
def broadcast_parameters(params, root_rank=0):
    """Broadcast a state_dict or an iterable of (name, tensor) from `root_rank`, in place."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    world = collective_comm(None)
    with torch.no_grad():
        for _, tensor in items:
            if isinstance(tensor, torch.Tensor):
                broadcast_in_place(world, tensor.data, root_rank)


@traced("BROADCAST")
def broadcast_optimizer_state(optimizer, root_rank=0):
    """Broadcast the optimizer's state tensors and hyperparameters from `root_rank`.

    A rank whose optimizer has no state yet (no step taken) first makes it as Horovod does, by
    one step of the wrapped optimizer with zero gradients; unlike Horovod, the parameters and
    gradients are then put back as they were, so that weight decay does not move them, except
    that a gradient that was None stays zeros, as in Horovod (scripts broadcast it). State
    the root has and a rank still lacks arrives into zeros of the root's layout; hyperparameters
    and the layout travel by broadcast_object.
    """
    if not optimizer.state_dict()["state"]:
        _make_state(optimizer)
    state = optimizer.state_dict()
    # The hyperparameters, each state tensor's shape and dtype, and the state's other values
    # (step counts, say): one broadcast_object.
    groups, layout, scalars = broadcast_object((
        [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
        {str(index): {name: [list(value.shape), str(value.dtype).removeprefix("torch.")]
                      for name, value in entries.items() if isinstance(value, torch.Tensor)}
         for index, entries in state["state"].items()},
        {str(index): {name: value for name, value in entries.items() if not isinstance(value, torch.Tensor)}
         for index, entries in state["state"].items()}), root_rank)
    # Every rank reads all of the root's dtype names, so that one the package does not know fails
    # alike everywhere, before any tensor is sent.
    dtypes = {name: wire.torch_dtype(wire.name_of(name)) for tensors in layout.values() for _, name in tensors.values()}
    new_state = {}
    for index, tensors in layout.items():
        entries = dict(scalars.get(index, {}))
        current = state["state"].get(int(index), {})
        for name, (shape, dtype) in tensors.items():
            tensor = current.get(name)
            if tensor is None or list(tensor.shape) != shape:
                tensor = torch.zeros(shape, dtype=dtypes[dtype])
            entries[name] = broadcast_(tensor.contiguous(), root_rank)
        new_state[int(index)] = entries
    for group, settings in zip(state["param_groups"], groups):
        group.update(settings)
    state["state"] = new_state
    optimizer.load_state_dict(state)


def _make_state(optimizer) -> None:
    """Step the wrapped optimizer (exchanging nothing) on zero gradients, so that it makes its
    state; the parameters and the gradients that were not None are restored afterwards."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    saved = [(p.detach().clone(), p.grad) for p in params]
    for param in params:
        param.grad = torch.zeros_like(param)
    try:
        local_step(optimizer)
    finally:
        with torch.no_grad():
            for param, (value, grad) in zip(params, saved):
                param.copy_(value)
                if grad is not None:
                    param.grad = grad


def _pickled(obj):
    """(obj's pickle as a uint8 array, None), or (an empty array, the error) when it cannot be pickled."""
    try:
        return np.frombuffer(pickle.dumps(obj), dtype=np.uint8).copy(), None
    except Exception as exc:  # noqa: BLE001 - pickling raises whatever the object's __reduce__ raises
        return np.empty(0, dtype=np.uint8), exc


def _refuse_unpicklable(world, error, what):
    """Every rank raises when some rank cannot pickle its object (`error`), naming those ranks,
    instead of the others waiting for its bytes."""
    def unpicklable(failures):
        failed = [rank for rank, failure in enumerate(failures) if failure is not None]
        name, message = failures[failed[0]]
        return f"{what}: rank(s) {failed} passed an object pickle cannot serialize: {name}: {message}"

    raise_together(world.mpi, error, what, InvalidArgumentError, message=unpicklable)


@traced("BROADCAST")
def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """`root_rank`'s object on every rank (pickled, as Horovod's)."""
    world, root = collective_comm(process_set), root_in(process_set, root_rank)
    data, error = _pickled(obj) if world.rank == root else (None, None)
    _refuse_unpicklable(world, error, "broadcast_object")
    length = np.array([0 if data is None else len(data)], dtype=np.int64)
    world.broadcast(length, root=root)
    if world.rank != root:
        data = np.empty(int(length[0]), dtype=np.uint8)
    world.broadcast(data, root=root)
    return pickle.loads(data.tobytes())


@traced("ALLGATHER")
def allgather_object(obj, name=None, process_set=None):
    """Every rank's object, in a list by rank (pickled, as broadcast_object)."""
    world = collective_comm(process_set)
    data, error = _pickled(obj)
    _refuse_unpicklable(world, error, "allgather_object")
    lengths = world.allgather(np.array([len(data)], dtype=np.int64))
    gathered = world.allgather(data)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [pickle.loads(gathered[offsets[k]:offsets[k + 1]].tobytes()) for k in range(world.size)]
