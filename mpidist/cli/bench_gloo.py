"""gloo as `mpidist bench`'s peer: torch.distributed's gloo process group, its rendezvous done
through MPI, torn down while every rank is still there."""
from __future__ import annotations

import socket

import numpy as np


class Gloo:
    """torch.distributed with the gloo backend, its rendezvous done through MPI: rank 0 picks a
    free port and broadcasts it with its host name."""

    def __init__(self, comm):
        import torch.distributed as dist
        self.dist = dist
        self.owned = not dist.is_initialized()
        if not self.owned:
            return
        host = socket.gethostname()
        port = 0
        if comm.rank == 0:
            with socket.socket() as probe:
                probe.bind(("", 0))
                port = probe.getsockname()[1]
        message = np.zeros(256, dtype=np.uint8)
        if comm.rank == 0:
            encoded = f"{port} {host}".encode()
            message[:len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
        comm.mpi.Bcast(message, root=0)
        port_text, root_host = bytes(message).rstrip(b"\0").decode().split(" ", 1)
        address = "127.0.0.1" if root_host == host else root_host
        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port_text}",
                                rank=comm.rank, world_size=comm.size)

    def close(self, comm):
        """Tear the group down while every rank is still here: gloo's threads abort the process
        when they outlive MPI_Finalize."""
        if self.owned:
            comm.mpi.Barrier()
            self.dist.destroy_process_group()
