"""`mpidist train --mode ps`: the workers' mode of the training loop (WorkerMode), the servers'
part (serve with checkpoints, the summary and the final or stop signal's checkpoint), and what a
death does to the run under --elastic.
"""
from __future__ import annotations

import os
import time

import numpy as np

from ..checkpoint import BackgroundCheckpoints, checkpoint_path, save_checkpoint
from .training import STOPPED_EARLY, Mode


class WorkerMode(Mode):
    """--mode ps, a worker: its steps go through the parameter server, at its own pace; the
    chief shows its progress; the servers checkpoint, and a stop signal stops the workers
    through the parameter server (`stopping`)."""

    def __init__(self, args, comm, ps, model, optimizer, sampler, stop):
        self.args, self.ps, self.model, self.optimizer = args, ps, model, optimizer
        self.sampler, self.stop = sampler, stop
        self.who, self.shown = f"chief, rank {comm.rank}", ps.is_chief

    def batches(self, loader) -> int:
        return -(-self.sampler.remaining() // self.args.batch_size)

    def run_step(self, x, y, train_batch) -> tuple:
        if self.stop.signalled:
            self.ps.request_stop()  # goes with this step's gradient
        if self.args.model == "embedding":
            self.ps.pull_rows(self.model.embedding, x)
        return train_batch(self.model, self.optimizer, self.ps.step, x, y)

    def finished(self) -> bool:
        return self.ps.stopping

    def postfix(self, loss: float, seen: int, correct: int, elapsed: float) -> dict:
        return {"loss": f"{loss:.3f}", "acc": f"{correct / seen:.3f}", "own_samples_per_s": f"{seen / elapsed:.0f}"}


def serve_and_checkpoint(args, comm, ps, model, optimizer, epoch_updates: int, applied: dict, say, stop) -> bool:
    """A server's part of --mode ps: serve, with rank 0 checkpointing every `epoch_updates`
    updates (in the background); then rank 0 says what was applied and writes the final or the
    stop signal's checkpoint. True when a stop signal stopped the workers."""
    directory, started = os.path.join(args.checkpoint_dir, "ps"), time.perf_counter()
    os.makedirs(directory, exist_ok=True)
    checkpoints = BackgroundCheckpoints()

    def save(write, version: int):
        """The checkpoint of update `version`, which rank 0's model and optimizer hold, by `write`."""
        return write(checkpoint_path(directory, version // epoch_updates, version), model, optimizer, step=version,
                     epoch=version // epoch_updates,
                     extra={"version": version, "applied": {str(w): n for w, n in applied.items()}})

    def checkpoint(update):
        for worker, _step, _version in update.gradients:
            applied[worker] += 1
        if stop.signalled:
            ps.request_stop()  # on the coordinator, rank 0; the other servers leave it to it
        if update.version % epoch_updates == 0:
            ps.gather_state()  # with several servers, onto rank 0, the coordinator
            if comm.rank == 0:
                save(checkpoints.save, update.version)

    try:
        updates = ps.serve(on_update=checkpoint)
    finally:
        checkpoints.close()
        stop.close()
    gradients = sum(len(u.gradients) for u in updates)
    staleness = [u.version - 1 - held for u in updates for _, _, held in u.gradients] or [0]
    placement = f"{len(ps.servers)} servers, " if len(ps.servers) > 1 else ""
    say(f"parameter server ({ps.mode}, {placement}{len(ps.workers)} workers): {len(updates)} updates of "
        f"{gradients} gradients in {time.perf_counter() - started:.1f} s; staleness mean "
        f"{np.mean(staleness):.2f}, max {max(staleness)}", flush=True)
    if ps.stopping:  # rank 0 (the coordinator), which holds the whole state since serve() ended
        path = save(save_checkpoint, ps.version)
        say(f"{STOPPED_EARLY}: a stop signal ({stop.signalled or 'on a worker'}) came; the workers stopped after "
            f"update {ps.version} (gradients per worker {list(applied.values())}); checkpoint {path}; --resume "
            "continues from it", flush=True)
        return True
    if comm.rank == 0:
        save_checkpoint(os.path.join(args.checkpoint_dir, "ps-final.h5"), model, optimizer, step=ps.version,
                        epoch=args.epochs)
    return False


def say_what_survives(mode: str, servers: int, say) -> None:
    """--elastic --mode ps: what a death does to this run, said at the start (with ULFM, whether
    the mode survives a dead worker; without it, what a death loses)."""
    from ..runtime import fault_tolerance_missing
    missing = fault_tolerance_missing()
    newest = "--resume continues from the newest checkpoint in ps/" if servers == 1 else \
        "with --servers > 1 there is no checkpoint on the way to resume from"
    if missing is not None:
        say(f"mpidist train --elastic: {missing}. A rank that dies ends the whole job, and what the servers applied "
            f"since the newest checkpoint is lost ({newest})", flush=True)
    elif mode == "sync":
        say("mpidist train --elastic: plain sync mode waits for every worker: a worker that dies ends the job, as a "
            f"server that dies does ({newest}); --ps-mode async or softsync go on without a dead worker", flush=True)
    else:
        say(f"mpidist train --elastic: a worker that dies is dropped and the others go on; a server that dies ends "
            f"the job ({newest})", flush=True)
