"""What every hvd operation checks on this rank before it starts, as Horovod does: its tensor
arguments are torch tensors, and its name= is not that of an asynchronous operation still in
flight (from its call until synchronize() has returned its result; Horovod refuses such a name
with a ValueError). A refusal is shared with the other ranks (the call check's share_refusal), so
that they raise at once too instead of waiting for this rank until MPIDIST_TIMEOUT.
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgumentError, MpidistError, UnsupportedBufferError
from .handles import Handle
from .negotiation import NEGOTIATED, negotiator_of
from .process_sets import comm_of

_names_in_flight = {}  # name= -> the Handle of the asynchronous operation that holds it


def check_call(operation: str, arguments: dict) -> None:
    """Refuse a call of hvd.`operation` (its bound `arguments`) whose tensor is none (on this
    rank, with the others told) or whose name is held (on this rank alone, as Horovod: the
    operation that holds it still completes)."""
    name = arguments.get("name")
    if name is not None and name in _names_in_flight:
        raise InvalidArgumentError(f"hvd.{operation}: name={name!r} is that of an asynchronous operation still in "
                                   "flight (until synchronize() returns its result); give each concurrent "
                                   "operation a name of its own")
    try:
        _check_tensors(operation, arguments)
    except MpidistError:
        _share_refusal(operation, name, arguments.get("process_set"))
        raise


def hold_name(name, result) -> None:
    """An asynchronous operation called with `name` returned `result`: the name is held until
    synchronize() has finished it (release)."""
    if name is not None and isinstance(result, Handle):
        _names_in_flight[name] = result


def release(handle) -> None:
    """synchronize() has finished `handle`: its name is free again."""
    for name, held in list(_names_in_flight.items()):
        if held is handle:
            del _names_in_flight[name]


def _check_tensors(operation: str, arguments: dict) -> None:
    if "tensor" in arguments and not isinstance(arguments["tensor"], torch.Tensor):
        raise UnsupportedBufferError(f"hvd.{operation} takes a torch tensor, got {type(arguments['tensor']).__name__}")
    group = arguments.get("tensors", ())
    if isinstance(group, (list, tuple)) and not all(isinstance(member, torch.Tensor) for member in group):
        raise InvalidArgumentError(f"hvd.{operation} takes a non-empty list of tensors, got "
                                   f"{[type(member).__name__ for member in group]}")


def _share_refusal(operation: str, name, process_set) -> None:
    try:
        comm = comm_of(process_set)
    except MpidistError:
        return  # outside the process set: no rank waits for this one
    if operation in NEGOTIATED:
        negotiator = negotiator_of(comm)
        negotiator.refuse(negotiator.name_of(name))
    else:
        share_refusal_on(comm)


def share_refusal_on(comm) -> None:
    """Join the other ranks' call check on `comm` with a refusal, so that they raise at once."""
    from ..collectives.callcheck import share_refusal  # imported here: the collectives initialize MPI
    from ..collectives.engine import in_order
    in_order(comm, share_refusal)
