"""`mpidist train --mode pipeline`: its mode of the training loop (PipelineMode: a stage of every
batch per rank, each rank's checkpoint of its own stage) and the newest checkpoint every rank
has, which --resume continues from.
"""
from __future__ import annotations

import os

import numpy as np

from ..checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    save_checkpoint,
)
from ..runtime import share_failure
from .training import Mode, stopped_line


class PipelineMode(Mode):
    """--mode pipeline: every rank runs its stage of each batch; rank 0 shows the progress; each
    rank checkpoints its stage every epoch and at a stop signal's step, in a directory of its own."""

    def __init__(self, args, comm, pipe, optimizer, sampler, directory, say, stop):
        self.args, self.comm, self.pipe, self.optimizer = args, comm, pipe, optimizer
        self.sampler, self.directory, self.say, self.stop = sampler, directory, say, stop
        self.shown = comm.rank == 0

    def run_step(self, x, y, train_batch) -> tuple:
        self.pipe.zero_grad()
        loss = self.pipe.train_step(x, y)  # the batch's mean loss, on every rank
        if self.optimizer is not None:
            self.optimizer.step()
        return None, loss

    def save(self, step: int, epoch: int) -> str:
        os.makedirs(self.directory, exist_ok=True)
        return save_checkpoint(checkpoint_path(self.directory, epoch, step), self.pipe, self.optimizer, step=step,
                               epoch=epoch, sampler=self.sampler)

    def interrupted(self, step: int, epoch: int) -> bool:
        if not self.stop.should_stop(self.comm):
            return False
        # As in --mode data, the sampler has handed out exactly the indices of the steps taken.
        path = self.save(step, epoch)
        self.say(f"{stopped_line(self.stop, step, epoch, self.args.epochs, path)} and the other ranks' of the same step; "
                 "--resume continues from them", flush=True)
        self.stop.close()
        return True

    def postfix(self, loss: float, seen: int, correct: int, elapsed: float) -> dict:
        # Every replica runs as many steps of equal batches (ShardedSampler).
        return {"loss": f"{loss:.3f}", "samples_per_s": f"{seen * self.pipe.replicas / elapsed:.0f}"}

    def end_epoch(self, epoch: int, step: int, counts: tuple, elapsed: float) -> None:
        # Each rank holds its replica's mean loss; every rank counts it once per stage.
        loss_sum = self.comm.allreduce(np.array([counts[0] / self.pipe.stages]))[0]
        seen = counts[2] * self.pipe.replicas
        self.say(f"epoch {epoch + 1}/{self.args.epochs}: loss {loss_sum / seen:.4f} ({seen} samples through "
                 f"{self.pipe.replicas} x {self.pipe.stages} stages, {seen / elapsed:.0f} samples/s)", flush=True)
        self.save(step, epoch + 1)


def common_checkpoint(directory, comm):
    """The path in this rank's `directory` of the newest checkpoint (epoch and step) that every
    rank has in its own, or None when a rank has none. Where ranks' newest differ (a job stopped
    while some ranks were writing an epoch's files), the oldest of them, if every rank has it;
    otherwise every rank raises. Where it is this rank's newest, the path is latest_checkpoint's,
    which load_checkpoint takes as checked."""
    latest = failure = None
    try:
        latest = latest_checkpoint(directory)
    except CheckpointError as exc:  # every rank's, so that no rank waits below for one that stopped
        failure = exc
    share_failure(comm, failure, f"looking for checkpoints in {directory}", CheckpointError)
    match = CHECKPOINT_NAME.match(os.path.basename(latest)) if latest else None
    mine = [int(match.group(1)), int(match.group(2))] if match else [-1, -1]
    table = comm.allgather(np.array(mine, dtype=np.int64)).reshape(comm.size, 2)
    if (table[:, 0] < 0).any():
        return None
    epoch, step = min(map(tuple, table.tolist()))
    have = comm.allreduce(np.array([os.path.exists(checkpoint_path(directory, epoch, step))], dtype=np.int64),
                          op="min")
    if not have[0]:
        newest = ", ".join(f"rank {r}: epoch {e}" for r, (e, _) in enumerate(table.tolist()))
        raise CheckpointError(f"the ranks' newest pipeline checkpoints differ ({newest}) and not every rank has "
                              f"epoch {epoch}'s; start again without --resume")
    return latest if [epoch, step] == mine else checkpoint_path(directory, epoch, step)
