"""Horovod's process sets: subsets of the ranks running collectives of their own, each on an MPI
sub-communicator. ProcessSet, the global set, their registration (collective, checked alike on
every rank) and the communicator and root rank an operation's process_set= stands for.
"""
from __future__ import annotations

import numpy as np

from .. import comm as _comm
from ..errors import InvalidArgumentError, MismatchError
from ..runtime import wire
from ..runtime.together import raise_together
from .negotiation import abandon_negotiators, negotiator_of, stop_negotiator


class ProcessSet:
    """A subset of the ranks running collectives of their own (Horovod's process sets), on an MPI
    sub-communicator. Give it a list of global ranks, or an mpi4py communicator this rank
    belongs to; register it with hvd.init(process_sets=[...]) or hvd.add_process_set(), in the
    same order on every rank, then pass process_set= to the operations. Only its ranks may call
    them; a broadcast's root_rank is a global rank of the set."""

    def __init__(self, ranks_or_comm):
        self.process_set_id = None
        self.ranks = None
        self.mpi_comm = None
        self._comm = None  # the mpidist Communicator of this rank's set, once registered
        if isinstance(ranks_or_comm, (list, tuple, range)):
            if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in ranks_or_comm):
                raise ValueError("ProcessSet takes a list of process ranks or an mpi4py communicator, got "
                                 f"{list(ranks_or_comm)!r}")
            self.ranks = sorted(int(r) for r in ranks_or_comm)
        elif isinstance(ranks_or_comm, _comm.load_mpi().Comm):
            self.mpi_comm = ranks_or_comm
        else:
            raise ValueError("ProcessSet takes a list of process ranks or an mpi4py communicator, got "
                             f"{type(ranks_or_comm).__name__}")

    def size(self) -> int:
        return len(self._registered().ranks)

    def rank(self) -> int:
        """This rank's position in the set (-1 outside it)."""
        return self._comm.rank if self._comm is not None else -1

    def included(self) -> bool:
        return self._comm is not None

    def _registered(self):
        if self.process_set_id is None:
            raise InvalidArgumentError(f"{self} is not registered: pass it to hvd.init(process_sets=[...]) or "
                                       "hvd.add_process_set() on every rank first")
        return self

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


class _GlobalProcessSet(ProcessSet):
    """Horovod's default process set: all ranks, on the world communicator."""

    def __init__(self):
        self.process_set_id = 0
        self.mpi_comm = None

    @property
    def ranks(self):
        return list(range(_comm.world().size)) if _comm.is_initialized() else []

    @property
    def _comm(self):
        return _comm.world()


global_process_set = _GlobalProcessSet()
_process_sets = {0: global_process_set}  # id -> registered ProcessSet
_registered_so_far = [0]  # ids are never reused, as Horovod's


def comm_of(process_set):
    """The communicator that runs `process_set`'s operations on this rank."""
    if process_set is None or process_set is global_process_set:
        return _comm.world()
    if not isinstance(process_set, ProcessSet):
        raise InvalidArgumentError(f"process_set= takes an hvd.ProcessSet, got {type(process_set).__name__}")
    process_set._registered()
    if process_set._comm is None:
        raise InvalidArgumentError(f"rank {_comm.world().rank} is not in {process_set}: only the ranks of a process "
                                   "set may call its operations")
    return process_set._comm


def root_in(process_set, root_rank) -> int:
    """A broadcast root given as a global rank, as its position in the process set."""
    if process_set is None or process_set is global_process_set:
        return root_rank
    if root_rank not in process_set.ranks:
        raise InvalidArgumentError(f"root_rank={root_rank} is not in {process_set}")
    return process_set.ranks.index(root_rank)


_REGISTERING = "registering a ProcessSet"
_INITIALIZING = "hvd.init(process_sets=...)"


def register(process_set: ProcessSet) -> ProcessSet:
    """Give `process_set` the next id and its sub-communicator. Collective over all ranks, which
    must register the same sets in the same order. A set one rank refuses is refused on every
    rank, with the same InvalidArgumentError naming the refusing ranks and their reasons
    (runtime.together); sets the ranks disagree on, with the same MismatchError."""
    world, mpi = _comm.world(), _comm.load_mpi()
    try:
        members, problem = _members(process_set, world, mpi), None
    except InvalidArgumentError as refused:
        members, problem = [], refused
    raise_together(world.mpi, problem, _REGISTERING, InvalidArgumentError)
    # Every rank's view of the set, so that every rank reaches the same verdict.
    mine = np.array(members, dtype=np.int64)
    lengths = world.allgather(np.array([len(mine)], dtype=np.int64))
    everyone = world.allgather(mine)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    seen = [everyone[offsets[k]:offsets[k + 1]].tolist() for k in range(world.size)]
    if process_set.mpi_comm is None:
        if any(view != seen[0] for view in seen):
            raise MismatchError(f"ranks registered different process sets at the same point: {seen} by rank")
        sub = world.mpi.Split(0 if world.rank in members else mpi.UNDEFINED, key=world.rank)
    else:  # each rank's communicator: its members must all have passed the same one
        if any(seen[member] != view for view in seen for member in view):
            raise MismatchError(f"the ranks' ProcessSet communicators do not agree on their members: {seen} by rank")
        sub = process_set.mpi_comm
    process_set.ranks = members
    if sub != mpi.COMM_NULL:
        process_set._comm = _comm.Communicator(sub)  # a duplicate: the split below is freed here
        negotiator_of(process_set._comm)  # collective over the set's ranks, as the duplicate is
        if process_set.mpi_comm is None:
            sub.Free()
    _registered_so_far[0] += 1
    process_set.process_set_id = _registered_so_far[0]
    _process_sets[process_set.process_set_id] = process_set
    return process_set


