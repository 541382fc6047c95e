"""Central storage: the model's variables held in one place per node, in the host memory of the
node's first rank, while the node's other ranks compute; synchronous. TensorFlow's
CentralStorageStrategy, as a configuration of the parameter server (ps/): the first rank of
every node is a server, every other rank a worker, mode="sync".

On one node this is CentralStorageStrategy itself: one copy of the variables, the optimizer
applied once, the compute replicated on the other ranks (one per GPU, say), each step averaging
every replica's gradient. On several nodes each node's storage rank holds one part of the
variables (the parameter server's row ranges), so no node holds a copy the others must keep in
step; a worker pushes and pulls each part from the node that stores it.
"""
from __future__ import annotations

import numpy as np

from ..comm import init
from ..errors import InvalidArgumentError
from ..runtime.deadlines import wait_for_collective
from .ps import ParameterServer


class CentralStorage(ParameterServer):
    """Synchronous training with the variables on the first rank of each node (`is_server`:
    it calls serve()) and the compute on the others (workers: forward, backward, step(), and
    close() at the end), exactly as with ParameterServer(mode="sync").

    Every rank passes the same module; the storage ranks also pass the optimizer (over
    module.parameters()) that applies the updates; workers may pass None.
    """

    def __init__(self, module, optimizer=None, comm=None, backup_workers: int = 0):
        comm = comm if comm is not None else init()
        super().__init__(module, optimizer, comm=comm, mode="sync", servers=storage_ranks(comm),
                         backup_workers=backup_workers)


def storage_ranks(comm) -> list:
    """The first rank of every node of `comm`, in rank order; an error on every rank when no
    node has a rank left to compute."""
    mine = np.array([comm.rank if comm.local_rank == 0 else -1], dtype=np.int64)
    firsts = np.empty(comm.size, dtype=np.int64)
    wait_for_collective(comm.mpi.Iallgather(mine, firsts), comm.mpi, "central storage's search for each node's first rank")
    storage = [int(rank) for rank in firsts if rank >= 0]
    if len(storage) == comm.size:
        raise InvalidArgumentError(f"central storage needs a node with at least two ranks, one to hold the variables "
                                   f"and one to compute; each of the {comm.size} nodes has one rank "
                                   "(use ParameterServer with chosen server ranks instead)")
    return storage
