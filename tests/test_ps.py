"""ParameterServer against float64 references computed in one process: synchronous mode against
plain synchronous SGD on the workers' batches; the asynchronous modes against a replay of the
server's updates (each gradient recomputed on the weights of the version its worker had), with
the rules of each mode checked on the updates: one gradient per update (async), at most
workers // n (n-softsync), the stale-synchronous bound, every worker's steps once and in order.
The same with the model partitioned over several servers, which must all record the same
updates; and sync mode with backup workers, whose dropped gradients are checked and replayed.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order;
the worker that never closes comes last."""
import re
import time

import numpy as np
import pytest
import torch

import mpidist as md

pytestmark = pytest.mark.mpi_shared_launch

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


def make_optimizer(kind, model):
    if kind == "adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=LR)
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def run(comm, mode="sync", softsync=None, max_staleness=None, staleness_lr=False, server=0, slow_worker=None,
        servers=1, backup_workers=0, optimizer_kind="sgd", slow_seconds=0.02):
    """Every rank's part of one training; returns (history or None, this worker's versions,
    the final weights, the ParameterServer)."""
    model = make_model(seed=comm.rank)  # different on every rank: the chief's must win
    server_ranks = list(range(server, server + servers)) if isinstance(servers, int) else servers
    optimizer = make_optimizer(optimizer_kind, model) if comm.rank in server_ranks else None
    ps = md.ParameterServer(model, optimizer, comm=comm, mode=mode, softsync=softsync, max_staleness=max_staleness,
                            staleness_lr=staleness_lr, server=server, servers=servers, backup_workers=backup_workers)
    assert ps.servers == server_ranks and ps.server == server_ranks[0]
    assert ps.is_chief == (comm.rank == min(r for r in range(comm.size) if r not in server_ranks))
    if ps.is_server:
        history, versions = ps.serve(), None
    else:
        history, versions = None, []
        for step in range(steps_of(comm.rank)):
            if comm.rank == slow_worker:
                time.sleep(slow_seconds)  # lets the other workers run ahead, unless a bound holds them
            model.zero_grad()
            loss_of(model, comm.rank, step).backward()
            versions.append(ps.version)
            ps.step()
        ps.close()
    final = flat(model)
    expected = final.clone()
    comm.broadcast(expected, root=ps.server)
    assert torch.equal(final, expected), "every rank ends with the server's weights"
    return history, versions, final, ps


def sync_reference(workers, chief, optimizer_kind="sgd"):
    """Synchronous SGD: step k averages the gradients of the workers that have a step k."""
    model = make_model(chief)
    optimizer = make_optimizer(optimizer_kind, model)
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


@pytest.mark.mpi(ranks=[2, 3, 5])
@pytest.mark.parametrize("server_is_last", [False, True], ids=["server_first", "server_last"])
def test_sync_mode_is_synchronous_sgd(mpi_world, server_is_last):
    """Synchronous SGD on the workers' batches, with the server on either end of the ranks."""
    comm = mpi_world
    server = comm.size - 1 if server_is_last else 0
    workers = [r for r in range(comm.size) if r != server]
    history, versions, final, _ = run(comm, "sync", server=server)
    if comm.rank == server:
        torch.testing.assert_close(final, sync_reference(workers, min(workers)), rtol=1e-12, atol=1e-14)
        assert all(u.staleness == 0 for u in history)
        check_every_step_once_in_order(history, workers)
    else:
        assert versions == list(range(steps_of(comm.rank))), "sync: step k on the weights of update k"


def check_asynchronous_training(comm, configuration):
    """`configuration` (run's arguments) on servers 0 .. servers - 1: the versions each worker
    computed on, the gradients per update, the stale-synchronous bound, and a replay of the
    server's updates, which every server recorded alike."""
    servers = configuration.get("servers", 1)
    server, workers = 0, list(range(servers, comm.size))
    chief = workers[0]
    history, versions, final, ps = run(comm, **configuration)
    gathered = comm.mpi.gather(versions, root=server)
    histories = comm.mpi.gather(history, root=server)
    if comm.rank != server:
        return
    assert histories[:servers] == [history] * servers, "every server applied the same updates"
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


@pytest.mark.mpi(ranks=[2, 3, 5])
@pytest.mark.parametrize("configuration, slow", [
    (dict(mode="async", staleness_lr=True), "chief"),
    (dict(mode="async", max_staleness=1), "chief"),
    (dict(mode="async", max_staleness=0, staleness_lr=True), "last worker"),
], ids=["staleness_lr", "max_staleness_1", "max_staleness_0_staleness_lr"])
def test_async_mode(mpi_world, configuration, slow):
    slow_worker = 1 if slow == "chief" else mpi_world.size - 1  # the server is rank 0
    check_asynchronous_training(mpi_world, dict(configuration, slow_worker=slow_worker))


