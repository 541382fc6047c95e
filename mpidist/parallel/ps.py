"""Parameter server: dedicated server ranks keep the model's weights and run the optimizer; the
other ranks, the workers, compute gradients on their own batches, push them to the servers and
pull the new weights back.

With several servers (servers=k), each owns one contiguous range of the flattened parameters
(ps_shards.py); a worker sends each server its range of the gradient and receives each one's
range of the weights, all at once. The first server, the coordinator, decides every update
(which workers' gradients it averages) and every reply, and tells the other servers in order:
they apply the same sequence of updates to their ranges and answer the same workers after the
same updates, so a worker's ranges always come from one version (it checks). Each of several
servers holds its range apart, in tensors of its own stepped by optimizers over them alone
(ps_shards.OwnedRange; its rows of a sparse table view the module's table), and copies it into
its module when the module is looked at (on_update, the end). gather_state() brings every
server's part of the weights and of the optimizers' state to the coordinator, for checkpoints.

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

Sparse rows (ps_sparse.py): the weights of nn.Embedding and nn.EmbeddingBag with sparse=True
(with sparse_embeddings=True, of every embedding) are tables that travel by rows, each table's
rows split over the servers in row ranges. Before its forward pass a worker pulls the rows its
batch uses (pull_rows); its step pushes only the rows of its gradient (unique indices and summed
rows), and the servers give their optimizers the workers' mean as a torch sparse gradient, so
torch's own sparse rules apply (SGD, Adagrad, SparseAdam). A pull goes through the coordinator's
order like everything else: every server answers it after the same update, with that update's
version; when it is newer than the worker's weights, the servers send their dense ranges along
and the worker pulls again the rows it pulled before in the step, so a worker's rows and dense
weights always come from one version (in sync mode, without backup workers, the version never
moves between a worker's reply and its next push).

A worker's bad input (pull_rows on a module that is no table of the model, ids out of range, a
gradient on rows it did not pull) stops the whole parameter server: the worker tells every
server, the coordinator tells every other worker in its next reply, and every rank raises the
same error. So does an error in a server's update, which that server tells every rank. Arguments
refused on some ranks only join the agreement on the settings, so every rank raises at once.
request_stop() asks every worker to stop, through the coordinator's replies (`stopping`).

Messages are typed buffers (runtime/wire.py: an int64 header, then the flat gradient, weights,
row indices or rows), never pickled. Every wait ends after MPIDIST_TIMEOUT seconds with a
DeadlineError naming the silent side: a server that hears from no worker for that long, or a
worker that waits that long for its weights. A rank that dies is another matter, under ULFM
(ps_survival.py): the servers drop a dead worker and go on, or every survivor raises the same
RankDiedError.
"""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import torch
from mpi4py import MPI

from ..comm import init
from ..errors import InvalidArgumentError, MismatchError, MpidistError
from ..runtime import wire
from ..runtime.deadlines import wait_for_collective, wait_until
from ..runtime.mpi import fault_tolerant, is_process_failure, return_errors
from . import ps_shards, ps_sparse, ps_survival
from .model_state import broadcast_module_state

MODES = ("sync", "async", "softsync")
# What a worker's message announces (its first field), the coordinator's commands to the other
# servers, what a server's reply to a worker holds (its second field), and the tags of each kind
# of message (each also uses the next tag, for its payload). DIED is no message: it stands for a
# worker that died (ps_survival.py), and LOST tells the other servers to drop it.
GRADIENT, DONE, PULL, FAILED, DIED = 0, 1, 2, 3, 4
APPLY, ANSWER, DROP, FINISH, ANSWER_PULL, FAIL, LOST = 0, 1, 2, 3, 4, 5, 6
SENT_WEIGHTS, SENT_ROWS, SENT_FAILURE = 0, 1, 2
PUSH, REPLY, COMMAND, SHARE, SPARSE, STATE = 1, 3, 5, 7, 9, 11
UNSPLITTABLE = -1  # the layout of a rank whose model has fewer rows than there are servers
# The settings every rank must agree on, in the order of the agreement table's columns; three more
# columns follow: two that only the servers fill, whether each has an optimizer and the first table
# its optimizer cannot apply a sparse gradient to (-1: none), then 1 on a rank whose arguments were
# refused (its other columns 0).
AGREED = ("parameters", "dtype", "server", "servers", "layout", "mode", "backup_workers", "gradients per update",
          "max_staleness", "staleness_lr", "starting version", "sparse tables")
