"""How hvd's operations meet across ranks: by name, as Horovod's controller matches them, not by
the order each rank calls them in; and Horovod's tensor fusion of the small all-reduces ready
together (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME).

Each communicator hvd runs on has a Negotiator: a private duplicate of the communicator and a
background thread. A call submits its operation under its name= (an unnamed one under the next
number of the communicator's sequence, so unnamed operations keep matching in call order) with
its signature (what it is, dtype, shape, op, root, ...). Every HOROVOD_CYCLE_TIME (longer while
no rank has anything to negotiate, IDLE_PAUSE_LIMIT_S at most) the threads of all ranks exchange
what was submitted since the last cycle (one allgather of a JSON text: names and numbers, never
pickled), so every rank holds the same table of who submitted what, and every rank takes the
same decisions from it: the operations every rank has submitted run in the order they became
complete (within a cycle, in the order of first submission), consecutive all-reduces of the
same dtype, op and device fused into one buffer up to the threshold (Adasum's never: each
combines its own tensor).

What the call check guarantees holds here too: a name submitted with different signatures is
refused on every rank that submitted it (MismatchError naming the ranks), as is a name some rank
refused its own arguments to; a name some rank never submits is reported on stderr after
MPIDIST_STALL_WARNING and refused with DeadlineError after MPIDIST_TIMEOUT, naming the ranks that
did not submit it. Ranks waiting in hvd.join() take part with zeros in the all-reduces that sum
or average, fused as the others' are (what is fused is decided from the table alone).
"""
from __future__ import annotations

import atexit
import functools
import json
import threading
import time

import numpy as np
import torch

from .. import comm as _comm
from ..errors import DeadlineError, MismatchError
from ..runtime import config, stall, tracing
from ..runtime.deadlines import other_ranks, timeout, wait_until

# The hvd operations that go through the negotiation (the others run in call order, on the
# communicator itself; their order against these does not matter, as they use another channel).
NEGOTIATED = frozenset({
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "broadcast_", "broadcast_async", "broadcast_async_",
    "allgather_async", "grouped_allgather_async", "reducescatter_async", "grouped_reducescatter_async", "barrier"})
_UNNAMED = "<unnamed operation "  # + its number and ">"
_REFUSED = ["refused"]  # the signature of an operation a rank refused its own arguments to
_REFUSED_GROUP = ["refused", "whole group"]  # ... of an all-reduce group's member 0: see refuse()
_JOINABLE_OPS = ("sum", "avg")  # zeros change no sum, and an average still divides by every rank
_FUSABLE_OPS = ("sum", "avg", "min", "max", "prod")  # elementwise: one all-reduce of a concatenation is each's
# While no rank has anything to negotiate, the pause between cycles doubles up to this, leaving
# the cores to the program (whose gradients go through the buckets); a submit here ends it.
IDLE_PAUSE_LIMIT_S = 0.05
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


def submit(comm, name, signature: list, run, buffer=None):
    """The handle of an operation submitted to `comm`'s negotiation under `name`, or under the
    next unnamed operation's (None), which runs once every rank has submitted it."""
    negotiator = negotiator_of(comm)
    return negotiator.submit(negotiator.name_of(name), signature, run, buffer)


def member_name(group: str, index: int) -> str:
    """The name member `index` of a grouped operation named `group` is submitted under."""
    return f"{group}.{index}"


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


