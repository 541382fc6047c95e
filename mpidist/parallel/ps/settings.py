"""A parameter server's settings: every rank's arguments checked, then agreed on by every rank
in one allgather of a row of named columns (and one of the compression's spelling), so that a
mismatch, a refusal on some ranks only, a server without an optimizer or one that cannot apply
the tables' sparse gradients raises the same error on every rank before any gradient moves.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ...errors import InvalidArgumentError, MismatchError
from ...runtime import wire
from ...runtime.deadlines import wait_for_collective
from ...runtime.together import agreed_error, raise_together
from . import shards, sparse
from .model import Model
from .policy import MODES

UNSPLITTABLE = -1  # the layout of a rank whose model has fewer rows than there are servers
# The settings every rank must agree on, in the order of the agreement table's columns.
AGREED = ("parameters", "dtype", "server", "servers", "layout", "mode", "backup_workers", "gradients per update",
          "max_staleness", "staleness_lr", "starting version", "sparse tables")
# Then the columns only the servers fill (whether each has an optimizer; the first table its
# optimizer cannot apply a sparse gradient to, -1: none), and 1 on a rank whose arguments were
# refused (its other columns 0).
COLUMNS = AGREED + ("has optimizer", "sparse refusal", "declined")


def column(table: np.ndarray, name: str) -> np.ndarray:
    """Every rank's value of the column `name` of the agreement table."""
    return table[:, COLUMNS.index(name)]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every rank of a parameter server agrees on: the server ranks (the first the
    coordinator) and the workers, each server's range of the flat dense parameters (None on a
    rank whose model is too small to split), and the update rules."""
    servers: list
    workers: list
    ranges: list | None
    mode: str
    max_staleness: int | None
    staleness_lr: bool
    backup_workers: int
    per_update: int  # gradients per update (policy.gradients_per_update)
    compression: object  # the Compressor of the workers' pushes (push_compression.py)

    @property
    def coordinator(self) -> int:
        return self.servers[0]

    @property
    def chief(self) -> int:
        """The first worker: every rank starts from its weights."""
        return self.workers[0]


def server_ranks(servers, server: int, size: int) -> list:
    """The server ranks `servers` (a number from `server`, or a list) name, checked."""
    if isinstance(servers, int) and not isinstance(servers, bool):
        ranks = list(range(server, server + servers))
        given = f"servers={servers} from server={server}"
    else:
        if server != 0:
            raise InvalidArgumentError(f"server={server} with a list of servers: the list's first rank is the "
                                       "coordinator, so give only servers=[...]")
        ranks = list(servers) if isinstance(servers, (list, tuple)) else []
        given = f"servers={servers!r}"
    if not ranks or len(set(ranks)) != len(ranks) or not all(isinstance(r, int) and 0 <= r < size for r in ranks):
        raise InvalidArgumentError(f"{given}: the servers must be distinct ranks of this communicator "
                                   f"(0..{size - 1}), at least one")
    if len(ranks) >= size:
        raise InvalidArgumentError(f"{given} leaves no worker among the {size} ranks")
    return ranks


def check_modes(size: int, servers: int, mode, softsync, max_staleness, version, backup_workers) -> None:
    """Refuse update rules that are unknown or do not go together."""
    if mode not in MODES:
        raise InvalidArgumentError(f"mode={mode!r}; choose one of {', '.join(MODES)}")
    if (mode == "softsync") != (softsync is not None):
        raise InvalidArgumentError(f"softsync=n goes with mode='softsync' and only with it (got mode={mode!r}, "
                                   f"softsync={softsync!r})")
    if softsync is not None and (not isinstance(softsync, int) or softsync < 1):
        raise InvalidArgumentError(f"softsync must be a positive integer, got {softsync!r}")
    if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
        raise InvalidArgumentError(f"max_staleness must be None or an integer >= 0, got {max_staleness!r}")
    if not isinstance(version, int) or version < 0:
        raise InvalidArgumentError(f"version must be an integer >= 0 (the number of updates the starting "
                                   f"weights have had), got {version!r}")
    if not isinstance(backup_workers, int) or backup_workers < 0 or (backup_workers and mode != "sync"):
        raise InvalidArgumentError(f"backup_workers must be an integer >= 0, and above 0 only with mode='sync' "
                                   f"(got backup_workers={backup_workers!r}, mode={mode!r})")
    if backup_workers >= size - servers:
        raise InvalidArgumentError(f"backup_workers={backup_workers} leaves no gradient to apply: there are "
                                   f"{size - servers} workers")


def partition(model: Model, servers: int) -> list:
    """Each of `servers` servers' range of the flat vector of dense parameters."""
    if not model.params:  # a model of tables only: nothing goes the dense path
        return [(0, 0)] * servers
    return shards.partition(model.shapes, servers)


