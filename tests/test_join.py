"""Uneven inputs: DataParallel.join() (PyTorch DDP's model.join()) and hvd.join() (Horovod's),
against single-process float64 training that applies the same updates.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order;
each leaves every rank out of join() and drops what it wrapped: hvd.join() takes part for every
live DistributedOptimizer, so the tests that make one drop it even when they fail."""
import gc

import pytest
import torch
from mpi4py import MPI
from test_data_parallel import ON_NODES, assert_close_to_reference, batch, communicator, make_model, train_steps

import mpidist as md
import mpidist.torch as hvd

pytestmark = pytest.mark.mpi_shared_launch

STEPS_BY_RANK = [5, 3, 6, 2, 4]  # uneven, and the rank with the most is not always the last rank


def steps_of(rank):
    return STEPS_BY_RANK[rank]


def last_rank_to_join(size):
    steps = [steps_of(r) for r in range(size)]
    return max(r for r in range(size) if steps[r] == max(steps))


def reference_parameters(size, steps, divide_by_world_size=True, lr=0.1):
    """Float64 SGD with momentum where step t's gradient is the sum of the mean-loss gradients
    of the ranks that still have a batch at step t, divided by the world size (or by how many
    ranks have one)."""
    model = make_model().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        active = [r for r in range(size) if steps_of(r) > step]
        optimizer.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(model(x.double()), y)
                   for x, y in (batch(step, r) for r in active))
        (loss / (size if divide_by_world_size else len(active))).backward()
        optimizer.step()
    return [p.detach().float() for p in model.parameters()]


@pytest.mark.mpi(ranks=[2, 3])
@ON_NODES  # shared slots on one node; the asynchronous engine
@pytest.mark.parametrize("divide, views", [(True, False), (False, True)],
                         ids=["by_world_size_copied", "by_ranks_training_views"])
def test_data_parallel_join_matches_reference(mpi_ranks, mpi_world, monkeypatch, ranks_per_node, divide, views):
    rank, size = mpi_world.rank, mpi_ranks
    longest = max(steps_of(r) for r in range(size))
    comm = communicator(ranks_per_node, monkeypatch)
    model = make_model(seed=rank)
    ddp = md.DataParallel(model, comm=comm, bucket_mb=0.0005, gradient_as_bucket_view=views)
    with ddp.join(divide_by_initial_world_size=divide):
        train_steps(ddp, rank, steps_of(rank))
    # Every rank now holds the parameters of the rank that trained longest.
    assert_close_to_reference(list(model.parameters()), reference_parameters(size, longest, divide))
    del ddp


@pytest.mark.mpi(ranks=[2, 3])
def test_join_gives_everyone_the_last_joiners_buffers(mpi_ranks, mpi_world):
    """Buffers are broadcast while every rank trains, not once one has joined (the joined ranks
    take part in those broadcasts too: nothing hangs); at the end every rank has the buffers of
    the last rank to join."""
    rank, size = mpi_world.rank, mpi_ranks
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3))
    ddp = md.DataParallel(model)
    with ddp.join():
        train_steps(ddp, rank, steps_of(rank))
        mine = [b.clone() for b in model.buffers()]
    if rank == last_rank_to_join(size):
        for before, after in zip(mine, model.buffers()):
            assert torch.equal(before, after)
    for buffer in list(model.buffers()) + list(model.parameters()):
        gathered = MPI.COMM_WORLD.allgather(buffer.detach().numpy())
        assert all((g == gathered[0]).all() for g in gathered)
    del ddp


