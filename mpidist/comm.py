"""Communicator: an mpi4py communicator plus the node-local and leader sub-communicators, its
point-to-point messages, its collectives, and the world communicator of md.init().

Every Communicator duplicates the communicator it wraps, so mpidist's messages never match the
user's own sends and receives on the same communicator.

This module sits above the collectives (mpidist/collectives/): a Communicator is the Channel
(channel.py) they run on, and its collective methods call them by name.
"""
from __future__ import annotations

import json
import threading
import warnings

import numpy as np

from . import buffers, collectives, launch
from .channel import Channel, NodeGroups, split_node_groups
from .errors import InvalidArgumentError, NotInitializedError, RankDiedError
from .runtime import config, leave, stall, tracing
from .runtime.abort import install_abort_on_exception
from .runtime.cuda_aware import mpi_library_cuda_aware
from .runtime.mpi import failed_ranks, fault_tolerant, load_mpi
from .runtime.together import raise_together


class Communicator(Channel):
    """Rank, size, node topology and point-to-point helpers over one MPI communicator.

    Collective methods (allreduce, broadcast, ...) run mpidist's own algorithms; see
    mpidist.collectives.
    """

    def __init__(self, mpi_comm=None):
        MPI = load_mpi()
        super().__init__()
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if base == MPI.COMM_NULL:
            raise InvalidArgumentError("cannot build a Communicator from MPI.COMM_NULL")
        self.mpi = base.Dup()
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        self.node_comm = self._split_node(MPI)
        self.local_rank = self.node_comm.Get_rank()
        self.local_size = self.node_comm.Get_size()
        is_leader = self.local_rank == 0
        leaders = self.mpi.Split(0 if is_leader else MPI.UNDEFINED, self.rank)
        self.leader_comm = None if leaders == MPI.COMM_NULL else leaders
        # Typed buffers, as everywhere in mpidist: nothing is pickled.
        node_rank = np.array([self.leader_comm.Get_rank() if is_leader else 0], dtype=np.int64)
        self.node_comm.Bcast(node_rank, root=0)
        self.node_rank = int(node_rank[0])
        leaders_total = np.array([1 if is_leader else 0], dtype=np.int64)
        self.mpi.Allreduce(MPI.IN_PLACE, leaders_total, op=MPI.SUM)
        self.num_nodes = int(leaders_total[0])
        self.cuda_aware = None  # asked lazily: only GPU buffers need to know
        self.check_calls = config.value("MPIDIST_CHECK")
        # algorithm="auto"'s decision table from `mpidist tune` (None: the built-in one), the
        # algorithm MPIDIST_ALLREDUCE_ALGORITHM forces, the sizes the fast path takes,
        # and the largest all-reduce the node window's one-shot takes.
        self.tuning_table, self.forced_algorithm, self.fast_path_bounds, self.one_shot_bytes = \
            collectives.auto_choice(self.mpi, self.num_nodes)
        self._node_groups = None  # node_communicators(), made at its first call
        self._node_and_lane = None  # node_and_lane(), made at its first call
        self._lock = threading.Lock()
        self._engine = None
        self._freed = False

    def _split_node(self, MPI):
        count = config.value("MPIDIST_RANKS_PER_NODE")
        # The local ranks in the order the launcher numbers them, so that md.local_rank() is the
        # LOCAL_RANK import set and the GPU the rank picks (launch.local_order); emulated nodes
        # are made of consecutive ranks.
        key = launch.local_order(self.rank) if count is None else self.rank
        shared = self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=key)
        if count is None:
            return shared
        # Emulate several nodes on one host: consecutive ranks of the host form "nodes".
        emulated = shared.Split(shared.Get_rank() // count, self.rank)
        shared.Free()
        return emulated

    # ---- buffers -----------------------------------------------------------------------------

    def is_cuda_aware(self) -> bool:
        if self.cuda_aware is None:
            # the probe runs on the GPU this rank's launch gives it, where the rank's buffers live
            self.cuda_aware = mpi_library_cuda_aware(probe_device=launch.gpu_for_local_rank() or 0)
        return self.cuda_aware

    def node_communicators(self) -> NodeGroups:
        if self._node_groups is None:
            self._node_groups = split_node_groups(self.mpi, self.node_comm, self.num_nodes)
        return self._node_groups

    def node_and_lane(self) -> tuple:
        """(the ranks of this rank's node, the ranks of the same local rank on every node: its
        lane) as Communicators, where this communicator spans several nodes with the same number
        (more than one) of its ranks on each; (None, None) otherwise. Collective at the first call
        (int8 compression's buckets, made in the same order on every rank); freed with this one."""
        if self._node_and_lane is None:
            local_sizes = {1}
            if self.num_nodes > 1:
                local_sizes = set(self.allgather(np.array([self.local_size], dtype=np.int64)).tolist())
            if local_sizes == {1} or len(local_sizes) > 1:
                self._node_and_lane = (None, None)
            else:
                self._node_and_lane = (Communicator(self.node_comm), Communicator(self.node_communicators().lane))
        return self._node_and_lane

    def _send_view(self, array, slot: int) -> buffers.BufferInfo:
        """The memory MPI should send from: the array itself, or a pinned host copy of it."""
        info = buffers.describe(array)
        if info.is_cuda and not self.is_cuda_aware():
            return self.staging.stage_in(array, info, slot)
        if info.is_cuda:
            buffers.synchronize(array, info)
        return info

    def _receive_view(self, info: buffers.BufferInfo, slot: int) -> buffers.BufferInfo:
        """The memory MPI should receive into: the array itself, or a pinned host buffer."""
        if info.is_cuda and not self.is_cuda_aware():
            host = self.staging.host_buffer(info.nbytes, slot)
            return buffers.BufferInfo(host.data_ptr(), info.count, info.dtype, "cpu", "torch")
        return info

    def _receive(self, receive, array, info, view, source) -> None:
        """Run receive(status); exactly info.nbytes must arrive (else a clear error), then move
        a staged receive to the GPU."""
        MPI = load_mpi()
        status = MPI.Status()
        try:
            receive(status)
        except MPI.Exception as exc:
            if exc.Get_error_class() == MPI.ERR_TRUNCATE:
                raise InvalidArgumentError(
                    f"rank {self.rank} expected {info.nbytes} bytes from rank {source}, "
                    "but the message was larger") from exc
            raise
        got = status.Get_count(MPI.BYTE)
        if got != info.nbytes:
            raise InvalidArgumentError(
                f"rank {self.rank} expected {info.nbytes} bytes from rank {source}, received {got}")
        if view is not info:
            self.staging.stage_out(array, info, view)

    # ---- point to point (typed buffers, never pickled) ---------------------------------------

    def send(self, array, dest: int, tag: int = 0) -> None:
        self._check_peer(dest, "dest")
        self.mpi.Send(buffers.mpi_spec(self._send_view(array, slot=0)), dest=dest, tag=tag)

    def recv(self, array, source: int, tag: int = 0) -> None:
        """Receive exactly as many bytes as `array` holds; a size mismatch raises."""
        self._check_peer(source, "source")
        info = buffers.describe(array)
        buffers.check_writable(array, "recv writes the message into the array")
        view = self._receive_view(info, slot=1)
        self._receive(lambda status: self.mpi.Recv(buffers.mpi_spec(view), source=source, tag=tag, status=status),
                      array, info, view, source)

    def sendrecv(self, send_array, dest: int, recv_array, source: int, tag: int = 0) -> None:
        self._check_peer(dest, "dest")
        self._check_peer(source, "source")
        send_spec = buffers.mpi_spec(self._send_view(send_array, slot=0))
        info = buffers.describe(recv_array)
        buffers.check_writable(recv_array, "sendrecv writes the message into recv_array")
        view = self._receive_view(info, slot=1)
        recv_spec = buffers.mpi_spec(view)
        self._receive(lambda status: self.mpi.Sendrecv(send_spec, dest=dest, sendtag=tag, recvbuf=recv_spec,
                                                       source=source, recvtag=tag, status=status),
                      recv_array, info, view, source)

    def _check_peer(self, peer, what):
        if not isinstance(peer, int) or not 0 <= peer < self.size:
            raise InvalidArgumentError(f"{what}={peer!r} is not a rank of this communicator (size {self.size})")


    # ---- collectives (mpidist's own algorithms; see mpidist/collectives/) ----------------------

    def allreduce(self, array, op="sum", algorithm="auto", out=None, shape=None):
        # CPU messages go straight to MPI_Allreduce or the node protocol where they can (the fast
        # path), unless spans are recorded (the general path has them) or the call check must
        # compare a shape.
        if out is None and (shape is None or not self.check_calls) and not tracing.recording() \
                and collectives.fast_cpu_allreduce(self, array, op, algorithm):
            return array
        return collectives.allreduce(self, array, op=op, algorithm=algorithm, out=out, shape=shape)

    def allreduce_async(self, array, op="sum", algorithm="auto", out=None, shape=None):
        return collectives.allreduce_async(self, array, op=op, algorithm=algorithm, out=out, shape=shape)

    def adasum_allreduce(self, array, sizes=None):
        """Adasum of the ranks' arrays, in place (collectives/adasum.py); `sizes` splits the
        array into tensors combined each with its own coefficients."""
        return collectives.adasum_allreduce(self, array, sizes)

    def broadcast(self, array, root=0):
        return collectives.broadcast(self, array, root=root)

    def allgather(self, array):
        return collectives.allgather(self, array)

    def reduce_scatter(self, array, op="sum"):
        return collectives.reduce_scatter(self, array, op=op)

    # The asynchronous forms: each returns a handle (wait(), done()) at once and runs on the
    # communicator's background thread, in the order of the calls, as allreduce_async does.

    def broadcast_async(self, array, root=0):
        return collectives.broadcast_async(self, array, root=root)

    def allgather_async(self, array):
        return collectives.allgather_async(self, array)

    def reduce_scatter_async(self, array, op="sum"):
        return collectives.reduce_scatter_async(self, array, op=op)

    def barrier(self) -> None:
        """Wait until every rank has called barrier() (with the deadline, MPIDIST_TIMEOUT)."""
        collectives.barrier(self)

    def alltoall(self, array, splits=None):
        """Send `splits[k]` rows of `array` (its first dimension; equal blocks without splits) to
        rank k (collectives/alltoall.py). Returns (the rows received, in rank order; the row
        counts received from each rank, an int64 NumPy array)."""
        return collectives.alltoall(self, array, splits)

    def async_engine(self):
        """The background thread of this communicator's asynchronous collectives (made on first
        use: every rank makes it at its first asynchronous call, so the duplication is collective)."""
        with self._lock:
            if self._engine is None:
                self._engine = collectives.AsyncEngine(self)
            return self._engine

    def free(self) -> None:
        """Release the duplicated MPI communicators, the asynchronous engine's thread and the
        shared windows of dropped DataParallels on this communicator (collective; optional:
        MPI_Finalize releases them too). Like mpi4py's communicators, a Communicator the program
        drops is not freed by itself, since freeing is collective and each rank drops it at its
        own moment; `with md.Communicator(sub) as comm:` frees it at the end of the block.
        Using it afterwards is an MPI error (an invalid communicator)."""
        if self._freed:
            return
        self._freed = True
        if self._engine is not None:
            self._engine.stop()
            self._engine = None
        collectives.free_released_windows(self.node_comm)
        self.free_windows()
        for group in self._node_and_lane or ():
            if group is not None:
                group.free()
        lane = self._node_groups.lane if self._node_groups is not None else None
        for comm in (lane, self.leader_comm, self.node_comm, self.mpi):
            if comm is not None:
                comm.Free()
        self.leader_comm = self._node_groups = None

    def communicators(self) -> list:
        """Every MPI communicator this one uses: its own, its node, leader and lane communicators,
        and its asynchronous engine's."""
        communicators = [self.mpi, self.node_comm, self.leader_comm]
        if self._node_groups is not None:
            communicators.append(self._node_groups.lane)
        if self._engine is not None:
            communicators.append(self._engine.mpi)
            if self._engine.node_groups is not None:
                communicators += [self._engine.node_groups.node, self._engine.node_groups.lane]
        return [comm for comm in communicators if comm is not None]

    def abandon(self) -> None:
        """Give up a communicator that lost a rank (md.elastic.run, after ULFM reported the death):
        revoke its MPI communicators and its engine's, so every survivor still waiting on one of
        them gets an error instead of waiting for the dead, and stop the engine's thread. Nothing is
        freed: freeing is collective and the dead rank cannot join; the memory goes at
        MPI_Finalize. Local; the communicator must not be used afterwards."""
        if self._freed:
            return
        self._freed = True
        for comm in self.communicators():
            comm.Revoke()
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.stop(free=False)
        collectives.forget_released_windows(self.node_comm)
        self.forget_windows()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.free()


def broadcast_json(comm, obj, root: int = 0, what: str = "broadcast_json"):
    """`root`'s JSON-serializable `obj` on every rank of `comm` (a Communicator): its length,
    then its UTF-8 text. Never pickled, so values come back as JSON gives them (dict keys
    become strings, tuples lists). An object JSON cannot encode raises InvalidArgumentError on
    every rank (raise_together)."""
    length, data, error = np.zeros(1, dtype=np.int64), None, None
    if comm.rank == root:
        try:
            data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy()
            length[0] = data.size
        except TypeError as exc:
            error = exc
    raise_together(comm.mpi, error, what, InvalidArgumentError,
                   message=lambda failures: f"{what} sends JSON only (no pickle); rank {root} passed an object JSON "
                                            f"cannot encode: {failures[root][1]}")
    comm.broadcast(length, root=root)
    if comm.rank != root:
        data = np.empty(int(length[0]), dtype=np.uint8)
    comm.broadcast(data, root=root)
    return json.loads(data.tobytes().decode())


_world: Communicator | None = None
_init_lock = threading.Lock()


def init(mpi_comm=None) -> Communicator:
    """Initialize MPI (if needed) and mpidist's world communicator. Idempotent.

    From here on an uncaught exception on any rank aborts the whole job (runtime/abort.py;
    MPIDIST_ABORT_ON_EXCEPTION=0 keeps Python's own behaviour), and a wait in a collective that
    runs past MPIDIST_STALL_WARNING reports the ranks that have not arrived (runtime/stall.py).
    In a fault-tolerant run, MPI_Finalize at exit is given MPIDIST_FINALIZE_TIMEOUT once a rank
    has died (runtime/leave.py).

    A launcher whose processes MPI does not join into one job (srun --mpi=none: N jobs of one
    rank each) is refused with LaunchMismatchError. RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE are set as torchrun sets them where the environment lacks them
    (launch.py)."""
    global _world
    with _init_lock:
        if _world is None:
            MPI = load_mpi()
            launch.check_agrees_with_mpi(MPI.COMM_WORLD.Get_size(), MPI.Get_library_version())
            if fault_tolerant():
                # First: its exit handler must run after the others, and a rank may die before
                # the world exists, whose survivors' MPI_Finalize must not wait for it forever.
                leave.install()
            _world = _make_world(MPI, mpi_comm)
            differing = launch.set_torchrun_variables(_world.rank, _world.size, _world.local_rank,
                                                      _world.local_size)
            if differing:
                warnings.warn(f"mpidist: rank {_world.rank}: the environment has {'; '.join(differing)}: "
                              "code that reads these variables gets another place than md.rank() and "
                              "md.local_rank() (unset them to let mpidist set them)", stacklevel=2)
            stall.open_board(_world.mpi)
            install_abort_on_exception(load_mpi().COMM_WORLD)
            timeline = config.value("MPIDIST_TIMELINE")
            if timeline and _world.rank == 0:  # rank 0 writes it, as Horovod's
                tracing.start_timeline(timeline)
    return _world


def _make_world(MPI, mpi_comm) -> Communicator:
    """md.init()'s world; a rank's death while it is made (the first collective calls of the job)
    is a RankDiedError naming the dead ranks, not MPI's bare MPI_ERR_PROC_FAILED: a job cannot go
    on from a rank lost before its training started, so it ends (md.elastic.run keeps going only
    from a state that every rank committed)."""
    try:
        return Communicator(mpi_comm)
    except MPI.Exception as error:
        if not fault_tolerant() or error.Get_error_class() not in (MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED):
            raise
        world_mpi = MPI.COMM_WORLD
        dead = failed_ranks(world_mpi, wait=1.0)
        raise RankDiedError(f"rank {world_mpi.Get_rank()}: rank(s) {dead} of {world_mpi.Get_size()} died while "
                            "md.init() was making mpidist's world, before the program could commit any state: the "
                            "job cannot go on without them; launch it again", ranks=dead) from error


def replace_world(communicator: Communicator) -> None:
    """Make `communicator` the world of md.rank(), md.allreduce(), hvd.size() ...: the survivors'
    communicator after a rank died (md.elastic.run)."""
    global _world
    with _init_lock:
        _world = communicator


def world() -> Communicator:
    if _world is None:
        raise NotInitializedError("mpidist is not initialized: call mpidist.init() first")
    return _world


def is_initialized() -> bool:
    return _world is not None
