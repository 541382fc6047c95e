"""ParameterServer against float64 references computed in one process: synchronous mode against
plain synchronous SGD on the workers' batches; the asynchronous modes against a replay of the
server's updates (each gradient recomputed on the weights of the version its worker had), with
the rules of each mode checked on the updates: one gradient per update (async), at most
workers // n (n-softsync), the stale-synchronous bound, every worker's steps once and in order.

All checks of one world size run in one launch (each launch starts every rank's interpreter)."""
import re
import time

import numpy as np
import pytest
import torch

import mpidist as md

LR, MOMENTUM = 0.1, 0.9


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def batch(worker, step):
    generator = torch.Generator().manual_seed(1000 * worker + step)
    return (torch.randn(4, 5, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (4,), generator=generator))


def loss_of(model, worker, step):
    x, y = batch(worker, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def steps_of(worker):
    return 4 + worker % 2  # workers stop at different steps


def run(comm, mode="sync", softsync=None, max_staleness=None, staleness_lr=False, server=0, slow_worker=None):
    """Every rank's part of one training; returns (history or None, this worker's versions)."""
    model = make_model(seed=comm.rank)  # different on every rank: the chief's must win
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM) if comm.rank == server else None
    ps = md.ParameterServer(model, optimizer, comm=comm, mode=mode, softsync=softsync,
                            max_staleness=max_staleness, staleness_lr=staleness_lr, server=server)
    assert ps.is_chief == (comm.rank == min(r for r in range(comm.size) if r != server))
    if ps.is_server:
        history, versions = ps.serve(), None
    else:
        history, versions = None, []
        for step in range(steps_of(comm.rank)):
            if comm.rank == slow_worker:
                time.sleep(0.02)  # lets the other workers run ahead, unless a bound holds them
            model.zero_grad()
            loss_of(model, comm.rank, step).backward()
            versions.append(ps.version)
            ps.step()
        ps.close()
    final = flat(model)
    expected = final.clone()
    comm.broadcast(expected, root=server)
    assert torch.equal(final, expected), "every rank ends with the server's weights"
    return history, versions, final, ps


def sync_reference(workers, chief):
    """Synchronous SGD: step k averages the gradients of the workers that have a step k."""
    model = make_model(chief)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(max(steps_of(w) for w in workers)):
        present = [w for w in workers if step < steps_of(w)]
        optimizer.zero_grad()
        (sum(loss_of(model, w, step) for w in present) / len(present)).backward()
        optimizer.step()
    return flat(model)


def replay(history, workers, chief, staleness_lr):
    """The server's updates recomputed: each gradient on the weights of the version it names."""
    model = make_model(chief)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    weights = [flat(model)]  # by version
    probe = make_model(chief)
    for index, update in enumerate(history):
        assert update.version == index + 1
        gradients = []
        for worker, step, version in update.gradients:
            assert 0 <= version <= index, "a gradient computed on weights the server had made"
            torch.nn.utils.vector_to_parameters(weights[version], probe.parameters())
            probe.zero_grad()
            loss_of(probe, worker, step).backward()
            gradients.append(torch.cat([p.grad.reshape(-1) for p in probe.parameters()]))
        staleness = float(np.mean([index - version for _, _, version in update.gradients]))
        assert update.staleness == staleness
        scale = 1.0 / max(1.0, staleness) if staleness_lr else 1.0
        assert update.lr_scale == scale
        mean = sum(gradients[1:], gradients[0].clone()) / len(gradients)
        for param, part in zip(model.parameters(), mean.split([p.numel() for p in model.parameters()])):
            param.grad = part.view_as(param).clone()
        optimizer.param_groups[0]["lr"] = LR * scale
        optimizer.step()
        weights.append(flat(model))
    return weights


def check_every_step_once_in_order(history, workers):
    for worker in workers:
        steps = [step for update in history for w, step, _ in update.gradients if w == worker]
        assert steps == list(range(steps_of(worker))), f"worker {worker}'s gradients: {steps}"


def check_stale_synchronous_bound(history, workers, bound):
    """Async mode applies a gradient on arrival, so a worker given version v for step k had seen
    every other worker push at least min(k - bound, its steps) gradients, all in updates < v."""
    for update in history:
        for worker, step, version in update.gradients:
            for other in workers:
                if other != worker:
                    applied = sum(w == other for u in history[:version] for w, _, _ in u.gradients)
                    assert applied >= min(step - bound, steps_of(other)), (
                        f"worker {worker} ran step {step} on version {version}, when worker {other} had "
                        f"{applied} gradients applied (bound {bound})")


def check_modes(comm):
    server, workers = 0, list(range(1, comm.size))
    chief = workers[0]
    # Synchronous: synchronous SGD on the workers' batches, on either end of the ranks.
    for server in (0, comm.size - 1):
        workers = [r for r in range(comm.size) if r != server]
        history, versions, final, _ = run(comm, "sync", server=server)
        if comm.rank == server:
            torch.testing.assert_close(final, sync_reference(workers, min(workers)), rtol=1e-12, atol=1e-14)
            assert all(u.staleness == 0 for u in history)
            check_every_step_once_in_order(history, workers)
        else:
            assert versions == list(range(steps_of(comm.rank))), "sync: step k on the weights of update k"
    server, workers = 0, list(range(1, comm.size))
    configurations = [dict(mode="async", staleness_lr=True, slow_worker=chief),
                      dict(mode="async", max_staleness=1, slow_worker=chief),
                      dict(mode="async", max_staleness=0, staleness_lr=True, slow_worker=workers[-1])]
    if len(workers) >= 4:
        configurations.append(dict(mode="softsync", softsync=2, max_staleness=1, staleness_lr=True, slow_worker=chief))
    for configuration in configurations:
        history, versions, final, ps = run(comm, **configuration)
        gathered = comm.mpi.gather(versions, root=server)
        if comm.rank != server:
            continue
        where = str(configuration)
        check_every_step_once_in_order(history, workers)
        for worker in workers:  # each worker computed on the versions the server recorded
            recorded = [v for u in history for w, _, v in u.gradients if w == worker]
            assert gathered[worker] == recorded, where
        limit = 1 if configuration["mode"] == "async" else len(workers) // configuration["softsync"]
        assert all(1 <= len(u.gradients) <= limit for u in history), where
        if configuration["mode"] == "async" and "max_staleness" in configuration:
            check_stale_synchronous_bound(history, workers, configuration["max_staleness"])
        weights = replay(history, workers, chief, configuration.get("staleness_lr", False))
        torch.testing.assert_close(final, weights[-1], rtol=1e-12, atol=1e-14, msg=where)


