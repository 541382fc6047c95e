"""A parameter server's settings: every rank's arguments checked, then agreed on by every rank
in one allgather of a row of named columns, so that a mismatch, a refusal on some ranks only, a
server without an optimizer or one that cannot apply the tables' sparse gradients raises the
same error on every rank before any gradient moves.
"""
from __future__ import annotations

import numpy as np

from ...errors import InvalidArgumentError, MismatchError
from ...runtime import wire
from ...runtime.deadlines import wait_for_collective
from ...runtime.together import agreed_error, raise_together
from . import shards, sparse
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


def take_model(ps, module, optimizer, sparse_embeddings: bool) -> None:
    """The module's trained parameters, split into the dense path's and the tables."""
    ps.module = module
    ps.optimizer = optimizer
    ps.optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [] if optimizer is None else [optimizer]
    trained = [p for p in module.parameters() if p.requires_grad]
    if not trained:
        raise InvalidArgumentError("the module has no parameters that require a gradient")
    dtypes = {p.dtype for p in trained}
    if len(dtypes) > 1 or not trained[0].is_floating_point() \
            or str(trained[0].dtype).removeprefix("torch.") not in wire.ITEMSIZE:
        raise InvalidArgumentError(f"the parameters must share one floating-point dtype, got "
                                   f"{sorted(str(d) for d in dtypes)}")
    ps.dtype = trained[0].dtype
    ps.tables = sparse.find_tables(module, len(ps.servers), sparse_embeddings)
    by_rows = {id(table.weight) for table in ps.tables}
    ps.params = [p for p in trained if id(p) not in by_rows]  # the dense path's, end to end
    ps.numels = [p.numel() for p in ps.params]
    ps.numel = sum(ps.numels)
    ps.shapes = [tuple(p.shape) for p in ps.params]


def partition(ps) -> list:
    """Each server's range of the flat vector of dense parameters."""
    if not ps.params:  # a model of tables only: nothing goes the dense path
        return [(0, 0)] * len(ps.servers)
    return shards.partition(ps.shapes, len(ps.servers))


def my_row(ps, unsplittable, refusals: list) -> np.ndarray:
    """This rank's row of the agreement table."""
    tables = [(t.name, tuple(t.weight.shape), tuple(t.bounds)) for t in ps.tables]
    layout = UNSPLITTABLE if unsplittable else shards.fingerprint(
        ps.shapes, [(rank, *span) for rank, span in zip(ps.servers, ps.ranges)] + tables)
    values = {"parameters": ps.numel, "dtype": wire.code_of(wire.name_of(ps.dtype)), "server": ps.server,
              "servers": len(ps.servers), "layout": layout, "mode": MODES.index(ps.mode),
              "backup_workers": ps.backup_workers, "gradients per update": ps.per_update,
              "max_staleness": -1 if ps.max_staleness is None else ps.max_staleness,
              "staleness_lr": ps.staleness_lr, "starting version": ps.version, "sparse tables": len(ps.tables),
              "has optimizer": bool(ps.optimizers),
              "sparse refusal": next((index for index, refusal in enumerate(refusals) if refusal), -1),
              "declined": 0}
    return np.array([values[name] for name in COLUMNS], dtype=np.int64)


def agree(ps, unsplittable, declined) -> None:
    """Every rank's model size and settings, checked on every rank alike, so a mismatch raises
    the same error everywhere before any gradient moves; then whether each server has an
    optimizer, and one that can apply the tables' sparse gradients. `declined`: the error of
    this rank's arguments (the others raise it too, naming this rank)."""
    refusals = []
    if declined is None:
        refusals = [sparse.refusal(ps.optimizers, t) for t in ps.tables] if ps.is_server else []
        mine = my_row(ps, unsplittable, refusals)
    else:
        mine = np.zeros(len(COLUMNS), dtype=np.int64)
        mine[COLUMNS.index("declined")] = 1
    table = np.empty((ps.comm.size, len(COLUMNS)), dtype=np.int64)
    wait_for_collective(ps.mpi.Iallgather(mine, table), ps.mpi, "parameter server's agreement on its settings")
    raise_declined(ps, column(table, "declined").nonzero()[0].tolist(), declined)
    for name in AGREED:
        values = column(table, name)
        if (values != values[0]).any():
            described = "; ".join(f"rank {r}: {describe(name, int(v))}" for r, v in enumerate(values))
            raise MismatchError(f"the ranks of the parameter server disagree on {name}: {described}")
    if unsplittable:
        raise unsplittable
    without = [r for r in ps.servers if not column(table, "has optimizer")[r]]
    if without:
        raise InvalidArgumentError(f"the server (rank {without[0]}) was given no optimizer; pass the optimizer "
                                   "that applies the updates (workers may pass None)")
    refusing = [r for r in ps.servers if column(table, "sparse refusal")[r] >= 0]
    if refusing:  # the refusing server's words, on every rank
        server = refusing[0]
        mine = InvalidArgumentError(refusals[int(column(table, "sparse refusal")[server])]) \
            if ps.comm.rank == server else None
        raise_together(ps.mpi, mine, "the server's refusal", InvalidArgumentError,
                       message=lambda failures: f"the server (rank {server}): {failures[server][1]}")


def raise_declined(ps, declining: list, declined) -> None:
    """Every rank raises when any rank's arguments were refused (`declining`, in rank order):
    such a rank its own error, the others that of the first of them, naming it."""
    if not declining:
        return
    first = declining[0]
    agreed = agreed_error(ps.mpi, declined, "the refusal of its arguments", InvalidArgumentError,
                          message=lambda failures: f"rank {first} refused its arguments to the parameter server: "
                                                   f"{failures[first][1]}")
    ps.mpi.Free()
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

