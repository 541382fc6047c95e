"""Pipeline (layer-wise model parallelism) against the same model trained in one process on the
whole batch (float64): the same losses and, stage by stage, the same parameters.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order:
4 ranks run the layouts with replicas only, the plain pipelines run on the others; the check of a
silent stage comes last."""
import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpidist as md

pytestmark = pytest.mark.mpi_shared_launch

LAYERS = 7
SCHEDULES = pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
# One micro-batch; micro-batches of 3, 3, 2 and 2 samples; one sample each.
CHUNKS = pytest.mark.parametrize("chunks", [1, 4, 10])


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5),
        torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()


def batch(step, size=10):
    generator = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(size, 6, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (size,), generator=generator))


def train_one_process(steps, lr=0.1, size=10):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = batch(step, size)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def pipeline_training_matches_one_process(comm, schedule, chunks, balance):
    steps = 3
    reference, reference_losses = train_one_process(steps)
    pipe = md.Pipeline(make_model(), torch.nn.functional.cross_entropy, chunks=chunks,
                       balance=balance, schedule=schedule)
    params = list(pipe.parameters())  # none on a stage of activations only (5 ranks)
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9) if params else None
    losses = []
    for step in range(steps):
        x, y = batch(step)
        pipe.zero_grad()
        # Only the first stage's inputs and the last stage's targets are used.
        losses.append(pipe.train_step(x if comm.rank == 0 else None,
                                      y if comm.rank == comm.size - 1 else None))
        if optimizer is not None:
            optimizer.step()
    where = f"{schedule}, chunks={chunks}, balance={balance}"
    assert losses == pytest.approx(reference_losses, rel=1e-12), where
    start, end = pipe.bounds[comm.rank]
    expected = dict(reference[start:end].named_parameters())
    for name, param in pipe.stage.named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=1e-12, atol=1e-14, msg=where)
    # Inference: the whole model's output, on every rank.
    x, _ = batch(99)
    torch.testing.assert_close(pipe(x if comm.rank == 0 else None), reference(x).detach(),
                               rtol=1e-12, atol=1e-14)
    pipe.free()  # its duplicated communicator


@pytest.mark.mpi(ranks=[1, 2, 3, 5])
@SCHEDULES
@CHUNKS
def test_pipeline_training_matches_one_process(mpi_world, schedule, chunks):
    pipeline_training_matches_one_process(mpi_world, schedule, chunks, balance=None)


@pytest.mark.mpi(ranks=[2, 3])
@SCHEDULES
@CHUNKS
def test_uneven_balance_matches_one_process(mpi_world, schedule, chunks):
    balance = {2: [6, 1], 3: [4, 2, 1]}[mpi_world.size]
    pipeline_training_matches_one_process(mpi_world, schedule, chunks, balance)


def replicas_match_one_process(comm, replicas, schedule, chunks):
    """Each replica trains on its own rows of the batch; averaged over the replicas, the
    gradients are those of the whole batch's mean loss, so each stage's parameters follow
    one-process training on the whole batch."""
    steps, rows = 3, 10
    reference, reference_losses = train_one_process(steps, size=rows * replicas)
    # Each replica starts from other weights: construction gives every one replica 0's.
    replica = comm.rank // (comm.size // replicas)
    pipe = md.Pipeline(make_model(seed=replica), torch.nn.functional.cross_entropy, chunks=chunks,
                       schedule=schedule, replicas=replicas)
    assert (pipe.stages, pipe.replica, pipe.index) == (comm.size // replicas, *divmod(comm.rank, pipe.stages))
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = batch(step, rows * replicas)
        mine = slice(pipe.replica * rows, (pipe.replica + 1) * rows)
        pipe.zero_grad()
        losses.append(pipe.train_step(x[mine], y[mine]))
        optimizer.step()
    # The replicas' own mean losses average to the whole batch's.
    average = MPI.COMM_WORLD.allreduce(np.array(losses) / comm.size)
    assert average == pytest.approx(reference_losses, rel=1e-12)
    start, end = pipe.bounds[pipe.index]
    expected = dict(reference[start:end].named_parameters())
    for name, param in pipe.stage.named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=1e-12, atol=1e-14, msg=f"{schedule} {name}")
    pipe.free()


REPLICA_SCHEDULES = pytest.mark.parametrize("schedule, chunks", [("1f1b", 4), ("gpipe", 3)], ids=["1f1b", "gpipe"])


@pytest.mark.mpi(ranks=[2, 4])  # two pipelines of one stage (2 ranks), of two stages (4 ranks)
@REPLICA_SCHEDULES
def test_two_replicas_match_one_process(mpi_world, schedule, chunks):
    replicas_match_one_process(mpi_world, 2, schedule, chunks)


