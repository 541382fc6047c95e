"""The records of hvd's negotiation and its rules, pure: what one rank sends in a cycle (a
Message of Submissions, each a name with its Signature, or a refusal), how it crosses the wire
(encode, decode: one JSON text, names and numbers, never pickled), and what every rank decides
from the table of who submitted what (Table.cycle). No MPI, no tensors moved: the messages of a
cycle go in, decisions come out (the operations that fail for want of a rank, the steps to run
in order: a Batch of operations run as one, or a Refusal), which the negotiation's thread
(negotiation.py) carries out on its rank.

The rules (see negotiation.py's docstring for why): an operation is complete once every rank
not waiting in join() has submitted it; the complete ones run in the order they became complete
(within a cycle, in the order of first submission). One is refused on every rank that submitted
it where a rank refused its own arguments, where the ranks' signatures differ, or where ranks
wait in join() and it is no all-reduce that sums or averages (MismatchError naming the ranks).
Consecutive all-reduces of the same dtype, op and device run as one buffer up to the fusion
threshold (0: none); Adasum's are never fused, each combines its own tensor. A refusal of an
all-reduce group as a whole (its member 0's) refuses every other member the ranks submitted.
"""
from __future__ import annotations

import json
from typing import NamedTuple

import torch

from ..errors import MismatchError

UNNAMED = "<unnamed operation "  # + its number and ">"
REFUSED = "operation"  # a Submission's refusal: the rank refused its own arguments to it
REFUSED_GROUP = "whole group"  # ... to the all-reduce group it is member 0 of (Negotiator.refuse_group)
_JOINABLE_OPS = ("sum", "avg")  # zeros change no sum, and an average still divides by every rank
_FUSABLE_OPS = ("sum", "avg", "min", "max", "prod")  # elementwise: one all-reduce of a concatenation is each's


class Signature(NamedTuple):
    """What an operation is, which every rank's must match: made by signature_of alone."""
    collective: str
    dtype: str
    count: int
    op: str
    device: str
    shape: tuple  # a group's: a shape per tensor
    root: int
    scale_factors: tuple  # (prescale, postscale), where the operation scales


# How the errors name a Signature's fields.
_LABELS = dict(zip(Signature._fields, ("collective", "dtype", "count", "op", "device", "shape", "root",
                                       "scale factors")))


class Member(NamedTuple):
    """Member `index` of the grouped operation named `group` (group_member)."""
    group: str
    index: int

    @property
    def name(self) -> str:
        """The name the ranks match the member by."""
        return f"{self.group}.{self.index}"


class Submission(NamedTuple):
    """A rank's submission of the operation `name`: its signature, or the rank's refusal of its
    own arguments to it (REFUSED, REFUSED_GROUP); `group` and `index` where it is a member of a
    grouped operation."""
    name: str
    signature: Signature | None = None
    refusal: str | None = None
    group: str | None = None
    index: int | None = None


class Message(NamedTuple):
    """What a rank sends in a cycle: its submissions since the last, whether it waits in join(),
    whether it is leaving, its HOROVOD_FUSION_THRESHOLD (rank 0's is every rank's), and the names
    it has waited for past MPIDIST_TIMEOUT."""
    submitted: tuple
    joined: bool
    leaving: bool
    fusion_threshold: int
    expired: tuple


class Batch(NamedTuple):
    """Operations run as one (an all-reduce of their buffers, fused where more than one): a
    Submission of each (the first rank's: the ranks' signatures are alike)."""
    submissions: tuple


class Refusal(NamedTuple):
    """The operation `name` is refused with `error` on every rank that submitted it (`who`:
    {rank: Submission}); `rest`: the other members of its group refused with it, (name, who)."""
    name: str
    who: dict
    error: MismatchError
    rest: tuple = ()


class Stalled(NamedTuple):
    """The operation `name` some rank waited for past MPIDIST_TIMEOUT: `missing` ranks never
    submitted it, `submitted` did."""
    name: str
    missing: list
    submitted: list


class Decisions(NamedTuple):
    """What every rank does after a cycle: fail `stalled`, then run `steps` in order; `all_joined`:
    every rank waits in join(), which returns; `busy`: something is left to negotiate (an operation
    not every rank has submitted, one deferred, a rank waiting in join())."""
    stalled: list
    steps: list
    all_joined: bool
    busy: bool


