"""A parameter server stopped and resumed, and stopped by its own ranks: arguments refused on some
ranks only, and an error in a server's update, raise on every rank at once.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order;
those that stop the parameter server with an error come last."""
import dataclasses
import os
import re

import numpy as np
import pytest
import test_ps
import torch
from conftest import run_python
from test_ps_sparse import SERVERS, batch, flat, loss_of, make_model, make_optimizer, replay, steps_of

import mpidist as md
from mpidist.checkpoint import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.mpi_shared_launch

LR = 0.1


def train(comm, mode, path, checkpoint_at=None):
    """Every rank's part of one training on servers 0 and 1 (test_ps_sparse.py's model, tables
    and a Linear, with Adagrad), from the checkpoint at `path` when `checkpoint_at` is None,
    else from scratch with a checkpoint written there after update `checkpoint_at`: each worker
    runs its steps that the starting weights do not hold. Returns (the servers' updates, the
    final weights), the updates' steps counted from each worker's first."""
    model = make_model(seed=comm.rank)  # different on every rank: the chief's, or the checkpoint's, win
    optimizer = make_optimizer("adagrad", model)[0] if comm.rank < SERVERS else None
    workers = list(range(SERVERS, comm.size))
    version, applied = 0, dict.fromkeys(workers, 0)  # worker -> its gradients the weights hold
    if checkpoint_at is None:
        state = load_checkpoint(path, model, optimizer, restore_rng=False)
        version, applied = state["step"], {int(w): n for w, n in state["extra"].items()}
    first = dict(applied)
    ps = md.ParameterServer(model, optimizer, comm=comm, servers=SERVERS, mode=mode, version=version)

    def checkpoint(update):
        for worker, _, _ in update.gradients:
            applied[worker] += 1
        if update.version == checkpoint_at:
            ps.gather_state()
            if comm.rank == ps.server:
                save_checkpoint(path, model, optimizer, step=update.version, extra=applied)

    history = None
    if ps.is_server:
        history = ps.serve(on_update=checkpoint)
    else:
        for step in range(applied[comm.rank], steps_of(comm.rank)):
            words, bag, _ = batch(comm.rank, step)
            ps.pull_rows(model.words, words)
            ps.pull_rows(model.bag, bag)
            model.zero_grad()
            loss_of(model, comm.rank, step).backward()
            ps.step()
        ps.close()
    comm.barrier()  # the checkpoint is written
    if history is not None:  # a resumed worker's ps.steps counted from 0
        history = [dataclasses.replace(update, gradients=tuple((w, step + first[w], v) for w, step, v in update.gradients))
                   for update in history]
    return history, flat(model)


@pytest.mark.mpi(ranks=[4])
@pytest.mark.parametrize("mode, checkpoint_at", [("sync", 2), ("async", 4)])
def test_two_servers_checkpoint_and_resume_exactly(mpi_world, tmp_path, mode, checkpoint_at):
    """A run checkpointed after some updates (every server's part of the weights and of the
    optimizer's state gathered on the coordinator), resumed from there, ends as the run that
    went on: in sync mode bit for bit, in async mode (whose updates land in the order the
    workers run) as a replay of the updates before the checkpoint and those after it."""
    comm = mpi_world
    path = os.path.join(comm.mpi.bcast(str(tmp_path), root=0), f"ps-{mode}.h5")
    whole_history, whole = train(comm, mode, path, checkpoint_at)
    history, resumed = train(comm, mode, path)
    if comm.rank != 0:
        return
    if mode == "sync":
        assert history == whole_history[checkpoint_at:]
        assert torch.equal(resumed, whole)
    else:
        history = whole_history[:checkpoint_at] + history
        test_ps.check_every_step_once_in_order(history, list(range(SERVERS, comm.size)))
        torch.testing.assert_close(resumed, replay(history, SERVERS, "adagrad", False)[-1], rtol=1e-12, atol=1e-14)