@pytest.mark.mpi(ranks=[2, 3])
def test_join_of_two_models(mpi_ranks, mpi_world):
    """md.Join (torch's Join context manager) over two models trained in the same loop: a rank
    that has run out shadows both models' steps, in their order."""
    rank, size = mpi_world.rank, mpi_ranks
    longest = max(steps_of(r) for r in range(size))
    first, second = make_model(seed=rank), make_model(seed=rank)
    wrapped = [md.DataParallel(first), md.DataParallel(second, bucket_mb=0.0005)]
    optimizers = [torch.optim.SGD(w.parameters(), lr=0.1, momentum=0.9) for w in wrapped]
    with md.Join(wrapped, divide_by_initial_world_size=False):
        for step in range(steps_of(rank)):
            x, y = batch(step, rank)
            for model, optimizer in zip(wrapped, optimizers):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
    for model in (first, second):
        assert_close_to_reference(list(model.parameters()), reference_parameters(size, longest, False))
    del wrapped, optimizers


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("wrap, keywords, refusal", [
    (False, {}, "non-empty list of mpidist.DataParallel"),
    (True, {"divide_by_world": True}, "unknown keyword arguments"),
], ids=["plain_module", "unknown_keyword"])
def test_join_refuses_bad_arguments(mpi_world, wrap, keywords, refusal):
    models = [make_model(seed=mpi_world.rank), make_model(seed=mpi_world.rank)]
    joinables = [md.DataParallel(models[0]), md.DataParallel(models[1], bucket_mb=0.0005)] if wrap else models[:1]
    with pytest.raises(md.InvalidArgumentError, match=refusal):
        md.Join(joinables, **keywords)
    del joinables


@pytest.mark.mpi(ranks=[2, 3])
def test_throw_on_early_termination_raises_on_every_rank(mpi_ranks, mpi_world):
    rank, size = mpi_world.rank, mpi_ranks
    first_out = min(steps_of(r) for r in range(size))
    ddp = md.DataParallel(make_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    steps_done = 0
    with pytest.raises(md.MpidistError, match="ran out of inputs"):
        with ddp.join(throw_on_early_termination=True):
            for step in range(steps_of(rank)):
                x, y = batch(step, rank)
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                optimizer.step()
                steps_done += 1
    # The ranks still training raise in the backward of the step the first rank no longer has.
    assert steps_done == min(steps_of(rank), first_out)
    # Then training goes on normally.
    train_steps(ddp, rank, 1)
    del ddp


@pytest.mark.mpi(ranks=[2, 3])
def test_join_refuses_nesting(mpi_world):
    ddp = md.DataParallel(make_model())
    with ddp.join():
        with pytest.raises(md.InvalidArgumentError, match="nested"):
            with ddp.join():
                pass
    del ddp


@pytest.mark.mpi(ranks=[2, 3])
def test_join_refuses_sync_batchnorm(mpi_world):
    model = torch.nn.Sequential(torch.nn.Linear(10, 4), md.SyncBatchNorm(4))
    ddp = md.DataParallel(model)
    with pytest.raises(md.InvalidArgumentError, match="SyncBatchNorm"):
        with ddp.join():
            pass
    del ddp


def drop(optimizers):
    """Drops the DistributedOptimizers in `optimizers` (a test's own list), for the next test's
    hvd.join(): a failed test's frame, kept with its traceback, would hold them otherwise."""
    optimizers.clear()
    gc.collect()


@pytest.mark.mpi(ranks=[2, 3])
def test_horovod_join(mpi_ranks, mpi_world):
    """Horovod's semantics: a joined rank adds zeros to the gradients and to the metrics, and the
    others still average over every rank; each rank keeps the parameters of its own last step;
    join() returns the last rank."""
    hvd.init()
    rank, size = mpi_world.rank, mpi_ranks
    optimizers = []
    try:
        for epoch in range(2):  # join() twice: the second epoch starts counting afresh
            model = make_model()
            optimizers.append(hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                                       named_parameters=model.named_parameters()))
            steps = steps_of((rank + epoch) % size)  # a different last joiner in the second epoch
            for step in range(steps):
                x, y = batch(step, (rank + epoch) % size)
                optimizers[0].zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizers[0].step()
                check_metrics_while_ranks_wait_in_join(epoch, step)
            last = hvd.join()
            assert last == max(r for r in range(size) if steps_of((r + epoch) % size) == max(STEPS_BY_RANK[:size]))
            if epoch == 0:
                assert_close_to_reference(list(model.parameters()), reference_parameters(size, steps))
            drop(optimizers)
    finally:
        drop(optimizers)


