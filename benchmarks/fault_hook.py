"""The rank side of benchmarks/faults.py: runs `mpidist train` unchanged in every rank, writing
each step's phases to a log the campaign reads, and on the victim rank injects the campaign's
fault at the first time the phase it drew begins at or after the step it drew.

    mpirun -np 4 python benchmarks/fault_hook.py train --epochs 3 ...   (FAULT_DIR, FAULT_SPEC set)

A step's phases: forward, backward (data parallel: the gradient buckets' all-reduces start here),
apply (the optimizer's step: data parallel waits for the all-reduces; a parameter-server worker
exchanges its gradient for the weights) and checkpoint (`save_checkpoint`); a parameter server's
step is an update, its phase "update" the time from one update to the next (receiving the
gradients, applying them, replying). The fault is one of
kill (SIGKILL to itself), stop (SIGSTOP to itself), raise (an exception in the training loop),
launcher (a signal to mpirun, as SLURM sends one) and checkpoint-kill (SIGKILL to itself inside
the write of a checkpoint, between two of its datasets or just before the file is renamed into
place), ranks (a signal to every rank, as SLURM sends SIGTERM at a time limit), and, on the
emulated nodes of tests/multinode/cluster.sh, where each rank runs in its node's network
namespace: link-down (its node's link, eth0, set down) and link-loss (a packet filter on its
node's link dropping a drawn share of the packets in and out). The campaign restores the link
(benchmarks/fault_launch.py, restore_link): a rank cannot be trusted to, since the fault may end it.
Kill, stop, launcher, ranks and the link faults fire a drawn fraction of the phase's usual
length after the phase begins; the phase in progress then is what the record says (fault.json).

For the replay of elastic training the hook also keeps each rank's batches (batches-<rank>.log),
the state the survivors restore after a death (restored-1.pt) and the final weights (final.pt).
"""
from __future__ import annotations

import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
LOG_DIR = os.environ.get("FAULT_DIR", "")  # set by benchmarks/fault_launch.py (which imports LINK from here)
SPEC = json.loads(os.environ.get("FAULT_SPEC", "null"))
VICTIM = SPEC is not None and SPEC["rank"] == RANK


class InjectedFault(RuntimeError):
    """The campaign's exception on one rank."""


class PhaseLog:
    """This rank's phases, one line each (`time phase step`), and the fault when its moment comes."""

    def __init__(self):
        self.file = open(os.path.join(LOG_DIR, f"rank-{RANK}.log"), "a", buffering=1)  # noqa: SIM115
        with open(os.path.join(LOG_DIR, f"pid-{RANK}"), "w") as f:  # for a signal to every rank
            f.write(str(os.getpid()))
        self.step, self.phase, self.armed = 0, "start", VICTIM
        self.durations: dict = {}
        self.lock = threading.Lock()

    def enter(self, phase: str) -> float:
        with self.lock:
            self.phase = phase
            started = time.time()
            self.file.write(f"{started:.6f} {phase} {self.step}\n")
        if self.armed and self.step >= SPEC["step"] and phase == SPEC["phase"]:
            self.armed = False
            self.strike(phase)
        return started

    def leave(self, phase: str, started: float) -> None:
        self.durations.setdefault(phase, []).append(time.time() - started)

    def strike(self, phase: str) -> None:
        action = SPEC["action"]
        if action == "raise":
            self.record()
            raise InjectedFault(f"injected fault at step {self.step} ({phase}) on rank {RANK}")
        if action == "checkpoint-kill":
            self.arm_checkpoint_kill()
            return
        usual = statistics.median(self.durations.get(phase, [0.0]))
        threading.Timer(SPEC["fraction"] * usual, self.fire).start()

    def fire(self) -> None:
        self.record()
        action = SPEC["action"]
        if action == "launcher":
            with open(SPEC["launcher_pid_file"]) as f:
                os.kill(int(f.read()), getattr(signal, SPEC["signal"]))
        elif action == "ranks":  # as SLURM signals every task of a job at its time limit
            for path in glob.glob(os.path.join(LOG_DIR, "pid-*")):
                with open(path) as f:
                    os.kill(int(f.read()), getattr(signal, SPEC["signal"]))
        elif action == "link-down":
            subprocess.run(["ip", "link", "set", LINK, "down"], check=True)
        elif action == "link-loss":
            subprocess.run(["nft", "-f", "-"], input=loss_rules(SPEC["percent"]), text=True, check=True)
        else:
            os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)

    def record(self) -> None:
        """The moment and place of the fault, for the campaign (written before the fault)."""
        with self.lock:
            phase, step = self.phase, self.step
        # Written and closed, not synced: the campaign reads it on this machine once the job has
        # ended, and an fsync can wait seconds on a busy disk, while this rank trains on
        # undisturbed and the fault comes too late.
        with open(os.path.join(LOG_DIR, "fault.json"), "w") as f:
            json.dump({"time": time.time(), "rank": RANK, "step": step, "phase": phase}, f)

    def arm_checkpoint_kill(self) -> None:
        """SIGKILL at the drawn point of this write: before one of its datasets, or at the rename."""
        import h5py

        import mpidist.checkpoint.files as files
        point = SPEC["write_point"]
        created = [0]
        create_dataset = h5py.Group.create_dataset

        def counting_create_dataset(group, *args, **kwargs):
            created[0] += 1
            if created[0] == point:
                self.die_in_write(f"before dataset {point}")
            return create_dataset(group, *args, **kwargs)

        def replace(source, target):
            self.die_in_write(f"at the rename, after {created[0]} datasets")

        h5py.Group.create_dataset = counting_create_dataset
        files.os = _OsWithReplace(replace)

    def die_in_write(self, where: str) -> None:
        with self.lock:
            self.phase = f"checkpoint write, {where}"
        self.record()
        os.kill(os.getpid(), signal.SIGKILL)


