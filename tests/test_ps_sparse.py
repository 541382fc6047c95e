"""ParameterServer's sparse rows against float64 references computed in one process: sync mode
with two servers against plain torch training on the workers' batches (SGD with momentum,
Adagrad, SparseAdam; tables with sparse=True, dense embeddings sent by rows, and the dense path),
with each worker's byte counters against the payload sizes its batches imply; the asynchronous
modes and sync mode with a backup worker against a replay of the servers' recorded updates, each
gradient recomputed on the weights of the version its worker had; bad input refused on every rank
at once.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order;
the tests whose worker stops the parameter server come last."""
import time

import numpy as np
import pytest
import torch

import mpidist as md

pytestmark = pytest.mark.mpi_shared_launch

LR, MOMENTUM = 0.1, 0.9
WORDS, BAGS, WIDTH, CLASSES = 23, 17, 4, 3
SERVERS = 2


class Model(torch.nn.Module):
    """Words through an Embedding (mean of three), bags through an EmbeddingBag, then a Linear."""

    def __init__(self, sparse):
        super().__init__()
        self.words = torch.nn.Embedding(WORDS, WIDTH, sparse=sparse)
        self.bag = torch.nn.EmbeddingBag(BAGS, WIDTH, mode="sum", sparse=sparse)
        self.out = torch.nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, words, bag):
        return self.out(torch.cat([self.words(words).mean(1), self.bag(bag)], dim=1))


def make_model(seed, sparse=True):
    torch.manual_seed(seed)
    return Model(sparse).double()


def batch(worker, step):
    generator = torch.Generator().manual_seed(1000 * worker + step)
    return (torch.randint(0, WORDS, (4, 3), generator=generator), torch.randint(0, BAGS, (4, 2), generator=generator),
            torch.randint(0, CLASSES, (4,), generator=generator))


def loss_of(model, worker, step):
    words, bag, y = batch(worker, step)
    return torch.nn.functional.cross_entropy(model(words, bag), y)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def steps_of(worker):
    return 4 + worker % 2  # workers stop at different steps


def make_optimizer(kind, model):
    if kind == "sparse_adam":  # SparseAdam takes only sparse gradients: Adam takes the Linear's
        return [torch.optim.SparseAdam([model.words.weight, model.bag.weight], lr=LR),
                torch.optim.Adam(model.out.parameters(), lr=LR)]
    if kind == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=LR)]
    return [torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)]


def train(comm, optimizer_kind="sgd", tables="sparse", slow_worker=None, slow_seconds=0.05, slow_at="pulls",
          **settings):
    """Every rank's part of one training on servers 0 and 1, `slow_worker` pausing around its
    pulls or before its push (slow_at="push"); returns (history or None, this worker's versions
    and whether each pull moved it, the final weights, the ParameterServer)."""
    model = make_model(seed=comm.rank, sparse=tables == "sparse")  # different on every rank: the chief's must win
    optimizer = make_optimizer(optimizer_kind, model) if comm.rank < SERVERS else None
    ps = md.ParameterServer(model, optimizer, comm=comm, servers=SERVERS,
                            sparse_embeddings=tables == "dense_by_rows", **settings)
    if ps.is_server:
        history, versions = ps.serve(), None
    else:
        history, versions = None, []
        for step in range(steps_of(comm.rank)):
            # The others run ahead of a slowed worker, before its first pull and between its two:
            # its pulls find newer weights, the second one after rows already pulled.
            pause = slow_seconds / 2 if comm.rank == slow_worker and slow_at == "pulls" else 0
            time.sleep(pause)
            words, bag, _ = batch(comm.rank, step)
            before = ps.version
            if tables != "dense_path":
                ps.pull_rows(model.words, words)
                time.sleep(pause)
                ps.pull_rows(model.bag, bag)
            versions.append((ps.version, ps.version != before))
            model.zero_grad()
            loss_of(model, comm.rank, step).backward()
            if comm.rank == slow_worker and slow_at == "push":
                time.sleep(slow_seconds)  # computes on its weights while the others move on
            ps.step()
        ps.close()
    final = flat(model)
    expected = final.clone()
    comm.broadcast(expected, root=ps.server)
    assert torch.equal(final, expected), "every rank ends with the server's weights"
    return history, versions, final, ps


