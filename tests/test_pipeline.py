"""Pipeline (layer-wise model parallelism) against the same model trained in one process on the
whole batch (float64): the same losses and, stage by stage, the same parameters."""
import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpidist as md

LAYERS = 7


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


@pytest.mark.mpi(ranks=[1, 2, 3, 4, 5])
def test_pipeline(mpi_ranks, mpi_world, monkeypatch):
    """The checks of one world size in one launch (each launch starts an interpreter and torch
    per rank); 4 ranks run the layouts with replicas only, the plain pipelines run on the rest."""
    if mpi_ranks == 4:
        check_replicas_match_one_process(replicas=2)  # two pipelines of two stages
        check_replicas_match_one_process(replicas=4)  # pure data parallelism: pipelines of one stage
        return
    check_pipeline_training_matches_one_process()
    if mpi_ranks == 2:
        check_replicas_match_one_process(replicas=2)
        check_a_silent_stage_is_named(monkeypatch)
    if mpi_ranks == 3:
        check_pipeline_refuses_bad_input_on_every_rank()


def check_replicas_match_one_process(replicas):
    """Each replica trains on its own rows of the batch; averaged over the replicas, the
    gradients are those of the whole batch's mean loss, so each stage's parameters follow
    one-process training on the whole batch."""
    comm = md.init()
    steps, rows = 3, 10
    reference, reference_losses = train_one_process(steps, size=rows * replicas)
    for schedule, chunks in (("1f1b", 4), ("gpipe", 3)):
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


def check_pipeline_training_matches_one_process():
    comm = md.init()
    steps = 3
    reference, reference_losses = train_one_process(steps)
    balances = [None] + {2: [[6, 1]], 3: [[4, 2, 1]]}.get(comm.size, [])
    for schedule in ("1f1b", "gpipe"):
        for chunks in (1, 4, 10):  # 4: micro-batches of 3, 3, 2, 2; 10: one sample each
            for balance in balances:
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
                pipe.free()  # its duplicated communicator: the loop builds many


def check_pipeline_refuses_bad_input_on_every_rank():
    comm = md.init()
    loss = torch.nn.functional.cross_entropy
    with pytest.raises(md.InvalidArgumentError, match="torch.nn.Sequential"):
        md.Pipeline(torch.nn.Linear(2, 2), loss)
    with pytest.raises(md.InvalidArgumentError, match="at least 3 layers"):
        md.Pipeline(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), loss)
    with pytest.raises(md.InvalidArgumentError, match="balance"):
        md.Pipeline(make_model(), loss, balance=[5, 1, 0])
    with pytest.raises(md.InvalidArgumentError, match="schedule"):
        md.Pipeline(make_model(), loss, schedule="interleaved")
    with pytest.raises(md.InvalidArgumentError, match="replicas=2 must be a positive integer that divides the 3"):
        md.Pipeline(make_model(), loss, replicas=2)
    pipe = md.Pipeline(make_model(), loss, chunks=4)
    x, y = batch(0)
    first, last = comm.rank == 0, comm.rank == comm.size - 1
    with pytest.raises(md.MismatchError, match="10 samples but the last stage's targets 9"):
        pipe.train_step(x if first else None, y[:9] if last else None)
    with pytest.raises(md.InvalidArgumentError, match="no target tensor"):
        pipe.train_step(x if first else None, None)
    with pytest.raises(md.InvalidArgumentError, match="no input tensor"):
        pipe.train_step(None, y if last else None)
    with pytest.raises(md.InvalidArgumentError, match="cannot be cut into chunks=4"):
        pipe.train_step(x[:3] if first else None, y[:3] if last else None)
    # After the refusals, the pipeline still trains.
    loss_value = pipe.train_step(x if first else None, y if last else None)
    assert loss_value == pytest.approx(loss(make_model()(x), y).item(), rel=1e-12)
    pipe.free()
    pipe.free()  # a second time does nothing
    with pytest.raises(md.InvalidArgumentError, match="was freed"):
        pipe.train_step(x if first else None, y if last else None)


def check_a_silent_stage_is_named(monkeypatch):
    """A stage that stops answering is a DeadlineError after MPIDIST_TIMEOUT on the stage waiting
    for it, naming the silent stage and its rank."""
    import time
    monkeypatch.setenv("MPIDIST_TIMEOUT", "2")
    comm = md.init()

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
        comm.barrier()
        pipe.free()
