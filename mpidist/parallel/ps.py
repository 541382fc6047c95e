"""Parameter server: dedicated server ranks keep the model's weights and run the optimizer; the
other ranks, the workers, compute gradients on their own batches, push them to the servers and
pull the new weights back.

With several servers (servers=k), each owns one contiguous range of the flattened parameters
(ps_shards.py); a worker sends each server its range of the gradient and receives each one's
range of the weights, all at once. The first server, the coordinator, decides every update
(which workers' gradients it averages) and every reply, and tells the other servers in order:
they apply the same sequence of updates to their ranges and answer the same workers after the
same updates, so a worker's ranges always come from one version (it checks).

Update rules (Zhang et al., "Staleness-Aware Async-SGD for Distributed Deep Learning", IJCAI
2016; Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter
Server", NIPS 2013):
- mode="sync" (hard synchronization): each update averages one gradient from every worker:
  synchronous SGD, the same steps as data parallelism. With backup_workers=b (TensorFlow's
  SyncReplicasOptimizer) it averages the first workers - b gradients computed on the current
  weights; a gradient computed on older weights arrives late and is dropped (ps.dropped, and
  each Update's `dropped`), its worker given the current weights at once.
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

Messages are typed buffers (runtime/wire.py: an int64 header, then the flat gradient or weights),
never pickled. Every wait ends after MPIDIST_TIMEOUT seconds with a DeadlineError naming the
silent side: a server that hears from no worker for that long, or a worker that waits that long
for its weights.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from mpi4py import MPI

from ..comm import init
from ..errors import InvalidArgumentError, MismatchError
from ..runtime import wire
from ..runtime.deadlines import wait_for_collective, wait_until
from . import ps_shards
from .model_state import broadcast_module_state

MODES = ("sync", "async", "softsync")
# What a worker's message announces (its first field), the coordinator's commands to the other
# servers, and the tags of each kind of message (each also uses the next tag, for its payload).
GRADIENT, DONE = 0, 1
APPLY, ANSWER, DROP, FINISH = 0, 1, 2, 3
PUSH, REPLY, COMMAND, SHARE = 1, 3, 5, 7
UNSPLITTABLE = -1  # the layout of a rank whose model has fewer rows than there are servers
# The settings every rank must agree on, in the order of the agreement table's columns.
AGREED = ("parameters", "dtype", "server", "servers", "layout", "mode", "backup_workers", "gradients per update",
          "max_staleness", "staleness_lr", "starting version", "server has an optimizer")


@dataclasses.dataclass(frozen=True)
class Update:
    """One update the server applied. `version`: the number of updates applied with this one.
    `gradients`: (worker rank, the worker's step, the version its weights had) for each gradient
    averaged, in the order summed (by worker rank). `staleness`: their mean staleness.
    `lr_scale`: what the learning rate was multiplied by (1 / staleness with staleness_lr).
    `dropped`: the late gradients (worker, step, version) dropped since the update before
    (backup workers)."""
    version: int
    gradients: tuple
    staleness: float
    lr_scale: float
    dropped: tuple = ()


def gradients_per_update(mode: str, workers: int, softsync, backup_workers: int = 0) -> int:
    if mode == "sync":
        return workers - backup_workers
    if mode == "async":
        return 1
    return max(1, workers // softsync)


class ParameterServer:
    """Train `module` with a parameter server on rank `server` of `comm` (default: the world),
    or on `servers` ranks: a number k (ranks server .. server + k - 1) or a list of ranks, the
    first of them the coordinator.

    Every rank builds the same module and a ParameterServer around it; the server also passes
    the optimizer (over module.parameters()) that applies the updates, workers may pass None.
    The server then calls serve(); each worker runs its own loop of forward, backward and
    step() (in place of optimizer.step()), then close().
    """

    def __init__(self, module: torch.nn.Module, optimizer=None, comm=None, mode: str = "sync", softsync=None,
                 max_staleness=None, staleness_lr: bool = False, server: int = 0, version: int = 0, servers=1,
                 backup_workers: int = 0):
        self.comm = comm if comm is not None else init()
        if self.comm.size < 2:
            raise InvalidArgumentError("a parameter server needs at least 2 ranks (the server and one worker); "
                                       f"this communicator has {self.comm.size}")
        if not isinstance(server, int) or not 0 <= server < self.comm.size:
            raise InvalidArgumentError(f"server={server!r} is not a rank of this communicator "
                                       f"(0..{self.comm.size - 1})")
        self.servers = self._server_ranks(servers, server)
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
        if not isinstance(backup_workers, int) or backup_workers < 0 or (backup_workers and mode != "sync"):
            raise InvalidArgumentError(f"backup_workers must be an integer >= 0, and above 0 only with mode='sync' "
                                       f"(got backup_workers={backup_workers!r}, mode={mode!r})")
        if backup_workers >= self.comm.size - len(self.servers):
            raise InvalidArgumentError(f"backup_workers={backup_workers} leaves no gradient to apply: there are "
                                       f"{self.comm.size - len(self.servers)} workers")
        self.module = module
        self.optimizer = optimizer
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise InvalidArgumentError("the module has no parameters that require a gradient")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1 or not self.params[0].is_floating_point() \
                or str(self.params[0].dtype).removeprefix("torch.") not in wire.ITEMSIZE:
            raise InvalidArgumentError(f"the parameters must share one floating-point dtype, got "
                                       f"{sorted(str(d) for d in dtypes)}")
        self.dtype = self.params[0].dtype
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        self.shapes = [tuple(p.shape) for p in self.params]
        try:  # each server's part of the flat vector
            self.ranges, unsplittable = ps_shards.partition(self.shapes, len(self.servers)), None
        except InvalidArgumentError as error:  # raised after the agreement, so that every rank learns of it
            self.ranges, unsplittable = None, error
        self.server = self.servers[0]  # the coordinator
        self.workers = [r for r in range(self.comm.size) if r not in self.servers]
        self.chief = self.workers[0]
        self.is_server = self.comm.rank in self.servers
        self.is_chief = self.comm.rank == self.chief
        self.mode, self.max_staleness, self.staleness_lr = mode, max_staleness, bool(staleness_lr)
        self.backup_workers = backup_workers
        self.per_update = gradients_per_update(mode, len(self.workers), softsync, backup_workers)
        self.version = version  # the number of updates applied to the weights held
        self.dropped = []  # servers: the late gradients dropped (backup workers), as in Update.dropped
        self._sent_weights = None  # server: (version, its range of the weights for replies)
        self.steps = 0  # workers: gradients pushed
        self.closed = False
        self.mpi = self.comm.mpi.Dup()  # point-to-point traffic of its own, apart from collectives
        self._agree(unsplittable)
        broadcast_module_state(module, self.comm, root=self.chief)

    def _server_ranks(self, servers, server: int) -> list:
        if isinstance(servers, int) and not isinstance(servers, bool):
            ranks = list(range(server, server + servers))
            given = f"servers={servers} from server={server}"
        else:
            if server != 0:
                raise InvalidArgumentError(f"server={server} with a list of servers: the list's first rank is the "
                                           "coordinator, so give only servers=[...]")
            ranks = list(servers) if isinstance(servers, (list, tuple)) else []
            given = f"servers={servers!r}"
        if not ranks or len(set(ranks)) != len(ranks) \
                or not all(isinstance(r, int) and 0 <= r < self.comm.size for r in ranks):
            raise InvalidArgumentError(f"{given}: the servers must be distinct ranks of this communicator "
                                       f"(0..{self.comm.size - 1}), at least one")
        if len(ranks) >= self.comm.size:
            raise InvalidArgumentError(f"{given} leaves no worker among the {self.comm.size} ranks")
        return ranks

    def _agree(self, unsplittable) -> None:
        """Every rank's model size and settings, checked on every rank alike, so a mismatch
        raises the same error everywhere before any gradient moves."""
        layout = UNSPLITTABLE if unsplittable else \
            ps_shards.fingerprint(self.shapes, [(rank, *span) for rank, span in zip(self.servers, self.ranges)])
        mine = np.array([self.numel, wire.code_of(wire.name_of(self.dtype)), self.server, len(self.servers), layout,
                         MODES.index(self.mode), self.backup_workers, self.per_update,
                         -1 if self.max_staleness is None else self.max_staleness, self.staleness_lr, self.version,
                         self.optimizer is not None], dtype=np.int64)
        table = np.empty((self.comm.size, len(mine)), dtype=np.int64)
        wait_for_collective(self.mpi.Iallgather(mine, table), self.mpi, "parameter server's agreement on its settings")
        for column, name in enumerate(AGREED[:-1]):
            values = table[:, column]
            if (values != values[0]).any():
                described = "; ".join(f"rank {r}: {self._describe(name, int(v))}" for r, v in enumerate(values))
                raise MismatchError(f"the ranks of the parameter server disagree on {name}: {described}")
        if unsplittable:
            raise unsplittable
        without = [r for r in self.servers if not table[r, -1]]
        if without:
            raise InvalidArgumentError(f"the server (rank {without[0]}) was given no optimizer; pass the optimizer "
                                       "that applies the updates (workers may pass None)")

    @staticmethod
    def _describe(name: str, value: int):
        if name == "dtype":
            return str(wire.torch_dtype(wire.DTYPES[value]))
        if name == "mode":
            return MODES[value]
        if name == "layout" and value == UNSPLITTABLE:
            return "a model too small to split over the servers"
        if name == "max_staleness" and value < 0:
            return "None"
        return value

    # ---- the servers -----------------------------------------------------------------------

    def serve(self, on_update=None) -> list:
        """Apply the workers' gradients until every worker has closed, then give each the final
        weights. Returns the list of Update applied, in order (the same on every server).
        `on_update(update)`, if given, is called after each update, with the module holding its
        weights (with several servers, only this server's range of them until serve() returns)."""
        if not self.is_server:
            raise InvalidArgumentError(f"serve() runs on {self._server_name}; rank {self.comm.rank} is a worker: "
                                       "call step() after each backward, and close() at the end")
        history = []
        if self.comm.rank == self.server:
            sends = self._coordinate(history, on_update)
        else:
            sends = self._follow(history, on_update)
        for worker in self.workers:
            sends.append(self._send_weights(worker))
        sends += self._share_final_weights()
        for outgoing in sends:
            outgoing.wait(self._who, f"the message sent to rank {outgoing.dest}", f"rank {outgoing.dest}")
        self.mpi.Free()
        return history

    def _coordinate(self, history: list, on_update) -> list:
        """The coordinator's loop: take the workers' messages, decide each update and each
        reply, and tell the other servers in the same order. Returns the sends still going."""
        receives = {w: wire.Incoming(self.mpi, w, PUSH) for w in self.workers}
        arrived = {}  # worker -> (gradient, its step, its version), waiting for an update
        owed = set()  # workers whose gradient is applied (or dropped) and who wait for their weights
        late = []  # gradients dropped since the last update
        pushed = dict.fromkeys(self.workers, 0)
        active = set(self.workers)
        sends = []
        while active:
            worker = self._next_message(receives)
            incoming = receives[worker]
            kind, step, version = incoming.fields
            if kind == DONE:
                active.discard(worker)
                del receives[worker]
            else:
                gradient = incoming.receive_payload(self._who, f"the gradient of worker {worker}", f"worker {worker}")
                pushed[worker] += 1
                receives[worker] = wire.Incoming(self.mpi, worker, PUSH)
                if self.backup_workers and version < self.version:  # a straggler's, for an update already applied
                    sends += self._command(DROP, [worker])
                    late.append(self._drop(worker, step, version))
                    owed.add(worker)
                else:
                    arrived[worker] = (gradient, step, version)
            # An update waits for its share of gradients, unless every worker still training is
            # already waiting (then nobody could bring more).
            if arrived and (len(arrived) >= self.per_update or active <= set(arrived) | owed):
                sends += self._command(APPLY, sorted(arrived))
                history.append(self._apply(arrived, tuple(late)))
                if on_update is not None:
                    on_update(history[-1])
                owed |= set(arrived)
                arrived, late = {}, []
            for waiting in sorted(owed):
                if self._may_start(waiting, pushed, active):
                    owed.discard(waiting)
                    sends += self._command(ANSWER, [waiting])
                    sends.append(self._send_weights(waiting))
            sends = [outgoing for outgoing in sends if not outgoing.test()]
        return sends + self._command(FINISH, [])

    def _follow(self, history: list, on_update) -> list:
        """Another server's loop: do what the coordinator commands, in its order, on this
        server's range. Returns the sends still going."""
        sends, late = [], []
        coordinator = f"the coordinating server (rank {self.server})"
        while True:
            workers, (kind,) = wire.receive(self.mpi, self.server, COMMAND, self._who, "the coordinator's next "
                                            "command", coordinator)
            workers = workers.tolist()
            if kind == FINISH:
                return sends
            if kind == ANSWER:
                sends.append(self._send_weights(workers[0]))
            elif kind == DROP:
                _, step, version = self._receive_gradient(workers[0])
                late.append(self._drop(workers[0], step, version))
            else:
                history.append(self._apply({w: self._receive_gradient(w) for w in workers}, tuple(late)))
                if on_update is not None:
                    on_update(history[-1])
                late = []
            sends = [outgoing for outgoing in sends if not outgoing.test()]

    def _command(self, kind: int, workers: list) -> list:
        """Start sending a command (the workers it concerns) to every other server."""
        payload = torch.tensor(workers, dtype=torch.int64)
        return [wire.send(self.mpi, payload, follower, COMMAND, fields=(kind,)) for follower in self.servers[1:]]

    def _receive_gradient(self, worker: int) -> tuple:
        gradient, (_, step, version) = wire.receive(self.mpi, worker, PUSH, self._who,
                                                    f"the gradient of worker {worker}", f"worker {worker}")
        return gradient, step, version

    def _drop(self, worker: int, step: int, version: int) -> tuple:
        self.dropped.append((worker, step, version))
        return self.dropped[-1]

    def _may_start(self, worker: int, pushed: dict, active: set) -> bool:
        """Bounded staleness: a worker may start its next step when it is at most max_staleness
        steps ahead of the slowest worker still training."""
        return self.max_staleness is None or pushed[worker] - min(pushed[w] for w in active) <= self.max_staleness

    def _apply(self, arrived: dict, dropped: tuple) -> Update:
        order = sorted(arrived)  # by worker rank: the same sum whatever order they arrived in
        total = arrived[order[0]][0].clone()
        for worker in order[1:]:
            total += arrived[worker][0]
        total /= len(order)
        staleness = float(np.mean([self.version - arrived[w][2] for w in order]))
        lr_scale = 1.0 / max(1.0, staleness) if self.staleness_lr else 1.0
        self._set_gradients(total)
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
        return Update(self.version, tuple((w, arrived[w][1], arrived[w][2]) for w in order), staleness, lr_scale,
                      dropped)

    def _set_gradients(self, part: torch.Tensor) -> None:
        """This server's range of the mean gradient as the parameters' gradients: none for a
        parameter outside the range (the optimizer skips it), zeros outside the range's rows
        for one the range cuts (an elementwise optimizer leaves the owned rows exact)."""
        start, end = self._range
        offset = 0
        for param, numel in zip(self.params, self.numels):
            low, high = max(start, offset), min(end, offset + numel)
            if low >= high:
                param.grad = None
            elif high - low == numel:
                param.grad = part[low - start:high - start].view_as(param).to(param.device)
            else:
                grad = torch.zeros(numel, dtype=part.dtype)
                grad[low - offset:high - offset] = part[low - start:high - start]
                param.grad = grad.view_as(param).to(param.device)
            offset += numel

    def _send_weights(self, worker: int) -> wire.Outgoing:
        """Start sending this server's range of the current weights and their version."""
        if self._sent_weights is None or self._sent_weights[0] != self.version:
            # One copy per version, shared by every reply of that version (sync mode answers
            # every worker with the same one): pending sends only read it.
            start, end = self._range
            self._sent_weights = (self.version, self._flat([p.detach() for p in self.params])[start:end])
        return wire.send(self.mpi, self._sent_weights[1], worker, REPLY, fields=(self.version,))

    def _share_final_weights(self) -> list:
        """Every server sends its range of the final weights to the others and takes theirs, so
        that every server ends with the whole model."""
        if len(self.servers) == 1:
            return []
        start, end = self._range
        weights = self._flat([p.detach() for p in self.params])
        others = [s for s in self.servers if s != self.comm.rank]
        sends = [wire.send(self.mpi, weights[start:end], other, SHARE) for other in others]
        for other, (low, high) in zip(self.servers, self.ranges):
            if other != self.comm.rank:
                weights[low:high], _ = wire.receive(self.mpi, other, SHARE, self._who,
                                                    f"the final weights of server {other}", f"server {other}")
        self._load(weights)
        return sends

    def _next_message(self, receives: dict) -> int:
        """The worker whose header arrived first among the pending receives."""
        workers = list(receives)
        requests = [receives[w].request for w in workers]
        found = []

        def arrived():
            index, flag = MPI.Request.Testany(requests)
            if flag:
                found.append(workers[index])
            return flag

        wait_until(arrived, self._who, "the wait for a message from the workers", f"workers {workers}",
                   peers=workers, advice="A worker that stops training must call close()")
        return found[0]

    # ---- a worker --------------------------------------------------------------------------

    def step(self) -> None:
        """Push this worker's gradients (zeros for parameters without one), each server its
        range, and wait for the weights of the update that took them, which replace the
        module's parameters."""
        self._check_worker("step()")
        gradient = self._flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        outgoing = [wire.send(self.mpi, gradient[start:end], server, PUSH, fields=(GRADIENT, self.steps, self.version))
                    for server, (start, end) in zip(self.servers, self.ranges)]
        self._receive_weights()
        for sent in outgoing:
            sent.wait(self._who, "the gradient sent to the server", f"the server (rank {sent.dest})")
        self.steps += 1

    def close(self) -> None:
        """Tell the coordinating server this worker is done, and take the final weights (once
        every worker has closed)."""
        self._check_worker("close()")
        nothing = torch.empty(0, dtype=self.dtype)
        outgoing = wire.send(self.mpi, nothing, self.server, PUSH, fields=(DONE, self.steps, self.version))
        self._receive_weights()
        outgoing.wait(self._who, "the last message to the server", f"the server (rank {self.server})")
        self.closed = True
        self.mpi.Free()

    def _check_worker(self, call: str) -> None:
        if self.is_server:
            raise InvalidArgumentError(f"{call} runs on workers; rank {self.comm.rank} is a server: call serve()")
        if self.closed:
            raise InvalidArgumentError(f"{call} after close(): this worker has already left the parameter server")

    def _receive_weights(self) -> None:
        """Every server's range of the weights, received at once; they must share one version."""
        incoming = [wire.Incoming(self.mpi, server, REPLY) for server in self.servers]
        weights = torch.empty(self.numel, dtype=self.dtype)
        versions = []
        for reply, (start, end) in zip(incoming, self.ranges):
            silent = f"the server (rank {reply.source})"
            reply.wait(self._who, "the weights from the server", silent)
            weights[start:end] = reply.receive_payload(self._who, "the weights from the server", silent)
            versions.append(reply.fields[0])
        if len(set(versions)) > 1:
            raise MismatchError(f"{self._who}: the servers {self.servers} sent weights of versions {versions}; "
                                "every server must answer with the same update")
        self._load(weights)
        self.version = versions[0]

    # ---- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _flat(tensors) -> torch.Tensor:
        """The tensors end to end in one contiguous CPU tensor (what travels)."""
        return torch.cat([t.detach().reshape(-1).cpu() for t in tensors])

    def _load(self, weights: torch.Tensor) -> None:
        with torch.no_grad():
            for param, part in zip(self.params, weights.split(self.numels)):
                param.copy_(part.view_as(param))

    @property
    def _range(self) -> tuple:
        return self.ranges[self.servers.index(self.comm.rank)]

    @property
    def _who(self) -> str:
        return f"rank {self.comm.rank} ({'the parameter server' if self.is_server else 'a worker'})"

    @property
    def _server_name(self) -> str:
        if len(self.servers) == 1:
            return f"the server (rank {self.server})"
        return f"the servers (ranks {self.servers})"
