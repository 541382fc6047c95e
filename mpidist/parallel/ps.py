"""Parameter server: one dedicated rank keeps the model's weights and runs the optimizer; the
other ranks, the workers, compute gradients on their own batches, push them to the server and
pull the new weights back.

Update rules (Zhang et al., "Staleness-Aware Async-SGD for Distributed Deep Learning", IJCAI
2016; Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter
Server", NIPS 2013):
- mode="sync" (hard synchronization): each update averages one gradient from every worker:
  synchronous SGD, the same steps as data parallelism.
- mode="async": each gradient is applied alone, as it arrives.
- mode="softsync", softsync=n (n-softsync): each update averages the first max(1, workers // n)
  gradients to arrive; n=1 is sync, n=workers is async.
- max_staleness=s (bounded staleness, "stale synchronous parallel"): no worker starts a step
  more than s steps ahead of the slowest worker still training; the server holds a faster
  worker's weights back until the slowest has pushed enough.
- staleness_lr=True (staleness-aware learning rate): each update's learning rate is divided by
  the mean staleness of its gradients (taken as 1 when below 1). A gradient's staleness is the
  number of updates the server applied between the weights it was computed on and the update
  that takes it.

A worker gets new weights only once the update that took its gradient is applied, so it never
computes on weights that miss its own last gradient. The chief is the first worker (the lowest
rank that is not the server): every rank starts from its weights, and scripts let it alone log,
evaluate and save (`is_chief`). When every worker has closed, each gets the final weights.

Messages are typed buffers (an int64 header, then the flat gradient or weights), never pickled.
Every wait ends after MPIDIST_TIMEOUT seconds with an error: a server that hears from no worker
for that long, or a worker that waits that long for its weights.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..runtime.deadlines import poll_until, timeout as call_timeout, wait_for_collective as wait_with_deadline
from ..comm import init
from ..errors import DeadlineError, InvalidArgumentError, MismatchError
from .data import broadcast_module_state
from .pipeline import DTYPES, byte_view

MODES = ("sync", "async", "softsync")
# What a worker's header announces (its first field), and the tags of the four messages.
GRADIENT, DONE = 0, 1
PUSH_HEADER, PUSH_GRADIENT, REPLY_HEADER, REPLY_WEIGHTS = 1, 2, 3, 4
# The settings every rank must agree on, in the order of the agreement table's columns.
AGREED = ("parameters", "dtype", "mode", "gradients per update", "max_staleness", "staleness_lr", "server",
          "starting version", "server has an optimizer")


@dataclasses.dataclass(frozen=True)
class Update:
    """One update the server applied. `version`: the number of updates applied with this one.
    `gradients`: (worker rank, the worker's step, the version its weights had) for each gradient
    averaged, in the order summed (by worker rank). `staleness`: their mean staleness.
    `lr_scale`: what the learning rate was multiplied by (1 / staleness with staleness_lr)."""
    version: int
    gradients: tuple
    staleness: float
    lr_scale: float


def gradients_per_update(mode: str, workers: int, softsync) -> int:
    if mode == "sync":
        return workers
    if mode == "async":
        return 1
    return max(1, workers // softsync)


class ParameterServer:
    """Train `module` with a parameter server on rank `server` of `comm` (default: the world).

    Every rank builds the same module and a ParameterServer around it; the server also passes
    the optimizer (over module.parameters()) that applies the updates, workers may pass None.
    The server then calls serve(); each worker runs its own loop of forward, backward and
    step() (in place of optimizer.step()), then close().
    """

    def __init__(self, module: torch.nn.Module, optimizer=None, comm=None, mode: str = "sync", softsync=None,
                 max_staleness=None, staleness_lr: bool = False, server: int = 0, version: int = 0):
        self.comm = comm if comm is not None else init()
        if self.comm.size < 2:
            raise InvalidArgumentError("a parameter server needs at least 2 ranks (the server and one worker); "
                                       f"this communicator has {self.comm.size}")
        if mode not in MODES:
            raise InvalidArgumentError(f"mode={mode!r}; choose one of {', '.join(MODES)}")
        if (mode == "softsync") != (softsync is not None):
            raise InvalidArgumentError(f"softsync=n goes with mode='softsync' and only with it (got mode={mode!r}, "
                                       f"softsync={softsync!r})")
        if softsync is not None and (not isinstance(softsync, int) or softsync < 1):
            raise InvalidArgumentError(f"softsync must be a positive integer, got {softsync!r}")
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise InvalidArgumentError(f"max_staleness must be None or an integer >= 0, got {max_staleness!r}")
        if not isinstance(version, int) or version < 0:
            raise InvalidArgumentError(f"version must be an integer >= 0 (the number of updates the starting "
                                       f"weights have had), got {version!r}")
        if not isinstance(server, int) or not 0 <= server < self.comm.size:
            raise InvalidArgumentError(f"server={server!r} is not a rank of this communicator "
                                       f"(0..{self.comm.size - 1})")
        self.module = module
        self.optimizer = optimizer
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise InvalidArgumentError("the module has no parameters that require a gradient")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1 or self.params[0].dtype not in DTYPES or not self.params[0].is_floating_point():
            raise InvalidArgumentError(f"the parameters must share one floating-point dtype, got "
                                       f"{sorted(str(d) for d in dtypes)}")
        self.dtype = self.params[0].dtype
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        self.server = server
        self.workers = [r for r in range(self.comm.size) if r != server]
        self.chief = self.workers[0]
        self.is_server = self.comm.rank == server
        self.is_chief = self.comm.rank == self.chief
        self.mode, self.max_staleness, self.staleness_lr = mode, max_staleness, bool(staleness_lr)
        self.per_update = gradients_per_update(mode, len(self.workers), softsync)
        self.version = version  # the number of updates applied to the weights held
        self._sent_weights = None  # server: (version, its weights flattened for replies)
        self.steps = 0  # workers: gradients pushed
        self.closed = False
        self.mpi = self.comm.mpi.Dup()  # point-to-point traffic of its own, apart from collectives
        self._agree(softsync)
        broadcast_module_state(module, self.comm, root=self.chief)

    def _agree(self, softsync) -> None:
        """Every rank's model size and settings, checked on every rank alike, so a mismatch
        raises the same error everywhere before any gradient moves."""
        mine = np.array([self.numel, DTYPES.index(self.dtype), MODES.index(self.mode), self.per_update,
                         -1 if self.max_staleness is None else self.max_staleness, self.staleness_lr,
                         self.server, self.version, self.optimizer is not None], dtype=np.int64)
        table = np.empty((self.comm.size, len(mine)), dtype=np.int64)
        wait_with_deadline(self.mpi.Iallgather(mine, table), self.mpi, "parameter server's agreement on its settings")
        for column, name in enumerate(AGREED[:-1]):
            values = table[:, column]
            if (values != values[0]).any():
                described = "; ".join(f"rank {r}: {self._describe(name, int(v))}" for r, v in enumerate(values))
                raise MismatchError(f"the ranks of the parameter server disagree on {name}: {described}")
        if not table[self.server, -1]:
            raise InvalidArgumentError(f"the server (rank {self.server}) was given no optimizer; pass the optimizer "
                                       "that applies the updates (workers may pass None)")

    @staticmethod
    def _describe(name: str, value: int):
        if name == "dtype":
            return str(DTYPES[value])
        if name == "mode":
            return MODES[value]
        if name == "max_staleness" and value < 0:
            return "None"
        return value

    # ---- the server ------------------------------------------------------------------------

    def serve(self, on_update=None) -> list:
        """Apply the workers' gradients until every worker has closed, then give each the final
        weights. Returns the list of Update applied, in order. `on_update(update)`, if given, is
        called after each update, with the module holding its weights (to checkpoint them)."""
        if not self.is_server:
            raise InvalidArgumentError(f"serve() runs on the server (rank {self.server}); rank {self.comm.rank} is a "
                                       "worker: call step() after each backward, and close() at the end")
        headers = {w: np.empty(3, dtype=np.int64) for w in self.workers}
        receives = {w: self.mpi.Irecv(headers[w], source=w, tag=PUSH_HEADER) for w in self.workers}
        arrived = {}  # worker -> (gradient, its step, its version), waiting for an update
        owed = set()  # workers whose gradient is applied and who wait for their weights
        pushed = dict.fromkeys(self.workers, 0)
        active = set(self.workers)
        history, sends = [], []
        while active:
            worker = self._next_message(receives)
            kind, step, version = (int(v) for v in headers[worker])
            if kind == DONE:
                active.discard(worker)
                del receives[worker]
            else:
                gradient = torch.empty(self.numel, dtype=self.dtype)
                self._wait(self.mpi.Irecv(byte_view(gradient), source=worker, tag=PUSH_GRADIENT),
                           f"the gradient of worker {worker}")
                arrived[worker] = (gradient, step, version)
                pushed[worker] += 1
                receives[worker] = self.mpi.Irecv(headers[worker], source=worker, tag=PUSH_HEADER)
            # An update waits for its share of gradients, unless every worker still training is
            # already waiting (then nobody could bring more).
            if arrived and (len(arrived) >= self.per_update or active <= set(arrived) | owed):
                history.append(self._apply(arrived))
                if on_update is not None:
                    on_update(history[-1])
                owed |= set(arrived)
                arrived = {}
            for waiting in sorted(owed):
                if self._may_start(waiting, pushed, active):
                    owed.discard(waiting)
                    sends.append(self._send_weights(waiting))
            sends = [s for s in sends if not all(r.Test() for r in s[0])]
        for worker in self.workers:
            sends.append(self._send_weights(worker))
        for requests, _buffers in sends:
            for request in requests:
                self._wait(request, "the weights sent to a worker")
        self.mpi.Free()
        return history

    def _may_start(self, worker: int, pushed: dict, active: set) -> bool:
        """Bounded staleness: a worker may start its next step when it is at most max_staleness
        steps ahead of the slowest worker still training."""
        return self.max_staleness is None or pushed[worker] - min(pushed[w] for w in active) <= self.max_staleness

    def _apply(self, arrived: dict) -> Update:
        order = sorted(arrived)  # by worker rank: the same sum whatever order they arrived in
        total = arrived[order[0]][0].clone()
        for worker in order[1:]:
            total += arrived[worker][0]
        total /= len(order)
        staleness = float(np.mean([self.version - arrived[w][2] for w in order]))
        lr_scale = 1.0 / max(1.0, staleness) if self.staleness_lr else 1.0
        for param, part in zip(self.params, total.split(self.numels)):
            param.grad = part.view_as(param).to(param.device)
        learning_rates = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * lr_scale
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, learning_rates):
                group["lr"] = lr
        for param in self.params:
            param.grad = None
        self.version += 1
        return Update(self.version, tuple((w, arrived[w][1], arrived[w][2]) for w in order), staleness, lr_scale)

    def _send_weights(self, worker: int):
        """Start sending the current weights and their version; returns the requests and the
        buffers they read."""
        header = np.array([self.version], dtype=np.int64)
        if self._sent_weights is None or self._sent_weights[0] != self.version:
            # One copy per version, shared by every reply of that version (sync mode answers
            # every worker with the same one): pending sends only read it.
            self._sent_weights = (self.version, self._flat([p.detach() for p in self.params]))
        weights = self._sent_weights[1]
        requests = [self.mpi.Isend(header, dest=worker, tag=REPLY_HEADER),
                    self.mpi.Isend(byte_view(weights), dest=worker, tag=REPLY_WEIGHTS)]
        return requests, (header, weights)

    def _next_message(self, receives: dict) -> int:
        """The worker whose header arrived first among the pending receives."""
        from mpi4py import MPI
        workers = list(receives)
        requests = [receives[w] for w in workers]
        found = []

        def arrived():
            index, flag = MPI.Request.Testany(requests)
            if flag:
                found.append(workers[index])
            return flag

        def timed_out():
            raise DeadlineError(f"parameter server (rank {self.server}): no message from workers {workers} within "
                                f"{call_timeout():.0f} s (MPIDIST_TIMEOUT); a worker that stops training must call "
                                "close()")

        poll_until(arrived, timed_out, yield_seconds=0.01, nap_seconds=0.0005)
        return found[0]

    # ---- a worker --------------------------------------------------------------------------

    def step(self) -> None:
        """Push this worker's gradients (zeros for parameters without one) and wait for the
        weights of the update that took them, which replace the module's parameters."""
        self._check_worker("step()")
        gradient = self._flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        header = np.array([GRADIENT, self.steps, self.version], dtype=np.int64)
        sends = [self.mpi.Isend(header, dest=self.server, tag=PUSH_HEADER),
                 self.mpi.Isend(byte_view(gradient), dest=self.server, tag=PUSH_GRADIENT)]
        self._receive_weights()
        for request in sends:
            self._wait(request, "the gradient sent to the server")
        self.steps += 1

    def close(self) -> None:
        """Tell the server this worker is done, and take the final weights (once every worker
        has closed)."""
        self._check_worker("close()")
        header = np.array([DONE, self.steps, self.version], dtype=np.int64)
        send = self.mpi.Isend(header, dest=self.server, tag=PUSH_HEADER)
        self._receive_weights()
        self._wait(send, "the last message to the server")
        self.closed = True
        self.mpi.Free()

    def _check_worker(self, call: str) -> None:
        if self.is_server:
            raise InvalidArgumentError(f"{call} runs on workers; rank {self.server} is the server: call serve()")
        if self.closed:
            raise InvalidArgumentError(f"{call} after close(): this worker has already left the parameter server")

    def _receive_weights(self) -> None:
        header = np.empty(1, dtype=np.int64)
        self._wait(self.mpi.Irecv(header, source=self.server, tag=REPLY_HEADER), "weights from the server")
        weights = torch.empty(self.numel, dtype=self.dtype)
        self._wait(self.mpi.Irecv(byte_view(weights), source=self.server, tag=REPLY_WEIGHTS), "weights from the server")
        with torch.no_grad():
            for param, part in zip(self.params, weights.split(self.numels)):
                param.copy_(part.view_as(param))
        self.version = int(header[0])

    # ---- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _flat(tensors) -> torch.Tensor:
        """The tensors end to end in one contiguous CPU tensor (what travels)."""
        return torch.cat([t.detach().reshape(-1).cpu() for t in tensors])

    def _wait(self, request, what: str) -> None:
        def timed_out():
            raise DeadlineError(f"rank {self.comm.rank}: {what} did not come within {call_timeout():.0f} s "
                                "(MPIDIST_TIMEOUT): the other side stopped or is stuck")

        poll_until(request.Test, timed_out, yield_seconds=0.01, nap_seconds=0.0005)