def one_process_training(workers, chief, optimizer_kind, tables):
    """Step k averages the losses of the workers that have a step k."""
    model = make_model(chief, sparse=tables == "sparse")
    optimizers = make_optimizer(optimizer_kind, model)
    for step in range(max(steps_of(w) for w in workers)):
        present = [w for w in workers if step < steps_of(w)]
        model.zero_grad()
        (sum(loss_of(model, w, step) for w in present) / len(present)).backward()
        for optimizer in optimizers:
            optimizer.step()
    return flat(model)


def expected_bytes(worker, tables, numel):
    """(pushed, pulled) payload bytes of `worker`'s training: each step the ids it pulls, the
    rows they bring, its gradient's rows (the same ids: every id used has a gradient row), and
    the dense gradient and weights; at close the whole final model."""
    dense = numel if tables == "dense_path" else 2 * WIDTH * CLASSES + CLASSES
    pushed = pulled = 0
    for step in range(steps_of(worker)):
        pushed, pulled = pushed + 8 * dense, pulled + 8 * dense
        if tables != "dense_path":
            rows = sum(ids.unique().numel() for ids in batch(worker, step)[:2])
            pushed += 8 * rows + 8 * rows * (1 + WIDTH)  # the pulls' ids; the gradient's indices and rows
            pulled += 8 * rows * WIDTH
    return pushed, pulled + 8 * numel


@pytest.mark.mpi(ranks=[5])
@pytest.mark.parametrize("tables, optimizer_kind", [
    ("sparse", "sgd"), ("sparse", "adagrad"), ("sparse", "sparse_adam"), ("dense_by_rows", "sgd"),
    ("dense_by_rows", "adagrad"), ("dense_path", "sgd"),
])
def test_sync_mode_is_one_process_training(mpi_world, tables, optimizer_kind):
    """Two servers and three workers train as one process does on the workers' batches (a dense
    embedding sent by rows gets sparse updates, which for SGD and Adagrad are the dense ones), and
    each worker's byte counters add up to the payloads of its pulls, gradients and weights."""
    comm = mpi_world
    workers = list(range(SERVERS, comm.size))
    history, versions, final, ps = train(comm, optimizer_kind, tables)
    assert [t.name for t in ps.tables] == ([] if tables == "dense_path" else ["words.weight", "bag.weight"])
    assert [t.bounds for t in ps.tables] == ([] if tables == "dense_path" else [[0, 11, 23], [0, 8, 17]])
    histories = comm.mpi.gather(history, root=0)
    if comm.rank == 0:
        assert histories[:SERVERS] == [history] * SERVERS
        torch.testing.assert_close(final, one_process_training(workers, workers[0], optimizer_kind, tables),
                                   rtol=1e-12, atol=1e-14)
    elif comm.rank in workers:
        assert versions == [(step, False) for step in range(steps_of(comm.rank))], "sync: one version per step"
        assert (ps.bytes_pushed, ps.bytes_pulled) == expected_bytes(comm.rank, tables, final.numel())


