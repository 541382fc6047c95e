"""The coordinating server's loop: receive the workers' messages, feed them to the update policy
(policy.py), carry out its decisions on this server's range and tell the other servers each one
in order (follower.py), so that every server applies the same updates and answers the same
workers after the same updates.
"""
from __future__ import annotations

import time

from mpi4py import MPI

from ...runtime import wire
from ...runtime.deadlines import wait_until
from . import survival
from .policy import Kind, Policy
from .protocol import Command, DiedHeader, DoneHeader, FailedHeader, Order, PullHeader, Tag, decode_push, order_of
from .roles import ServerRole
from .server import answer_pull, apply, command, drop, receive_gradient, send_weights, stop


def coordinate(role: ServerRole, history: list, on_update) -> list:
    """Serve until every worker has closed; returns the sends still going."""
    rules, mpi = role.settings, role.endpoint.mpi
    policy = Policy(rules.workers, rules.per_update, rules.max_staleness, rules.staleness_lr, rules.backup_workers,
                    role.version)
    receives = {w: wire.Incoming(mpi, w, Tag.PUSH) for w in rules.workers}
    # The other servers send the coordinator nothing but the failure of their update.
    role.failures = {s: wire.Incoming(mpi, s, Tag.PUSH) for s in rules.servers[1:]}
    gradients = {}  # worker -> its server.Gradient, waiting for an update
    sends = []
    started = time.time()
    while not policy.finished:
        worker = next_message(role, receives)
        incoming = receives.get(worker) or role.failures[worker]
        header = decode_push(incoming.fields)
        decisions = []
        if isinstance(header, (DoneHeader, DiedHeader)):
            del receives[worker]
            decisions = policy.done(worker) if isinstance(header, DoneHeader) else policy.died(worker)
            gradients.pop(worker, None)
        elif isinstance(header, FailedHeader):
            stop(role, worker, incoming, sends)
        elif isinstance(header, PullHeader):
            sends += take_pull(role, worker, incoming, header, receives)
        else:
            gradient = rest_of_message(role, worker, receives, lambda: receive_gradient(role, worker, incoming))
            if gradient is None:
                continue
            role.stopping |= bool(header.stop)  # the worker asks every worker to stop
            receives[worker] = wire.Incoming(mpi, worker, Tag.PUSH)
            gradients[worker] = gradient
            decisions = policy.gradient(*gradient.stamp)
        for decision in decisions:
            sends += carry_out(role, decision, gradients, history, on_update, started)
        sends = survival.pending(role, sends)
    return sends + command(role, Order(Command.FINISH))


def carry_out(role: ServerRole, decision, gradients: dict, history: list, on_update, started: float) -> list:
    """Do one decision of the policy here and command it to the other servers."""
    worker = decision.workers[0]
    sends = command(role, order_of(decision))
    if decision.kind == Kind.APPLY:
        arrived = [gradients.pop(stamp.worker) for stamp in decision.update.gradients]
        history.append(apply(role, arrived, decision.update, on_update))
    elif decision.kind == Kind.DROP:
        gradients.pop(worker)
        drop(role, decision.dropped)
    elif decision.kind == Kind.ANSWER:
        sends.append(send_weights(role, worker))
    else:
        survival.report(role, worker, decision.steps, started)
    return sends


def take_pull(role: ServerRole, worker: int, incoming: wire.Incoming, header: PullHeader, receives: dict) -> list:
    """Answer a worker's pull of rows, and command the other servers to answer it too."""
    pull = rest_of_message(role, worker, receives, lambda: incoming.receive_payload(
        role.endpoint.who, f"the rows worker {worker} pulls", f"worker {worker}"))
    if pull is None:
        return []
    receives[worker] = wire.Incoming(role.endpoint.mpi, worker, Tag.PUSH)
    return command(role, Order(Command.ANSWER_PULL, (worker,))) + answer_pull(role, worker, pull, header)


def next_message(role: ServerRole, receives: dict) -> int:
    """The rank whose header arrived first among the pending receives (the workers', and the
    other servers' failures), or a worker that died (its receive replaced by a survival.Death)
    when the parameter server goes on without it."""
    died = [w for w, incoming in receives.items() if isinstance(incoming, survival.Death)]
    if died:
        return died[0]
    pending = {**receives, **role.failures}
    ranks = list(pending)
    requests = [pending[r].request for r in ranks]
    workers = [r for r in ranks if r not in role.settings.servers]
    found = []

    def arrived():
        index, flag = MPI.Request.Testany(requests)
        if flag:
            found.append(ranks[index])
        return flag

    try:
        wait_until(arrived, role.endpoint.who, "the wait for a message from the workers", f"workers {workers}",
                   peers=workers, advice="A worker that stops training must call close()")
    except Exception as error:
        died = survival.dead_workers(role, error, receives)
        for worker in died:
            receives[worker] = survival.Death()
        return died[0]
    return found[0]


def rest_of_message(role: ServerRole, worker: int, receives: dict, receive):
    """receive(): the rest of a worker's message, whose header has come. None when the worker
    died in the middle of it and the parameter server goes on without it: its receive is then
    a survival.Death, taken as its death at the next wait (the other servers had no command to
    take its message yet, so they drop it together)."""
    try:
        return receive()
    except Exception as error:
        for dead in survival.dead_workers(role, error, [worker]):
            receives[dead] = survival.Death()
        return None