@pytest.mark.mpi(ranks=[5])  # 2-softsync takes 2 gradients per update from 4 workers
def test_softsync_mode(mpi_world):
    check_asynchronous_training(mpi_world, dict(mode="softsync", softsync=2, max_staleness=1, staleness_lr=True,
                                                slow_worker=1))


def one_rank_world():
    from mpi4py import MPI
    return md.Communicator(MPI.COMM_SELF)


def uneven_model(last):
    model = torch.nn.Linear(5, 4 if last else 3).double()
    return model, torch.optim.SGD(model.parameters(), lr=LR)


# Each builds a ParameterServer from (model, optimizer, whether this rank is the last); settings
# that differ between ranks fail on every rank, before anything moves.
@pytest.mark.mpi(ranks=[2, 3, 5])
@pytest.mark.parametrize("construct, error, refusal", [
    (lambda model, optimizer, last: md.ParameterServer(model, optimizer, mode="bogus"),
     md.InvalidArgumentError, "mode='bogus'"),
    (lambda model, optimizer, last: md.ParameterServer(model, optimizer, mode="async", softsync=2),
     md.InvalidArgumentError, "softsync=n goes with mode='softsync'"),
    (lambda model, optimizer, last: md.ParameterServer(model, optimizer, mode="async", max_staleness=-1),
     md.InvalidArgumentError, "max_staleness must be None or an integer >= 0"),
    (lambda model, optimizer, last: md.ParameterServer(model, optimizer, comm=one_rank_world()),
     md.InvalidArgumentError, "at least 2 ranks"),
    (lambda model, optimizer, last: md.ParameterServer(*uneven_model(last)),
     md.MismatchError, r"disagree on parameters: .*rank 0: 18"),
    (lambda model, optimizer, last: md.ParameterServer(model, optimizer, mode="async" if last else "sync"),
     md.MismatchError, "disagree on mode: .*async"),
    (lambda model, optimizer, last: md.ParameterServer(model, None),
     md.InvalidArgumentError, r"server \(rank 0\) was given no optimizer"),
    (lambda model, optimizer, last: md.ParameterServer(model, optimizer, version=-1),
     md.InvalidArgumentError, "version must be an integer >= 0"),
    (lambda model, optimizer, last: md.ParameterServer(model, optimizer, version=5 if last else 0),
     md.MismatchError, "disagree on starting version: .*rank 0: 0"),
], ids=["unknown_mode", "softsync_without_its_mode", "negative_max_staleness", "one_rank", "parameters_differ",
        "modes_differ", "no_optimizer_on_the_server", "negative_version", "starting_versions_differ"])
def test_refusals(mpi_world, construct, error, refusal):
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(error, match=refusal):
        construct(model, optimizer, mpi_world.rank == mpi_world.size - 1)


@pytest.mark.mpi(ranks=[2, 3, 5])
def test_calls_on_the_wrong_side_and_after_close_are_refused(mpi_world):
    model = make_model(0)
    ps = md.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=LR))
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


@pytest.mark.mpi(ranks=[2, 3, 5])
def test_resumed_versions_and_the_update_hook(mpi_world):
    """A server started at version 7 (resumed weights) numbers its updates on from there, and
    staleness counts from there too; on_update sees each update as it is applied."""
    comm = mpi_world
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


@pytest.mark.mpi(ranks=[4, 5])
@pytest.mark.parametrize("optimizer_kind", ["sgd", "adagrad"])
def test_sharded_sync_mode_is_synchronous_sgd(mpi_world, optimizer_kind):
    """Two servers (and, with 5 ranks, three given as a list with the coordinator last, which
    cuts a weight matrix into row ranges) apply synchronous SGD as one process does."""
    comm = mpi_world
    servers = 2 if comm.size == 4 else [4, 0, 2]
    server_ranks = [0, 1] if comm.size == 4 else servers
    workers = [r for r in range(comm.size) if r not in server_ranks]
    history, versions, final, ps = run(comm, "sync", servers=servers, optimizer_kind=optimizer_kind)
    assert ps.ranges[0][0] == 0 and ps.ranges[-1][1] == ps.numel
    assert [start for start, _ in ps.ranges[1:]] == [end for _, end in ps.ranges[:-1]]
    if comm.size == 5:
        assert ps.ranges[1][0] == 20, "the first weight matrix (7 rows of 5) cut after its 4th row"
    histories = comm.mpi.gather(history, root=ps.server)
    if comm.rank == ps.server:
        assert [histories[r] for r in server_ranks] == [history] * len(server_ranks)
        torch.testing.assert_close(final, sync_reference(workers, min(workers), optimizer_kind), rtol=1e-12,
                                   atol=1e-14)
        check_every_step_once_in_order(history, workers)
    elif comm.rank in workers:
        assert versions == list(range(steps_of(comm.rank))), "sync: step k on the weights of update k"