def my_row(settings: Settings, model: Model, version: int, unsplittable, refusals: list) -> np.ndarray:
    """This rank's row of the agreement table."""
    tables = [(t.name, tuple(t.weight.shape), tuple(t.bounds)) for t in model.tables]
    layout = UNSPLITTABLE if unsplittable else shards.fingerprint(
        model.shapes, [(rank, *span) for rank, span in zip(settings.servers, settings.ranges)] + tables)
    values = {"parameters": model.numel, "dtype": wire.code_of(wire.name_of(model.dtype)),
              "server": settings.coordinator, "servers": len(settings.servers), "layout": layout,
              "mode": MODES.index(settings.mode), "backup_workers": settings.backup_workers,
              "gradients per update": settings.per_update,
              "max_staleness": -1 if settings.max_staleness is None else settings.max_staleness,
              "staleness_lr": settings.staleness_lr, "starting version": version, "sparse tables": len(model.tables),
              "has optimizer": bool(model.optimizers),
              "sparse refusal": next((index for index, refusal in enumerate(refusals) if refusal), -1),
              "declined": 0}
    return np.array([values[name] for name in COLUMNS], dtype=np.int64)


def agree(mpi, settings: Settings | None, model: Model | None, version: int, unsplittable, declined) -> None:
    """Every rank's model size and settings, checked on every rank alike (collective over `mpi`,
    the parameter server's communicator), so a mismatch raises the same error everywhere before
    any gradient moves; then whether each server has an optimizer, and one that can apply the
    tables' sparse gradients. `declined`: the error of this rank's arguments (the others raise it
    too, naming this rank; `settings` and `model` are then None)."""
    rank, refusals = mpi.Get_rank(), []
    if declined is None:
        refusals = [sparse.refusal(model.optimizers, t) for t in model.tables] if rank in settings.servers else []
        mine = my_row(settings, model, version, unsplittable, refusals)
    else:
        mine = np.zeros(len(COLUMNS), dtype=np.int64)
        mine[COLUMNS.index("declined")] = 1
    table = np.empty((mpi.Get_size(), len(COLUMNS)), dtype=np.int64)
    wait_for_collective(mpi.Iallgather(mine, table), mpi, "parameter server's agreement on its settings")
    raise_declined(mpi, column(table, "declined").nonzero()[0].tolist(), declined)
    for name in AGREED:
        values = column(table, name)
        if (values != values[0]).any():
            described = "; ".join(f"rank {r}: {describe(name, int(v))}" for r, v in enumerate(values))
            raise MismatchError(f"the ranks of the parameter server disagree on {name}: {described}")
    spellings = wire.allgather_texts(mpi, str(settings.compression), "parameter server's agreement on its compression")
    if len(set(spellings)) > 1:
        described = "; ".join(f"rank {r}: {spelling}" for r, spelling in enumerate(spellings))
        raise MismatchError(f"the ranks of the parameter server disagree on compression: {described}")
    if unsplittable:
        raise unsplittable
    without = [r for r in settings.servers if not column(table, "has optimizer")[r]]
    if without:
        raise InvalidArgumentError(f"the server (rank {without[0]}) was given no optimizer; pass the optimizer "
                                   "that applies the updates (workers may pass None)")
    refusing = [r for r in settings.servers if column(table, "sparse refusal")[r] >= 0]
    if refusing:  # the refusing server's words, on every rank
        server = refusing[0]
        mine = InvalidArgumentError(refusals[int(column(table, "sparse refusal")[server])]) \
            if rank == server else None
        raise_together(mpi, mine, "the server's refusal", InvalidArgumentError,
                       message=lambda failures: f"the server (rank {server}): {failures[server][1]}")


def raise_declined(mpi, declining: list, declined) -> None:
    """Every rank raises when any rank's arguments were refused (`declining`, in rank order):
    such a rank its own error, the others that of the first of them, naming it."""
    if not declining:
        return
    first = declining[0]
    agreed = agreed_error(mpi, declined, "the refusal of its arguments", InvalidArgumentError,
                          message=lambda failures: f"rank {first} refused its arguments to the parameter server: "
                                                   f"{failures[first][1]}")
    mpi.Free()
    if declined is not None:
        raise declined
    raise agreed


def describe(name: str, value: int):
    if name == "dtype":
        return str(wire.torch_dtype(wire.DTYPES[value]))
    if name == "mode":
        return MODES[value]
    if name == "layout" and value == UNSPLITTABLE:
        return "a model too small to split over the servers"
    if name == "max_staleness" and value < 0:
        return "None"
    return value