# The errors a worker's bad input raises on every rank, by their code in its failure message; the
# last, that of an error in a server's update (its own exception on that server).
FAILURES = (InvalidArgumentError, MismatchError, MpidistError)


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
    step() (in place of optimizer.step()), then close(). `optimizer` may be a list of
    optimizers (SparseAdam for the tables and Adam for the rest, say).

    Embedding weights with sparse=True (all of them with sparse_embeddings=True) go by rows: a
    worker calls pull_rows(embedding, ids) before its forward pass for the rows it uses.
    `bytes_pushed` and `bytes_pulled` count, on a worker, the payload bytes it sent and received.
    """

    def __init__(self, module: torch.nn.Module, optimizer=None, comm=None, mode: str = "sync", softsync=None,
                 max_staleness=None, staleness_lr: bool = False, server: int = 0, version: int = 0, servers=1,
                 backup_workers: int = 0, sparse_embeddings: bool = False):
        self.comm = comm if comm is not None else init()
        if self.comm.size < 2:
            raise InvalidArgumentError("a parameter server needs at least 2 ranks (the server and one worker); "
                                       f"this communicator has {self.comm.size}")
        self.mpi = None
        try:
            self._build(module, optimizer, mode, softsync, max_staleness, staleness_lr, server, version, servers,
                        backup_workers, sparse_embeddings)
        except Exception as error:
            made = [mpi for mpi in (self.comm.mpi, self.mpi) if mpi is not None]
            if not (fault_tolerant() and is_process_failure(error, made)):
                raise
            raise ps_survival.ending_at_start(self) from error

    def _build(self, module, optimizer, mode, softsync, max_staleness, staleness_lr, server, version, servers,
               backup_workers, sparse_embeddings):
        """Take the arguments, agree on them with the other ranks and give every rank the chief
        worker's weights (collective over comm)."""
        self.mpi = self.comm.mpi.Dup()  # point-to-point traffic of its own, apart from collectives
        if fault_tolerant():  # a death comes back as an error (ps_survival.py)
            return_errors(self.mpi)
        try:  # a refusal on some ranks only joins the agreement, so that no rank waits for the others
            unsplittable, declined = self._take_settings(module, optimizer, mode, softsync, max_staleness,
                                                         staleness_lr, server, version, servers, backup_workers,
                                                         sparse_embeddings), None
        except InvalidArgumentError as error:
            unsplittable, declined = None, error
        self._agree(unsplittable, declined)
        broadcast_module_state(module, self.comm, root=self.chief)
        # A server of several steps its own rows alone; one server steps the user's optimizer,
        # whose state is then the whole model's (what checkpoints save).
        self._owned = ps_shards.OwnedRange(
            self.params, self._range, self.optimizers,
            [(table.weight, table.row_range(self.servers.index(self.comm.rank))) for table in self.tables]) \
            if self.is_server and len(self.servers) > 1 else None

    def _take_settings(self, module, optimizer, mode, softsync, max_staleness, staleness_lr, server, version,
                       servers, backup_workers, sparse_embeddings):
        """Check and take the arguments of this rank; returns the error of a model too small to
        split over the servers (raised after the agreement, so that every rank learns of it)."""
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
        self.optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else \
            [] if optimizer is None else [optimizer]
        trained = [p for p in module.parameters() if p.requires_grad]
        if not trained:
            raise InvalidArgumentError("the module has no parameters that require a gradient")
        dtypes = {p.dtype for p in trained}
        if len(dtypes) > 1 or not trained[0].is_floating_point() \
                or str(trained[0].dtype).removeprefix("torch.") not in wire.ITEMSIZE:
            raise InvalidArgumentError(f"the parameters must share one floating-point dtype, got "
                                       f"{sorted(str(d) for d in dtypes)}")
        self.dtype = trained[0].dtype
        self.tables = ps_sparse.find_tables(module, len(self.servers), sparse_embeddings)
        by_rows = {id(table.weight) for table in self.tables}
        self.params = [p for p in trained if id(p) not in by_rows]  # the dense path's, end to end
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        self.shapes = [tuple(p.shape) for p in self.params]
        try:  # each server's part of the flat vector
            self.ranges, unsplittable = self._partition(), None
        except InvalidArgumentError as error:
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
        self.lost = []  # servers: the workers dropped when they died, as ps_survival.Lost
        self._sent_weights = None  # server: (version, its range of the weights for replies)
        self._serving = False  # server: within serve()
        self._server_failures = {}  # the coordinator in serve(): other server -> the receive of its failure
        self._state_sends = []  # a server of several: its parts of gather_state() still being sent
        self.steps = 0  # workers: gradients pushed
        self.bytes_pushed = self.bytes_pulled = 0  # workers: payload bytes sent and received
        self._pulled = {}  # workers: table index -> the rows pulled in this step (sorted, unique)
        self.closed = False
        self.stopping = False  # the coordinator and workers: every worker is to close (request_stop())
        self._stop_asked = False  # a worker: request_stop() was called
        return unsplittable

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

    def _partition(self) -> list:
        if not self.params:  # a model of tables only: nothing goes the dense path
            return [(0, 0)] * len(self.servers)
        return ps_shards.partition(self.shapes, len(self.servers))

    def _agree(self, unsplittable, declined) -> None:
        """Every rank's model size and settings, checked on every rank alike, so a mismatch
        raises the same error everywhere before any gradient moves; then whether each server
        has an optimizer, and one that can apply the tables' sparse gradients. `declined`: the
        error of this rank's arguments (the others raise it too, naming this rank)."""
        if declined is None:
            tables = [(t.name, tuple(t.weight.shape), tuple(t.bounds)) for t in self.tables]
            layout = UNSPLITTABLE if unsplittable else ps_shards.fingerprint(
                self.shapes, [(rank, *span) for rank, span in zip(self.servers, self.ranges)] + tables)
            refusals = [ps_sparse.refusal(self.optimizers, t) for t in self.tables] if self.is_server else []
            refused = next((index for index, refusal in enumerate(refusals) if refusal), -1)
            mine = np.array([self.numel, wire.code_of(wire.name_of(self.dtype)), self.server, len(self.servers),
                             layout, MODES.index(self.mode), self.backup_workers, self.per_update,
                             -1 if self.max_staleness is None else self.max_staleness, self.staleness_lr,
                             self.version, len(self.tables), bool(self.optimizers), refused, 0], dtype=np.int64)
        else:
            mine = np.zeros(len(AGREED) + 3, dtype=np.int64)
            mine[-1] = 1
        table = np.empty((self.comm.size, len(mine)), dtype=np.int64)
        wait_for_collective(self.mpi.Iallgather(mine, table), self.mpi, "parameter server's agreement on its settings")
        self._raise_declined(table[:, -1].nonzero()[0].tolist(), declined)
        for column, name in enumerate(AGREED):
            values = table[:, column]
            if (values != values[0]).any():
                described = "; ".join(f"rank {r}: {self._describe(name, int(v))}" for r, v in enumerate(values))
                raise MismatchError(f"the ranks of the parameter server disagree on {name}: {described}")
        if unsplittable:
            raise unsplittable
        without = [r for r in self.servers if not table[r, -3]]
        if without:
            raise InvalidArgumentError(f"the server (rank {without[0]}) was given no optimizer; pass the optimizer "
                                       "that applies the updates (workers may pass None)")
        refusing = [r for r in self.servers if table[r, -2] >= 0]
        if refusing:  # the refusing server's words, on every rank
            words = torch.tensor(list(refusals[refused].encode()), dtype=torch.uint8) \
                if self.comm.rank == refusing[0] else None
            words = wire.broadcast(self.mpi, words, refusing[0], self._who, "the server's refusal",
                                   f"rank {refusing[0]}")
            raise InvalidArgumentError(f"the server (rank {refusing[0]}): {bytes(words.tolist()).decode()}")

    def _raise_declined(self, declining: list, declined) -> None:
        """Every rank raises when any rank's arguments were refused (`declining`, in rank order):
        such a rank its own error, the others that of the first of them, naming it."""
        if not declining:
            return
        words = torch.tensor(list(str(declined).encode()), dtype=torch.uint8) \
            if self.comm.rank == declining[0] else None
        words = wire.broadcast(self.mpi, words, declining[0], f"rank {self.comm.rank}", "the refusal of its arguments",
                               f"rank {declining[0]}")
        self.mpi.Free()
        if declined is not None:
            raise declined
        raise InvalidArgumentError(f"rank {declining[0]} refused its arguments to the parameter server: "
                                   f"{bytes(words.tolist()).decode()}")

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

    @ps_survival.ends_on_death
    def serve(self, on_update=None) -> list:
        """Apply the workers' gradients until every worker has closed, then give each the final
        weights. Returns the list of Update applied, in order (the same on every server).
        `on_update(update)`, if given, is called after each update, with the module holding its
        weights (with several servers, only this server's range of them until serve() returns)."""
        if not self.is_server:
            raise InvalidArgumentError(f"serve() runs on {self._server_name}; rank {self.comm.rank} is a worker: "
                                       "call step() after each backward, and close() at the end")
        history, self._serving = [], True
        if self.comm.rank == self.server:
            sends = self._coordinate(history, on_update)
        else:
            sends = self._follow(history, on_update)
        for worker in [w for w in self.workers if w not in {lost.worker for lost in self.lost}]:
            sends.append(self._send_weights(worker))
            sends += self._send_table_ranges(worker, REPLY)
        sends += self._share_final_weights()
        sends += self._gather(weights=False) + self._state_sends
        for failure in self._server_failures.values():  # none came
            failure.request.Cancel()
            failure.request.Wait()
        ps_survival.wait_last_sends(self, sends)
        self._serving = False
        self.mpi.Free()
        return history

    def gather_state(self) -> None:
        """Gather the whole model and optimizer state on the coordinating server, for a
        checkpoint. Every server calls it at the same update (in serve()'s on_update); the
        coordinator's module then holds the update's whole weights, tables too, and its
        optimizers (the user's) the whole state, as those of one server do; the other servers
        send their parts and go on at once. With one server there is nothing to gather."""
        if not self.is_server or not self._serving:
            raise InvalidArgumentError("gather_state() runs on the servers during serve(), in on_update")
        if len(self.servers) > 1:
            self._state_sends = [outgoing for outgoing in self._state_sends if not outgoing.test()]
            self._state_sends += self._gather(weights=True)

    def _gather(self, weights: bool) -> list:
        """The optimizers' state (and, with `weights`, the weights) of every server on the
        coordinator: another server starts sending its part and returns the sends."""
        if len(self.servers) == 1:
            return []
        index = self.servers.index(self.comm.rank)
        pieces = self._owned.state_pieces()
        if self.comm.rank != self.server:
            parts = [self._owned.weights()] + [table.weight.detach()[slice(*table.row_range(index))].clone()
                                               for table in self.tables] if weights else []
            contents, tensors = [], []
            for optimizer, position, span, state in pieces:
                named = {}
                for name, (spread, value) in state.items():
                    named[name] = [spread, len(tensors)] if torch.is_tensor(value) else [None, value]
                    if torch.is_tensor(value):
                        tensors.append(value)
                contents.append([optimizer, position, list(span), named])
            words = torch.tensor(list(json.dumps(contents).encode()), dtype=torch.uint8)
            return [wire.send(self.mpi, part, self.server, STATE) for part in [*parts, words, *tensors]]
        flat = torch.empty(self.numel, dtype=self.dtype)
        if weights:
            flat[slice(*self._range)] = self._owned.weights()
        for other, (low, high) in zip(self.servers[1:], self.ranges[1:]):
            what = f"the state of server {other}"
            if weights:
                flat[low:high], _ = self._receive_from_server(other, STATE, what)
                for table in self.tables:
                    rows, _ = self._receive_from_server(other, STATE, what)
                    with torch.no_grad():
                        table.weight[slice(*table.row_range(self.servers.index(other)))] = rows.to(table.weight.device)
            words, _ = self._receive_from_server(other, STATE, what)
            contents = json.loads(bytes(words.tolist()).decode())
            count = sum(spread is not None for *_, named in contents for spread, _ in named.values())
            tensors = [self._receive_from_server(other, STATE, what)[0] for _ in range(count)]
            pieces += [(optimizer, position, tuple(span),
                        {name: (bool(spread), value if spread is None else tensors[value])
                         for name, (spread, value) in named.items()})
                       for optimizer, position, span, named in contents]
        if weights:
            self._load(flat)
        ps_shards.assemble_state(self.optimizers, pieces)
        return []

    def _coordinate(self, history: list, on_update) -> list:
        """The coordinator's loop: take the workers' messages, decide each update and each
        reply, and tell the other servers in the same order. Returns the sends still going."""
        receives = {w: wire.Incoming(self.mpi, w, PUSH) for w in self.workers}
        # The other servers send the coordinator nothing but the failure of their update.
        self._server_failures = {s: wire.Incoming(self.mpi, s, PUSH) for s in self.servers[1:]}
        arrived = {}  # worker -> (gradient, its step, its version), waiting for an update
        owed = set()  # workers whose gradient is applied (or dropped) and who wait for their weights
        late = []  # gradients dropped since the last update
        pushed = dict.fromkeys(self.workers, 0)
        active = set(self.workers)
        sends = []
        started = time.time()
        while active:
            worker = self._next_message(receives, self._server_failures)
            incoming = receives.get(worker) or self._server_failures[worker]
            kind, step, version = incoming.fields[:3]
            if kind in (DONE, DIED):
                active.discard(worker)
                del receives[worker]
                if kind == DIED:  # dropped: its gradient not yet applied goes with it
                    arrived.pop(worker, None)
                    owed.discard(worker)
                    sends += self._command(LOST, [worker, pushed[worker]])
                    ps_survival.report(self, worker, pushed[worker], started)
            elif kind == FAILED:
                self._stop(worker, incoming, sends)
            elif kind == PULL:
                pull = self._rest_of_message(worker, receives, lambda: incoming.receive_payload(
                    self._who, f"the rows worker {worker} pulls", f"worker {worker}"))
                if pull is None:
                    continue
                receives[worker] = wire.Incoming(self.mpi, worker, PUSH)
                sends += self._command(ANSWER_PULL, [worker])
                sends += self._answer_pull(worker, pull, incoming.fields)
            else:
                gradient = self._rest_of_message(worker, receives, lambda: (incoming.receive_payload(
                    self._who, f"the gradient of worker {worker}", f"worker {worker}"),
                    self._receive_gradient_rows(worker)))
                if gradient is None:
                    continue
                pushed[worker] += 1
                self.stopping |= bool(incoming.fields[3])  # the worker asks every worker to stop
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
                history.append(self._apply(arrived, tuple(late), on_update))
                owed |= set(arrived)
                arrived, late = {}, []
            for waiting in sorted(owed):
                if self._may_start(waiting, pushed, active):
                    owed.discard(waiting)
                    sends += self._command(ANSWER, [waiting])
                    sends.append(self._send_weights(waiting))
            sends = ps_survival.pending(self, sends)
        return sends + self._command(FINISH, [])

    def _rest_of_message(self, worker: int, receives: dict, receive):
        """receive(): the rest of a worker's message, whose header has come. None when the worker
        died in the middle of it and the parameter server goes on without it: its receive is
        then a ps_survival.Death, taken as its death at the next wait (the other servers had no
        command to take its message yet, so they drop it together)."""
        try:
            return receive()
        except Exception as error:
            for dead in ps_survival.dead_workers(self, error, [worker]):
                receives[dead] = ps_survival.Death(DIED)
            return None

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
            elif kind == ANSWER_PULL:
                pull, fields = wire.receive(self.mpi, workers[0], PUSH, self._who,
                                            f"the rows worker {workers[0]} pulls", f"worker {workers[0]}")
                sends += self._answer_pull(workers[0], pull, fields)
            elif kind == FAIL:
                self._stop(workers[0], wire.Incoming(self.mpi, workers[0], PUSH), sends)
            elif kind == LOST:
                ps_survival.report(self, *workers, started=0.0)
            elif kind == DROP:
                _, step, version = self._receive_gradient(workers[0])
                late.append(self._drop(workers[0], step, version))
            else:
                history.append(self._apply({w: self._receive_gradient(w) for w in workers}, tuple(late), on_update))
                late = []
            sends = ps_survival.pending(self, sends)

    def _command(self, kind: int, workers: list) -> list:
        """Start sending a command (the workers it concerns) to every other server."""
        payload = torch.tensor(workers, dtype=torch.int64)
        return [wire.send(self.mpi, payload, follower, COMMAND, fields=(kind,)) for follower in self.servers[1:]]

    def _receive_gradient(self, worker: int) -> tuple:
        dense, (_, step, version, _) = wire.receive(self.mpi, worker, PUSH, self._who,
                                                    f"the gradient of worker {worker}", f"worker {worker}")
        return (dense, self._receive_gradient_rows(worker)), step, version

    def _receive_gradient_rows(self, worker: int) -> list:
        """[(indices, rows)] of each table's gradient in this server's row ranges, as sent
        after the dense range."""
        parts = []
        for table in self.tables:
            what, silent = f"the gradient rows of {table.name} from worker {worker}", f"worker {worker}"
            indices, _ = wire.receive(self.mpi, worker, SPARSE, self._who, what, silent)
            rows, _ = wire.receive(self.mpi, worker, SPARSE, self._who, what, silent)
            parts.append((indices, rows))
        return parts

    def _answer_pull(self, worker: int, pull: torch.Tensor, fields: tuple) -> list:
        """Start sending the rows a worker pulls, of the current version, and this server's
        range of the dense weights too when the worker's are older."""
        _, index, version = fields
        rows = self.tables[index].weight.detach()[pull]
        sends = [wire.send(self.mpi, rows, worker, REPLY, fields=(self.version, SENT_ROWS))]
        if version != self.version:
            sends.append(self._send_weights(worker))
        return sends

    def _stop(self, worker: int, incoming: wire.Incoming, sends: list):
        """A worker's bad input, or another server's failed update: the coordinator tells the
        other servers, and every other worker in its next reply; then this server raises the
        error, naming the rank."""
        silent = f"{'server' if worker in self.servers else 'worker'} {worker}"
        incoming.wait(self._who, f"the failure of {silent}", silent)
        words = incoming.receive_payload(self._who, f"the failure of {silent}", silent)
        _, code, _ = incoming.fields
        if self.comm.rank == self.server:
            sends += self._command(FAIL, [worker])
            sends += [wire.send(self.mpi, words, other, REPLY, fields=(self.version, SENT_FAILURE, code, worker))
                      for other in self.workers if other != worker]
            for outgoing in sends:
                outgoing.wait(self._who, f"the message sent to rank {outgoing.dest}", f"rank {outgoing.dest}")
        raise self._failure(words, code, worker)

    def _failure(self, words: torch.Tensor, code: int, rank: int) -> Exception:
        role = "server" if rank in self.servers else "worker"
        return FAILURES[code](f"{self._who}: {role} {rank} stopped the parameter server: "
                              f"{bytes(words.tolist()).decode()}")

    def _server_failed(self, error: Exception):
        """An error in this server's update stops the parameter server: this server tells the
        other servers and every worker (in place of its next reply), then raises `error`."""
        words = torch.tensor(list(f"its update {self.version + 1} raised {type(error).__name__}: {error}".encode()),
                             dtype=torch.uint8)
        code = len(FAILURES) - 1
        sends = self._command(FAIL, [self.comm.rank]) if self.comm.rank == self.server else []
        sends += [wire.send(self.mpi, words, other, PUSH, fields=(FAILED, code, self.version))
                  for other in self.servers if other != self.comm.rank]
        # In place of this server's next reply to each worker (which may wait for it alone).
        sends += [wire.send(self.mpi, words, worker, REPLY, fields=(self.version, SENT_FAILURE, code, self.comm.rank))
                  for worker in self.workers]
        for outgoing in sends:
            outgoing.wait(self._who, f"the failure sent to rank {outgoing.dest}", f"rank {outgoing.dest}")
        raise error

    def _drop(self, worker: int, step: int, version: int) -> tuple:
        self.dropped.append((worker, step, version))
        return self.dropped[-1]

    def _may_start(self, worker: int, pushed: dict, active: set) -> bool:
        """Bounded staleness: a worker may start its next step when it is at most max_staleness
        steps ahead of the slowest worker still training."""
        return self.max_staleness is None or pushed[worker] - min(pushed[w] for w in active) <= self.max_staleness

    def _apply(self, arrived: dict, dropped: tuple, on_update) -> Update:
        order = sorted(arrived)  # by worker rank: the same sum whatever order they arrived in
        total = arrived[order[0]][0][0].clone()
        for worker in order[1:]:
            total += arrived[worker][0][0]
        total /= len(order)
        for index, table in enumerate(self.tables):
            gradient = ps_sparse.mean_gradient(table, [arrived[w][0][1][index] for w in order], len(order))
            if self._owned is not None:
                self._owned.set_table_gradient(table.weight, gradient)
            else:
                table.weight.grad = gradient
        staleness = float(np.mean([self.version - arrived[w][2] for w in order]))
        lr_scale = 1.0 / max(1.0, staleness) if self.staleness_lr else 1.0
        try:
            if self._owned is not None:
                self._owned.set_gradients(total)
                self._owned.step(lr_scale)
            else:
                self._step_whole(total, lr_scale)
        except Exception as error:  # the optimizer's, or a check of the user's in it
            self._server_failed(error)
        for table in self.tables:
            table.weight.grad = None
        self.version += 1
        update = Update(self.version, tuple((w, arrived[w][1], arrived[w][2]) for w in order), staleness, lr_scale,
                        dropped)
        if on_update is not None:
            if self._owned is not None:
                self._owned.to_module()
            on_update(update)
        return update

    def _step_whole(self, gradient: torch.Tensor, lr_scale: float) -> None:
        """The one server's update: the mean gradient as the parameters' gradients, the user's
        optimizers stepped with the learning rate times lr_scale for this update alone."""
        for param, part in zip(self.params, gradient.split(self.numels)):
            param.grad = part.view_as(param).to(param.device)
        groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]
        learning_rates = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * lr_scale
        try:
            for optimizer in self.optimizers:
                optimizer.step()
        finally:
            for group, lr in zip(groups, learning_rates):
                group["lr"] = lr
        for param in self.params:
            param.grad = None

    def _send_weights(self, worker: int) -> wire.Outgoing:
        """Start sending this server's range of the current weights and their version."""
        if self._sent_weights is None or self._sent_weights[0] != self.version:
            # One copy per version, shared by every reply of that version (sync mode answers
            # every worker with the same one): pending sends only read it.
            weights = self._owned.weights() if self._owned is not None else self._flat(self.params)
            self._sent_weights = (self.version, weights)
        return wire.send(self.mpi, self._sent_weights[1], worker, REPLY, fields=(self.version, SENT_WEIGHTS, self.stopping))

    def _send_table_ranges(self, rank: int, tag: int) -> list:
        """Start sending this server's row range of every table (the final weights)."""
        index = self.servers.index(self.comm.rank)
        return [wire.send(self.mpi, table.weight.detach()[slice(*table.row_range(index))], rank, tag,
                          fields=(self.version, SENT_ROWS)) for table in self.tables]

    def _share_final_weights(self) -> list:
        """Every server sends its range of the final weights to the others and takes theirs, so
        that every server ends with the whole model."""
        if len(self.servers) == 1:
            return []
        start, end = self._range
        weights = torch.empty(self.numel, dtype=self.dtype)
        weights[start:end] = self._owned.weights()
        others = [s for s in self.servers if s != self.comm.rank]
        sends = [wire.send(self.mpi, weights[start:end], other, SHARE) for other in others]
        for other in others:
            sends += self._send_table_ranges(other, SHARE)
        for index, (other, (low, high)) in enumerate(zip(self.servers, self.ranges)):
            if other != self.comm.rank:
                what = f"the final weights of server {other}"
                weights[low:high], _ = self._receive_from_server(other, SHARE, what)
                for table in self.tables:
                    rows, _ = self._receive_from_server(other, SHARE, what)
                    with torch.no_grad():
                        table.weight[slice(*table.row_range(index))] = rows.to(table.weight.device)
        self._load(weights)
        return sends

    def _next_message(self, receives: dict, server_failures: dict) -> int:
        """The rank whose header arrived first among the pending receives (the workers', and
        the other servers' failures), or a worker that died (its receive replaced by a
        ps_survival.Death) when the parameter server goes on without it."""
        died = [w for w, incoming in receives.items() if isinstance(incoming, ps_survival.Death)]
        if died:
            return died[0]
        pending = {**receives, **server_failures}
        ranks = list(pending)
        requests = [pending[r].request for r in ranks]
        workers = [r for r in ranks if r not in self.servers]
        found = []

        def arrived():
            index, flag = MPI.Request.Testany(requests)
            if flag:
                found.append(ranks[index])
            return flag

        try:
            wait_until(arrived, self._who, "the wait for a message from the workers", f"workers {workers}",
                       peers=workers, advice="A worker that stops training must call close()")
        except Exception as error:
            died = ps_survival.dead_workers(self, error, receives)
            for worker in died:
                receives[worker] = ps_survival.Death(DIED)
            return died[0]
        return found[0]

    def _receive_from_server(self, other: int, tag: int, what: str) -> tuple:
        """(tensor, fields) of another server's message with `tag`; on the coordinator, should
        that server's update fail first, its failure stops the parameter server instead."""
        if self.comm.rank != self.server:
            return wire.receive(self.mpi, other, tag, self._who, what, f"server {other}")
        incoming = wire.Incoming(self.mpi, other, tag)
        failure = self._server_failures[other]
        # Get_status leaves a failure that came with the message for the next wait to find.
        wait_until(lambda: incoming.request.Test() or failure.request.Get_status(), self._who, what,
                   f"server {other}", peers=(other,))
        if not incoming.request.Test():
            incoming.request.Cancel()
            self._stop(other, failure, [])
        return incoming.receive_payload(self._who, what, f"server {other}"), incoming.fields

    # ---- a worker --------------------------------------------------------------------------

    @ps_survival.ends_on_death
    def pull_rows(self, module: torch.nn.Module, ids) -> None:
        """Fetch the current rows `ids` (an integer tensor of any shape; each row once) of the
        table of `module` (an embedding of the model that goes by rows) from the servers that
        hold them, into this worker's table. Call it before the forward pass, for every table
        and every id the batch uses."""
        self._check_worker("pull_rows()")
        index, unique = self._rows_asked(module, ids)
        pulled = self._pulled.get(index)
        self._pulled[index] = unique if pulled is None else torch.unique(torch.cat([pulled, unique]))
        moved = self._pull(index, unique)
        while moved:  # newer weights came along: the rows pulled before them in this step are stale
            for again in sorted(self._pulled):
                moved = self._pull(again, self._pulled[again])
                if moved:
                    break

    def _rows_asked(self, module, ids) -> tuple:
        """(the table's index, the sorted unique ids) of a pull, or the failure of bad input."""
        index = next((i for i, table in enumerate(self.tables) if table.module is module), None)
        if index is None:
            names = [f"{type(table.module).__name__} {table.name.removesuffix('.weight')}" for table in self.tables]
            self._fail(InvalidArgumentError(
                f"pull_rows() on a {type(module).__name__} that is no table of this parameter server's model; its "
                f"tables (embeddings with sparse=True, or every embedding with sparse_embeddings=True): "
                f"{', '.join(names) if names else 'none'}"))
        table = self.tables[index]
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            self._fail(InvalidArgumentError(f"pull_rows({table.name}): ids must be an integer tensor, got "
                                            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}"))
        unique = torch.unique(ids.detach().reshape(-1).cpu()).to(torch.int64)
        if unique.numel() and (unique[0] < 0 or unique[-1] >= table.rows):
            wrong = unique[(unique < 0) | (unique >= table.rows)]
            self._fail(InvalidArgumentError(f"pull_rows({table.name}): ids {wrong[:8].tolist()} out of range: the "
                                            f"table has rows 0..{table.rows - 1}"))
        return index, unique

    def _pull(self, index: int, ids: torch.Tensor) -> bool:
        """Pull rows `ids` (sorted) of table `index`, each server its part, into the table;
        True when they came with newer weights (loaded too)."""
        table = self.tables[index]
        outgoing = []
        for server, (low, high) in zip(self.servers, table.split(ids)):
            outgoing.append(wire.send(self.mpi, ids[low:high], server, PUSH, fields=(PULL, index, self.version)))
            self.bytes_pushed += (high - low) * ids.element_size()
        parts, version = self._receive_replies(f"the rows of {table.name} from the server")
        moved = version != self.version
        if moved:
            self._receive_weights()
        with torch.no_grad():
            table.weight[ids.to(table.weight.device)] = torch.cat(parts).to(table.weight.device)
        for sent in outgoing:
            sent.wait(self._who, "the rows asked of the server", f"the server (rank {sent.dest})")
        return moved

    @ps_survival.ends_on_death
    def step(self) -> None:
        """Push this worker's gradients (zeros for parameters without one), each server its
        range, and the rows of each table's gradient, each server those in its row ranges; then
        wait for the weights of the update that took them, which replace the module's dense
        parameters."""
        self._check_worker("step()")
        try:
            rows = [ps_sparse.gradient_rows(table, self._pulled.get(i)) for i, table in enumerate(self.tables)]
        except InvalidArgumentError as error:
            self._fail(error)
        gradient = self._flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        outgoing = []
        for position, (server, (start, end)) in enumerate(zip(self.servers, self.ranges)):
            parts = [gradient[start:end]]
            outgoing.append(wire.send(self.mpi, parts[0], server, PUSH, fields=(GRADIENT, self.steps, self.version,
                                                                                   self._stop_asked)))
            for table, (indices, values) in zip(self.tables, rows):
                low, high = table.split(indices)[position]
                parts += [indices[low:high], values[low:high]]
                outgoing += [wire.send(self.mpi, part, server, SPARSE) for part in parts[-2:]]
            self.bytes_pushed += sum(part.numel() * part.element_size() for part in parts)
        self._receive_weights()
        for sent in outgoing:
            sent.wait(self._who, "the gradient sent to the server", f"the server (rank {sent.dest})")
        self.steps += 1
        self._pulled = {}

    def request_stop(self) -> None:
        """Ask every worker to stop training (a stop signal before the time limit, say), from the
        coordinating server or a worker (elsewhere it does nothing). A worker's request goes with
        its next step(); every worker then learns of it from its next weights, as `stopping`
        turns True, and closes. In sync mode (without backup workers) every worker learns of it
        after the same update."""
        if self.comm.rank == self.server:
            self.stopping = True
        elif not self.is_server:
            self._stop_asked = True

    @ps_survival.ends_on_death
    def close(self) -> None:
        """Tell the coordinating server this worker is done, and take the final weights, tables
        whole (once every worker has closed)."""
        self._check_worker("close()")
        nothing = torch.empty(0, dtype=self.dtype)
        outgoing = wire.send(self.mpi, nothing, self.server, PUSH, fields=(DONE, self.steps, self.version))
        self._receive_weights()
        for table in self.tables:
            parts, _ = self._receive_replies(f"the final rows of {table.name} from the server")
            with torch.no_grad():
                table.weight.copy_(torch.cat(parts).to(table.weight.device))
        outgoing.wait(self._who, "the last message to the server", f"the server (rank {self.server})")
        self.closed = True
        self.mpi.Free()

    def _fail(self, error: Exception):
        """Stop the parameter server on bad input: tell every server (the coordinator tells
        the other workers), then raise `error` here."""
        words = torch.tensor(list(str(error).encode()), dtype=torch.uint8)
        code = FAILURES.index(type(error))
        for sent in [wire.send(self.mpi, words, server, PUSH, fields=(FAILED, code, self.version))
                     for server in self.servers]:
            sent.wait(self._who, "the failure sent to the server", f"the server (rank {sent.dest})")
        self.closed = True
        raise error

    def _check_worker(self, call: str) -> None:
        if self.is_server:
            raise InvalidArgumentError(f"{call} runs on workers; rank {self.comm.rank} is a server: call serve()")
        if self.closed:
            raise InvalidArgumentError(f"{call} after close(): this worker has already left the parameter server")

    def _receive_replies(self, what: str) -> tuple:
        """([each server's reply], their version): every server's answer to this worker's last
        message, received at once (the coordinator's first), or the failure one reports."""
        incoming = [wire.Incoming(self.mpi, server, REPLY) for server in self.servers]
        parts, versions = [], []
        for position, reply in enumerate(incoming):
            silent = f"the server (rank {reply.source})"
            reply.wait(self._who, what, silent)
            parts.append(reply.receive_payload(self._who, what, silent))
            if reply.fields[1] == SENT_FAILURE:
                for pending in incoming[position + 1:]:
                    pending.request.Cancel()
                self.closed = True
                raise self._failure(parts[-1], *reply.fields[2:])
            versions.append(reply.fields[0])
            if reply.source == self.server and reply.fields[1] == SENT_WEIGHTS:
                self.stopping |= bool(reply.fields[2])
            self.bytes_pulled += parts[-1].numel() * parts[-1].element_size()
        if len(set(versions)) > 1:
            raise MismatchError(f"{self._who}: the servers {self.servers} sent weights of versions {versions}; "
                                "every server must answer with the same update")
        return parts, versions[0]

    def _receive_weights(self) -> None:
        """Every server's range of the weights; they must share one version."""
        parts, self.version = self._receive_replies("the weights from the server")
        self._load(torch.cat(parts))

    # ---- helpers ---------------------------------------------------------------------------

    def _flat(self, tensors) -> torch.Tensor:
        """The tensors end to end in one contiguous CPU tensor (what travels)."""
        return torch.cat([t.detach().reshape(-1).cpu() for t in tensors]) if tensors else torch.empty(0, dtype=self.dtype)

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