# Each is given only to the last rank; the others are given valid arguments.
@pytest.mark.mpi(ranks=[3])
@pytest.mark.parametrize("bad, refusal", [
    (lambda size: dict(mode="bogus"), "mode='bogus'"),
    (lambda size: dict(servers=[0, 0]), "the servers must be distinct ranks"),
    (lambda size: dict(servers=size), "leaves no worker"),
    (lambda size: dict(version=-1), "version must be an integer >= 0"),
], ids=["unknown_mode", "repeated_server", "no_worker_left", "negative_version"])
def test_arguments_refused_on_one_rank_are_refused_on_every_rank_at_once(mpi_world, monkeypatch, bad, refusal):
    """The other ranks do not wait for the refusing rank (a wait would end in a DeadlineError
    after MPIDIST_TIMEOUT): they raise its error, naming it."""
    monkeypatch.setenv("MPIDIST_TIMEOUT", "20")
    comm = mpi_world
    culprit = comm.size - 1
    model = make_model(0)
    given = bad(comm.size) if comm.rank == culprit else {}
    named = refusal if comm.rank == culprit else \
        rf"rank {culprit} refused its arguments to the parameter server: .*{refusal}"
    with pytest.raises(md.InvalidArgumentError, match=named):
        md.ParameterServer(model, torch.optim.SGD(model.parameters(), lr=LR), comm=comm, **given)


@pytest.mark.mpi(ranks=[4])
@pytest.mark.parametrize("asking", [0, 3], ids=["coordinator", "worker"])
def test_a_stop_request_stops_every_worker_after_the_same_sync_update(mpi_world, asking):
    """request_stop() on the coordinator after update 2, or on the last worker before its third
    step: every worker learns of it (`stopping`) after the same update, and stops there."""
    comm = mpi_world
    model = test_ps.make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR) if comm.rank < SERVERS else None
    ps = md.ParameterServer(model, optimizer, comm=comm, servers=SERVERS, mode="sync")
    updates = 2 if asking == 0 else 3
    if ps.is_server:
        history = ps.serve(on_update=lambda update: asking == 0 and update.version == 2 and ps.request_stop())
        assert len(history) == updates and ps.stopping == (comm.rank == 0)
    else:
        steps = 0
        while not ps.stopping and steps < 10:
            if comm.rank == asking and steps == 2:
                ps.request_stop()
            model.zero_grad()
            test_ps.loss_of(model, comm.rank, steps).backward()
            ps.step()
            steps += 1
        ps.close()
        assert steps == updates


# `mpidist train` as tests/test_train.py runs it; in SIGNALLED, rank `signaller` sends SIGUSR1
# (SLURM's warning before the time limit) to mpirun in its 3rd call of `owner.name` (a training
# step), and mpirun passes it to every rank; the signaller goes on once it has it.
TRAIN = "from mpidist.cli import main; raise SystemExit(main({args!r}))"
SIGNALLED = """
import os, signal, time
import mpidist, mpidist.cli.train, mpidist.parallel.pipeline
steps = 0
original = {owner}.{name}
def signalling(*args, **kwargs):
    global steps
    steps += 1
    if steps == 3 and mpidist.rank() == {signaller}:
        os.kill(os.getppid(), signal.SIGUSR1)
        stop = signal.getsignal(signal.SIGUSR1).__self__  # this rank's GracefulStop
        while stop.signalled is None:  # until the signal is here too, however loaded the machine
            time.sleep(0.01)
    return original(*args, **kwargs)
{owner}.{name} = signalling
from mpidist.cli import main; raise SystemExit(main({args!r}))
"""


