"""A worker's side of a parameter server: pull a batch's rows of the tables, push its gradient
(each server its range) and take the weights of the update that took it, and stop the parameter
server on its bad input. Functions of the worker's WorkerRole (roles.py: the agreed settings,
the model, the endpoint and the worker's own state).
"""
from __future__ import annotations

import torch

from ...errors import InvalidArgumentError, MismatchError
from ...runtime import wire
from . import sparse
from .protocol import (
    FAILURES,
    DoneHeader,
    FailedHeader,
    FailureReply,
    PullHeader,
    PushHeader,
    Tag,
    WeightsReply,
    decode_reply,
    encode_push,
    words,
)
from .roles import WorkerRole
from .server import failure


def pull_rows(role: WorkerRole, module: torch.nn.Module, ids) -> None:
    """Pull rows `ids` of the table of `module`; again the rows pulled before in this step when
    newer weights came along (those are stale)."""
    check_worker(role, "pull_rows()")
    index, unique = rows_asked(role, module, ids)
    pulled = role.pulled
    pulled[index] = unique if index not in pulled else torch.unique(torch.cat([pulled[index], unique]))
    moved = pull(role, index, unique)
    while moved:
        for again in sorted(pulled):
            moved = pull(role, again, pulled[again])
            if moved:
                break


def rows_asked(role: WorkerRole, module, ids) -> tuple:
    """(the table's index, the sorted unique ids) of a pull, or the failure of bad input."""
    tables = role.model.tables
    index = next((i for i, table in enumerate(tables) if table.module is module), None)
    if index is None:
        names = [f"{type(table.module).__name__} {table.name.removesuffix('.weight')}" for table in tables]
        fail(role, InvalidArgumentError(
            f"pull_rows() on a {type(module).__name__} that is no table of this parameter server's model; its "
            f"tables (embeddings with sparse=True, or every embedding with sparse_embeddings=True): "
            f"{', '.join(names) if names else 'none'}"))
    table = tables[index]
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        fail(role, InvalidArgumentError(f"pull_rows({table.name}): ids must be an integer tensor, got "
                                        f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}"))
    unique = torch.unique(ids.detach().reshape(-1).cpu()).to(torch.int64)
    if unique.numel() and (unique[0] < 0 or unique[-1] >= table.rows):
        wrong = unique[(unique < 0) | (unique >= table.rows)]
        fail(role, InvalidArgumentError(f"pull_rows({table.name}): ids {wrong[:8].tolist()} out of range: the "
                                        f"table has rows 0..{table.rows - 1}"))
    return index, unique


def pull(role: WorkerRole, index: int, ids: torch.Tensor) -> bool:
    """Pull rows `ids` (sorted) of table `index`, each server its part, into the table; True
    when they came with newer weights (loaded too)."""
    table, mpi = role.model.tables[index], role.endpoint.mpi
    outgoing, header = [], encode_push(PullHeader(index, role.version))
    for server, (low, high) in zip(role.settings.servers, table.split(ids)):
        outgoing.append(wire.send(mpi, ids[low:high], server, Tag.PUSH, fields=header))
        role.bytes_pushed += (high - low) * ids.element_size()
    parts, version = receive_replies(role, f"the rows of {table.name} from the server")
    moved = version != role.version
    if moved:
        receive_weights(role)
    with torch.no_grad():
        table.weight[ids.to(table.weight.device)] = torch.cat(parts).to(table.weight.device)
    for sent in outgoing:
        sent.wait(role.endpoint.who, "the rows asked of the server", f"the server (rank {sent.dest})")
    return moved


def step(role: WorkerRole) -> None:
    """Push this worker's gradients, each server its range and its rows of each table's
    gradient; then take the weights of the update that took them."""
    check_worker(role, "step()")
    model, mpi = role.model, role.endpoint.mpi
    try:
        rows = [sparse.gradient_rows(table, role.pulled.get(i)) for i, table in enumerate(model.tables)]
    except InvalidArgumentError as error:
        fail(role, error)
    gradient = model.flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in model.params])
    outgoing = []
    header = encode_push(PushHeader(role.steps, role.version, int(role.stop_asked)))
    for position, (server, (start, end)) in enumerate(zip(role.settings.servers, role.settings.ranges)):
        parts = [role.codecs[position].encode(gradient[start:end])]
        outgoing.append(wire.send(mpi, parts[0], server, Tag.PUSH, fields=header))
        for table, table_rows in zip(model.tables, rows):
            low, high = table.split(table_rows.indices)[position]
            parts += [table_rows.indices[low:high], table_rows.values[low:high]]
            outgoing += [wire.send(mpi, part, server, Tag.SPARSE) for part in parts[-2:]]
        role.bytes_pushed += sum(part.numel() * part.element_size() for part in parts)
    receive_weights(role)
    for sent in outgoing:
        sent.wait(role.endpoint.who, "the gradient sent to the server", f"the server (rank {sent.dest})")
    role.steps += 1
    role.pulled = {}


