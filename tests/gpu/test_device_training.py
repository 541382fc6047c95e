"""mpidist's training modes on a float64 module on the launch's device against one-process CPU
training on every worker's batches: DataParallel (one bucket; small buckets as gradient views),
hvd.DistributedOptimizer, Pipeline (a stage per rank; on an even count above 2 also half the
stages twice over) and the synchronous ParameterServer."""
import pytest
import torch
from device_training import (
    ROWS,
    STEPS,
    assert_trained_like,
    batch,
    mlp,
    train_data_parallel,
    train_reference,
    training_roundings,
    union_of_batches,
)
from tolerances import assert_within

import mpidist as md

pytestmark = pytest.mark.training
PIPELINE_SIZES = (10, 16, 16, 12, 3)  # 7 layers: enough for 4 stages


def pytest_generate_tests(metafunc):
    if "replicas" in metafunc.fixturenames:
        size = md.init().size  # idempotent: the launch's world
        metafunc.parametrize("replicas", [1, 2] if size % 2 == 0 and size > 2 else [1],
                             ids=lambda replicas: f"replicas={replicas}")


def data_parallel(comm, device, bucket_mb, as_view):
    def wrap(model):
        return md.DataParallel(model, bucket_mb=bucket_mb, gradient_as_bucket_view=as_view)
    train_data_parallel(wrap, device, comm.rank, comm.size, "DataParallel")


def test_data_parallel_in_one_bucket_trains_as_one_process(comm, device):
    data_parallel(comm, device, bucket_mb=25, as_view=False)


def test_horovod_distributed_optimizer_trains_as_one_process(comm, device):
    import mpidist.torch as hvd

    def wrap(model):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model

    def wrap_optimizer(optimizer, model):
        return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    train_data_parallel(wrap, device, comm.rank, comm.size, "hvd.DistributedOptimizer", wrap_optimizer)


def test_data_parallel_in_small_buckets_as_gradient_views_trains_as_one_process(comm, device):
    data_parallel(comm, device, bucket_mb=0.0005, as_view=True)


def test_pipeline_trains_as_one_process(comm, device, replicas):
    stages = comm.size // replicas
    model = mlp(seed=0, sizes=PIPELINE_SIZES).to(device)
    pipe = md.Pipeline(model, torch.nn.functional.cross_entropy, chunks=4, replicas=replicas)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, 0, rows=ROWS * replicas)
        mine = slice(pipe.replica * ROWS, (pipe.replica + 1) * ROWS)
        pipe.zero_grad()
        losses.append(pipe.train_step(x[mine].to(device) if pipe.first else None,
                                      y[mine].to(device) if pipe.last else None))
        optimizer.step()
    reference, reference_losses = train_reference(0, [batch(step, 0, rows=ROWS * replicas) for step in range(STEPS)],
                                                  PIPELINE_SIZES)
    start, end = pipe.bounds[pipe.index]
    try:
        assert_trained_like(list(pipe.parameters()), list(reference[start:end].parameters()),
                            f"Pipeline stage {pipe.index} of {stages}", ROWS * replicas, PIPELINE_SIZES)
    finally:
        pipe.free()
    if replicas == 1:  # with replicas each returns its own rows' loss
        assert_within(torch.tensor(losses, dtype=torch.float64), torch.tensor(reference_losses, dtype=torch.float64),
                      roundings=training_roundings(ROWS, PIPELINE_SIZES))


def test_synchronous_parameter_server_trains_as_one_process(comm, device):
    size, rank, server = comm.size, comm.rank, 0
    workers = list(range(1, size))
    model = mlp(seed=rank).to(device)  # the chief's weights win
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if rank == server else None
    ps = md.ParameterServer(model, optimizer, mode="sync", server=server)
    if ps.is_server:
        ps.serve()
    else:
        for step in range(STEPS):
            model.zero_grad()
            x, y = batch(step, rank)
            torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
            ps.step()
        ps.close()
    # Synchronous SGD: each update averages one gradient of every worker, which is the gradient
    # of the mean loss over the workers' batches together.
    reference, _ = train_reference(workers[0], [union_of_batches(step, workers) for step in range(STEPS)])
    assert_trained_like(list(model.parameters()), list(reference.parameters()),
                        f"ParameterServer ({size - 1} workers)", ROWS * len(workers))