def train_cli(directory, *extra, ranks, code=TRAIN, **signalling):
    args = ["train", "--no-progress", "--checkpoint-dir", str(directory / "ck"), "--data",
            str(directory.parent / "d.h5"), "--epochs", "1", *extra]
    result = run_python(code.format(args=args, **signalling), ranks=ranks, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def assert_same_training_state(path, other):
    """The two checkpoints hold the same model and optimizer state, bit for bit (momentum too)."""
    import h5py

    def tensors(path):
        found = {}
        with h5py.File(path) as f:
            for group in ("model", "optimizer"):
                f[group].visititems(lambda name, item, group=group: found.update(
                    {f"{group}/{name}": item[()]} if isinstance(item, h5py.Dataset) else {}))
        return found

    one, two = tensors(path), tensors(other)
    assert sorted(one) == sorted(two) and any(name.startswith("optimizer/state") for name in one), (one, two)
    assert all(np.array_equal(one[name], two[name]) for name in one)


def test_a_stop_signal_stops_the_parameter_server_and_resume_finishes_the_run(tmp_path):
    """Two servers and two workers, sync mode: the chief signals mpirun in its 3rd step; the
    workers stop after the same update, rank 0 checkpoints it (weights and momentum gathered
    from both servers) and every rank exits with status 0; --resume then applies exactly the
    rest of the epoch's updates. (That a resumed run of two servers ends as the uninterrupted
    one: test_two_servers_checkpoint_and_resume_exactly.)"""
    options = ("--mode", "ps", "--servers", "2", "--ps-mode", "sync", "--batch-size", "50")
    stopped = train_cli(tmp_path / "run", *options, ranks=4, code=SIGNALLED, owner="mpidist.cli.train",
                        name="train_batch", signaller=2)
    found = re.search(r"mpidist train: stopped early: a stop signal \(SIGUSR1\) came; the workers stopped after "
                      r"update (\d+) \(gradients per worker \[(\d+), (\d+)\]\); checkpoint (\S+);", stopped)
    assert found, stopped
    update, batches = int(found.group(1)), 1500 // 2 // 50  # per worker and epoch: 1500 images, 2 workers
    assert 3 <= update < batches and found.group(2) == found.group(3) == str(update), stopped
    assert "final test accuracy" not in stopped and not os.path.exists(tmp_path / "run" / "ck" / "ps-final.h5")
    resumed = train_cli(tmp_path / "run", *options, "--resume", ranks=4)
    assert f"resumed from {found.group(4)} (update {update}, gradients per worker [{update}, {update}])" in resumed, \
        resumed
    assert f"{batches - update} updates of {2 * (batches - update)} gradients" in resumed, resumed
    assert "final test accuracy" in resumed


def test_a_stop_signal_stops_every_pipeline_stage_at_one_step_and_resume_finishes_the_run(tmp_path):
    """Two stages: rank 1 signals mpirun in its 3rd step; every rank checkpoints its stage at the
    step they all stop at and exits with status 0; --resume continues that epoch and ends with the
    uninterrupted run's stages, bit for bit."""
    whole = train_cli(tmp_path / "whole", "--mode", "pipeline", ranks=2)
    assert "final test accuracy" in whole
    stopped = train_cli(tmp_path / "run", "--mode", "pipeline", ranks=2, code=SIGNALLED,
                        owner="mpidist.parallel.pipeline.Pipeline", name="train_step", signaller=1)
    found = re.search(r"mpidist train: stopped early: a stop signal \(SIGUSR1\) came; every rank stopped after step "
                      r"(\d+) \(epoch 1/1\)", stopped)
    assert found, stopped
    step = int(found.group(1))
    for rank in range(2):
        assert os.listdir(tmp_path / "run" / "ck" / f"pipeline-rank{rank}") == [f"ckpt-0000-{step:08d}.h5"]
    resumed = train_cli(tmp_path / "run", "--mode", "pipeline", "--resume", ranks=2)
    assert f"the other ranks' of epoch 0 (step {step})" in resumed, resumed
    for rank in range(2):
        assert_same_training_state(*(tmp_path / run / "ck" / f"pipeline-final-rank{rank}.h5" for run in ("whole", "run")))


class FailingSGD(torch.optim.SGD):
    """SGD that raises in its third step, as a check for NaN in it would."""

    def __init__(self, params, lr=LR):
        super().__init__(params, lr=lr)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        if self.steps == 3:
            raise FloatingPointError("the weights hold a NaN")
        return super().step(closure)


# Last of the launch: the failed update stops the parameter server on every rank, leaving some of
# its messages unmatched.
@pytest.mark.mpi(ranks=[4])
@pytest.mark.parametrize("culprit, mode", [(0, "sync"), (1, "async")], ids=["coordinator", "other_server"])
def test_an_error_in_a_servers_update_stops_every_rank(mpi_world, monkeypatch, culprit, mode):
    """The optimizer of one of two servers raises in its third update: that server raises its
    exception, every other rank an error naming the server and the exception, at once (a wait
    would end in a DeadlineError after MPIDIST_TIMEOUT)."""
    monkeypatch.setenv("MPIDIST_TIMEOUT", "20")
    comm = mpi_world
    model = test_ps.make_model(0)
    kind = FailingSGD if comm.rank == culprit else torch.optim.SGD
    optimizer = kind(model.parameters(), lr=LR) if comm.rank < SERVERS else None
    ps = md.ParameterServer(model, optimizer, comm=comm, servers=SERVERS, mode=mode)
    if comm.rank == culprit:
        error, message = FloatingPointError, "the weights hold a NaN"
    else:
        error, message = md.MpidistError, rf"rank {comm.rank} \(.*\): server {culprit} stopped the parameter " \
                                          r"server: its update 3 raised FloatingPointError: the weights hold a NaN"
    with pytest.raises(error, match=message):
        if ps.is_server:
            ps.serve()
        for step in range(100):  # the workers train until they hear of it
            model.zero_grad()
            test_ps.loss_of(model, comm.rank, step).backward()
            ps.step()
