"""How hvd's operations meet across ranks: by name, as Horovod's controller matches them, not by
the order each rank calls them in; and Horovod's tensor fusion of the small all-reduces ready
together (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME).

Each communicator hvd runs on has a Negotiator: a private duplicate of the communicator and a
background thread. A call submits its operation under its name= (an unnamed one under the next
number of the communicator's sequence, so unnamed operations keep matching in call order) with
its signature (what it is, dtype, shape, op, root, ...). Every HOROVOD_CYCLE_TIME (while nothing
is left to negotiate, after a pause of up to IDLE_PAUSE_LIMIT_S that a submit ends) the threads
of all ranks exchange what was submitted since the last cycle (one allgather of a JSON text:
names and numbers, never pickled), so every rank holds the same table of who submitted what,
and every rank takes the same decisions from it: the operations every rank has submitted run in
the order they became complete (within a cycle, in the order of first submission), consecutive
all-reduces of the same dtype, op and device fused into one buffer up to the threshold (Adasum's
never: each combines its own tensor).

What the call check guarantees holds here too: a name submitted with different signatures is
refused on every rank that submitted it (MismatchError naming the ranks), as is a name some rank
refused its own arguments to; a name some rank never submits is reported on stderr after
MPIDIST_STALL_WARNING and refused with DeadlineError after MPIDIST_TIMEOUT, naming the ranks that
did not submit it. Ranks waiting in hvd.join() take part with zeros in the all-reduces that sum
or average, fused as the others' are (what is fused is decided from the table alone).

This module owns the thread and the exchange; what crosses the wire (Submission, Signature,
Message, as one JSON text) and the rules every rank decides by (Table) are pure, in
negotiation_rules.py.
"""
from __future__ import annotations

import atexit
import threading
import time

import numpy as np
import torch

from .. import comm as _comm
from ..collectives.engine import Handle
from ..errors import DeadlineError
from ..runtime import config, stall, tracing
from ..runtime.deadlines import other_ranks, timeout, wait_until
from .negotiation_rules import (
    REFUSED,
    REFUSED_GROUP,
    Member,
    Message,
    Refusal,
    Signature,
    Table,
    decode,
    encode,
    group_member,
    submission_of,
    unnamed_name,
    unnamed_number,
)

# The hvd operations that go through the negotiation (the others run in call order, on the
# communicator itself; their order against these does not matter, as they use another channel).
NEGOTIATED = frozenset({
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "broadcast_", "broadcast_async", "broadcast_async_",
    "allgather_async", "grouped_allgather_async", "reducescatter_async", "grouped_reducescatter_async", "barrier"})
# While no rank has anything to negotiate, the pause between cycles doubles up to this, leaving
# the cores to the program (whose gradients go through the buckets); a submit here ends it, and
# so does anything else a rank has to tell the others (a refusal, join, leaving).
IDLE_PAUSE_LIMIT_S = 0.25
_negotiators = {}  # Communicator -> Negotiator
_creation = threading.Lock()
_stopped_at_exit = False  # whether _stop_all is registered with atexit


def negotiator_of(comm) -> Negotiator:
    """The Negotiator of `comm`, made on first use (collective: hvd.init() and add_process_set make
    it, where every rank calls, before the communicator's asynchronous engine exists)."""
    global _stopped_at_exit
    with _creation:
        if comm not in _negotiators:
            if not _stopped_at_exit:
                # Registered once MPI is initialized, after mpi4py's MPI_Finalize: so it runs before.
                atexit.register(_stop_all)
                _stopped_at_exit = True
            _negotiators[comm] = Negotiator(comm)
        return _negotiators[comm]


def submit(comm, name, signature: Signature, run, buffer=None):
    """The handle of an operation submitted to `comm`'s negotiation under `name` (a str, or a
    Member of a group: negotiation_rules.group_member), or under the next unnamed operation's
    (None), which runs once every rank has submitted it."""
    negotiator = negotiator_of(comm)
    return negotiator.submit(negotiator.name_of(name), signature, run, buffer)


def stop_negotiator(comm) -> None:
    """End `comm`'s negotiation once every rank asks (remove_process_set; at exit for them all)."""
    with _creation:
        negotiator = _negotiators.pop(comm, None)
    if negotiator is not None:
        negotiator.stop()