def register_at_init(process_sets) -> None:
    """hvd.init(process_sets=[...]): register the sets not registered yet, in order. Collective
    over all ranks, which first agree on the list: a list one rank refuses (not a list of
    ProcessSet) is refused on every rank with the same InvalidArgumentError naming it, and lists
    that differ by rank (in length, or in which sets a rank has registered already) with the same
    MismatchError showing each rank's, instead of a rank skipping a registration the others
    make, which would leave them waiting for it."""
    world = _comm.world()
    sets, problem = [], None
    if isinstance(process_sets, (list, tuple)) and all(isinstance(item, ProcessSet) for item in process_sets):
        sets = list(process_sets)
    else:
        problem = InvalidArgumentError("hvd.init takes process_sets=None, \"dynamic\" or a list of hvd.ProcessSet, got "
                                       f"{process_sets!r}")
    raise_together(world.mpi, problem, _INITIALIZING, InvalidArgumentError)
    view = "[" + ", ".join("new" if s.process_set_id is None else f"registered already as {s.process_set_id}"
                           for s in sets) + "]"
    views = wire.allgather_texts(world.mpi, view, _INITIALIZING)
    if len(set(views)) > 1:
        by_view = {}
        for rank, seen in enumerate(views):
            by_view.setdefault(seen, []).append(rank)
        raise MismatchError(f"{_INITIALIZING}: the ranks passed different lists of process sets (every rank must "
                            "pass the same sets, in the same order): "
                            + "; ".join(f"ranks {ranks}: {seen}" for seen, ranks in by_view.items()))
    for process_set in sets:
        if process_set.process_set_id is None:
            register(process_set)


def _members(process_set: ProcessSet, world, mpi) -> list:
    """The sorted global ranks of `process_set` on this rank, or InvalidArgumentError saying why
    this rank cannot register it."""
    if process_set.process_set_id is not None:
        raise InvalidArgumentError(f"{process_set} is registered already")
    if process_set.mpi_comm is None:
        members = process_set.ranks
        if not (members and len(set(members)) == len(members) and 0 <= members[0] and members[-1] < world.size):
            raise InvalidArgumentError(f"ProcessSet ranks {members} must be distinct ranks of "
                                       f"0..{world.size - 1}, at least one")
        return members
    group = process_set.mpi_comm.Get_group()
    members = sorted(mpi.Group.Translate_ranks(group, list(range(group.Get_size())), world.mpi.Get_group()))
    if mpi.UNDEFINED in members:
        raise InvalidArgumentError("a ProcessSet's communicator holds ranks outside the world")
    return members


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of ranks) after init; every rank must call it,
    with the same sets in the same order. Returns the ProcessSet. A list ProcessSet() refuses on
    one rank is refused on every rank, as register's refusals are."""
    if not isinstance(process_set, ProcessSet):
        try:
            process_set = ProcessSet(process_set)
        except ValueError as refused:  # the other ranks are in register's agreement
            raise_together(_comm.world().mpi, refused, _REGISTERING, InvalidArgumentError)
            raise  # not reached: raise_together raises where any rank refused
    return register(process_set)


def remove_process_set(process_set) -> bool:
    """Unregister a process set and free its communicator (every rank, same order). False for the
    global one."""
    if process_set is global_process_set or process_set.process_set_id == 0:
        return False
    process_set._registered()
    _process_sets.pop(process_set.process_set_id, None)
    if process_set._comm is not None:
        stop_negotiator(process_set._comm)
        process_set._comm.free()  # its own duplicate; a user's communicator stays the user's
    process_set.process_set_id, process_set._comm = None, None
    return True


def drop_process_sets() -> None:
    """Forget every process set but the global one, without freeing their communicators (a rank
    of the old world died, so no collective runs on them; hvd.elastic.run calls this), and start
    the negotiation of the survivors' world (collective over them)."""
    abandon_negotiators()
    negotiator_of(_comm.world())
    for process_set_id in [key for key in _process_sets if key != 0]:
        process_set = _process_sets.pop(process_set_id)
        if process_set._comm is not None:
            process_set._comm.abandon()
        process_set.process_set_id, process_set._comm = None, None