def replay(history, chief, optimizer_kind, staleness_lr):
    """The servers' updates recomputed in one process: each gradient on the weights of the
    version it names, the mean given to torch's optimizer (sparse for the tables)."""
    model = make_model(chief)
    optimizers = make_optimizer(optimizer_kind, model)
    weights = [flat(model)]  # by version
    probe = make_model(chief)
    for index, update in enumerate(history):
        assert update.version == index + 1
        gradients = []
        for worker, step, version in update.gradients:
            assert 0 <= version <= index, "a gradient computed on weights the servers had made"
            torch.nn.utils.vector_to_parameters(weights[version], probe.parameters())
            probe.zero_grad()
            loss_of(probe, worker, step).backward()
            gradients.append([p.grad for p in probe.parameters()])
        staleness = float(np.mean([index - version for _, _, version in update.gradients]))
        assert update.staleness == staleness
        scale = 1.0 / max(1.0, staleness) if staleness_lr else 1.0
        for param, grads in zip(model.parameters(), zip(*gradients)):
            param.grad = sum(grads[1:], grads[0].clone()) / len(grads)
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = LR * scale
            optimizer.step()
        weights.append(flat(model))
    return weights


@pytest.mark.mpi(ranks=[6])  # two servers; 2-softsync takes 2 gradients per update from 4 workers
@pytest.mark.parametrize("configuration", [
    dict(mode="async", staleness_lr=True, slow_worker=2),
    dict(mode="async", max_staleness=1, slow_worker=5, optimizer_kind="adagrad"),
    dict(mode="softsync", softsync=2, staleness_lr=True, slow_worker=3, optimizer_kind="sparse_adam"),
], ids=["async_staleness_lr", "async_max_staleness_1", "softsync"])
def test_asynchronous_modes_replay(mpi_world, configuration):
    """The versions each worker computed on are those the servers recorded, and a replay of the
    recorded updates gives the final weights; the slowed worker's pulls find newer weights,
    which it takes with its rows."""
    comm = mpi_world
    workers = list(range(SERVERS, comm.size))
    history, versions, final, ps = train(comm, **configuration)
    gathered = comm.mpi.gather(versions, root=0)
    histories = comm.mpi.gather(history, root=0)
    if comm.rank != 0:
        return
    assert histories[:SERVERS] == [history] * SERVERS, "every server applied the same updates"
    for worker in workers:
        steps = [step for update in history for w, step, _ in update.gradients if w == worker]
        assert steps == list(range(steps_of(worker)))
        recorded = [v for u in history for w, _, v in u.gradients if w == worker]
        assert [version for version, _ in gathered[worker]] == recorded
    limit = 1 if configuration["mode"] == "async" else (comm.size - SERVERS) // configuration["softsync"]
    assert all(1 <= len(u.gradients) <= limit for u in history)
    assert any(moved for moved in (m for _, m in gathered[configuration["slow_worker"]])), \
        f"the slowed worker's pulls never found newer weights: {gathered}"
    weights = replay(history, workers[0], configuration.get("optimizer_kind", "sgd"),
                     configuration.get("staleness_lr", False))
    torch.testing.assert_close(final, weights[-1], rtol=1e-12, atol=1e-14)


@pytest.mark.mpi(ranks=[6])
def test_backup_workers_drop_late_sparse_gradients(mpi_world):
    """Sync mode with one backup worker among four: each update takes the first three gradients
    of its step; the gradients the slowed worker computes while the others move on are dropped and
    counted on every server, and the applied ones replay to the final weights. (A worker slow
    before its pulls is not late: the pulls bring it the current weights.)"""
    comm = mpi_world
    workers = list(range(SERVERS, comm.size))
    slow = workers[-1]
    history, _, final, ps = train(comm, "adagrad", mode="sync", backup_workers=1, slow_worker=slow, slow_seconds=0.5,
                                  slow_at="push")
    dropped = comm.mpi.gather(ps.dropped if ps.is_server else None, root=0)
    histories = comm.mpi.gather(history, root=0)
    if comm.rank != 0:
        return
    assert histories[:SERVERS] == [history] * SERVERS and dropped[:SERVERS] == [ps.dropped] * SERVERS
    assert all(1 <= len(u.gradients) <= len(workers) - 1 and u.staleness == 0 for u in history), history
    assert any(worker == slow for worker, _, _ in ps.dropped), f"the slowed worker is never late: {history}"
    for worker in workers:  # every step either applied or dropped, once
        applied = [step for u in history for w, step, _ in u.gradients if w == worker]
        late = [step for w, step, _ in ps.dropped if w == worker]
        assert sorted(applied + late) == list(range(steps_of(worker))), (worker, applied, late)
    weights = replay(history, workers[0], "adagrad", staleness_lr=False)
    torch.testing.assert_close(final, weights[-1], rtol=1e-12, atol=1e-14)


