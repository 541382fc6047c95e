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
settings.py (the arguments and their agreement), model.py (what is trained: the flat dense
parameters, the tables, the optimizers), roles.py (each rank's state: ServerRole, WorkerRole),
policy.py, server.py (what every server does), coordinator.py and follower.py (the servers'
loops), worker.py (the workers' calls), state.py (the state between servers), shards.py,
sparse.py, survival.py. Their functions take the role of this rank, never the front; this
module is the front.

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
from ...runtime import losses
from ...runtime.mpi import fault_tolerant, is_process_failure, return_errors
from ..bucket_exchanges import check_state
from ..compressors import resolve_compression
from ..model_state import broadcast_module_state
from . import coordinator, follower, settings, shards, state, survival, worker
from .model import take_model
from .policy import MODES, Update, gradients_per_update
from .protocol import Tag
from .roles import Endpoint, ServerRole, WorkerRole
from .server import send_table_ranges, send_weights
from .settings import Settings

__all__ = ["MODES", "ParameterServer", "Update", "gradients_per_update"]


def _read(part: str, name: str, absent=None) -> property:
    """A read-only attribute of the front: `name` of its "role", "settings" or "model"; where
    this rank's role has none (a worker's dropped gradients, a server's steps), absent()."""
    def read(ps):
        held = getattr(ps, part)
        return getattr(held, name) if absent is None or hasattr(held, name) else absent()

    return property(read)


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

    `compression` ("fp16", "bf16", "int8", "topk:<fraction>" or such a compressor of
    mpidist.parallel.compressors; the same on every rank) compresses each worker's push of its
    dense gradient, range by range, with error feedback kept on the worker for int8 and top-k
    (push_compression.py); the weights come back uncompressed.
    """

    # What every rank agreed on, what it trains, and the state of its role (roles.py).
    servers, workers, ranges = _read("settings", "servers"), _read("settings", "workers"), _read("settings", "ranges")
    server, chief = _read("settings", "coordinator"), _read("settings", "chief")
    mode, max_staleness = _read("settings", "mode"), _read("settings", "max_staleness")
    staleness_lr, backup_workers = _read("settings", "staleness_lr"), _read("settings", "backup_workers")
    per_update, compression = _read("settings", "per_update"), _read("settings", "compression")
    module, optimizer, optimizers = _read("model", "module"), _read("model", "optimizer"), _read("model", "optimizers")
    params, tables, dtype = _read("model", "params"), _read("model", "tables"), _read("model", "dtype")
    numels, numel, shapes = _read("model", "numels"), _read("model", "numel"), _read("model", "shapes")
    version, stopping, closed = _read("role", "version"), _read("role", "stopping"), _read("role", "closed")
    dropped, lost = _read("role", "dropped", list), _read("role", "lost", list)
    steps, bytes_pushed = _read("role", "steps", int), _read("role", "bytes_pushed", int)
    bytes_pulled = _read("role", "bytes_pulled", int)

    def __init__(self, module: torch.nn.Module, optimizer=None, comm=None, mode: str = "sync", softsync=None,
                 max_staleness=None, staleness_lr: bool = False, server: int = 0, version: int = 0, servers=1,
                 backup_workers: int = 0, sparse_embeddings: bool = False, compression=None):
        self.comm = comm if comm is not None else init()
        if self.comm.size < 2:
            raise InvalidArgumentError("a parameter server needs at least 2 ranks (the server and one worker); "
                                       f"this communicator has {self.comm.size}")
        self.mpi = None
        try:
            self._build(module, optimizer, dict(mode=mode, softsync=softsync, max_staleness=max_staleness,
                                                staleness_lr=staleness_lr, server=server, version=version,
                                                servers=servers, backup_workers=backup_workers,
                                                compression=compression), sparse_embeddings)
        except Exception as error:
            made = [mpi for mpi in (self.comm.mpi, self.mpi) if mpi is not None]
            if not (fault_tolerant() and is_process_failure(error, made)):
                raise
            raise survival.ending_at_start(self.comm, self.mpi) from error

    def _build(self, module, optimizer, rules: dict, sparse_embeddings: bool) -> None:
        """Take the arguments, agree on them with the other ranks, give every rank the chief
        worker's weights (collective over comm) and make this rank's role."""
        self.mpi = self.comm.mpi.Dup()  # point-to-point traffic of its own, apart from collectives
        if fault_tolerant():  # a death comes back as an error (survival.py)
            return_errors(self.mpi)
        try:  # a refusal on some ranks only joins the agreement, so that no rank waits for the others
            (agreed, model, unsplittable), declined = self._take_settings(module, optimizer, rules,
                                                                          sparse_embeddings), None
        except InvalidArgumentError as error:
            (agreed, model, unsplittable), declined = (None, None, None), error
        settings.agree(self.mpi, agreed, model, rules["version"], unsplittable, declined)
        self.settings, self.model = agreed, model
        broadcast_module_state(module, self.comm, root=agreed.chief)
        rank = self.comm.rank
        if rank in agreed.servers:
            endpoint = Endpoint(self.mpi, rank, f"rank {rank} (the parameter server)")
            start, end = agreed.ranges[agreed.servers.index(rank)]
            self.role = ServerRole(agreed, model, endpoint, version=rules["version"],
                                   codec=agreed.compression.push_codec(end - start, model.dtype))
            # A server of several steps its own rows alone; one server steps the user's
            # optimizer, whose state is then the whole model's (what checkpoints save).
            if len(agreed.servers) > 1:
                index = agreed.servers.index(rank)
                self.role.owned = shards.OwnedRange(model.params, agreed.ranges[index], model.optimizers,
                                                    [(table.weight, table.row_range(index)) for table in model.tables])
        else:
            self.role = WorkerRole(agreed, model, Endpoint(self.mpi, rank, f"rank {rank} (a worker)"),
                                   version=rules["version"],
                                   codecs=[agreed.compression.push_codec(end - start, model.dtype)
                                           for start, end in agreed.ranges])

    def _take_settings(self, module, optimizer, rules: dict, sparse_embeddings: bool) -> tuple:
        """Check the arguments of this rank: (its Settings, its Model, the error of a model too
        small to split over the servers, raised after the agreement so that every rank learns of
        it)."""
        server, size = rules["server"], self.comm.size
        if not isinstance(server, int) or not 0 <= server < size:
            raise InvalidArgumentError(f"server={server!r} is not a rank of this communicator (0..{size - 1})")
        servers = settings.server_ranks(rules["servers"], server, size)
        settings.check_modes(size, len(servers), rules["mode"], rules["softsync"], rules["max_staleness"],
                             rules["version"], rules["backup_workers"])
        model = take_model(module, optimizer, len(servers), sparse_embeddings)
        compressor = resolve_compression(rules["compression"])
        compressor.check_push()
        compressor.check(model.params)
        try:  # each server's part of the flat vector
            ranges, unsplittable = settings.partition(model, len(servers)), None
        except InvalidArgumentError as error:
            ranges, unsplittable = None, error
        workers = [r for r in range(size) if r not in servers]
        per_update = gradients_per_update(rules["mode"], len(workers), rules["softsync"], rules["backup_workers"])
        agreed = Settings(servers, workers, ranges, rules["mode"], rules["max_staleness"], bool(rules["staleness_lr"]),
                          rules["backup_workers"], per_update, compressor)
        return agreed, model, unsplittable

    @property
    def is_server(self) -> bool:
        return isinstance(self.role, ServerRole)

    @property
    def is_chief(self) -> bool:
        """The first worker: scripts let it alone log, evaluate and save."""
        return self.comm.rank == self.settings.chief

    @property
    def own_range(self) -> tuple:
        """This server's range of the flat vector of dense parameters."""
        return self.role.own_range

    @property
    def who(self) -> str:
        """This rank as errors name it."""
        return self.role.endpoint.who

    # ---- the servers -----------------------------------------------------------------------

    @survival.ends_on_death
    def serve(self, on_update=None) -> list:
        """Apply the workers' gradients until every worker has closed, then give each the final
        weights. Returns the list of Update applied, in order (the same on every server).
        `on_update(update)`, if given, is called after each update, with the module holding its
        weights (with several servers, only this server's range of them until serve() returns)."""
        role = self.role
        if not self.is_server:
            raise InvalidArgumentError(f"serve() runs on {self._server_name}; rank {self.comm.rank} is a worker: "
                                       "call step() after each backward, and close() at the end")
        history, role.serving = [], True
        loop = coordinator.coordinate if role.coordinating else follower.follow
        sends = loop(role, history, on_update)
        for worker_rank in [w for w in self.workers if w not in {lost.worker for lost in role.lost}]:
            sends.append(send_weights(role, worker_rank))
            sends += send_table_ranges(role, worker_rank, Tag.REPLY)
        sends += state.share_final_weights(role)
        sends += state.gather(role, weights=False) + role.state_sends
        for failure in role.failures.values():  # none came
            failure.request.Cancel()
            failure.request.Wait()
        survival.wait_last_sends(role, sends)
        role.serving = False
        self.mpi.Free()
        losses.tell()  # the end of training: the coordinator's summary of the workers lost, if any
        return history

    def gather_state(self) -> None:
        """Gather the whole model and optimizer state on the coordinating server, for a
        checkpoint. Every server calls it at the same update (in serve()'s on_update); the
        coordinator's module then holds the update's whole weights, tables too, and its
        optimizers (the user's) the whole state, as those of one server do; the other servers
        send their parts and go on at once. With one server there is nothing to gather."""
        role = self.role
        if not self.is_server or not role.serving:
            raise InvalidArgumentError("gather_state() runs on the servers during serve(), in on_update")
        if len(self.servers) > 1:
            role.state_sends = [outgoing for outgoing in role.state_sends if not outgoing.test()]
            role.state_sends += state.gather(role, weights=True)

    # ---- a worker --------------------------------------------------------------------------

    @survival.ends_on_death
    def pull_rows(self, module: torch.nn.Module, ids) -> None:
        """Fetch the current rows `ids` (an integer tensor of any shape; each row once) of the
        table of `module` (an embedding of the model that goes by rows) from the servers that
        hold them, into this worker's table. Call it before the forward pass, for every table
        and every id the batch uses."""
        worker.pull_rows(self.role, module, ids)

    @survival.ends_on_death
    def step(self) -> None:
        """Push this worker's gradients (zeros for parameters without one), each server its
        range, and the rows of each table's gradient, each server those in its row ranges; then
        wait for the weights of the update that took them, which replace the module's dense
        parameters."""
        worker.step(self.role)

    def compression_state_dict(self) -> dict:
        """This worker's residuals of its compressed pushes ("range<i>": that of server i's
        range), for a checkpoint of its own (they differ between workers); {} on a server and
        for compressions without error feedback."""
        if self.is_server or not self.role.codecs[0].error_feedback:
            return {}
        return {f"range{index}": codec.residual.clone() for index, codec in enumerate(self.role.codecs)}

    def load_compression_state_dict(self, state: dict) -> None:
        """Restore what compression_state_dict() gave, on the same worker of the same layout."""
        expected = self.compression_state_dict()
        check_state(state, expected, "this rank's pushes", "this rank's")
        for index, codec in enumerate(self.role.codecs if expected else []):
            codec.residual.copy_(state[f"range{index}"])

    def request_stop(self) -> None:
        """Ask every worker to stop training (a stop signal before the time limit, say), from the
        coordinating server or a worker (elsewhere it does nothing). A worker's request goes with
        its next step(); every worker then learns of it from its next weights, as `stopping`
        turns True, and closes. In sync mode (without backup workers) every worker learns of it
        after the same update."""
        if self.comm.rank == self.server:
            self.role.stopping = True
        elif not self.is_server:
            self.role.stop_asked = True

    @survival.ends_on_death
    def close(self) -> None:
        """Tell the coordinating server this worker is done, and take the final weights, tables
        whole (once every worker has closed)."""
        worker.close(self.role, self._receive_weights)

    def _receive_weights(self) -> None:
        worker.receive_weights(self.role)

    @property
    def _server_name(self) -> str:
        if len(self.servers) == 1:
            return f"the server (rank {self.server})"
        return f"the servers (ranks {self.servers})"
