"""The loop of a server other than the coordinator: do what the coordinator commands, in its
order, on this server's range, so that it applies the same updates and answers the same workers
after the same updates.
"""
from __future__ import annotations

from ...runtime import wire
from . import survival
from .protocol import Command, Tag
from .roles import ServerRole
from .server import answer_pull, apply_received, drop, receive_gradient, send_weights, stop


def follow(role: ServerRole, history: list, on_update) -> list:
    """Follow the coordinator's commands until FINISH; returns the sends still going."""
    mpi, who, sends, late = role.endpoint.mpi, role.endpoint.who, [], []
    coordinator = f"the coordinating server (rank {role.settings.coordinator})"
    while True:
        workers, (kind,) = wire.receive(mpi, role.settings.coordinator, Tag.COMMAND, who,
                                        "the coordinator's next command", coordinator)
        workers = workers.tolist()
        if kind == Command.FINISH:
            return sends
        if kind == Command.ANSWER:
            sends.append(send_weights(role, workers[0]))
        elif kind == Command.ANSWER_PULL:
            pull, fields = wire.receive(mpi, workers[0], Tag.PUSH, who, f"the rows worker {workers[0]} pulls",
                                        f"worker {workers[0]}")
            sends += answer_pull(role, workers[0], pull, fields)
        elif kind == Command.FAIL:
            stop(role, workers[0], wire.Incoming(mpi, workers[0], Tag.PUSH), sends)
        elif kind == Command.LOST:
            survival.report(role, *workers, started=0.0)
        elif kind == Command.DROP:
            _, step, version = receive_gradient(role, workers[0])
            late.append(drop(role, workers[0], step, version))
        else:
            arrived = {w: receive_gradient(role, w) for w in workers}
            history.append(apply_received(role, arrived, tuple(late), on_update))
            late = []
        sends = survival.pending(role, sends)
