"""The parameter server's wire protocol: what each message announces, the coordinator's commands
to the other servers, what a reply holds, and the tags they travel on. Messages are typed
buffers (runtime/wire.py: an int64 header of these fields, then the payload), never pickled.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from ...errors import InvalidArgumentError, MismatchError, MpidistError


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
    and what the loops add: the end, a pull's answer, a failure)."""
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


class PushHeader(NamedTuple):
    """The fields of a worker's gradient or close (a pull's: PULL, the table, the version; a
    failure's: FAILED, the error's code, the version)."""
    kind: int
    step: int
    version: int
    stop: int = 0


# The errors a worker's bad input raises on every rank, by their code in its failure message; the
# last, that of an error in a server's update (its own exception on that server).
FAILURES = (InvalidArgumentError, MismatchError, MpidistError)
UPDATE_FAILED = len(FAILURES) - 1


def words(text: str) -> torch.Tensor:
    """Text as it travels: its UTF-8 bytes in a uint8 tensor."""
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def text(words_sent: torch.Tensor) -> str:
    return bytes(words_sent.tolist()).decode()
