"""The rendezvous of the backend "mpidist", which needs no MASTER_ADDR, RANK or WORLD_SIZE: rank
and size come from MPI, and the key-value store torch.distributed keeps for every process group
is a TCPStore whose address rank 0 broadcasts over MPI. Given variables, or rank= and
world_size= arguments, that disagree with MPI are refused on every rank.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from ..comm import broadcast_json, init
from ..errors import InvalidArgumentError
from ..runtime.together import raise_together


def mpi_rendezvous(url, timeout=dist.constants.default_pg_timeout, **kwargs):
    """torch's rendezvous protocol (a generator of (store, rank, world_size)) over MPI."""
    world = init()
    given_rank = kwargs.get("rank", -1)
    given_size = kwargs.get("world_size", -1)
    check_agrees_with_mpi(world, _given("RANK", given_rank), _given("WORLD_SIZE", given_size))
    yield tcp_store_over_mpi(world, timeout), world.rank, world.size
    raise RuntimeError("the mpi:// rendezvous cannot be repeated (MPI's world does not change)")


def _given(variable: str, argument: int):
    """The value the program gave: the argument, else the environment variable, else None."""
    if argument is not None and argument >= 0:
        return argument, f"{variable.lower()}={argument}"
    if variable in os.environ:
        try:
            return int(os.environ[variable]), f"{variable}={os.environ[variable]}"
        except ValueError:
            return os.environ[variable], f"{variable}={os.environ[variable]!r}"
    return None


def check_agrees_with_mpi(world, rank, size) -> None:
    """Refuse, on every rank of `world`, a given (value, source) rank or size that is not MPI's:
    every rank raises the refusals of all ranks that were given one."""
    problems = [f"{given[1]} but MPI says {actual}" for given, actual in ((rank, world.rank), (size, world.size))
                if given is not None and given[0] != actual]
    refusal = InvalidArgumentError(
        f"the mpidist backend takes rank and size from MPI; rank {world.rank} was given {' and '.join(problems)}: "
        "unset RANK and WORLD_SIZE (or pass the values MPI gives) and launch with mpirun or srun") if problems else None
    raise_together(world.mpi, refusal, "check of RANK and WORLD_SIZE against MPI", InvalidArgumentError,
                   message=lambda failures: "; ".join(failure[1] for failure in failures if failure is not None))


def tcp_store_over_mpi(world, timeout: datetime.timedelta):
    """A TCPStore served by rank 0 on a free port; its address reaches the others over MPI."""
    address = None
    if world.rank == 0:
        host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if world.num_nodes == 1 else socket.gethostname())
        store = dist.TCPStore(host, 0, world.size, is_master=True, timeout=timeout, wait_for_workers=False)
        address = [host, store.port]
    host, port = broadcast_json(world, address, what="the mpidist rendezvous")
    if world.rank != 0:
        store = dist.TCPStore(host, port, world.size, is_master=False, timeout=timeout)
    return store
