"""What every server of a parameter server does, coordinator and followers alike: receive a
worker's gradient, apply an update to its range, answer a worker with its range of the weights
or the rows it pulls, and stop the parameter server on a failure. Functions of the server's
ServerRole (roles.py: the agreed settings, the model, the endpoint and the server's own state).
A worker's gradient, as a server holds it until an update takes it, is a Gradient.
"""
from __future__ import annotations

import dataclasses

import torch

from ...runtime import wire
from ...runtime.deadlines import wait_until
from . import sparse
from .model import Model
from .policy import Stamp, Update, make_update
from .protocol import (
    FAILURES,
    UPDATE_FAILED,
    Command,
    FailedHeader,
    FailureReply,
    Order,
    PullHeader,
    RowsReply,
    Tag,
    WeightsReply,
    decode_push,
    encode_order,
    encode_push,
    encode_reply,
    text,
    words,
)
from .roles import Role, ServerRole


@dataclasses.dataclass(frozen=True)
class Gradient:
    """A worker's gradient as a server received it: its `worker`, `step` and the `version` of
    the weights it was computed on (as its PushHeader said), this server's range of its dense
    part (`dense`, decoded) and the sparse.Rows of each table in this server's row ranges."""
    worker: int
    step: int
    version: int
    dense: torch.Tensor
    rows: list

    @property
    def stamp(self) -> Stamp:
        """The gradient as the update policy knows it."""
        return Stamp(self.worker, self.step, self.version)


def command(role: ServerRole, order: Order) -> list:
    """Start sending a command to every other server."""
    payload, fields = encode_order(order)
    return [wire.send(role.endpoint.mpi, payload, follower, Tag.COMMAND, fields=fields)
            for follower in role.settings.servers[1:]]


def send_weights(role: ServerRole, worker: int) -> wire.Outgoing:
    """Start sending this server's range of the current weights and their version."""
    if role.sent_weights is None or role.sent_weights[0] != role.version:
        # One copy per version, shared by every reply of that version (sync mode answers
        # every worker with the same one): pending sends only read it.
        weights = role.owned.weights() if role.owned is not None else role.model.flat(role.model.params)
        role.sent_weights = (role.version, weights)
    return wire.send(role.endpoint.mpi, role.sent_weights[1], worker, Tag.REPLY,
                     fields=encode_reply(WeightsReply(role.version, int(role.stopping))))


def send_table_ranges(role: ServerRole, rank: int, tag: int) -> list:
    """Start sending this server's row range of every table (the final weights)."""
    return [wire.send(role.endpoint.mpi, table.weight.detach()[slice(*table.row_range(role.index))], rank, tag,
                      fields=encode_reply(RowsReply(role.version))) for table in role.model.tables]


def receive_gradient(role: ServerRole, worker: int, incoming: wire.Incoming | None = None) -> Gradient:
    """The gradient of `worker`: its header from `incoming` (come already) or, when None,
    received here; then its dense range and the rows of each table, as sent after it."""
    who, what, silent = role.endpoint.who, f"the gradient of worker {worker}", f"worker {worker}"
    if incoming is None:
        incoming = wire.Incoming(role.endpoint.mpi, worker, Tag.PUSH)
        incoming.wait(who, what, silent)
    header = decode_push(incoming.fields)
    dense = role.codec.decode(incoming.receive_payload(who, what, silent))
    rows = []
    for table in role.model.tables:
        what = f"the gradient rows of {table.name} from worker {worker}"
        indices, _ = wire.receive(role.endpoint.mpi, worker, Tag.SPARSE, who, what, silent)
        values, _ = wire.receive(role.endpoint.mpi, worker, Tag.SPARSE, who, what, silent)
        rows.append(sparse.Rows(indices, values))
    return Gradient(worker, header.step, header.version, dense, rows)


def receive_from_server(role: ServerRole, other: int, tag: int, what: str) -> torch.Tensor:
    """The tensor of another server's message with `tag`; on the coordinator, should
    that server's update fail first, its failure stops the parameter server instead."""
    mpi, who = role.endpoint.mpi, role.endpoint.who
    if not role.coordinating:
        return wire.receive(mpi, other, tag, who, what, f"server {other}")[0]
    incoming = wire.Incoming(mpi, other, tag)
    failure = role.failures[other]
    # Get_status leaves a failure that came with the message for the next wait to find.
    wait_until(lambda: incoming.request.Test() or failure.request.Get_status(), who, what, f"server {other}",
               peers=(other,))
    if not incoming.request.Test():
        incoming.request.Cancel()
        stop(role, other, failure, [])
    return incoming.receive_payload(who, what, f"server {other}")


def answer_pull(role: ServerRole, worker: int, pull: torch.Tensor, header: PullHeader) -> list:
    """Start sending the rows a worker pulls, of the current version, and this server's range
    of the dense weights too when the worker's are older."""
    rows = role.model.tables[header.table].weight.detach()[pull]
    sends = [wire.send(role.endpoint.mpi, rows, worker, Tag.REPLY, fields=encode_reply(RowsReply(role.version)))]
    if header.version != role.version:
        sends.append(send_weights(role, worker))
    return sends