def close(role: WorkerRole, receive_weights) -> None:
    """Tell the coordinating server this worker is done, and take the final weights (by
    `receive_weights()`), tables whole."""
    check_worker(role, "close()")
    mpi, coordinator = role.endpoint.mpi, role.settings.coordinator
    nothing = torch.empty(0, dtype=role.model.dtype)
    outgoing = wire.send(mpi, nothing, coordinator, Tag.PUSH, fields=encode_push(DoneHeader(role.steps, role.version)))
    receive_weights()
    for table in role.model.tables:
        parts, _ = receive_replies(role, f"the final rows of {table.name} from the server")
        with torch.no_grad():
            table.weight.copy_(torch.cat(parts).to(table.weight.device))
    outgoing.wait(role.endpoint.who, "the last message to the server", f"the server (rank {coordinator})")
    role.closed = True
    mpi.Free()


def fail(role: WorkerRole, error: Exception):
    """Stop the parameter server on bad input: tell every server (the coordinator tells the
    other workers), then raise `error` here."""
    said = words(str(error))
    header = encode_push(FailedHeader(FAILURES.index(type(error)), role.version))
    for sent in [wire.send(role.endpoint.mpi, said, server, Tag.PUSH, fields=header)
                 for server in role.settings.servers]:
        sent.wait(role.endpoint.who, "the failure sent to the server", f"the server (rank {sent.dest})")
    role.closed = True
    raise error


def check_worker(role, call: str) -> None:
    """Refuse a worker's call on a server (`role` a ServerRole) or after close()."""
    if not isinstance(role, WorkerRole):
        raise InvalidArgumentError(f"{call} runs on workers; rank {role.endpoint.rank} is a server: call serve()")
    if role.closed:
        raise InvalidArgumentError(f"{call} after close(): this worker has already left the parameter server")


def receive_replies(role: WorkerRole, what: str) -> tuple:
    """([each server's reply], their version): every server's answer to this worker's last
    message, received at once (the coordinator's first), or the failure one reports."""
    who, servers = role.endpoint.who, role.settings.servers
    incoming = [wire.Incoming(role.endpoint.mpi, server, Tag.REPLY) for server in servers]
    parts, versions = [], []
    for position, reply in enumerate(incoming):
        silent = f"the server (rank {reply.source})"
        reply.wait(who, what, silent)
        parts.append(reply.receive_payload(who, what, silent))
        header = decode_reply(reply.fields)
        if isinstance(header, FailureReply):
            for pending in incoming[position + 1:]:
                pending.request.Cancel()
            role.closed = True
            raise failure(role, parts[-1], header.code, header.rank)
        versions.append(header.version)
        if reply.source == role.settings.coordinator and isinstance(header, WeightsReply):
            role.stopping |= bool(header.stopping)
        role.bytes_pulled += parts[-1].numel() * parts[-1].element_size()
    if len(set(versions)) > 1:
        raise MismatchError(f"{who}: the servers {servers} sent weights of versions {versions}; "
                            "every server must answer with the same update")
    return parts, versions[0]


def receive_weights(role: WorkerRole) -> None:
    """Every server's range of the weights; they must share one version."""
    parts, role.version = receive_replies(role, "the weights from the server")
    role.model.load(torch.cat(parts))