def abandon_negotiators() -> None:
    """Give up every negotiation (a rank of the world died: hvd.elastic.run calls this): their
    communicators are revoked, so their threads end in errors instead of waiting for the dead."""
    with _creation:
        abandoned = list(_negotiators.values())
        _negotiators.clear()
    for negotiator in abandoned:
        negotiator.private.abandon()


def _stop_all() -> None:
    for comm in list(_negotiators):
        stop_negotiator(comm)


class NegotiatedHandle(Handle):
    """The handle of a negotiated operation: the engine's Handle, whose wait says on the stall
    board that this rank waits for the operation."""

    def wait(self, timeout=None):
        stall.publish(self.description)
        try:
            return super().wait(timeout)
        finally:
            stall.returned()


class _Request:
    """An operation submitted on this rank: run(private communicator) does it; an all-reduce
    also gives its buffer and op, so that it can be fused with others."""

    def __init__(self, name, signature, handle, run, buffer=None):
        self.name, self.signature, self.handle, self.run, self.buffer = name, signature, handle, run, buffer
        self.inside_span = tracing.inside_span()  # the hvd operation's span: its collectives stay in it
        self.submitted = time.monotonic()
        self.stall_reported = False


class Negotiator:
    """The negotiation of one communicator's hvd operations (see the module's docstring)."""

    def __init__(self, comm):
        self.comm = comm
        self.private = _comm.Communicator(comm.mpi)  # collective: every rank makes it at the same call
        self.rank, self.size = comm.rank, comm.size
        self._lock = threading.Lock()
        self._outbox = []  # the Submissions made here since the last cycle
        self._local = {}  # name -> _Request, submitted here and not yet run
        self._table = Table(self.size)  # who submitted what, the same on every rank (the thread's alone)
        self._sequence = 0  # the number of the last unnamed operation
        self._joining = False  # this rank waits in hvd.join()
        self._zeros_while_joined = 0
        self._all_joined = threading.Event()
        self._leaving = False
        self._failure = None  # the error that ended the thread
        self._wake, self._idle = threading.Event(), False  # an idle pause's end; nothing on any rank
        # Read in the caller's thread at every submit (a malformed value is the caller's error): rank
        # 0's, sent in each cycle's message, is every rank's (as Horovod's coordinator decides).
        self._cycle_seconds = config.value("HOROVOD_CYCLE_TIME") / 1000
        self._fusion_threshold = config.value("HOROVOD_FUSION_THRESHOLD")
        self._thread = threading.Thread(target=self._serve, name="mpidist-negotiation", daemon=True)
        self._thread.start()

    # ---- the caller's side ----------------------------------------------------------------

    def name_of(self, name):
        """`name` (a Member of a group as it is), or the next unnamed operation's, as the ranks
        match them."""
        if isinstance(name, Member):
            return name
        if name is not None:
            return str(name)
        with self._lock:
            self._sequence += 1
            return unnamed_name(self._sequence)

    def submit(self, name, signature: Signature, run, buffer=None):
        """Submit an operation under `name` (a str or a Member); returns its handle
        (collectives.engine.Handle), completed by the thread with run's result or the error
        that refused it."""
        submission = submission_of(name, signature)
        handle = NegotiatedHandle(f"the hvd operation {submission.name!r}")
        threshold = config.value("HOROVOD_FUSION_THRESHOLD")
        with self._lock:
            if self._failure is not None:
                raise self._failure
            self._fusion_threshold = threshold
            self._local[submission.name] = _Request(submission.name, signature, handle, run, buffer)
            self._outbox.append(submission)
        self._wake.set()
        return handle

    def refuse(self, name) -> None:
        """This rank refused its own arguments to the operation `name` (a str or a Member): the
        ranks that submit it raise too instead of waiting for this one."""
        with self._lock:
            self._outbox.append(submission_of(name, refusal=REFUSED))
        self._wake.set()

    def refuse_group(self, group: str) -> None:
        """This rank refused its own arguments to the all-reduce group `group`, whose members the
        others submit as group_member(group, k), one per dtype and device of their tensors: how
        many, this rank cannot tell. So it refuses member 0, which every group has, as the whole
        group's; when member 0 is refused, so is every other member the ranks submitted
        (negotiation_rules.Table._rest_of_group)."""
        with self._lock:
            self._outbox.append(submission_of(group_member(group, 0), refusal=REFUSED_GROUP))
        self._wake.set()

    def join(self) -> None:
        """This rank waits in hvd.join() from now: it takes part with zeros in the all-reduces the
        others run, until every rank has called join()."""
        with self._lock:
            self._joining, self._zeros_while_joined = True, 0
            self._all_joined.clear()
        self._wake.set()

    def wait_for_every_rank_to_join(self) -> int:
        """Wait until every rank has called join(); returns how many of the others' all-reduces
        this rank took part in meanwhile."""
        while not self._all_joined.wait(1.0):
            if self._failure is not None:
                raise self._failure
        return self._zeros_while_joined

    def stop(self) -> None:
        with self._lock:
            self._leaving = True
        self._wake.set()
        self._thread.join()
        if self._failure is None:
            self.private.free()

    # ---- the thread -----------------------------------------------------------------------

    def _serve(self):
        pause = 0.0
        try:
            began = time.monotonic()
            while self._cycle():
                if self._idle:  # a pause that a submit ends: what it brings is negotiated at once
                    pause = min(max(2 * pause, self._cycle_seconds), IDLE_PAUSE_LIMIT_S)
                    self._wake.wait(pause)
                else:  # Horovod's cycle: the next begins a cycle time after the last began
                    pause = 0.0
                    time.sleep(max(0.0, began + self._cycle_seconds - time.monotonic()))
                self._wake.clear()  # before the next cycle reads the outbox: no submit is missed
                began = time.monotonic()
        except BaseException as error:  # handed to every operation waiting here
            with self._lock:
                self._failure = error
                waiting, self._local = list(self._local.values()), {}
            for request in waiting:
                request.handle._complete(error=error)
            self._all_joined.set()

    def _cycle(self) -> bool:
        """One exchange and what every rank decides from it; False once every rank is leaving."""
        now = time.monotonic()
        with self._lock:
            message = Message(tuple(self._outbox), self._joining, self._leaving, self._fusion_threshold,
                              tuple(name for name, request in self._local.items()
                                    if name in self._table.pending and now - request.submitted > timeout()))
            self._outbox = []
        messages = self._exchange(message)
        decisions = self._table.cycle(messages)
        for stalled in decisions.stalled:
            self._fail_stalled(stalled)
        self._run(decisions.steps)
        if decisions.all_joined:
            self._end_join()
        self._report_stalls(now)
        self._idle = not decisions.busy
        return not all(sent.leaving for sent in messages)

    def _exchange(self, message: Message) -> list:
        """Every rank's Message of this cycle, by rank."""
        from mpi4py import MPI  # imported here: importing mpi4py's MPI initializes MPI
        mpi = self.private.mpi
        mine = np.frombuffer(encode(message), dtype=np.uint8)
        lengths = np.empty(self.size, dtype=np.int64)
        self._wait(mpi.Iallgather([np.array([mine.size], dtype=np.int64), MPI.INT64_T], [lengths, MPI.INT64_T]))
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        everything = np.empty(int(lengths.sum()), dtype=np.uint8)
        self._wait(mpi.Iallgatherv([mine, MPI.BYTE], [everything, (lengths, offsets), MPI.BYTE]))
        return [decode(everything[start:start + length].tobytes())
                for start, length in zip(offsets.tolist(), lengths.tolist())]

    def _wait(self, request) -> None:
        """A cycle's exchange, with the deadline: every rank's thread cycles until all leave, so
        only a rank that died or hangs leaves it waiting. Not published on the stall board,
        which tells what the program waits in, not this thread."""
        others = other_ranks(self.private.mpi)
        wait_until(request.Test, f"rank {self.rank}", "the negotiation of hvd's operations", f"ranks {list(others)}",
                   peers=others, advice="A rank's program hangs outside Python or its process died.")

    def _run(self, steps: list) -> None:
        """Carry out a cycle's steps (negotiation_rules.Table.cycle's), in order, with this rank's
        requests; where this rank waits in join(), its zeros stand for the all-reduces it did not
        submit, fused as the others' tensors are (as Horovod's joined ranks fill a fused response
        with zeros)."""
        for step in steps:
            if isinstance(step, Refusal):
                self._refuse(step)
            else:
                self._run_fused([(submission, self._request(submission)) for submission in step.submissions])

    def _refuse(self, refusal: Refusal) -> None:
        """Complete this rank's requests of a refused operation and of the group members refused
        with it with the refusal's error. Where this rank refused the operation, a request of its
        own under the name is its next use's."""
        mine = refusal.who.get(self.rank)
        if mine is not None and mine.refusal is not None:
            request = None
            self._count_unnamed(mine)
        else:
            request = self._request(next(iter(refusal.who.values())))
        for name, who in refusal.rest:  # first: the caller may go on once told
            if self.rank in who:  # else a request here is a later group's
                member = self._take(name)
                if member is not None:
                    member.handle._complete(error=refusal.error)
        if request is not None:
            request.handle._complete(error=refusal.error)

    def _request(self, submission):
        """This rank's request of the operation of `submission`, None where it did not submit it."""
        request = self._take(submission.name)
        if request is None:
            self._count_unnamed(submission)
        return request

    def _count_unnamed(self, submission) -> None:
        """An unnamed operation the others ran while this rank waited in join() counts here too, so
        that the ranks' next unnamed operations still meet (a member of an unnamed group counts as
        its group)."""
        number = unnamed_number(submission)
        if number is not None:
            with self._lock:
                self._sequence = max(self._sequence, number)

    def _take(self, name):
        with self._lock:
            return self._local.pop(name, None)

    def _run_fused(self, fusion: list) -> None:
        """Run a Batch: `fusion`, (Submission, this rank's request or None) each. One request
        runs as it is; else all-reduce the requests' buffers as one (zeros for the operations
        this rank, waiting in join(), did not submit) and complete each request with its part."""
        if len(fusion) == 1 and fusion[0][1] is not None:
            self._complete(fusion[0][1], fusion[0][1].run, self.private)
            return
        parts = []
        for submission, request in fusion:
            if request is None:
                signature = submission.signature
                parts.append(torch.zeros(signature.count, dtype=getattr(torch, signature.dtype),
                                         device=signature.device))
                self._zeros_while_joined += 1
            else:
                parts.append(request.buffer.reshape(-1))
        # One device: the signature holds the device's type only, so a rank whose fused tensors
        # sit on two GPUs gathers them on the first's, and still runs what the others run.
        flat = torch.cat([part.to(parts[0].device) for part in parts]) if len(parts) > 1 else parts[0]
        requests = [request for _, request in fusion if request is not None]
        try:
            with tracing.continuing(requests[0].inside_span if requests else False):
                self.private.allreduce(flat, op=fusion[0][0].signature.op)
        except Exception as error:
            for request in requests:
                request.handle._complete(error=error)
            if not requests:
                raise  # this rank's thread: the error ends it, handed to what waits here
            return
        for (_, request), part in zip(fusion, flat.split([part.numel() for part in parts])):
            if request is not None:
                request.buffer.copy_(part.view_as(request.buffer))
                request.handle._complete(request.buffer)

    @staticmethod
    def _complete(request, run, private) -> None:
        try:
            with tracing.continuing(request.inside_span):
                result = run(private)
        except Exception as error:  # the caller's synchronize() raises it
            request.handle._complete(error=error)
        else:
            request.handle._complete(result)

    def _end_join(self) -> None:
        """Every rank has called join(): each lets its join() return, at the same cycle."""
        with self._lock:
            self._joining = False
        self._all_joined.set()

    def _fail_stalled(self, stalled) -> None:
        """Fail this rank's request of a Stalled operation with DeadlineError."""
        request = self._take(stalled.name)
        if request is not None:
            request.handle._complete(error=DeadlineError(
                f"the hvd operation {stalled.name!r} was not submitted by ranks {stalled.missing} within "
                f"{timeout():.0f} s (MPIDIST_TIMEOUT); ranks {stalled.submitted} submitted it", peers=stalled.missing))

    def _report_stalls(self, now: float) -> None:
        """Horovod's stall warning, as the stall report of the collectives (runtime/stall.py): once
        per operation waiting past MPIDIST_STALL_WARNING, from the lowest rank waiting for it."""
        warning = config.value("MPIDIST_STALL_WARNING")
        with self._lock:
            stalled = [request for request in self._local.values()
                       if not request.stall_reported and now - request.submitted > warning]
            for request in stalled:
                request.stall_reported = True
        for request in stalled:
            stall.report(self.private.mpi, request.handle.description, now - request.submitted, timeout())

