"""The state of one rank of a parameter server, by its role: a ServerRole on each server (the
coordinator and the followers), a WorkerRole on each worker. Each holds what every rank shares
(the agreed Settings, the Model, the Endpoint its messages travel from) and its own state, and the
functions of server.py, coordinator.py, follower.py, state.py, survival.py (servers) and
worker.py (workers) take it in place of the whole ParameterServer.
"""
from __future__ import annotations

import dataclasses

from .model import Model
from .settings import Settings


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """The parameter server's own communicator `mpi` (a duplicate, apart from collectives), this
    rank in it, and this rank as errors name it (`who`)."""
    mpi: object
    rank: int
    who: str


@dataclasses.dataclass
class Role:
    """What every rank's role holds. `version`: the number of updates applied to the weights
    held; `stopping`: every worker is to close (request_stop()); `closed`: this rank has left
    the parameter server (a worker's close(), or an end on a failure)."""
    settings: Settings
    model: Model
    endpoint: Endpoint
    version: int = 0
    stopping: bool = False
    closed: bool = False


@dataclasses.dataclass
class ServerRole(Role):
    """A server's own state. `owned`: its range of a model split over several servers
    (shards.OwnedRange), None with one server. `sent_weights`: (version, its range of the
    weights) that replies share. `failures`: on the coordinator in serve(), another server ->
    the receive of its failure. `state_sends`: its parts of gather_state() still being sent.
    `dropped`: the late gradients dropped (backup workers), as in Update.dropped; `lost`: the
    workers dropped when they died, as survival.Lost. `codec`: the decoding of the workers'
    pushes of its range (push_compression.py)."""
    owned: object = None
    codec: object = None
    sent_weights: tuple | None = None
    failures: dict = dataclasses.field(default_factory=dict)
    state_sends: list = dataclasses.field(default_factory=list)
    serving: bool = False
    dropped: list = dataclasses.field(default_factory=list)
    lost: list = dataclasses.field(default_factory=list)

    @property
    def index(self) -> int:
        """This server's position among the servers (that of its ranges)."""
        return self.settings.servers.index(self.endpoint.rank)

    @property
    def coordinating(self) -> bool:
        return self.endpoint.rank == self.settings.coordinator

    @property
    def own_range(self) -> tuple:
        """This server's range of the flat vector of dense parameters."""
        return self.settings.ranges[self.index]


@dataclasses.dataclass
class WorkerRole(Role):
    """A worker's own state. `steps`: the gradients it pushed; `bytes_pushed`, `bytes_pulled`:
    the payload bytes it sent and received; `pulled`: table index -> the rows pulled in this
    step (sorted, unique); `stop_asked`: request_stop() was called here; `codecs`: the encoding
    of its push of each server's range, with that range's residual (push_compression.py)."""
    steps: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    pulled: dict = dataclasses.field(default_factory=dict)
    stop_asked: bool = False
    codecs: list = dataclasses.field(default_factory=list)
