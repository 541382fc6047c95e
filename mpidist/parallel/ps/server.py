"""What every server of a parameter server does, coordinator and followers alike: receive a
worker's gradient, apply an update to its range, answer a worker with its range of the weights
or the rows it pulls, and stop the parameter server on a failure. Functions of the
ParameterServer `ps` (its settings) and its ServerRole (a server's own state).
"""
from __future__ import annotations

import dataclasses

import torch

from ...runtime import wire
from ...runtime.deadlines import wait_until
from . import sparse
from .policy import Update, make_update
from .protocol import FAILURES, UPDATE_FAILED, Command, Push, Sent, Tag, text, words


@dataclasses.dataclass
class ServerRole:
    """A server's own state. `owned`: its range of a model split over several servers
    (shards.OwnedRange), None with one server. `sent_weights`: (version, its range of the
    weights) that replies share. `failures`: on the coordinator in serve(), another server ->
    the receive of its failure. `state_sends`: its parts of gather_state() still being sent."""
    owned: object = None
    sent_weights: tuple | None = None
    failures: dict = dataclasses.field(default_factory=dict)
    state_sends: list = dataclasses.field(default_factory=list)
    serving: bool = False


def flat(ps, tensors) -> torch.Tensor:
    """The tensors end to end in one contiguous CPU tensor (what travels)."""
    return torch.cat([t.detach().reshape(-1).cpu() for t in tensors]) if tensors else torch.empty(0, dtype=ps.dtype)


def load(ps, weights: torch.Tensor) -> None:
    with torch.no_grad():
        for param, part in zip(ps.params, weights.split(ps.numels)):
            param.copy_(part.view_as(param))


def command(ps, kind: Command, workers: list) -> list:
    """Start sending a command (the workers it concerns) to every other server."""
    payload = torch.tensor(workers, dtype=torch.int64)
    return [wire.send(ps.mpi, payload, follower, Tag.COMMAND, fields=(kind,)) for follower in ps.servers[1:]]


def send_weights(ps, worker: int) -> wire.Outgoing:
    """Start sending this server's range of the current weights and their version."""
    role = ps.server_role
    if role.sent_weights is None or role.sent_weights[0] != ps.version:
        # One copy per version, shared by every reply of that version (sync mode answers
        # every worker with the same one): pending sends only read it.
        role.sent_weights = (ps.version, role.owned.weights() if role.owned is not None else flat(ps, ps.params))
    return wire.send(ps.mpi, role.sent_weights[1], worker, Tag.REPLY, fields=(ps.version, Sent.WEIGHTS, ps.stopping))


def send_table_ranges(ps, rank: int, tag: int) -> list:
    """Start sending this server's row range of every table (the final weights)."""
    index = ps.servers.index(ps.comm.rank)
    return [wire.send(ps.mpi, table.weight.detach()[slice(*table.row_range(index))], rank, tag,
                      fields=(ps.version, Sent.ROWS)) for table in ps.tables]


def receive_gradient(ps, worker: int) -> tuple:
    dense, (_, step, version, _) = wire.receive(ps.mpi, worker, Tag.PUSH, ps.who, f"the gradient of worker {worker}",
                                                f"worker {worker}")
    return (dense, receive_gradient_rows(ps, worker)), step, version


def receive_gradient_rows(ps, worker: int) -> list:
    """[(indices, rows)] of each table's gradient in this server's row ranges, as sent after
    the dense range."""
    parts = []
    for table in ps.tables:
        what, silent = f"the gradient rows of {table.name} from worker {worker}", f"worker {worker}"
        indices, _ = wire.receive(ps.mpi, worker, Tag.SPARSE, ps.who, what, silent)
        rows, _ = wire.receive(ps.mpi, worker, Tag.SPARSE, ps.who, what, silent)
        parts.append((indices, rows))
    return parts


def receive_from_server(ps, other: int, tag: int, what: str) -> tuple:
    """(tensor, fields) of another server's message with `tag`; on the coordinator, should
    that server's update fail first, its failure stops the parameter server instead."""
    if ps.comm.rank != ps.server:
        return wire.receive(ps.mpi, other, tag, ps.who, what, f"server {other}")
    incoming = wire.Incoming(ps.mpi, other, tag)
    failure = ps.server_role.failures[other]
    # Get_status leaves a failure that came with the message for the next wait to find.
    wait_until(lambda: incoming.request.Test() or failure.request.Get_status(), ps.who, what, f"server {other}",
               peers=(other,))
    if not incoming.request.Test():
        incoming.request.Cancel()
        stop(ps, other, failure, [])
    return incoming.receive_payload(ps.who, what, f"server {other}"), incoming.fields


def answer_pull(ps, worker: int, pull: torch.Tensor, fields: tuple) -> list:
    """Start sending the rows a worker pulls, of the current version, and this server's range
    of the dense weights too when the worker's are older."""
    _, index, version = fields
    rows = ps.tables[index].weight.detach()[pull]
    sends = [wire.send(ps.mpi, rows, worker, Tag.REPLY, fields=(ps.version, Sent.ROWS))]
    if version != ps.version:
        sends.append(send_weights(ps, worker))
    return sends