@pytest.mark.mpi(ranks=[6])  # two servers; 2-softsync takes 2 gradients per update from 4 workers
@pytest.mark.parametrize("configuration", [
    dict(mode="async", staleness_lr=True, slow_worker=2),
    dict(mode="async", max_staleness=1, slow_worker=5),
    dict(mode="softsync", softsync=2, max_staleness=1, staleness_lr=True, slow_worker=2),
], ids=["async_staleness_lr", "async_max_staleness_1", "softsync"])
def test_sharded_asynchronous_modes(mpi_world, configuration):
    check_asynchronous_training(mpi_world, dict(configuration, servers=2))


@pytest.mark.mpi(ranks=[5])
@pytest.mark.parametrize("servers", [1, 2])
def test_backup_workers_drop_late_gradients(mpi_world, servers):
    """Sync mode with one backup worker (among four workers, or three beside two servers): each
    update takes the first gradients but one of its step; the slowed worker's late ones are
    dropped and counted, and the applied ones replay to the final weights."""
    comm = mpi_world
    workers = list(range(servers, comm.size))
    slow = workers[-1]
    history, _, final, ps = run(comm, "sync", servers=servers, backup_workers=1, slow_worker=slow, slow_seconds=0.5)
    dropped = comm.mpi.gather(ps.dropped if ps.is_server else None, root=0)
    histories = comm.mpi.gather(history, root=0)
    if comm.rank != 0:
        return
    assert histories[:servers] == [history] * servers and dropped[:servers] == [ps.dropped] * servers
    assert all(1 <= len(u.gradients) <= len(workers) - 1 and u.staleness == 0 for u in history), history
    assert [d for u in history for d in u.dropped] == ps.dropped[:len([d for u in history for d in u.dropped])]
    assert any(worker == slow for worker, _, _ in ps.dropped), f"the slowed worker is never late: {history}"
    for worker in workers:  # every step either applied or dropped, once
        applied = [step for u in history for w, step, _ in u.gradients if w == worker]
        late = [step for w, step, _ in ps.dropped if w == worker]
        assert sorted(applied + late) == list(range(steps_of(worker))), (worker, applied, late)
    weights = replay(history, workers, workers[0], staleness_lr=False)
    torch.testing.assert_close(final, weights[-1], rtol=1e-12, atol=1e-14)


class Table(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))


# Layouts the ranks disagree on fail on every rank, before anything moves.
@pytest.mark.mpi(ranks=[3, 5])
@pytest.mark.parametrize("construct, error, refusal", [
    (lambda last: md.ParameterServer(Table((6, 4)), servers=2 if last else 1),
     md.MismatchError, r"disagree on servers: rank 0: 1; .*: 2"),
    (lambda last: md.ParameterServer(Table((4, 6) if last else (6, 4)), servers=2),
     md.MismatchError, "disagree on layout"),
    (lambda last: md.ParameterServer(Table((6, 4)), servers=[0, 1] if last else [1, 0]),
     md.MismatchError, "disagree on server: rank 0: 1"),
    (lambda last: md.ParameterServer(Table((6, 4)), mode="sync", backup_workers=1 if last else 0),
     md.MismatchError, "disagree on backup_workers: .*: 1"),
    (lambda last: md.ParameterServer(Table((6, 4)), servers=[0, 0]),
     md.InvalidArgumentError, "the servers must be distinct ranks"),
    (lambda last: md.ParameterServer(Table((6, 4)), servers=[1], server=1),
     md.InvalidArgumentError, "give only servers="),
    (lambda last: md.ParameterServer(Table((6, 4)), mode="async", backup_workers=1),
     md.InvalidArgumentError, "above 0 only with mode='sync'"),
    (lambda last: md.ParameterServer(Table((6, 4)), backup_workers=4),
     md.InvalidArgumentError, "leaves no gradient to apply"),
    (lambda last: md.ParameterServer(Table((1, 4)), servers=2),
     md.InvalidArgumentError, "too few to split over 2 servers"),
    (lambda last: md.ParameterServer(Table((1, 24) if last else (6, 4)), servers=2),
     md.MismatchError, "disagree on layout: .*: a model too small to split over the servers"),
], ids=["servers_differ", "layouts_differ", "coordinators_differ", "backup_workers_differ", "repeated_server",
        "server_and_list", "backup_without_sync", "too_many_backups", "too_few_rows", "too_few_rows_on_one_rank"])
def test_layout_refusals(mpi_world, construct, error, refusal):
    with pytest.raises(error, match=refusal):
        construct(mpi_world.rank == mpi_world.size - 1)


# Last of its launch: the server and the worker each give up waiting for the other, leaving this
# parameter server's messages unmatched, which a test after it could meet.
@pytest.mark.mpi(ranks=[2])
def test_a_worker_that_never_closes(mpi_world, monkeypatch):
    """Nobody waits forever: the server gives up after MPIDIST_TIMEOUT, and so does the worker
    waiting for the final weights it will never get."""
    comm = mpi_world
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
