"""Names the backend "mpidist" to torch.distributed with its creator, and the rendezvous over
MPI (rendezvous.py) to torch's init methods.

init_process_group's default init_method is "env://"; where that method would fail for want of
its variables, it takes them from MPI instead (the scheme "mpi://" asks for this explicitly).
Nothing here initializes MPI before init_process_group (or new_group) runs.
"""
from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.rendezvous import _rendezvous_handlers, register_rendezvous_handler

from .rendezvous import mpi_rendezvous

NAME = "mpidist"
ENV_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def register() -> None:
    """Register the backend and the rendezvous (idempotent)."""
    if NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, create_process_group, extended_api=True, devices=["cpu", "cuda"])
    register_rendezvous_handler("mpi", mpi_rendezvous)
    env_rendezvous = _rendezvous_handlers["env"]

    def env_or_mpi_rendezvous(url, timeout=dist.constants.default_pg_timeout, **kwargs):
        if all(name in os.environ for name in ENV_VARIABLES):
            return env_rendezvous(url, timeout=timeout, **kwargs)
        return mpi_rendezvous(url, timeout=timeout, **kwargs)

    _rendezvous_handlers["env"] = env_or_mpi_rendezvous


def create_process_group(options, _backend_options):
    """torch's creator of a process group: the world (no ranks listed) or a sub-group."""
    from .backend import ProcessGroupMpidist  # initializes MPI: only when a group is made
    return ProcessGroupMpidist.create(options.group_rank, options.group_size,
                                      list(options.global_ranks_in_group), options.group_id, NAME)
