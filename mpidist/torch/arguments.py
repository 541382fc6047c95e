"""What every hvd operation checks on this rank before it starts, as Horovod does: its tensor
arguments are torch tensors, and its name= is not that of an asynchronous operation still in
flight (from its call until synchronize() has returned its result; Horovod refuses such a name
with a ValueError). And share_refusal, the hvd operations' one way to tell the other ranks that
this rank refused its arguments, so that they raise at once too (MismatchError naming this rank)
instead of waiting for it until MPIDIST_TIMEOUT.

The refusal travels inside the exchange the other ranks take for the operation anyway: the
negotiation's cycle for an operation matched by name, the call check's for one run in call order.
runtime.together's raise_together, the package's way to fail together elsewhere, would add an
exchange to every call that no rank refuses, and negotiated operations do not meet in call order,
so a collective taken at the call could pair different operations.
"""
from __future__ import annotations

import torch

from ..collectives.callcheck import share_refusal as share_in_call_check
from ..collectives.engine import in_order
from ..errors import InvalidArgumentError, MpidistError, UnsupportedBufferError
from .handles import Handle
from .negotiation import NEGOTIATED, negotiator_of
from .negotiation_rules import group_member
from .process_sets import comm_of

_names_in_flight = {}  # name= -> the Handle of the asynchronous operation that holds it
# Their members (one per dtype and device) are negotiated under names only the ranks that have the
# tensors can count: a refusal goes as the whole group's (Negotiator.refuse_group).
_ALLREDUCE_GROUPS = frozenset({"grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
                               "grouped_allreduce_async_"})
# Negotiated with a member per tensor (group_member(name, k), or each the next unnamed operation's):
# a refusal goes under each.
_PER_TENSOR_GROUPS = frozenset({"grouped_allgather_async", "grouped_reducescatter_async"})


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
        comm = _comm_or_none(arguments.get("process_set"))
        if comm is not None:  # outside the process set, no rank waits for this one
            if operation in _PER_TENSOR_GROUPS:
                for index in range(len(arguments["tensors"])):
                    share_refusal(comm, True, None if name is None else group_member(name, index))
            else:
                share_refusal(comm, operation in NEGOTIATED, name, group=operation in _ALLREDUCE_GROUPS)
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


def share_refusal(comm, negotiated: bool, name=None, group=False) -> None:
    """This rank refused its own arguments to an operation on `comm` (it raises its own error
    next): tell the other ranks, so that they raise at once instead of waiting for it. A
    `negotiated` operation is refused under its name (`name`; None: the next unnamed one's), in the
    negotiation's exchange (negotiation.py), an all-reduce `group` as a whole under its members'
    names (Negotiator.refuse_group); one run in call order in the call check's exchange
    (collectives.callcheck.share_refusal), on the channel the operation would have run on."""
    if negotiated:
        negotiator = negotiator_of(comm)
        if group:
            negotiator.refuse_group(negotiator.name_of(name))
        else:
            negotiator.refuse(negotiator.name_of(name))
        return
    in_order(comm, share_in_call_check)


def _comm_or_none(process_set):
    """The communicator of `process_set`, or None on a rank outside it."""
    try:
        return comm_of(process_set)
    except MpidistError:
        return None