def apply(role: ServerRole, arrived: list, update: Update, on_update) -> Update:
    """Apply `update`: the mean of the gradients `arrived` (a Gradient each, in the order of
    update.gradients) to this server's range, then on_update."""
    total = arrived[0].dense.clone()
    for gradient in arrived[1:]:
        total += gradient.dense
    total /= len(arrived)
    owned, tables = role.owned, role.model.tables
    for index, table in enumerate(tables):
        mean = sparse.mean_gradient(table, [gradient.rows[index] for gradient in arrived], len(arrived))
        if owned is not None:
            owned.set_table_gradient(table.weight, mean)
        else:
            table.weight.grad = mean
    try:
        with sparse.invariants_checked():
            if owned is not None:
                owned.set_gradients(total)
                owned.step(update.lr_scale)
            else:
                step_whole(role.model, total, update.lr_scale)
    except Exception as error:  # the optimizer's, or a check of the user's in it
        server_failed(role, error)
    for table in tables:
        table.weight.grad = None
    role.version = update.version
    if on_update is not None:
        if owned is not None:
            owned.to_module()
        on_update(update)
    return update


def apply_received(role: ServerRole, arrived: list, dropped: tuple, on_update) -> Update:
    """A follower's update: the gradients `arrived` (a Gradient each), in the coordinator's
    order (by worker rank), as it commanded."""
    gradients = tuple(gradient.stamp for gradient in arrived)
    return apply(role, arrived, make_update(role.version, gradients, dropped, role.settings.staleness_lr), on_update)


def step_whole(model: Model, gradient: torch.Tensor, lr_scale: float) -> None:
    """The one server's update: the mean gradient as the parameters' gradients, the user's
    optimizers stepped with the learning rate times lr_scale for this update alone."""
    for param, part in zip(model.params, gradient.split(model.numels)):
        param.grad = part.view_as(param).to(param.device)
    groups = [group for optimizer in model.optimizers for group in optimizer.param_groups]
    learning_rates = [group["lr"] for group in groups]
    for group in groups:
        group["lr"] = group["lr"] * lr_scale
    try:
        for optimizer in model.optimizers:
            optimizer.step()
    finally:
        for group, lr in zip(groups, learning_rates):
            group["lr"] = lr
    for param in model.params:
        param.grad = None


def drop(role: ServerRole, stamp: Stamp) -> Stamp:
    role.dropped.append(stamp)
    return stamp


def stop(role: ServerRole, rank: int, incoming: wire.Incoming, sends: list):
    """A worker's bad input, or another server's failed update: the coordinator tells the other
    servers, and every other worker in its next reply; then this server raises the error,
    naming the rank."""
    mpi, who = role.endpoint.mpi, role.endpoint.who
    silent = f"{'server' if rank in role.settings.servers else 'worker'} {rank}"
    incoming.wait(who, f"the failure of {silent}", silent)
    said = incoming.receive_payload(who, f"the failure of {silent}", silent)
    code = decode_push(incoming.fields).code
    if role.coordinating:
        sends += command(role, Order(Command.FAIL, (rank,)))
        sends += [wire.send(mpi, said, other, Tag.REPLY, fields=encode_reply(FailureReply(role.version, code, rank)))
                  for other in role.settings.workers if other != rank]
        for outgoing in sends:
            outgoing.wait(who, f"the message sent to rank {outgoing.dest}", f"rank {outgoing.dest}")
    raise failure(role, said, code, rank)


def failure(role: Role, said: torch.Tensor, code: int, rank: int) -> Exception:
    """The error a failure message of `rank` raises here (on a server or a worker)."""
    named = "server" if rank in role.settings.servers else "worker"
    return FAILURES[code](f"{role.endpoint.who}: {named} {rank} stopped the parameter server: {text(said)}")


def server_failed(role: ServerRole, error: Exception):
    """An error in this server's update stops the parameter server: this server tells the other
    servers and every worker (in place of its next reply), then raises `error`."""
    mpi, rank, servers = role.endpoint.mpi, role.endpoint.rank, role.settings.servers
    said = words(f"its update {role.version + 1} raised {type(error).__name__}: {error}")
    sends = command(role, Order(Command.FAIL, (rank,))) if role.coordinating else []
    failed = encode_push(FailedHeader(UPDATE_FAILED, role.version))
    sends += [wire.send(mpi, said, other, Tag.PUSH, fields=failed) for other in servers if other != rank]
    # In place of this server's next reply to each worker (which may wait for it alone).
    failure_reply = encode_reply(FailureReply(role.version, UPDATE_FAILED, rank))
    sends += [wire.send(mpi, said, worker, Tag.REPLY, fields=failure_reply) for worker in role.settings.workers]
    for outgoing in sends:
        outgoing.wait(role.endpoint.who, f"the failure sent to rank {outgoing.dest}", f"rank {outgoing.dest}")
    raise error
