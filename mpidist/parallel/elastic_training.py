"""Elastic data parallelism: training that goes on, on the surviving ranks, after a rank dies.

    state = md.elastic.State(model=ddp, optimizer=optimizer, sampler=sampler, epoch=0, batch=0)
    md.elastic.run(train, state)      # train(state) commits every few steps: state.commit()

run() calls train(state). When a rank dies in a collective, the MPI library's fault tolerance
(ULFM: `mpirun --with-ft ulfm`) tells the ranks waiting for it (MPI_ERR_PROC_FAILED, or a
revoked communicator); a rank waiting in shared memory asks MPI (collectives/node_buckets.py). Each
survivor then revokes mpidist's world communicator and its sub-communicators (so no survivor
keeps waiting on them), shrinks it to the living ranks (MPIX_Comm_shrink, which they all join),
makes that the world (md.rank(), md.size(), hvd.size() ...), restores its last commit,
reconnects the DataParallel or DistributedOptimizer of the state to the new world, calls the
reset callbacks, gives every rank the lowest surviving rank's state (State.sync) and calls
train(state) again. An ElasticSampler deals the samples not yet processed in the epoch out
over the ranks left. A rank that ULFM's heartbeat detector (`--mca mpi_ft_detector true`)
declares dead may be frozen, not gone: the survivors on its host kill its process, which mpirun
would otherwise wait for after they end.

Each shrink is recorded (runtime/losses.py): the lowest surviving rank sums up the ranks lost in
one line when run() returns, and MPIDIST_EXIT_ON_RANK_LOSS may give the survivors an exit status.

A commit is a copy in memory on every rank (model, optimizer, sampler, the named values): what
was done since the last commit is done again after a death. Ranks are never added: an MPI job's
processes are fixed when it starts, so a job only shrinks. Without ULFM a death ends the job as
before, and run() says so at its start.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import signal
import socket
import sys
import time
import warnings
import zlib

import numpy as np
import torch

from ..comm import Communicator, broadcast_json, init, replace_world, world
from ..errors import InvalidArgumentError
from ..runtime import losses
from ..runtime.mpi import fault_tolerance_missing, is_process_failure, load_mpi, return_errors
from ..runtime.wire import byte_view


class ElasticSampler(torch.utils.data.Sampler):
    """The samples of one epoch dealt out over the ranks of the world, as Horovod's
    ElasticSampler: record_batch() (or record_indices()) marks what this rank has trained on,
    State.commit() gathers those marks from every rank, and after a death the samples that no
    commit marked are dealt out again over the ranks left (reset()). `shuffle`: a fresh order
    each epoch (torch.randperm seeded with seed + epoch); without it the remaining samples are
    taken in order, rank r getting every size-th one from the r-th. Padded, as Horovod's, with
    the first samples so that every rank gets as many."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices = set()  # trained on by some rank, as of the last commit
        self.recorded = set()  # trained on by this rank since the last commit
        self.indices = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: every sample is to be processed again."""
        self.epoch = epoch
        self.processed_indices = set()
        self.recorded = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch `batch_idx` (counted from the start of the current iteration) as trained on."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices) -> None:
        self.recorded.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list:
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def gather_recorded(self, comm) -> None:
        """Add every rank's recorded samples to processed_indices (collective over `comm`)."""
        mine = np.array(sorted(self.recorded), dtype=np.int64)
        self.processed_indices.update(comm.allgather(mine).tolist())
        self.recorded = set()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices | self.recorded)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.processed_indices = set(state["processed_indices"])
        self.recorded = set()
        self.reset()

    def reset(self) -> None:
        """Deal the samples not yet processed out over the current world's ranks."""
        self.num_replicas, self.rank = (world().size, world().rank)
        self.remaining_indices = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = list(self.remaining_indices)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = [indices[i] for i in torch.randperm(len(indices), generator=generator).tolist()]
        while indices and len(indices) < self.total_size:
            indices += indices[:self.total_size - len(indices)]
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


