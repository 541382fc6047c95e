"""The loop of a server other than the coordinator: do what the coordinator commands, in its
order, on this server's range, so that it applies the same updates and answers the same workers
after the same updates.
"""
from __future__ import annotations

from ...runtime import wire
from . import survival
from .protocol import Command, Tag, decode_order, decode_push
from .roles import ServerRole
from .server import answer_pull, apply_received, drop, receive_gradient, send_weights, stop


def follow(role: ServerRole, history: list, on_update) -> list:
    """Follow the coordinator's commands until FINISH; returns the sends still going."""
    mpi, who, sends, late = role.endpoint.mpi, role.endpoint.who, [], []
    coordinator = f"the coordinating server (rank {role.settings.coordinator})"
    while True:
        order = decode_order(*wire.receive(mpi, role.settings.coordinator, Tag.COMMAND, who,
                                           "the coordinator's next command", coordinator))
        worker = order.workers[0] if order.workers else None
        if order.command == Command.FINISH:
            return sends
        if order.command == Command.ANSWER:
            sends.append(send_weights(role, worker))
        elif order.command == Command.ANSWER_PULL:
            pull, fields = wire.receive(mpi, worker, Tag.PUSH, who, f"the rows worker {worker} pulls",
                                        f"worker {worker}")
            sends += answer_pull(role, worker, pull, decode_push(fields))
        elif order.command == Command.FAIL:
            stop(role, worker, wire.Incoming(mpi, worker, Tag.PUSH), sends)
        elif order.command == Command.LOST:
            survival.report(role, worker, order.steps, started=0.0)
        elif order.command == Command.DROP:
            late.append(drop(role, receive_gradient(role, worker).stamp))
        else:
            arrived = [receive_gradient(role, w) for w in order.workers]
            history.append(apply_received(role, arrived, tuple(late), on_update))
            late = []
        sends = survival.pending(role, sends)
