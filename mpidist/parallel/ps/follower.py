"""The loop of a server other than the coordinator: do what the coordinator commands, in its
order, on this server's range, so that it applies the same updates and answers the same workers
after the same updates.
"""
from __future__ import annotations

from ...runtime import wire
from . import survival
from .protocol import Command, Tag
from .server import answer_pull, apply_received, drop, receive_gradient, send_weights, stop


def follow(ps, history: list, on_update) -> list:
    """Follow the coordinator's commands until FINISH; returns the sends still going."""
    sends, late = [], []
    coordinator = f"the coordinating server (rank {ps.server})"
    while True:
        workers, (kind,) = wire.receive(ps.mpi, ps.server, Tag.COMMAND, ps.who, "the coordinator's next command",
                                        coordinator)
        workers = workers.tolist()
        if kind == Command.FINISH:
            return sends
        if kind == Command.ANSWER:
            sends.append(send_weights(ps, workers[0]))
        elif kind == Command.ANSWER_PULL:
            pull, fields = wire.receive(ps.mpi, workers[0], Tag.PUSH, ps.who, f"the rows worker {workers[0]} pulls",
                                        f"worker {workers[0]}")
            sends += answer_pull(ps, workers[0], pull, fields)
        elif kind == Command.FAIL:
            stop(ps, workers[0], wire.Incoming(ps.mpi, workers[0], Tag.PUSH), sends)
        elif kind == Command.LOST:
            survival.report(ps, *workers, started=0.0)
        elif kind == Command.DROP:
            _, step, version = receive_gradient(ps, workers[0])
            late.append(drop(ps, workers[0], step, version))
        else:
            history.append(apply_received(ps, {w: receive_gradient(ps, w) for w in workers}, tuple(late), on_update))
            late = []
        sends = survival.pending(ps, sends)
