"""Parameter server: dedicated server ranks keep the model's weights and run the optimizer; the
other ranks, the workers, compute gradients on their own batches, push them to the servers and
pull the new weights back.

With several servers (servers=k), each owns one contiguous range of the flattened parameters
(shards.py); a worker sends each server its range of the gradient and receives each one's
range of the weights, all at once. The first server, the coordinator, decides every update
(which workers' gradients it averages) and every reply, and tells the other servers in order:
they apply the same sequence of updates to their ranges and answer the same workers after the
same updates, so a worker's ranges always come from one version (it checks). Each of several
servers holds its range apart, in tensors of its own stepped by optimizers over them alone
(shards.OwnedRange; its rows of a sparse table view the module's table), and copies it into
its module when the module is looked at (on_update, the end). gather_state() brings every
server's part of the weights and of the optimizers' state to the coordinator, for checkpoints.

Which gradients each update averages (sync, async, n-softsync, backup workers, bounded
staleness, the staleness-aware learning rate) is policy.py's: a pure state machine the
coordinator (coordinator.py) feeds with the messages it receives and whose decisions it tells
the other servers (follower.py). The package: protocol.py (message kinds, tags, headers),
settings.py (the arguments and their agreement), policy.py, server.py (what every server does),
coordinator.py and follower.py (the servers' loops), worker.py (the workers' calls), state.py
(the state between servers), shards.py, sparse.py, survival.py; this module is the front.

A worker gets new weights only once the update that took its gradient is applied, so it never
computes on weights that miss its own last gradient. The chief is the first worker (the lowest
rank that is not the server): every rank starts from its weights, and scripts let it alone log,
evaluate and save (`is_chief`). When every worker has closed, each gets the final weights.

Sparse rows (sparse.py): the weights of nn.Embedding and nn.EmbeddingBag with sparse=True
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
(survival.py): the servers drop a dead worker and go on, or every survivor raises the same
RankDiedError.
"""
from __future__ import annotations

import torch

from ...comm import init
from ...errors import InvalidArgumentError
from ...runtime import wire
from ...runtime.mpi import fault_tolerant, is_process_failure, return_errors
from ..model_state import broadcast_module_state
from . import coordinator, follower, settings, shards, state, survival, worker
from .policy import MODES, Update, gradients_per_update
from .protocol import Push, Tag
from .server import ServerRole, send_table_ranges, send_weights
from .worker import WorkerRole

