"""The asynchronous engine: a background thread per communicator that runs its collectives in
submission order on a private duplicate of the communicator, and the Handle of each call.

The engine is a Channel (channel.py) of its own: the collectives run on it exactly as on a
Communicator. It has its own MPI communicator, scratch and staging buffers (its thread must not
share them with the caller's), and its own node communicators for the hierarchical all-reduce,
split from its duplicate on first use; the settings (call check, tuning table, forced algorithm,
small-message bounds, CUDA-awareness) are its Communicator's.

A blocking collective of a communicator that has an engine runs on the engine's channel too (so
that every rank runs it on the same MPI communicator, whatever its engine's queue holds), in
submission order: on the caller's thread when nothing is queued or running there (no hop to the
engine's thread and back), else queued behind the rest and waited for (in_order).
"""
from __future__ import annotations

import queue
import threading
import time

from ..channel import Channel, split_node_groups
from ..errors import DeadlineError
from ..runtime import deadlines, tracing


class Handle:
    """The result of an asynchronous collective: wait() for it, or ask done()."""

    def __init__(self, description: str):
        self.description = description
        self._finished = threading.Event()
        self._result = None
        self._error = None
        self.started = self.finished = None  # perf_counter times on the engine's thread

    def _complete(self, result=None, error=None):
        self._result, self._error = result, error
        self.finished = time.perf_counter()
        self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None):
        if not self._finished.wait(timeout if timeout is not None else deadlines.timeout() + 60):
            # The engine's own wait has the deadline and names the silent ranks; this one only
            # fires if the engine thread itself is stuck.
            raise DeadlineError(f"{self.description} did not complete within MPIDIST_TIMEOUT + 60 s")
        if self._error is not None:
            raise self._error
        return self._result


class AsyncEngine(Channel):
    """A background thread that runs a communicator's asynchronous collectives in submission
    order on a private duplicate of the communicator, so they progress while the caller computes
    (as Horovod's background thread does). Every rank must submit them in the same order."""

    # A collective called on the engine itself (from work running on its thread) runs at once
    # (in_order): the engine has no engine of its own.
    _engine = None

    def __init__(self, comm):
        super().__init__()
        self.comm = comm
        # Nonblocking, with the call check's deadline: a rank whose first asynchronous call never
        # comes (refused locally, or it called something else) would otherwise hang here forever.
        self.mpi, request = comm.mpi.Idup()
        deadlines.wait_for_collective(request, comm.mpi, what="duplication of the communicator for "
                                                              "asynchronous collectives (at the first asynchronous call)")
        self.rank, self.size = comm.rank, comm.size
        self.node_groups = None  # node_communicators(), split from self.mpi on first use
        self._queue = queue.Queue()
        # Held while a collective runs on this engine, on whichever thread: the engine's memory
        # and communicators serve one collective at a time.
        self._running = threading.Lock()
        self._counting = threading.Lock()
        self._unfinished = 0  # submitted and not yet run to the end, under _counting
        self._thread = threading.Thread(target=self._serve, name="mpidist-async", daemon=True)
        self._thread.start()

    # ---- the Channel: settings are the communicator's --------------------------------------

    @property
    def check_calls(self) -> bool:
        return self.comm.check_calls

    @property
    def tuning_table(self):
        return self.comm.tuning_table

    @property
    def forced_algorithm(self):
        return self.comm.forced_algorithm

    @property
    def num_nodes(self) -> int:
        return self.comm.num_nodes

    @property
    def fast_path_bounds(self):
        return self.comm.fast_path_bounds

    @property
    def one_shot_bytes(self):
        return self.comm.one_shot_bytes

    def is_cuda_aware(self) -> bool:
        return self.comm.is_cuda_aware()

    def node_communicators(self):
        """Split from the private duplicate (collective on it; every rank's engine thread asks at
        the same call), so the engine never shares a communicator with the caller's thread."""
        if self.node_groups is None:
            owner = self.comm
            node = self.mpi.Split(owner.node_rank, owner.rank)
            self.node_groups = split_node_groups(self.mpi, node, owner.num_nodes)
        return self.node_groups

    # ---- the thread ------------------------------------------------------------------------

    def submit(self, description: str, work) -> Handle:
        handle = Handle(description)
        with self._counting:
            self._unfinished += 1
        self._queue.put((handle, work, tracing.inside_span()))
        return handle

    def run_in_order(self, work):
        """work(self) behind the submitted collectives, on the caller's thread when none is
        queued or running (or when the caller is the engine's thread itself, running one: a
        future's callback), else on the engine's thread, waited for. Returns its result."""
        with self._counting:
            idle = self._unfinished == 0 and self._running.acquire(blocking=False)
        if not idle:
            if self.is_current_thread():
                return work(self)
            return self.submit("collective", work).wait()
        try:
            return work(self)
        finally:
            self._running.release()

    def is_current_thread(self) -> bool:
        """Whether the caller runs on the engine's own thread: in a callback of a future that
        one of its collectives completes."""
        return threading.get_ident() == self._thread.ident

    def _serve(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, work, inside_span = item
            result = error = None
            with self._running, tracing.continuing(inside_span):
                handle.started = time.perf_counter()
                try:
                    result = work(self)
                except BaseException as exc:  # handed to the waiting caller
                    error = exc
                with self._counting:
                    self._unfinished -= 1
            # Completed once the engine is free: the woken caller's next blocking collective
            # then finds it idle and runs on its own thread.
            handle._complete(result, error)

    def stop(self, free: bool = True):
        """End the thread once the queued work is done; with `free`, free the communicators
        and the window (collective). Without it (a communicator that lost a rank, already
        revoked, so the queued work ends in errors) they are left to MPI_Finalize."""
        self._queue.put(None)
        self._thread.join()
        if not free:
            return
        self.free_windows()
        if self.node_groups is not None:
            for comm in (self.node_groups.lane, self.node_groups.node):
                if comm is not None:
                    comm.Free()
        self.mpi.Free()


def on_engine_thread(comm) -> bool:
    """Whether the caller runs on `comm`'s engine thread (AsyncEngine.is_current_thread)."""
    return comm._engine is not None and comm._engine.is_current_thread()


def in_order(comm, work):
    """Run a blocking collective, work(channel). Once the communicator has an asynchronous
    engine, the work runs on the engine's channel behind the operations already submitted there
    (AsyncEngine.run_in_order): the collectives of one communicator then never run concurrently
    (MPI libraries do not all allow creating shared-memory windows from two threads at once) and
    always in program order."""
    engine = comm._engine
    if engine is None:
        return work(comm)
    return engine.run_in_order(work)