@pytest.mark.mpi(ranks=[2, 3])
def test_horovod_join_meets_the_call_checks_in_the_node_window(mpi_ranks, mpi_world):
    """test_horovod_join's first epoch once the world's and its engine's node windows exist: the
    ranks waiting in join meet the others' call checks in the window (callcheck.agreed_on_node),
    take part in their all-reduces with zeros, and are named where they cannot."""
    import numpy as np
    hvd.init()
    rank, size = mpi_world.rank, mpi_ranks
    assert (mpi_world.allreduce(np.ones(4), algorithm="hierarchical") == size).all()
    assert (mpi_world.allreduce_async(np.ones(4), algorithm="hierarchical").wait() == size).all()
    assert mpi_world.node_window is not None and mpi_world._engine.node_window is not None
    model = make_model()
    optimizers = [hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=model.named_parameters())]
    try:
        for step in range(steps_of(rank)):
            x, y = batch(step, rank)
            optimizers[0].zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizers[0].step()
            check_metrics_while_ranks_wait_in_join(0, step)
        assert hvd.join() == last_rank_to_join(size)
        assert_close_to_reference(list(model.parameters()), reference_parameters(size, steps_of(rank)))
    finally:
        drop(optimizers)


def check_metrics_while_ranks_wait_in_join(epoch, step):
    """After step `step`, every rank still training all-reduces metrics: the ranks waiting in
    join() add zeros (an average still divides by every rank, as in Horovod); collectives they
    cannot join are refused at once."""
    rank, size = hvd.rank(), hvd.size()
    training = [r for r in range(size) if steps_of((r + epoch) % size) > step]
    expected = float(sum(r + 1 for r in training))
    mine = torch.tensor([float(rank + 1), 2.0 * (rank + 1)])
    assert hvd.allreduce(mine, op=hvd.Sum, name="metric").tolist() == [expected, 2 * expected]
    average = hvd.synchronize(hvd.allreduce_async(mine[:1].double(), name="metric.async"))
    assert average.item() == pytest.approx(expected / size, rel=1e-12)
    summed = hvd.grouped_allreduce([mine[:1], torch.tensor([rank + 1])], op=hvd.Sum)
    assert [t.item() for t in summed] == [expected, expected]
    joined = size - len(training)
    if joined:
        with pytest.raises(md.MpidistError, match=rf"^{joined} rank\(s\) ran out of data and wait in hvd.join"):
            hvd.broadcast(mine, root_rank=0)
        with pytest.raises(md.MpidistError, match=r"op='max' of a torch.float32 tensor on cpu is not one they"):
            hvd.allreduce(mine, op=hvd.Max)
        for in_place in (hvd.allreduce_, hvd.allreduce_async_):  # refused before the prescale: untouched
            with pytest.raises(md.MpidistError, match=r"op='min' of a torch.float32 tensor on cpu is not one"):
                in_place(mine, op=hvd.Min, prescale_factor=2.0)
            assert mine.tolist() == [rank + 1, 2 * (rank + 1)]


@pytest.mark.mpi(ranks=[2, 3])
def test_horovod_join_without_an_optimizer_returns_the_highest_rank(mpi_ranks, mpi_world):
    hvd.init()
    assert hvd.join() == mpi_ranks - 1  # nothing exchanged: the highest rank


@pytest.mark.mpi(ranks=[2, 3])
def test_horovod_join_refuses_an_optimizer_of_op_min(mpi_world):
    hvd.init()
    model = make_model()
    optimizers = [hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Min)]
    try:
        with pytest.raises(hvd.NotOfferedError, match="op='min'"):
            hvd.join()
    finally:
        drop(optimizers)


@pytest.mark.mpi(ranks=[2, 3])
def test_horovod_join_refuses_two_optimizers(mpi_world):
    hvd.init()
    optimizers = [hvd.DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1)) for _ in range(2)]
    try:
        with pytest.raises(hvd.NotOfferedError, match="2 live DistributedOptimizers"):
            hvd.join()
    finally:
        drop(optimizers)