def check_refusals(comm):
    from mpi4py import MPI
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(md.InvalidArgumentError, match="mode='bogus'"):
        md.ParameterServer(model, optimizer, mode="bogus")
    with pytest.raises(md.InvalidArgumentError, match="softsync=n goes with mode='softsync'"):
        md.ParameterServer(model, optimizer, mode="async", softsync=2)
    with pytest.raises(md.InvalidArgumentError, match="max_staleness must be None or an integer >= 0"):
        md.ParameterServer(model, optimizer, mode="async", max_staleness=-1)
    with pytest.raises(md.InvalidArgumentError, match="at least 2 ranks"):
        md.ParameterServer(model, optimizer, comm=md.Communicator(MPI.COMM_SELF))
    # Settings that differ between ranks fail on every rank, before anything moves.
    last = comm.rank == comm.size - 1
    uneven = torch.nn.Linear(5, 4 if last else 3).double()
    with pytest.raises(md.MismatchError, match=r"disagree on parameters: .*rank 0: 18"):
        md.ParameterServer(uneven, torch.optim.SGD(uneven.parameters(), lr=LR))
    with pytest.raises(md.MismatchError, match="disagree on mode: .*async"):
        md.ParameterServer(model, optimizer, mode="async" if last else "sync")
    with pytest.raises(md.InvalidArgumentError, match=r"server \(rank 0\) was given no optimizer"):
        md.ParameterServer(model, None)
    with pytest.raises(md.InvalidArgumentError, match="version must be an integer >= 0"):
        md.ParameterServer(model, optimizer, version=-1)
    with pytest.raises(md.MismatchError, match="disagree on starting version: .*rank 0: 0"):
        md.ParameterServer(model, optimizer, version=5 if last else 0)
    # Calls on the wrong side, and after close().
    ps = md.ParameterServer(model, optimizer)
    if ps.is_server:
        with pytest.raises(md.InvalidArgumentError, match="step\\(\\) runs on workers"):
            ps.step()
        ps.serve()
    else:
        with pytest.raises(md.InvalidArgumentError, match="serve\\(\\) runs on the server"):
            ps.serve()
        ps.close()
        with pytest.raises(md.InvalidArgumentError, match="after close"):
            ps.step()


def check_resumed_versions_and_the_update_hook(comm):
    """A server started at version 7 (resumed weights) numbers its updates on from there, and
    staleness counts from there too; on_update sees each update as it is applied."""
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ps = md.ParameterServer(model, optimizer, mode="async", version=7)
    if ps.is_server:
        seen, start = [], flat(model)
        history = ps.serve(on_update=lambda update: seen.append((update, flat(model))))
        assert [update for update, _ in seen] == history
        assert [u.version for u in history] == list(range(8, 8 + len(ps.workers)))
        assert history[0].gradients[0][2] == 7 and history[0].staleness == 0
        assert not torch.equal(seen[0][1], start)  # the module held the update's weights
        assert torch.equal(seen[-1][1], flat(model))
    else:
        assert ps.version == 7
        model.zero_grad()
        loss_of(model, comm.rank, 0).backward()
        ps.step()
        assert ps.version >= 8
        ps.close()
    assert ps.version == 7 + comm.size - 1  # every rank ends with the final weights' version


def check_a_worker_that_never_closes(comm, monkeypatch):
    """Nobody waits forever: the server gives up after MPIDIST_TIMEOUT, and so does the worker
    waiting for the final weights it will never get."""
    monkeypatch.setenv("MPIDIST_TIMEOUT", "2")
    model = make_model(0)
    ps = md.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=LR))
    if ps.is_server:
        workers = list(range(1, comm.size))
        with pytest.raises(md.DeadlineError, match=re.escape(f"no answer from workers {workers}. A worker that stops "
                                                             "training must call close()")) as excinfo:
            ps.serve()
        assert excinfo.value.peers == tuple(workers)
    else:
        loss_of(model, comm.rank, 0).backward()
        ps.step()
        time.sleep(4)  # stops without close() for longer than the server waits
        with pytest.raises(md.DeadlineError, match=r"rank \d+ \(a worker\): the weights from the server did not "
                                                   r"complete within 2 s .* no answer from the server \(rank 0\)") as excinfo:
            ps.close()
        assert excinfo.value.peers == (0,)


@pytest.mark.mpi(ranks=[2, 3, 5])
def test_parameter_server(mpi_ranks, mpi_world, monkeypatch):
    comm = md.init()
    check_modes(comm)
    check_refusals(comm)
    check_resumed_versions_and_the_update_hook(comm)
    if comm.size == 2:
        check_a_worker_that_never_closes(comm, monkeypatch)
