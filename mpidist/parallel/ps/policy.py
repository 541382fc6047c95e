"""The parameter server's update policy, pure: which gradients each update averages, which are
dropped, when each worker gets its weights back, and each update's learning-rate scale. No MPI,
no tensors: events go in (a worker's gradient arrived, with its step and the version of the
weights it was computed on; a worker closed; a worker died), decisions come out (APPLY these
workers' gradients, ANSWER this worker with the current weights, DROP this late gradient, LOST
this dead worker), in the order the servers carry them out, each of the policy's own Kind. The
coordinating server (coordinator.py) feeds it the messages it receives and tells the other
servers its decisions (protocol.order_of makes them commands).

Update rules (Zhang et al., "Staleness-Aware Async-SGD for Distributed Deep Learning", IJCAI
2016; Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter
Server", NIPS 2013):
- sync: each update averages one gradient from every worker (synchronous SGD). With
  backup_workers=b (TensorFlow's SyncReplicasOptimizer) it averages the first workers - b
  gradients computed on the current weights; a gradient computed on older weights arrives late
  and is dropped, its worker answered at once.
- async: each gradient is applied alone, as it arrives.
- n-softsync: each update averages the first max(1, workers // n) gradients to arrive.
- max_staleness=s (bounded staleness): no worker starts a step more than s steps ahead of the
  slowest worker still training; its answer waits until the slowest has pushed enough.
- staleness_lr: each update's learning rate is divided by the mean staleness of its gradients
  (taken as 1 when below 1); a gradient's staleness is the number of updates applied between
  the weights it was computed on and the update that takes it.

An update waits for its share of gradients, unless every worker still training is already
waiting (then nobody could bring more). A worker is answered only once the update that took its
gradient is applied (or its gradient dropped), so it never computes on weights that miss its
own last gradient.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

MODES = ("sync", "async", "softsync")


class Kind(enum.Enum):
    """What a decision has the servers do (see Decision)."""
    APPLY = "apply"
    ANSWER = "answer"
    DROP = "drop"
    LOST = "lost"


class Stamp(NamedTuple):
    """A gradient as the policy knows it: its `worker` (rank), the worker's `step` (the
    gradients it pushed before this one) and the `version` of the weights it was computed on."""
    worker: int
    step: int
    version: int


@dataclasses.dataclass(frozen=True)
class Update:
    """One update the server applied. `version`: the number of updates applied with this one.
    `gradients`: the Stamp (worker rank, the worker's step, the version its weights had) of each
    gradient averaged, in the order summed (by worker rank). `staleness`: their mean staleness.
    `lr_scale`: what the learning rate was multiplied by (1 / staleness with staleness_lr).
    `dropped`: the Stamp of each late gradient dropped since the update before (backup
    workers)."""
    version: int
    gradients: tuple
    staleness: float
    lr_scale: float
    dropped: tuple = ()


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the servers do next: `kind` (APPLY, ANSWER, DROP or LOST) for `workers`. APPLY
    carries its `update`; DROP the late gradient's Stamp (`dropped`); LOST the gradients the dead
    worker had pushed (`steps`)."""
    kind: Kind
    workers: tuple
    update: Update | None = None
    dropped: Stamp | None = None
    steps: int = 0


def gradients_per_update(mode: str, workers: int, softsync, backup_workers: int = 0) -> int:
    if mode == "sync":
        return workers - backup_workers
    if mode == "async":
        return 1
    return max(1, workers // softsync)


def make_update(version: int, gradients: tuple, dropped: tuple, staleness_lr: bool) -> Update:
    """The update after `version` that averages `gradients` (a Stamp each)."""
    staleness = sum(version - gradient.version for gradient in gradients) / len(gradients)
    lr_scale = 1.0 / max(1.0, staleness) if staleness_lr else 1.0
    return Update(version + 1, tuple(gradients), staleness, lr_scale, tuple(dropped))


class Policy:
    """The coordinator's decisions for `workers` (ranks), starting at `version`."""

    def __init__(self, workers, per_update: int, max_staleness=None, staleness_lr: bool = False,
                 backup_workers: int = 0, version: int = 0):
        self.per_update, self.max_staleness, self.staleness_lr = per_update, max_staleness, staleness_lr
        self.backup_workers, self.version = backup_workers, version
        self.pushed = dict.fromkeys(workers, 0)  # gradients each worker pushed
        self.active = set(workers)  # the workers still training
        self.arrived = {}  # worker -> the Stamp of its gradient waiting for an update
        self.owed = set()  # workers whose gradient is applied (or dropped), waiting for their weights
        self.late = []  # gradients dropped since the last update

    def gradient(self, worker: int, step: int, version: int) -> list:
        """A worker's gradient arrived, computed on weights of `version`."""
        self.pushed[worker] += 1
        stamp = Stamp(worker, step, version)
        if self.backup_workers and version < self.version:  # a straggler's, for an update already applied
            self.late.append(stamp)
            self.owed.add(worker)
            return [Decision(Kind.DROP, (worker,), dropped=stamp)] + self._decide()
        self.arrived[worker] = stamp
        return self._decide()

    def done(self, worker: int) -> list:
        """A worker closed."""
        self.active.discard(worker)
        return self._decide()

    def died(self, worker: int) -> list:
        """A worker died: its gradient not yet applied goes with it."""
        self.active.discard(worker)
        self.arrived.pop(worker, None)
        self.owed.discard(worker)
        return [Decision(Kind.LOST, (worker,), steps=self.pushed[worker])] + self._decide()

    @property
    def finished(self) -> bool:
        return not self.active

    def may_start(self, worker: int) -> bool:
        """Bounded staleness: a worker may start its next step when it is at most max_staleness
        steps ahead of the slowest worker still training."""
        return self.max_staleness is None or \
            self.pushed[worker] - min(self.pushed[w] for w in self.active) <= self.max_staleness

    def _decide(self) -> list:
        decisions = []
        if self.arrived and (len(self.arrived) >= self.per_update or self.active <= set(self.arrived) | self.owed):
            order = sorted(self.arrived)  # by worker rank: the same sum whatever order they arrived in
            update = make_update(self.version, tuple(self.arrived[w] for w in order), tuple(self.late),
                                 self.staleness_lr)
            decisions.append(Decision(Kind.APPLY, tuple(order), update=update))
            self.version = update.version
            self.owed |= set(order)
            self.arrived, self.late = {}, []
        for waiting in sorted(self.owed):
            if self.may_start(waiting):
                self.owed.discard(waiting)
                decisions.append(Decision(Kind.ANSWER, (waiting,)))
        return decisions