def optimizer_over(model, kind):
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=LR)
    if kind == "sgd_weight_decay":
        return torch.optim.SGD(model.parameters(), lr=LR, weight_decay=0.01)
    return torch.optim.SGD(model.out.parameters(), lr=LR)  # leaves the tables out


@pytest.mark.mpi(ranks=[5])
@pytest.mark.parametrize("kind, refusal", [
    ("adam", r"the server \(rank 0\): the optimizer Adam cannot apply a sparse gradient, which the sparse table "
             r"words.weight sends \(RuntimeError: Adam does not support sparse gradients"),
    ("sgd_weight_decay", r"the server \(rank 0\): the optimizer SGD cannot apply a sparse gradient, which the sparse "
                         r"table words.weight sends"),
    ("tables_left_out", r"the server \(rank 0\): no optimizer of the server holds the sparse table words.weight"),
])
def test_an_optimizer_that_cannot_apply_sparse_gradients_is_refused_everywhere(mpi_world, kind, refusal):
    model = make_model(0)
    with pytest.raises(md.InvalidArgumentError, match=refusal):
        md.ParameterServer(model, optimizer_over(model, kind) if mpi_world.rank < SERVERS else None,
                           comm=mpi_world, servers=SERVERS)


def pull_outside_the_model(ps, model, words, bag):
    ps.pull_rows(torch.nn.Embedding(WORDS, WIDTH, sparse=True), words)


def pull_out_of_range(ps, model, words, bag):
    ps.pull_rows(model.words, words + WORDS - 1)


def forget_a_table(ps, model, words, bag):
    ps.pull_rows(model.words, words)


# Last of the launch: a worker's bad input stops the parameter server on every rank, leaving
# some of its messages unmatched.
@pytest.mark.mpi(ranks=[5])
@pytest.mark.parametrize("bad_step, refusal", [
    (pull_outside_the_model, r"pull_rows\(\) on a Embedding that is no table of this parameter server's model; its "
                             r"tables .*: Embedding words, EmbeddingBag bag"),
    (pull_out_of_range, r"pull_rows\(words.weight\): ids \[\d+(, \d+)*\] out of range: the table has rows 0..22"),
    (forget_a_table, r"the gradient of the sparse table bag.weight has rows that were not pulled in this step"),
], ids=["module_not_in_the_model", "ids_out_of_range", "rows_not_pulled"])
def test_bad_input_of_one_worker_stops_every_rank(mpi_world, bad_step, refusal):
    """The last worker goes wrong at its second step: it raises, and so does every other rank,
    naming that worker and its error."""
    comm = mpi_world
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR) if comm.rank < SERVERS else None
    ps = md.ParameterServer(model, optimizer, comm=comm, servers=SERVERS, mode="async")
    culprit = comm.size - 1
    named = refusal if comm.rank == culprit else rf"worker {culprit} stopped the parameter server: {refusal}"
    with pytest.raises(md.InvalidArgumentError, match=named):
        if ps.is_server:
            ps.serve()
        for step in range(100):  # the others train until they hear of it
            words, bag, _ = batch(comm.rank, step)
            if comm.rank == culprit and step == 1:
                bad_step(ps, model, words, bag)
            else:
                ps.pull_rows(model.words, words)
                ps.pull_rows(model.bag, bag)
            model.zero_grad()
            loss_of(model, comm.rank, step).backward()
            ps.step()