@functools.cache
def _handle_class():
    """The handle of a negotiated operation: the engine's Handle, whose wait says on the stall
    board that this rank waits for the operation (made on first use: the collectives initialize
    MPI)."""
    from ..collectives.engine import Handle

    class NegotiatedHandle(Handle):
        def wait(self, timeout=None):
            stall.publish(self.description)
            try:
                return super().wait(timeout)
            finally:
                stall.returned()

    return NegotiatedHandle


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
        self._outbox = []  # [name, signature] submitted here since the last cycle
        self._local = {}  # name -> _Request, submitted here and not yet run
        self._pending = {}  # name -> {rank: signature}, the same table on every rank
        self._deferred = []  # (rank, name, signature) entered once a refusal is resolved (_enter)
        self._sequence = 0  # the number of the last unnamed operation
        self._joined = set()  # ranks waiting in hvd.join(), the same on every rank
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

    def name_of(self, name) -> str:
        """`name`, or the next unnamed operation's, as the ranks match them."""
        if name is not None:
            return str(name)
        with self._lock:
            self._sequence += 1
            return f"{_UNNAMED}{self._sequence}>"

    def submit(self, name: str, signature: list, run, buffer=None):
        """Submit an operation; returns its handle (collectives.engine.Handle), completed by the
        thread with run's result or the error that refused it."""
        handle = _handle_class()(f"the hvd operation {name!r}")
        threshold = config.value("HOROVOD_FUSION_THRESHOLD")
        with self._lock:
            if self._failure is not None:
                raise self._failure
            self._fusion_threshold = threshold
            self._local[name] = _Request(name, signature, handle, run, buffer)
            self._outbox.append([name, signature])
        self._wake.set()
        return handle

    def refuse(self, name: str) -> None:
        """This rank refused its own arguments to the operation `name`: the ranks that submit it
        raise too instead of waiting for this one."""
        with self._lock:
            self._outbox.append([name, _REFUSED])
        self._wake.set()

    def refuse_group(self, group: str) -> None:
        """This rank refused its own arguments to the all-reduce group `group`, whose members the
        others submit as member_name(group, k), one per dtype and device of their tensors: how
        many, this rank cannot tell. So it refuses member 0, which every group has, as the whole
        group's; when member 0 is refused, so is every other member the ranks submitted
        (_refuse_rest_of_group)."""
        with self._lock:
            self._outbox.append([member_name(group, 0), _REFUSED_GROUP])
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
            while self._cycle():
                pause = min(max(2 * pause, self._cycle_seconds), IDLE_PAUSE_LIMIT_S) if self._idle else 0.0
                self._wake.wait(pause)  # a submit here ends it
                time.sleep(self._cycle_seconds)  # then, as between busy cycles: one call's submits, one cycle
                self._wake.clear()  # before the next cycle reads the outbox: no submit is missed
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
            message = {"submitted": self._outbox, "joined": self._joining, "leaving": self._leaving,
                       "fusion_threshold": self._fusion_threshold,
                       "expired": [name for name, request in self._local.items()
                                   if name in self._pending and now - request.submitted > timeout()]}
            self._outbox = []
        messages = self._exchange(message)
        arrived = self._deferred + [(rank, name, signature) for rank, sent in enumerate(messages)
                                    for name, signature in sent["submitted"]]
        self._deferred = []
        for rank, name, signature in arrived:
            self._enter(rank, name, signature)
        self._joined |= {rank for rank, sent in enumerate(messages) if sent["joined"]}
        expired = {name for sent in messages for name in sent["expired"]}
        training = [rank for rank in range(self.size) if rank not in self._joined]
        ready = [name for name, who in self._pending.items() if training and all(r in who for r in training)]
        for name in [name for name in expired if name in self._pending and name not in ready]:
            self._fail_stalled(name, self._pending.pop(name))
        self._run([(name, self._pending.pop(name)) for name in ready], messages[0]["fusion_threshold"])
        if not training:
            self._end_join()
        self._report_stalls(now)
        self._idle = not (self._pending or self._deferred or self._joined or arrived)
        return not all(sent["leaving"] for sent in messages)

    def _enter(self, rank: int, name: str, signature: list) -> None:
        """Enter a rank's submission in the table. A refusal holds no name on the refusing rank,
        which may use the name again at once: while the table still holds its refusal of `name`
        (or of the all-reduce group `name` is a member of), that refused use is the one the
        others' submissions meet, and the next waits here until it is resolved."""
        group, _, index = name.rpartition(".")
        refused_group = index.isdigit() and self._pending.get(member_name(group, 0), {}).get(rank) == _REFUSED_GROUP
        if rank in self._pending.get(name, {}) or refused_group:
            self._deferred.append((rank, name, signature))
        else:
            self._pending.setdefault(name, {})[rank] = signature

    def _exchange(self, message: dict) -> list:
        """Every rank's message of this cycle, by rank."""
        from mpi4py import MPI  # imported here: importing mpi4py's MPI initializes MPI
        mpi = self.private.mpi
        mine = np.frombuffer(json.dumps(message).encode(), dtype=np.uint8)
        lengths = np.empty(self.size, dtype=np.int64)
        self._wait(mpi.Iallgather([np.array([mine.size], dtype=np.int64), MPI.INT64_T], [lengths, MPI.INT64_T]))
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        everything = np.empty(int(lengths.sum()), dtype=np.uint8)
        self._wait(mpi.Iallgatherv([mine, MPI.BYTE], [everything, (lengths, offsets), MPI.BYTE]))
        return [json.loads(everything[start:start + length].tobytes())
                for start, length in zip(offsets.tolist(), lengths.tolist())]

    def _wait(self, request) -> None:
        """A cycle's exchange, with the deadline: every rank's thread cycles until all leave, so
        only a rank that died or hangs leaves it waiting. Not published on the stall board,
        which tells what the program waits in, not this thread."""
        others = other_ranks(self.private.mpi)
        wait_until(request.Test, f"rank {self.rank}", "the negotiation of hvd's operations", f"ranks {list(others)}",
                   peers=others, advice="A rank's program hangs outside Python or its process died.")

    def _run(self, ready: list, threshold: int) -> None:
        """Run the operations every rank has submitted, in the table's order; fuse what can be.
        What is fused is decided from the signatures alone, the same on every rank, so a rank
        waiting in join() fuses its zeros as the others fuse their tensors (as Horovod's joined
        ranks fill a fused response with zeros). `threshold` is rank 0's HOROVOD_FUSION_THRESHOLD."""
        fusion, fused_bytes = [], 0  # [(signature, this rank's request or None)]
        for name, who in ready:
            # Where this rank refused `name`, a request of its own under the name is its next use's.
            request = None if who.get(self.rank, [None])[0] == _REFUSED[0] else self._take(name)
            if request is None:
                self._count_unnamed(name)
            error = self._refusal(name, who)
            if error is not None:
                self._run_fused(fusion)
                fusion, fused_bytes = [], 0
                self._refuse_rest_of_group(name, who, error)  # first: the caller may go on once told
                if request is not None:
                    request.handle._complete(error=error)
                continue
            signature = next(iter(who.values()))
            fusable = 0 < threshold and signature[0] == "allreduce" and signature[3] in _FUSABLE_OPS
            nbytes = signature[2] * getattr(torch, signature[1]).itemsize if fusable else 0
            if fusion and (not fusable or _kind(fusion[0][0]) != _kind(signature) or fused_bytes + nbytes > threshold):
                self._run_fused(fusion)
                fusion, fused_bytes = [], 0
            if fusable:
                fusion.append((signature, request))
                fused_bytes += nbytes
            else:
                self._run_one(signature, request)
        self._run_fused(fusion)

    def _refuse_rest_of_group(self, name: str, who: dict, error) -> None:
        """`name` was refused: where a rank refused it as an all-reduce group's member 0
        (refuse_group), refuse the group's other members too, with the same error. Every rank
        submits a group's members last to first (reductions.py), so a rank's member 0 in the table means
        all its members are: none is left waiting for the refusing rank."""
        if _REFUSED_GROUP not in who.values():
            return
        group = name.removesuffix(".0")  # member_name(group, 0)
        for other in [other for other in self._pending
                      if other.startswith(f"{group}.") and other[len(group) + 1:].isdigit()]:
            if self.rank in self._pending.pop(other):  # else a request here is a later group's
                request = self._take(other)
                if request is not None:
                    request.handle._complete(error=error)

    def _count_unnamed(self, name: str) -> None:
        """An unnamed operation the others ran while this rank waited in join() counts here too, so
        that the ranks' next unnamed operations still meet (a member of an unnamed group counts as
        its group: "<unnamed operation 7>.1" as 7)."""
        if name.startswith(_UNNAMED):
            with self._lock:
                self._sequence = max(self._sequence, int(name.removeprefix(_UNNAMED).split(">")[0]))

    def _take(self, name):
        with self._lock:
            return self._local.pop(name, None)

    def _refusal(self, name: str, who: dict):
        """The error every rank that submitted `name` raises, or None when it can run."""
        refused = sorted(rank for rank, signature in who.items() if signature[0] == _REFUSED[0])
        if refused:
            return MismatchError(f"ranks {refused} refused their arguments to the hvd operation {name!r} (each raised "
                                 "its own error there: see those ranks' output), so the other ranks cannot run it "
                                 "either")
        differences = _differences(who)
        if differences:
            return MismatchError(f"the ranks submitted the hvd operation {name!r} with different arguments: "
                                 + " | ".join(differences))
        signature = next(iter(who.values()))
        if self._joined and (signature[0] != "allreduce" or signature[3] not in _JOINABLE_OPS):
            return MismatchError(f"{signature[0]} is not supported with join: ranks {sorted(self._joined)} have run "
                                 "out of data and wait in join(), where they take part only in all-reduces that sum "
                                 f"or average (the hvd operation {name!r}: {_described(signature)})")
        return None

    def _run_one(self, signature: list, request) -> None:
        """Run one operation: this rank's request, or, where this rank waits in join(), its zeros."""
        if request is None:
            self._run_fused([(signature, None)])
        else:
            self._complete(request, request.run, self.private)

    def _run_fused(self, fusion: list) -> None:
        """All-reduce the buffers of `fusion`'s requests as one (zeros for the operations this
        rank, waiting in join(), did not submit) and complete each request with its part."""
        if len(fusion) == 1 and fusion[0][1] is not None:
            self._complete(fusion[0][1], fusion[0][1].run, self.private)
            return
        if not fusion:
            return
        parts = []
        for signature, request in fusion:
            if request is None:
                _, dtype, count, _, device = signature[:5]
                parts.append(torch.zeros(count, dtype=getattr(torch, dtype), device=device))
                self._zeros_while_joined += 1
            else:
                parts.append(request.buffer.reshape(-1))
        # One device: the signature holds the device's type only, so a rank whose fused tensors
        # sit on two GPUs gathers them on the first's, and still runs what the others run.
        flat = torch.cat([part.to(parts[0].device) for part in parts]) if len(parts) > 1 else parts[0]
        requests = [request for _, request in fusion if request is not None]
        try:
            with tracing.continuing(requests[0].inside_span if requests else False):
                self.private.allreduce(flat, op=fusion[0][0][3])
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
        self._joined = set()
        with self._lock:
            self._joining = False
        self._all_joined.set()

    def _fail_stalled(self, name: str, who: dict) -> None:
        request = self._take(name)
        missing = [rank for rank in range(self.size) if rank not in who and rank not in self._joined]
        if request is not None:
            request.handle._complete(error=DeadlineError(
                f"the hvd operation {name!r} was not submitted by ranks {missing} within {timeout():.0f} s "
                f"(MPIDIST_TIMEOUT); ranks {sorted(who)} submitted it", peers=missing))

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