def apply(ps, arrived: dict, update: Update, on_update) -> Update:
    """Apply `update`: the mean of the gradients `arrived` (worker -> (gradient, step,
    version)) to this server's range, then on_update."""
    order = [worker for worker, _, _ in update.gradients]
    total = arrived[order[0]][0][0].clone()
    for worker in order[1:]:
        total += arrived[worker][0][0]
    total /= len(order)
    owned = ps.server_role.owned
    for index, table in enumerate(ps.tables):
        gradient = sparse.mean_gradient(table, [arrived[w][0][1][index] for w in order], len(order))
        if owned is not None:
            owned.set_table_gradient(table.weight, gradient)
        else:
            table.weight.grad = gradient
    try:
        if owned is not None:
            owned.set_gradients(total)
            owned.step(update.lr_scale)
        else:
            step_whole(ps, total, update.lr_scale)
    except Exception as error:  # the optimizer's, or a check of the user's in it
        server_failed(ps, error)
    for table in ps.tables:
        table.weight.grad = None
    ps.version = update.version
    if on_update is not None:
        if owned is not None:
            owned.to_module()
        on_update(update)
    return update


def apply_received(ps, arrived: dict, dropped: tuple, on_update) -> Update:
    """A follower's update: the gradients `arrived` as the coordinator commanded."""
    gradients = tuple((w, arrived[w][1], arrived[w][2]) for w in sorted(arrived))
    return apply(ps, arrived, make_update(ps.version, gradients, dropped, ps.staleness_lr), on_update)


def step_whole(ps, gradient: torch.Tensor, lr_scale: float) -> None:
    """The one server's update: the mean gradient as the parameters' gradients, the user's
    optimizers stepped with the learning rate times lr_scale for this update alone."""
    for param, part in zip(ps.params, gradient.split(ps.numels)):
        param.grad = part.view_as(param).to(param.device)
    groups = [group for optimizer in ps.optimizers for group in optimizer.param_groups]
    learning_rates = [group["lr"] for group in groups]
    for group in groups:
        group["lr"] = group["lr"] * lr_scale
    try:
        for optimizer in ps.optimizers:
            optimizer.step()
    finally:
        for group, lr in zip(groups, learning_rates):
            group["lr"] = lr
    for param in ps.params:
        param.grad = None


def drop(ps, worker: int, step: int, version: int) -> tuple:
    ps.dropped.append((worker, step, version))
    return ps.dropped[-1]


def stop(ps, rank: int, incoming: wire.Incoming, sends: list):
    """A worker's bad input, or another server's failed update: the coordinator tells the other
    servers, and every other worker in its next reply; then this server raises the error,
    naming the rank."""
    silent = f"{'server' if rank in ps.servers else 'worker'} {rank}"
    incoming.wait(ps.who, f"the failure of {silent}", silent)
    said = incoming.receive_payload(ps.who, f"the failure of {silent}", silent)
    _, code, _ = incoming.fields
    if ps.comm.rank == ps.server:
        sends += command(ps, Command.FAIL, [rank])
        sends += [wire.send(ps.mpi, said, other, Tag.REPLY, fields=(ps.version, Sent.FAILURE, code, rank))
                  for other in ps.workers if other != rank]
        for outgoing in sends:
            outgoing.wait(ps.who, f"the message sent to rank {outgoing.dest}", f"rank {outgoing.dest}")
    raise failure(ps, said, code, rank)


def failure(ps, said: torch.Tensor, code: int, rank: int) -> Exception:
    """The error a failure message of `rank` raises here."""
    role = "server" if rank in ps.servers else "worker"
    return FAILURES[code](f"{ps.who}: {role} {rank} stopped the parameter server: {text(said)}")


def server_failed(ps, error: Exception):
    """An error in this server's update stops the parameter server: this server tells the other
    servers and every worker (in place of its next reply), then raises `error`."""
    said = words(f"its update {ps.version + 1} raised {type(error).__name__}: {error}")
    sends = command(ps, Command.FAIL, [ps.comm.rank]) if ps.comm.rank == ps.server else []
    sends += [wire.send(ps.mpi, said, other, Tag.PUSH, fields=(Push.FAILED, UPDATE_FAILED, ps.version))
              for other in ps.servers if other != ps.comm.rank]
    # In place of this server's next reply to each worker (which may wait for it alone).
    sends += [wire.send(ps.mpi, said, worker, Tag.REPLY, fields=(ps.version, Sent.FAILURE, UPDATE_FAILED, ps.comm.rank))
              for worker in ps.workers]
    for outgoing in sends:
        outgoing.wait(ps.who, f"the failure sent to rank {outgoing.dest}", f"rank {outgoing.dest}")
    raise error