LINK = "eth0"  # an emulated node's one interface (tests/multinode/cluster.sh)
LOSS_TABLE = "mpidist_fault"  # the packet filter's table, which benchmarks/fault_launch.py deletes


def loss_rules(percent: int) -> str:
    """nft's rules that drop `percent` % of the packets, drawn at random, that leave or reach
    this network namespace through LINK (counted, for the record)."""
    drop = f"numgen random mod 100 < {int(percent)} counter drop"
    return (f"table inet {LOSS_TABLE} {{\n"
            f"  chain out {{ type filter hook output priority 0; oifname \"{LINK}\" {drop}; }}\n"
            f"  chain in {{ type filter hook input priority 0; iifname \"{LINK}\" {drop}; }}\n"
            "}\n")


class _OsWithReplace:
    """The os module as mpidist.checkpoint.files sees it, with os.replace taken over."""

    def __init__(self, replace):
        self.replace = replace

    def __getattr__(self, name):
        return getattr(os, name)


def logged_batch(record_batch, batches):
    """ElasticSampler.record_batch, also writing the batch's samples to this rank's batch log
    `batches` (for the replay of elastic training from the commit its survivors restore)."""
    def record_and_log(sampler, batch_idx, batch_size):
        record_batch(sampler, batch_idx, batch_size)
        batches.write(" ".join(map(str, sampler.get_indices(batch_idx, batch_size))) + "\n")
    return record_and_log


def with_restored_state_saved(run, batches):
    """md.elastic.run, with the state the survivors restore after a death saved by the new rank 0
    in restored-<n>.pt, and a mark in every survivor's batch log `batches`."""
    import torch

    import mpidist as md

    def run_saving_restored(train_fn, state, *args, **kwargs):
        resets = []

        def save_restored():
            resets.append(md.size())
            batches.write(f"reset {len(resets)}\n")
            if md.rank() == 0:
                torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()},
                           os.path.join(LOG_DIR, f"restored-{len(resets)}.pt"))

        state.register_reset_callbacks([save_restored])
        return run(train_fn, state, *args, **kwargs)
    return run_saving_restored


def with_final_weights_saved(evaluate):
    """train.evaluate, with the final weights saved by rank 0 in final.pt first."""
    import torch

    import mpidist as md

    def save_and_evaluate(model, dataset):
        if md.rank() == 0:
            torch.save(model.state_dict(), os.path.join(LOG_DIR, "final.pt"))
        return evaluate(model, dataset)
    return save_and_evaluate


def logged_train_batch(log: PhaseLog):
    """train.train_batch, with its forward, backward and apply phases logged and the step counted."""
    import torch

    def train_batch(model, optimizer, apply, x, y):
        log.step += 1
        optimizer.zero_grad()
        started = log.enter("forward")
        output = model(x)
        loss = torch.nn.functional.cross_entropy(output, y)
        log.leave("forward", started)
        started = log.enter("backward")
        loss.backward()
        log.leave("backward", started)
        started = log.enter("apply")
        apply()
        log.leave("apply", started)
        log.enter("done")
        return output, loss.item()
    return train_batch


def logged_save(save, log: PhaseLog):
    """A save_checkpoint whose write is the phase "checkpoint", marked "checkpoint-done" when it ends."""
    def save_checkpoint(*args, **kwargs):
        started = log.enter("checkpoint")
        try:
            return save(*args, **kwargs)
        finally:
            log.leave("checkpoint", started)
            log.enter("checkpoint-done")
    return save_checkpoint


def logged_commit(commit, log: PhaseLog):
    """md.elastic.State.commit, with each commit marked in the log."""
    def commit_and_log(state):
        commit(state)
        log.enter("commit")
    return commit_and_log


def logged_serve(serve, log: PhaseLog):
    """ParameterServer.serve, with the server's updates as its steps: phase "update" runs from
    one update to the next."""
    def serve_and_log(ps, on_update=None):
        started = [log.enter("update")]

        def logged_update(update):
            log.leave("update", started[0])
            log.step += 1
            if on_update is not None:
                on_update(update)
            started[0] = log.enter("update")
        return serve(ps, on_update=logged_update)
    return serve_and_log


def install(log: PhaseLog) -> None:
    """Wraps the training step, the checkpoint writes and the elastic commits of `mpidist train`
    with the phase log; records the elastic batches, restored state and final weights."""
    import mpidist as md
    import mpidist.cli.train as train
    import mpidist.cli.train_ps as train_ps

    md.elastic.State.commit = logged_commit(md.elastic.State.commit, log)
    batches = open(os.path.join(LOG_DIR, f"batches-{RANK}.log"), "a", buffering=1)  # noqa: SIM115
    md.elastic.ElasticSampler.record_batch = logged_batch(md.elastic.ElasticSampler.record_batch, batches)
    md.elastic.run = with_restored_state_saved(md.elastic.run, batches)
    train.evaluate = with_final_weights_saved(train.evaluate)
    train.train_batch = logged_train_batch(log)
    train.save_checkpoint = logged_save(train.save_checkpoint, log)
    train_ps.save_checkpoint = logged_save(train_ps.save_checkpoint, log)
    md.ParameterServer.serve = logged_serve(md.ParameterServer.serve, log)
    backup = int(os.environ.get("FAULT_BACKUP_WORKERS", "0"))
    if backup:  # `mpidist train` has no option for backup workers: its sync mode gets them here
        import functools
        md.ParameterServer = functools.partial(md.ParameterServer, backup_workers=backup)


def main() -> int:
    from mpidist.cli import main as mpidist_main
    install(PhaseLog())
    return mpidist_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