# A signature's fields: [collective, dtype, count, op, device, shape, root, scale factors].
_FIELDS = ("collective", "dtype", "count", "op", "device", "shape", "root", "scale factors")


def _kind(signature: list) -> tuple:
    """What all-reduces fused into one buffer share: dtype, op and device."""
    return signature[1], signature[3], signature[4]


def _differences(who: dict) -> list:
    """For each field the ranks' signatures differ in: which ranks have which value."""
    differences = []
    for index, field in enumerate(_FIELDS):
        values = {}
        for rank, signature in sorted(who.items()):
            values.setdefault(_shown(signature[index]), []).append(rank)
        if len(values) > 1:
            if field == "shape" and next(iter(who.values()))[0] == "allgather":
                field = "row shape (shape[1:])"
            differences.append(f"{field}: " + "; ".join(f"ranks {ranks} have {value}" for value, ranks in values.items()))
    return differences


def _described(signature: list) -> str:
    """A signature in words, for the errors."""
    return ", ".join(f"{field} {_shown(value)}" for field, value in zip(_FIELDS, signature) if value not in ("", []))


def _shown(value) -> str:
    """A signature's value as the errors show it: shapes as tuples, names quoted."""
    if isinstance(value, list):
        return str(_as_tuples(value))
    return json.dumps(value)


def _as_tuples(value):
    return tuple(_as_tuples(item) for item in value) if isinstance(value, list) else value
