"""The parameter server's wire protocol: what each message announces, the coordinator's commands
to the other servers, what a reply holds, and the tags they travel on. Messages are typed
buffers (runtime/wire.py: an int64 header of a few fields, then the payload), never pickled.

Each kind of header is a record of its own (a NamedTuple): a worker's message to a server
(PushHeader, DoneHeader, PullHeader, FailedHeader), a server's reply to a worker (WeightsReply,
RowsReply, FailureReply), the coordinator's command to the other servers (Order). encode_push,
encode_reply and encode_order make the fields that travel and decode_push, decode_reply and
decode_order read them back: they alone know where a field sits, so every other module reads
fields by name. order_of is the one place where the update policy's decisions become commands.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from ...errors import InvalidArgumentError, MismatchError, MpidistError
from .policy import Decision, Kind


class Push(enum.IntEnum):
    """What a worker's message to a server announces (its header's first field). DIED is no
    message: it stands for a worker that died (survival.py)."""
    GRADIENT = 0
    DONE = 1
    PULL = 2
    FAILED = 3
    DIED = 4


class Command(enum.IntEnum):
    """The coordinator's commands to the other servers, in its order (the policy's decisions,
    mapped by order_of, and what the loops add: the end, a pull's answer, a failure)."""
    APPLY = 0
    ANSWER = 1
    DROP = 2
    FINISH = 3
    ANSWER_PULL = 4
    FAIL = 5
    LOST = 6


class Sent(enum.IntEnum):
    """What a server's reply to a worker holds (its header's second field)."""
    WEIGHTS = 0
    ROWS = 1
    FAILURE = 2


class Tag(enum.IntEnum):
    """The tag of each kind of message. wire.send puts the payload on the tag after the header's,
    so the tags go two apart."""
    PUSH = 1  # a worker's gradient, pull, close or failure (and a server's failure) to a server
    REPLY = 3  # a server's answer to a worker
    COMMAND = 5  # the coordinator's commands to the other servers
    SHARE = 7  # the final weights between servers
    SPARSE = 9  # a gradient's rows, after its dense range
    STATE = 11  # a server's part of the weights and optimizer state, for a checkpoint


# ---- a worker's messages to a server (fields: the kind, then the record's) ------------------

class PushHeader(NamedTuple):
    """A worker's gradient (the payload: its range of the dense gradient; each table's rows
    follow on Tag.SPARSE): the gradients the worker pushed before it (`step`), the `version` of
    the weights it was computed on, and `stop` (1: the worker asks every worker to stop)."""
    step: int
    version: int
    stop: int
    KIND = Push.GRADIENT


class DoneHeader(NamedTuple):
    """A worker's close(): the gradients it pushed (`steps`) and the version of its weights."""
    steps: int
    version: int
    KIND = Push.DONE


class PullHeader(NamedTuple):
    """A worker's pull of rows (the payload: their indices, sorted) of the table at index
    `table`, with its weights of `version`."""
    table: int
    version: int
    KIND = Push.PULL


class FailedHeader(NamedTuple):
    """A worker's bad input or a server's failed update (the payload: the error's words): the
    error's `code` (its index in FAILURES) and the version of the sender's weights."""
    code: int
    version: int
    KIND = Push.FAILED


class DiedHeader(NamedTuple):
    """No message: what the coordinator's pending receive of a worker that died reads
    (survival.Death)."""
    KIND = Push.DIED


PUSHES = {record.KIND: record for record in (PushHeader, DoneHeader, PullHeader, FailedHeader, DiedHeader)}


def encode_push(header) -> tuple:
    """The fields a worker's message travels with: its kind, then the record's fields."""
    return (int(header.KIND), *header)


def decode_push(fields: tuple):
    """The record of the fields of a message to a server."""
    return _decoded(PUSHES, fields[0] if fields else None, fields[1:], fields)


# ---- a server's replies to a worker (fields: the version, the kind, then the record's rest) --

class WeightsReply(NamedTuple):
    """A server's range of the weights of `version` (the payload); `stopping` (1: every worker
    is to close, as the coordinator says)."""
    version: int
    stopping: int
    KIND = Sent.WEIGHTS


class RowsReply(NamedTuple):
    """A server's rows of a table (the payload), of the weights of `version`."""
    version: int
    KIND = Sent.ROWS


class FailureReply(NamedTuple):
    """In place of a reply, the failure of `rank` (the payload: its error's words), the error's
    `code` (its index in FAILURES); `version`: the server's weights."""
    version: int
    code: int
    rank: int
    KIND = Sent.FAILURE


REPLIES = {record.KIND: record for record in (WeightsReply, RowsReply, FailureReply)}


def encode_reply(header) -> tuple:
    """The fields a reply travels with: its version, its kind, then the record's other fields."""
    return (header.version, int(header.KIND), *header[1:])


def decode_reply(fields: tuple):
    """The record of the fields of a server's reply."""
    return _decoded(REPLIES, fields[1] if len(fields) > 1 else None, fields[:1] + fields[2:], fields)


def _decoded(records: dict, kind, values: tuple, fields: tuple):
    record = records.get(kind)
    if record is None or len(values) != len(record._fields):
        raise MismatchError(f"a parameter server message with the header fields {list(fields)}, which no rank of "
                            "this version of mpidist sends: every rank must run the same mpidist")
    return record(*values)


# ---- the coordinator's commands to the other servers ---------------------------------------

class Order(NamedTuple):
    """A command of the coordinator to the other servers: `command` for `workers` (ranks); LOST
    carries the gradients the dead worker had pushed (`steps`) as well. It travels as one field,
    the command, and an int64 payload: the workers, then LOST's steps."""
    command: Command
    workers: tuple = ()
    steps: int = 0


def encode_order(order: Order) -> tuple:
    """(the payload, the fields) an order travels as."""
    numbers = [*order.workers, order.steps] if order.command == Command.LOST else list(order.workers)
    return torch.tensor(numbers, dtype=torch.int64), (int(order.command),)


def decode_order(payload: torch.Tensor, fields: tuple) -> Order:
    """The order of a command message (as encode_order made it)."""
    if len(fields) != 1 or fields[0] not in tuple(Command):
        raise MismatchError(f"a parameter server command with the header fields {list(fields)}, which no rank of "
                            "this version of mpidist sends: every rank must run the same mpidist")
    command, numbers = Command(fields[0]), tuple(payload.tolist())
    if command == Command.LOST:
        return Order(command, numbers[:-1], numbers[-1])
    return Order(command, numbers)


# The command that carries out each kind of the policy's decisions on the other servers.
COMMANDS = {Kind.APPLY: Command.APPLY, Kind.ANSWER: Command.ANSWER, Kind.DROP: Command.DROP, Kind.LOST: Command.LOST}


def order_of(decision: Decision) -> Order:
    """The command that tells the other servers a decision of the policy."""
    return Order(COMMANDS[decision.kind], tuple(decision.workers), decision.steps)


# The errors a worker's bad input raises on every rank, by their code in its failure message; the
# last, that of an error in a server's update (its own exception on that server).
FAILURES = (InvalidArgumentError, MismatchError, MpidistError)
UPDATE_FAILED = len(FAILURES) - 1


def words(text: str) -> torch.Tensor:
    """Text as it travels: its UTF-8 bytes in a uint8 tensor."""
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def text(words_sent: torch.Tensor) -> str:
    return bytes(words_sent.tolist()).decode()