@pytest.mark.mpi(ranks=[4])
@REPLICA_SCHEDULES
def test_pure_data_parallelism_matches_one_process(mpi_world, schedule, chunks):
    """Pipelines of one stage each."""
    replicas_match_one_process(mpi_world, 4, schedule, chunks)


@pytest.mark.mpi(ranks=[3])
@pytest.mark.parametrize("model, settings, refusal", [
    (lambda: torch.nn.Linear(2, 2), {}, "torch.nn.Sequential"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), {}, "at least 3 layers"),
    (make_model, {"balance": [5, 1, 0]}, "balance"),
    (make_model, {"schedule": "interleaved"}, "schedule"),
    (make_model, {"replicas": 2}, "replicas=2 must be a positive integer that divides the 3"),
], ids=["not_sequential", "two_layers", "balance_with_an_empty_stage", "unknown_schedule", "replicas_not_dividing"])
def test_pipeline_refuses_bad_construction_on_every_rank(mpi_world, model, settings, refusal):
    with pytest.raises(md.InvalidArgumentError, match=refusal):
        md.Pipeline(model(), torch.nn.functional.cross_entropy, **settings)


@pytest.mark.mpi(ranks=[3])
@pytest.mark.parametrize("given, error, refusal", [
    (lambda x, y: (x, y[:9]), md.MismatchError, "10 samples but the last stage's targets 9"),
    (lambda x, y: (x, None), md.InvalidArgumentError, "no target tensor"),
    (lambda x, y: (None, y), md.InvalidArgumentError, "no input tensor"),
    (lambda x, y: (x[:3], y[:3]), md.InvalidArgumentError, "cannot be cut into chunks=4"),
], ids=["targets_of_another_count", "no_targets", "no_inputs", "fewer_samples_than_chunks"])
def test_train_step_refuses_bad_input_on_every_rank(mpi_world, given, error, refusal):
    loss = torch.nn.functional.cross_entropy
    pipe = md.Pipeline(make_model(), loss, chunks=4)
    x, y = batch(0)
    first, last = mpi_world.rank == 0, mpi_world.rank == mpi_world.size - 1
    inputs, targets = given(x, y)
    with pytest.raises(error, match=refusal):
        pipe.train_step(inputs if first else None, targets if last else None)
    # After the refusal, the pipeline still trains.
    loss_value = pipe.train_step(x if first else None, y if last else None)
    assert loss_value == pytest.approx(loss(make_model()(x), y).item(), rel=1e-12)
    pipe.free()


@pytest.mark.mpi(ranks=[3])
def test_a_freed_pipeline_refuses_to_train(mpi_world):
    pipe = md.Pipeline(make_model(), torch.nn.functional.cross_entropy, chunks=4)
    x, y = batch(0)
    first, last = mpi_world.rank == 0, mpi_world.rank == mpi_world.size - 1
    pipe.train_step(x if first else None, y if last else None)
    pipe.free()
    pipe.free()  # a second time does nothing
    with pytest.raises(md.InvalidArgumentError, match="was freed"):
        pipe.train_step(x if first else None, y if last else None)


# In a launch of its own: rank 0 gives up on a receive that stage 1 answers later, so a test after
# it could meet that late message.
@pytest.mark.mpi_own_launch
@pytest.mark.mpi(ranks=[2])
def test_a_silent_stage_is_named(mpi_world, monkeypatch):
    """A stage that stops answering is a DeadlineError after MPIDIST_TIMEOUT on the stage waiting
    for it, naming the silent stage and its rank."""
    import time
    monkeypatch.setenv("MPIDIST_TIMEOUT", "2")
    comm = mpi_world

    def slow_loss(output, target):  # the last stage stalls before its backward
        time.sleep(5)
        return torch.nn.functional.cross_entropy(output, target)

    pipe = md.Pipeline(make_model(), slow_loss, chunks=1)
    x, y = batch(0)
    try:
        if comm.rank == 0:
            with pytest.raises(md.DeadlineError, match=r"stage 0 \(rank 0\): the pipeline receive from stage 1 did not "
                                                       r"complete within 2 s \(MPIDIST_TIMEOUT\): no answer from "
                                                       r"stage 1 \(rank 1\)") as excinfo:
                pipe.train_step(x, None)
            assert excinfo.value.peers == (1,)
        else:
            # Its small messages go out eagerly; whether the result's broadcast completes on its
            # root with stage 0 gone is up to the MPI library (if not: a DeadlineError too).
            try:
                pipe.train_step(None, y)
            except md.DeadlineError as exc:
                assert "no answer from the other stages" in str(exc), str(exc)
    finally:
        monkeypatch.setenv("MPIDIST_TIMEOUT", "120")  # the barrier waits for the stalled stage
        comm.barrier()
        pipe.free()