__all__ = ["MODES", "ParameterServer", "Update", "gradients_per_update"]


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
            self._build(module, optimizer, dict(mode=mode, softsync=softsync, max_staleness=max_staleness,
                                                staleness_lr=staleness_lr, server=server, version=version,
                                                servers=servers, backup_workers=backup_workers), sparse_embeddings)
        except Exception as error:
            made = [mpi for mpi in (self.comm.mpi, self.mpi) if mpi is not None]
            if not (fault_tolerant() and is_process_failure(error, made)):
                raise
            raise survival.ending_at_start(self) from error

    def _build(self, module, optimizer, rules: dict, sparse_embeddings: bool) -> None:
        """Take the arguments, agree on them with the other ranks and give every rank the chief
        worker's weights (collective over comm)."""
        self.mpi = self.comm.mpi.Dup()  # point-to-point traffic of its own, apart from collectives
        if fault_tolerant():  # a death comes back as an error (survival.py)
            return_errors(self.mpi)
        try:  # a refusal on some ranks only joins the agreement, so that no rank waits for the others
            unsplittable, declined = self._take_settings(module, optimizer, rules, sparse_embeddings), None
        except InvalidArgumentError as error:
            unsplittable, declined = None, error
        settings.agree(self, unsplittable, declined)
        broadcast_module_state(module, self.comm, root=self.chief)
        # A server of several steps its own rows alone; one server steps the user's optimizer,
        # whose state is then the whole model's (what checkpoints save).
        self.server_role.owned = shards.OwnedRange(
            self.params, self.own_range, self.optimizers,
            [(table.weight, table.row_range(self.servers.index(self.comm.rank))) for table in self.tables]) \
            if self.is_server and len(self.servers) > 1 else None

    def _take_settings(self, module, optimizer, rules: dict, sparse_embeddings: bool):
        """Check and take the arguments of this rank; returns the error of a model too small to
        split over the servers (raised after the agreement, so that every rank learns of it)."""
        server = rules["server"]
        if not isinstance(server, int) or not 0 <= server < self.comm.size:
            raise InvalidArgumentError(f"server={server!r} is not a rank of this communicator "
                                       f"(0..{self.comm.size - 1})")
        self.servers = settings.server_ranks(rules["servers"], server, self.comm.size)
        settings.check_modes(self.comm.size, len(self.servers), rules["mode"], rules["softsync"],
                             rules["max_staleness"], rules["version"], rules["backup_workers"])
        settings.take_model(self, module, optimizer, sparse_embeddings)
        try:  # each server's part of the flat vector
            self.ranges, unsplittable = settings.partition(self), None
        except InvalidArgumentError as error:
            self.ranges, unsplittable = None, error
        self.server = self.servers[0]  # the coordinator
        self.workers = [r for r in range(self.comm.size) if r not in self.servers]
        self.chief = self.workers[0]
        self.is_server = self.comm.rank in self.servers
        self.is_chief = self.comm.rank == self.chief
        self.mode, self.max_staleness = rules["mode"], rules["max_staleness"]
        self.staleness_lr, self.backup_workers = bool(rules["staleness_lr"]), rules["backup_workers"]
        self.per_update = gradients_per_update(self.mode, len(self.workers), rules["softsync"], self.backup_workers)
        self.version = rules["version"]  # the number of updates applied to the weights held
        self.dropped = []  # servers: the late gradients dropped (backup workers), as in Update.dropped
        self.lost = []  # servers: the workers dropped when they died, as survival.Lost
        self.server_role, self.worker_role = ServerRole(), WorkerRole()
        self.steps = 0  # workers: gradients pushed
        self.bytes_pushed = self.bytes_pulled = 0  # workers: payload bytes sent and received
        self.closed = False
        self.stopping = False  # the coordinator and workers: every worker is to close (request_stop())
        return unsplittable

    # ---- the servers -----------------------------------------------------------------------

    @survival.ends_on_death
    def serve(self, on_update=None) -> list:
        """Apply the workers' gradients until every worker has closed, then give each the final
        weights. Returns the list of Update applied, in order (the same on every server).
        `on_update(update)`, if given, is called after each update, with the module holding its
        weights (with several servers, only this server's range of them until serve() returns)."""
        if not self.is_server:
            raise InvalidArgumentError(f"serve() runs on {self._server_name}; rank {self.comm.rank} is a worker: "
                                       "call step() after each backward, and close() at the end")
        history, self.server_role.serving = [], True
        loop = coordinator.coordinate if self.comm.rank == self.server else follower.follow
        sends = loop(self, history, on_update)
        for worker_rank in [w for w in self.workers if w not in {lost.worker for lost in self.lost}]:
            sends.append(send_weights(self, worker_rank))
            sends += send_table_ranges(self, worker_rank, Tag.REPLY)
        sends += state.share_final_weights(self)
        sends += state.gather(self, weights=False) + self.server_role.state_sends
        for failure in self.server_role.failures.values():  # none came
            failure.request.Cancel()
            failure.request.Wait()
        survival.wait_last_sends(self, sends)
        self.server_role.serving = False
        self.mpi.Free()
        return history

    def gather_state(self) -> None:
        """Gather the whole model and optimizer state on the coordinating server, for a
        checkpoint. Every server calls it at the same update (in serve()'s on_update); the
        coordinator's module then holds the update's whole weights, tables too, and its
        optimizers (the user's) the whole state, as those of one server do; the other servers
        send their parts and go on at once. With one server there is nothing to gather."""
        if not self.is_server or not self.server_role.serving:
            raise InvalidArgumentError("gather_state() runs on the servers during serve(), in on_update")
        if len(self.servers) > 1:
            role = self.server_role
            role.state_sends = [outgoing for outgoing in role.state_sends if not outgoing.test()]
            role.state_sends += state.gather(self, weights=True)

    # ---- a worker --------------------------------------------------------------------------

    @survival.ends_on_death
    def pull_rows(self, module: torch.nn.Module, ids) -> None:
        """Fetch the current rows `ids` (an integer tensor of any shape; each row once) of the
        table of `module` (an embedding of the model that goes by rows) from the servers that
        hold them, into this worker's table. Call it before the forward pass, for every table
        and every id the batch uses."""
        worker.pull_rows(self, module, ids)

    @survival.ends_on_death
    def step(self) -> None:
        """Push this worker's gradients (zeros for parameters without one), each server its
        range, and the rows of each table's gradient, each server those in its row ranges; then
        wait for the weights of the update that took them, which replace the module's dense
        parameters."""
        worker.step(self)

    def request_stop(self) -> None:
        """Ask every worker to stop training (a stop signal before the time limit, say), from the
        coordinating server or a worker (elsewhere it does nothing). A worker's request goes with
        its next step(); every worker then learns of it from its next weights, as `stopping`
        turns True, and closes. In sync mode (without backup workers) every worker learns of it
        after the same update."""
        if self.comm.rank == self.server:
            self.stopping = True
        elif not self.is_server:
            self.worker_role.stop_asked = True

    @survival.ends_on_death
    def close(self) -> None:
        """Tell the coordinating server this worker is done, and take the final weights, tables
        whole (once every worker has closed)."""
        worker.check_worker(self, "close()")
        nothing = torch.empty(0, dtype=self.dtype)
        outgoing = wire.send(self.mpi, nothing, self.server, Tag.PUSH,
                                    fields=(Push.DONE, self.steps, self.version))
        self._receive_weights()
        for table in self.tables:
            parts, _ = worker.receive_replies(self, f"the final rows of {table.name} from the server")
            with torch.no_grad():
                table.weight.copy_(torch.cat(parts).to(table.weight.device))
        outgoing.wait(self.who, "the last message to the server", f"the server (rank {self.server})")
        self.closed = True
        self.mpi.Free()

    def _receive_weights(self) -> None:
        worker.receive_weights(self)

    # ---- helpers ---------------------------------------------------------------------------

    @property
    def own_range(self) -> tuple:
        """This server's range of the flat vector of dense parameters."""
        return self.ranges[self.servers.index(self.comm.rank)]

    @property
    def who(self) -> str:
        """This rank as errors name it."""
        return f"rank {self.comm.rank} ({'the parameter server' if self.is_server else 'a worker'})"

    @property
    def _server_name(self) -> str:
        if len(self.servers) == 1:
            return f"the server (rank {self.server})"
        return f"the servers (ranks {self.servers})"
