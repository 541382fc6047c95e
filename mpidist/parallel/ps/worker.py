"""A worker's side of a parameter server: pull a batch's rows of the tables, push its gradient
(each server its range) and take the weights of the update that took it, and stop the parameter
server on its bad input. Functions of the ParameterServer `ps` (its settings) and its
WorkerRole (a worker's own state).
"""
from __future__ import annotations

import dataclasses

import torch

from ...errors import InvalidArgumentError, MismatchError
from ...runtime import wire
from . import sparse
from .protocol import FAILURES, Push, Sent, Tag, words
from .server import failure, flat, load


@dataclasses.dataclass
class WorkerRole:
    """A worker's own state. `pulled`: table index -> the rows pulled in this step (sorted,
    unique). `stop_asked`: request_stop() was called here."""
    pulled: dict = dataclasses.field(default_factory=dict)
    stop_asked: bool = False


def pull_rows(ps, module: torch.nn.Module, ids) -> None:
    """Pull rows `ids` of the table of `module`; again the rows pulled before in this step when
    newer weights came along (those are stale)."""
    check_worker(ps, "pull_rows()")
    index, unique = rows_asked(ps, module, ids)
    pulled = ps.worker_role.pulled
    pulled[index] = unique if index not in pulled else torch.unique(torch.cat([pulled[index], unique]))
    moved = pull(ps, index, unique)
    while moved:
        for again in sorted(pulled):
            moved = pull(ps, again, pulled[again])
            if moved:
                break


def rows_asked(ps, module, ids) -> tuple:
    """(the table's index, the sorted unique ids) of a pull, or the failure of bad input."""
    index = next((i for i, table in enumerate(ps.tables) if table.module is module), None)
    if index is None:
        names = [f"{type(table.module).__name__} {table.name.removesuffix('.weight')}" for table in ps.tables]
        fail(ps, InvalidArgumentError(
            f"pull_rows() on a {type(module).__name__} that is no table of this parameter server's model; its "
            f"tables (embeddings with sparse=True, or every embedding with sparse_embeddings=True): "
            f"{', '.join(names) if names else 'none'}"))
    table = ps.tables[index]
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        fail(ps, InvalidArgumentError(f"pull_rows({table.name}): ids must be an integer tensor, got "
                                      f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}"))
    unique = torch.unique(ids.detach().reshape(-1).cpu()).to(torch.int64)
    if unique.numel() and (unique[0] < 0 or unique[-1] >= table.rows):
        wrong = unique[(unique < 0) | (unique >= table.rows)]
        fail(ps, InvalidArgumentError(f"pull_rows({table.name}): ids {wrong[:8].tolist()} out of range: the "
                                      f"table has rows 0..{table.rows - 1}"))
    return index, unique


def pull(ps, index: int, ids: torch.Tensor) -> bool:
    """Pull rows `ids` (sorted) of table `index`, each server its part, into the table; True
    when they came with newer weights (loaded too)."""
    table = ps.tables[index]
    outgoing = []
    for server, (low, high) in zip(ps.servers, table.split(ids)):
        outgoing.append(wire.send(ps.mpi, ids[low:high], server, Tag.PUSH, fields=(Push.PULL, index, ps.version)))
        ps.bytes_pushed += (high - low) * ids.element_size()
    parts, version = receive_replies(ps, f"the rows of {table.name} from the server")
    moved = version != ps.version
    if moved:
        receive_weights(ps)
    with torch.no_grad():
        table.weight[ids.to(table.weight.device)] = torch.cat(parts).to(table.weight.device)
    for sent in outgoing:
        sent.wait(ps.who, "the rows asked of the server", f"the server (rank {sent.dest})")
    return moved


def step(ps) -> None:
    """Push this worker's gradients, each server its range and its rows of each table's
    gradient; then take the weights of the update that took them."""
    check_worker(ps, "step()")
    try:
        rows = [sparse.gradient_rows(table, ps.worker_role.pulled.get(i)) for i, table in enumerate(ps.tables)]
    except InvalidArgumentError as error:
        fail(ps, error)
    gradient = flat(ps, [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps.params])
    outgoing = []
    header = (Push.GRADIENT, ps.steps, ps.version, ps.worker_role.stop_asked)
    for position, (server, (start, end)) in enumerate(zip(ps.servers, ps.ranges)):
        parts = [gradient[start:end]]
        outgoing.append(wire.send(ps.mpi, parts[0], server, Tag.PUSH, fields=header))
        for table, (indices, values) in zip(ps.tables, rows):
            low, high = table.split(indices)[position]
            parts += [indices[low:high], values[low:high]]
            outgoing += [wire.send(ps.mpi, part, server, Tag.SPARSE) for part in parts[-2:]]
        ps.bytes_pushed += sum(part.numel() * part.element_size() for part in parts)
    receive_weights(ps)
    for sent in outgoing:
        sent.wait(ps.who, "the gradient sent to the server", f"the server (rank {sent.dest})")
    ps.steps += 1
    ps.worker_role.pulled = {}


def fail(ps, error: Exception):
    """Stop the parameter server on bad input: tell every server (the coordinator tells the
    other workers), then raise `error` here."""
    said = words(str(error))
    code = FAILURES.index(type(error))
    for sent in [wire.send(ps.mpi, said, server, Tag.PUSH, fields=(Push.FAILED, code, ps.version))
                 for server in ps.servers]:
        sent.wait(ps.who, "the failure sent to the server", f"the server (rank {sent.dest})")
    ps.closed = True
    raise error


def check_worker(ps, call: str) -> None:
    if ps.is_server:
        raise InvalidArgumentError(f"{call} runs on workers; rank {ps.comm.rank} is a server: call serve()")
    if ps.closed:
        raise InvalidArgumentError(f"{call} after close(): this worker has already left the parameter server")


def receive_replies(ps, what: str) -> tuple:
    """([each server's reply], their version): every server's answer to this worker's last
    message, received at once (the coordinator's first), or the failure one reports."""
    incoming = [wire.Incoming(ps.mpi, server, Tag.REPLY) for server in ps.servers]
    parts, versions = [], []
    for position, reply in enumerate(incoming):
        silent = f"the server (rank {reply.source})"
        reply.wait(ps.who, what, silent)
        parts.append(reply.receive_payload(ps.who, what, silent))
        if reply.fields[1] == Sent.FAILURE:
            for pending in incoming[position + 1:]:
                pending.request.Cancel()
            ps.closed = True
            raise failure(ps, parts[-1], *reply.fields[2:])
        versions.append(reply.fields[0])
        if reply.source == ps.server and reply.fields[1] == Sent.WEIGHTS:
            ps.stopping |= bool(reply.fields[2])
        ps.bytes_pulled += parts[-1].numel() * parts[-1].element_size()
    if len(set(versions)) > 1:
        raise MismatchError(f"{ps.who}: the servers {ps.servers} sent weights of versions {versions}; "
                            "every server must answer with the same update")
    return parts, versions[0]


def receive_weights(ps) -> None:
    """Every server's range of the weights; they must share one version."""
    parts, ps.version = receive_replies(ps, "the weights from the server")
    load(ps, torch.cat(parts))