class State:
    """What training needs to go on after a death, committed in memory on every rank: `model`
    (parameters and buffers), `optimizer` (its state_dict), `sampler` and any ElasticSampler
    among the named values (their state_dict), and the other named values (epoch=0, batch=0,
    ...: attributes of the state, copied at each commit).

    commit(): remember the current state (collective: the sampler's marks are gathered).
    restore(): go back to the last commit (local). sync(): every rank takes rank 0's current
    state (collective). register_reset_callbacks(): functions called after each shrink, before
    the state is synchronized (to scale a learning rate with md.size(), say)."""

    def __init__(self, model=None, optimizer=None, sampler=None, **values):
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        # ElasticSamplers among the values (Horovod's train_sampler=...) are kept by state_dict.
        self._samplers = {name: value for name, value in values.items() if isinstance(value, ElasticSampler)}
        if sampler is not None:
            self._samplers["sampler"] = sampler
        self._value_names = sorted(name for name in values if name not in self._samplers)
        for name, value in values.items():
            setattr(self, name, value)
        self._reset_callbacks = []
        self._committed = self._snapshot()

    def register_reset_callbacks(self, callbacks) -> None:
        self._reset_callbacks.extend(callbacks)

    def commit(self) -> None:
        for sampler in self._samplers.values():
            sampler.gather_recorded(world())
        self._committed = self._snapshot()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod's check for hosts added or removed by its driver. An MPI job's ranks only
        shrink, and run() sees that by itself: nothing to do."""

    def restore(self) -> None:
        self._load(self._committed)

    def sync(self) -> None:
        comm = world()
        if comm.size > 1:
            self._load(_broadcast_tree(comm, self._snapshot() if comm.rank == 0 else None))
        self._committed = self._snapshot()

    def on_reset(self) -> None:
        """After a shrink: reconnect the model or optimizer that all-reduces gradients to the new
        world, then call the reset callbacks."""
        for owner in (self.model, self.optimizer):
            if hasattr(owner, "reconnect"):
                owner.reconnect(world())
        for callback in self._reset_callbacks:
            callback()

    def _snapshot(self) -> dict:
        return copy.deepcopy({
            "model": None if self.model is None else self.model.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "samplers": {name: sampler.state_dict() for name, sampler in self._samplers.items()},
            "values": {name: getattr(self, name) for name in self._value_names},
        })

    def _load(self, snapshot: dict) -> None:
        snapshot = copy.deepcopy(snapshot)  # the optimizer may keep the tensors it is given
        if self.model is not None:
            self.model.load_state_dict(snapshot["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(snapshot["optimizer"])
        for name, sampler in self._samplers.items():
            sampler.load_state_dict(snapshot["samplers"][name])
        for name, value in snapshot["values"].items():
            setattr(self, name, value)


def _broadcast_tree(comm, tree, root: int = 0):
    """`root`'s tree of dicts, lists, tuples, tensors and JSON values on every rank: its shape as
    JSON (broadcast_json), then each tensor's bytes. Never pickled."""
    tensors = []
    shape = broadcast_json(comm, _encode(tree, tensors) if comm.rank == root else None, root, "elastic State.sync")
    return _decode(shape, tensors, comm, root)