def signature_of(collective: str, tensor=None, op: str = "", shape=None, root: int = 0, scale_factors=(),
                 count=None) -> Signature:
    """The Signature of an operation on `tensor` (none: a barrier); `shape` and `count` default
    to the tensor's."""
    if tensor is None:
        return Signature(collective, "", 0, op, "", (), root, tuple(scale_factors))
    return Signature(collective, dtype_name(tensor), tensor.numel() if count is None else count,
                     op, tensor.device.type, _as_tuples(list(tensor.shape) if shape is None else shape), root,
                     tuple(scale_factors))


def dtype_name(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def group_member(group: str, index: int) -> Member:
    """Member `index` of the grouped operation named `group`."""
    return Member(group, index)


def unnamed_name(number: int) -> str:
    return f"{UNNAMED}{number}>"


def unnamed_number(submission: Submission) -> int | None:
    """The number of the unnamed operation `submission` is (or is a member of), None where named."""
    name = submission.name if submission.group is None else submission.group
    if not name.startswith(UNNAMED):
        return None
    return int(name.removeprefix(UNNAMED).split(">")[0])


def submission_of(name, signature: Signature | None = None, refusal: str | None = None) -> Submission:
    """The Submission of the operation `name` (a str, or a Member of a group)."""
    if isinstance(name, Member):
        return Submission(name.name, signature, refusal, name.group, name.index)
    return Submission(name, signature, refusal)


# ---- the wire --------------------------------------------------------------------------------

def encode(message: Message) -> bytes:
    """`message` as the JSON text every rank decodes: each record as the array of its fields, in
    the record's order (the records' field lists are the wire's layout, read the same on every
    rank), which keeps a cycle's text as short as the operations it names allow."""
    return json.dumps(message).encode()


def decode(text: bytes) -> Message:
    """The Message encode() made, its records named again (JSON's arrays of numbers as tuples)."""
    submitted, joined, leaving, fusion_threshold, expired = json.loads(text)
    return Message(tuple(_decoded_submission(*sent) for sent in submitted), joined, leaving, fusion_threshold,
                   tuple(expired))


def _decoded_submission(name, signature, refusal, group, index) -> Submission:
    if signature is not None:
        collective, dtype, count, op, device, shape, root, scale_factors = signature
        signature = Signature(collective, dtype, count, op, device, _as_tuples(shape), root, tuple(scale_factors))
    return Submission(name, signature, refusal, group, index)


def _as_tuples(value):
    return tuple(_as_tuples(item) for item in value) if isinstance(value, (list, tuple)) else value


# ---- the table and what is decided from it ---------------------------------------------------

class Table:
    """Who submitted what, the same on every rank: `pending` {name: {rank: Submission}} in the
    order of first submission, `deferred` (rank, Submission) entered once a refusal is resolved,
    `joined` the ranks waiting in join()."""

    def __init__(self, size: int):
        self.size = size
        self.pending = {}
        self.deferred = []
        self.joined = set()

    def cycle(self, messages: list) -> Decisions:
        """Enter every rank's `messages` of a cycle (by rank) and decide what every rank does."""
        arrived = self.deferred + [(rank, submission) for rank, message in enumerate(messages)
                                   for submission in message.submitted]
        self.deferred = []
        for rank, submission in arrived:
            self._enter(rank, submission)
        self.joined |= {rank for rank, message in enumerate(messages) if message.joined}
        training = [rank for rank in range(self.size) if rank not in self.joined]
        ready = [name for name, who in self.pending.items() if training and all(r in who for r in training)]
        expired = {name for message in messages for name in message.expired}
        stalled = [Stalled(name, [rank for rank in range(self.size) if rank not in who and rank not in self.joined],
                           sorted(who))
                   for name, who in self.pending.items() if name in expired and name not in ready]
        for failed in stalled:
            del self.pending[failed.name]
        steps = self._steps([(name, self.pending.pop(name)) for name in ready], messages[0].fusion_threshold)
        all_joined = not training
        if all_joined:
            self.joined = set()
        return Decisions(stalled, steps, all_joined, bool(self.pending or self.deferred or self.joined))

    def _enter(self, rank: int, submission: Submission) -> None:
        """Enter a rank's submission. A refusal holds no name on the refusing rank, which may use
        the name again at once: while the table still holds its refusal of the name (or of the
        all-reduce group the submission is a member of), that refused use is the one the others'
        submissions meet, and the next waits in `deferred` until it is resolved."""
        refused_group = False
        if submission.group is not None:
            first = self.pending.get(Member(submission.group, 0).name, {}).get(rank)
            refused_group = first is not None and first.refusal == REFUSED_GROUP
        if rank in self.pending.get(submission.name, {}) or refused_group:
            self.deferred.append((rank, submission))
        else:
            self.pending.setdefault(submission.name, {})[rank] = submission

    def _steps(self, ready: list, threshold: int) -> list:
        """The Batches and Refusals that run the `ready` operations ((name, who), in order);
        `threshold` is rank 0's HOROVOD_FUSION_THRESHOLD. What is fused is decided from the
        signatures alone, so a rank waiting in join() fuses its zeros as the others fuse their
        tensors."""
        steps, fusion, fused_bytes = [], [], 0
        for name, who in ready:
            error = refusal(name, who, self.joined)
            if error is not None:
                steps += [Batch(tuple(fusion))] if fusion else []
                fusion, fused_bytes = [], 0
                steps.append(Refusal(name, who, error, self._rest_of_group(who)))
                continue
            submission = next(iter(who.values()))
            nbytes = fusable_bytes(submission.signature, threshold)
            if fusion and (nbytes is None or _kind(fusion[0].signature) != _kind(submission.signature)
                           or fused_bytes + nbytes > threshold):
                steps.append(Batch(tuple(fusion)))
                fusion, fused_bytes = [], 0
            if nbytes is None:
                steps.append(Batch((submission,)))
            else:
                fusion.append(submission)
                fused_bytes += nbytes
        return steps + ([Batch(tuple(fusion))] if fusion else [])

    def _rest_of_group(self, who: dict) -> tuple:
        """Where a rank refused an all-reduce group as a whole (its member 0, `who`), the group's
        other members in the table, taken out of it. Every rank submits a group's members last to
        first (reductions.py), so a rank's member 0 in the table means all its members are: none
        is left waiting for the refusing rank."""
        group = next((submission.group for submission in who.values() if submission.refusal == REFUSED_GROUP), None)
        if group is None:
            return ()
        members = [name for name, others in self.pending.items()
                   if next(iter(others.values())).group == group]
        return tuple((name, self.pending.pop(name)) for name in members)


def refusal(name: str, who: dict, joined: set):
    """The error every rank that submitted `name` ({rank: Submission}) raises, or None when it
    can run; `joined`: the ranks waiting in join()."""
    refused = sorted(rank for rank, submission in who.items() if submission.refusal is not None)
    if refused:
        return MismatchError(f"ranks {refused} refused their arguments to the hvd operation {name!r} (each raised "
                             "its own error there: see those ranks' output), so the other ranks cannot run it "
                             "either")
    differences = _differences({rank: submission.signature for rank, submission in who.items()})
    if differences:
        return MismatchError(f"the ranks submitted the hvd operation {name!r} with different arguments: "
                             + " | ".join(differences))
    signature = next(iter(who.values())).signature
    if joined and (signature.collective != "allreduce" or signature.op not in _JOINABLE_OPS):
        return MismatchError(f"{signature.collective} is not supported with join: ranks {sorted(joined)} have run "
                             "out of data and wait in join(), where they take part only in all-reduces that sum "
                             f"or average (the hvd operation {name!r}: {_described(signature)})")
    return None


def fusable_bytes(signature: Signature, threshold: int):
    """The bytes an all-reduce of `signature` adds to a fused buffer, None where it is not fused."""
    if 0 < threshold and signature.collective == "allreduce" and signature.op in _FUSABLE_OPS:
        return signature.count * getattr(torch, signature.dtype).itemsize
    return None


def _kind(signature: Signature) -> tuple:
    """What all-reduces fused into one buffer share: dtype, op and device."""
    return signature.dtype, signature.op, signature.device


def _differences(signatures: dict) -> list:
    """For each field the ranks' signatures ({rank: Signature}) differ in: which ranks have which
    value."""
    differences = []
    for field in Signature._fields:
        values = {}
        for rank, signature in sorted(signatures.items()):
            values.setdefault(_shown(getattr(signature, field)), []).append(rank)
        if len(values) > 1:
            label = _LABELS[field]
            if field == "shape" and next(iter(signatures.values())).collective == "allgather":
                label = "row shape (shape[1:])"
            differences.append(f"{label}: " + "; ".join(f"ranks {ranks} have {value}" for value, ranks in values.items()))
    return differences


def _described(signature: Signature) -> str:
    """A signature in words, for the errors."""
    return ", ".join(f"{_LABELS[field]} {_shown(value)}" for field, value in zip(Signature._fields, signature)
                     if value not in ("", ()))


def _shown(value) -> str:
    """A signature's value as the errors show it: shapes as tuples, names quoted."""
    if isinstance(value, tuple):
        return str(value)
    return json.dumps(value)