def _encode(value, tensors):
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().cpu().contiguous())
        return {"tensor": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                "device": str(value.device)}
    if isinstance(value, dict):
        return {"dict": [[key, _encode(item, tensors)] for key, item in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"tuple" if isinstance(value, tuple) else "list": [_encode(item, tensors) for item in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise InvalidArgumentError(f"elastic State.sync sends tensors, dicts, lists and JSON values; got {type(value)}")


def _decode(shape: dict, tensors: list, comm, root: int):
    if "tensor" in shape:
        if comm.rank == root:
            tensor = tensors.pop(0)
        else:
            tensor = torch.empty(shape["shape"], dtype=getattr(torch, shape["tensor"]))
        if tensor.numel():
            comm.broadcast(byte_view(tensor), root=root)
        return tensor.to(shape["device"])
    if "dict" in shape:
        return {key: _decode(item, tensors, comm, root) for key, item in shape["dict"]}
    if "list" in shape:
        return [_decode(item, tensors, comm, root) for item in shape["list"]]
    if "tuple" in shape:
        return tuple(_decode(item, tensors, comm, root) for item in shape["tuple"])
    return shape["value"]


def run(train_fn, state: State, *args, **kwargs):
    """Call train_fn(state, *args, **kwargs) until it returns, going on after each rank death
    on the ranks left (see the module notes); returns what it returns. Other errors propagate."""
    return run_elastic(train_fn, state, args, kwargs)


def run_elastic(train_fn, state: State, args=(), kwargs=None, on_shrink=None):
    """run(), and `on_shrink()` called after each shrink, before the state's reset (the Horovod
    namespace drops its process sets there)."""
    comm = init()
    missing = fault_tolerance_missing()
    if missing is not None:
        if comm.rank == 0 and comm.size > 1:
            warnings.warn(f"md.elastic.run: {missing}. A rank that dies ends the whole job, and whatever was trained "
                          "since the last checkpoint on disk is lost (commits are kept in memory only).", stacklevel=3)
    else:
        _return_errors(comm)
    processes = None if missing is not None else where_ranks_run(world())
    while True:
        state.sync()
        try:
            result = train_fn(state, *args, **(kwargs or {}))
        except Exception as exc:
            if missing is not None or not is_process_failure(exc, world().communicators()):
                raise
        else:
            losses.tell()  # the end of training: the summary of the ranks lost, if any
            return result
        # Out of the except block: the traceback, which holds the old communicator's buckets and
        # handles, is gone.
        old_size, reached = world().size, counters(state)
        dead = shrink_world()
        processes = end_frozen_processes(processes, dead)
        ranks = f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} of {old_size}"
        if world().rank == 0:
            lost = f"{ranks} died" if dead else "a communicator was revoked, but no rank died"
            print(f"mpidist elastic: {lost}; going on with {world().size} ranks from the last commit",
                  file=sys.stderr, flush=True)
        if dead:
            losses.record(losses.RankLoss(f"{ranks} (elastic training)", reached, time.time(),
                                          f"the training since the last commit ({counters(state, committed=True)}) "
                                          f"was done again on the {world().size} ranks left"),
                          reports=world().rank == 0)
        state.restore()
        if on_shrink is not None:
            on_shrink()
        state.on_reset()


def counters(state: State, committed: bool = False) -> str:
    """Where training is (or was at the last commit): the state's whole-number values, as
    "epoch=1 batch=3"."""
    values = state._committed["values"] if committed else {name: getattr(state, name) for name in state._value_names}
    named = [f"{name}={value}" for name, value in values.items() if isinstance(value, int) and not isinstance(value, bool)]
    return " ".join(named) or "a step (the state names no counter such as epoch=)"


def where_ranks_run(comm: Communicator) -> np.ndarray:
    """(host, process id) of every rank of `comm`, the host as a number (collective)."""
    mine = np.array([zlib.crc32(socket.gethostname().encode()), os.getpid()], dtype=np.int64)
    return comm.allgather(mine).reshape(-1, 2)


def end_frozen_processes(processes: np.ndarray, dead: list) -> np.ndarray:
    """SIGKILL to the processes of the ranks `dead` on this host that still run, and the rows of
    `processes` (where_ranks_run) of the ranks left. ULFM's failure detector may declare dead a
    rank that is frozen (stopped, stuck in the kernel), not gone, and mpirun would wait for its
    process forever after the survivors end; one on another host is beyond reach."""
    host = zlib.crc32(socket.gethostname().encode())
    for rank in dead:
        if processes[rank, 0] == host:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(processes[rank, 1]), signal.SIGKILL)
    return np.delete(processes, dead, axis=0)


def shrink_world() -> list:
    """Replace mpidist's world by its surviving ranks (collective over the survivors): revoke
    the old one, shrink it, and make the shrunk communicator the world. Returns the ranks of the
    old world that died."""
    old = world()
    old.abandon()
    survivors = old.mpi.Shrink()
    return_errors(survivors)
    MPI = load_mpi()
    old_group, new_group = old.mpi.Get_group(), survivors.Get_group()
    lost = MPI.Group.Difference(old_group, new_group)
    dead = MPI.Group.Translate_ranks(lost, list(range(lost.Get_size())), old_group)
    for group in (old_group, new_group, lost):
        group.Free()
    new = Communicator(survivors)
    survivors.Free()
    _return_errors(new)
    replace_world(new)
    return sorted(dead)


def _return_errors(comm: Communicator) -> None:
    """Errors come back as exceptions on every communicator of `comm` (MPI's default would end
    the job), so a death surfaces in the collective that meets it."""
    for mpi_comm in (comm.mpi, comm.node_comm, comm.leader_comm):
        if mpi_comm is not None:
            return_errors(mpi_comm)
