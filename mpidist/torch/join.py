"""hvd.join(): a rank that has run out of data takes part, with zeros, in what the ranks still
training do over all ranks (the DistributedOptimizer's gradient exchanges and all-reduces) until
every rank has joined, through the announcements below. Also the registry of live
DistributedOptimizers that join() takes part for, and collective_comm, which refuses the other
collectives while ranks wait in join().
"""
from __future__ import annotations

import gc
import weakref

import numpy as np

from .. import comm as _comm
from ..collectives.api import join_round
from ..collectives.engine import in_order
from ..errors import MismatchError, MpidistError, NotOfferedError
from ..parallel.uneven_inputs import last_joiner
from ..runtime import wire
from ..runtime.deadlines import wait_for_collective
from .basics import Average, Sum
from .negotiation import negotiator_of
from .process_sets import comm_of
from .timeline import traced

_OPTIMIZER_BUCKETS = weakref.WeakSet()  # the gradient buckets of the live DistributedOptimizers
_ADASUM_OPTIMIZERS = weakref.WeakSet()  # the live Adasum DistributedOptimizers


def register_optimizer(buckets) -> None:
    """A DistributedOptimizer's gradient buckets: join() takes part in their exchanges, which
    announce themselves to joined ranks."""
    _OPTIMIZER_BUCKETS.add(buckets)
    buckets.before_exchange = announce_exchange


def register_adasum_optimizer(optimizer) -> None:
    """An Adasum DistributedOptimizer, with which join() is refused."""
    _ADASUM_OPTIMIZERS.add(optimizer)


def collective_comm(process_set):
    """comm_of, for the collectives that ranks waiting in join() take no part in (all but the
    all-reduces): while the ranks still training know that some wait there, such a collective
    would wait for them until MPIDIST_TIMEOUT, so it is refused at once."""
    comm = comm_of(process_set)
    waiting = ranks_waiting_in_join(comm) if comm is _comm.world() else 0
    if waiting:
        raise MismatchError(f"{waiting} rank(s) ran out of data and wait in hvd.join(), where they take part only "
                            "in all-reduces and the DistributedOptimizer's gradient exchanges: run other "
                            "collectives before any rank joins, or after every rank has")
    return comm


@traced("JOIN")
def join(device=-1) -> int:
    """This rank has run out of data (Horovod's hvd.join()): until every rank has called join(),
    take part with zeros in the other ranks' gradient exchanges of the DistributedOptimizer and
    in their all-reduces over all ranks (they still average over every rank, as in Horovod; see
    the notes above _announce), and in their all-reduce calls (allreduce, allreduce_async) that
    sum or average. Returns the rank that joined last, the same on every rank (the highest of
    several joining at the same step)."""
    world = _comm.world()  # not comm_of: the ranks still training call join() once others have
    negotiator = negotiator_of(world)
    if any(o._adasum_comm is world for o in _ADASUM_OPTIMIZERS):
        raise NotOfferedError("hvd.join() with a DistributedOptimizer(op=hvd.Adasum): a joined rank has no "
                              "change of its own to combine; use op=hvd.Average")
    live = _live_optimizer_buckets(world)
    if len(live) > 1:
        raise NotOfferedError(f"hvd.join() with {len(live)} live DistributedOptimizers: a joined rank could not "
                              "tell whose exchange comes next; join with one")
    exchanges = 0
    if live:
        buckets = live[0]
        if buckets.op not in ("avg", "sum"):
            raise NotOfferedError(f"hvd.join() with op={buckets.op!r}: a joined rank's zeros would change a "
                                  "minimum, maximum or product; use op=hvd.Average or hvd.Sum")
        buckets.check_idle()
    # From here this rank's negotiation takes part with zeros in the others' hvd all-reduces.
    negotiator.join()
    if live:
        # The first ranks to join shadow the next exchange unannounced: it tells the others.
        if buckets.active_ranks < world.size or buckets.shadow():
            _take_part_while_joined(world, buckets)
        exchanges = buckets.restart_exchange_count()
        buckets.end_join()
    # The rank that joined last brought gradients to the most exchanges and waited through the
    # fewest of the others' all-reduces (those of the DistributedOptimizer's channel, and the
    # negotiated ones of hvd's operations).
    waited = _wait_for_every_rank_to_join(world) + negotiator.wait_for_every_rank_to_join()
    return last_joiner(world, exchanges - waited)


def _wait_for_every_rank_to_join(world) -> int:
    """Meet the other ranks' call checks until every rank has called join(), taking part with
    zeros in their all-reduces that sum or average: a rank that calls another collective
    meanwhile (an allgather, a broadcast, a barrier, ... as in Horovod) raises there at once,
    naming it, and this rank waits on. Returns how many of the others' calls it waited through."""
    rounds = 0
    while not in_order(world, join_round):
        rounds += 1
    return rounds


# Ranks that have joined (run out of data) take part, with zeros, in what the ranks still
# training do over all ranks: the DistributedOptimizer's gradient exchanges and all-reduces, as in
# Horovod. The training ranks learn that a rank has joined from their next exchange, which the
# joined rank shadows unannounced (each exchange sums the count of ranks that bring gradients).
# From then on, until every rank has joined, the training ranks announce each exchange before
# running it: one small all-reduce over all ranks, in which the joined ranks add zeros and each
# training rank adds 1 and what comes next. When the sum of the 1s is 0, every rank has joined.
# hvd's all-reduces need no announcement: the negotiation (negotiation.py) knows which ranks
# wait in join() and runs their side with zeros.

_NEXT_EXCHANGE = 1
_JOINABLE_OPS = (Sum, Average)  # zeros change no sum; an average still divides by every rank
_JOINABLE_DEVICES = ("cpu", "cuda")


def ranks_waiting_in_join(world) -> int:
    """How many ranks the last exchange of this rank's DistributedOptimizer over all ranks
    showed waiting in join() (0 on a rank that waits there itself: it resets the count)."""
    return max((world.size - b.active_ranks for b in _OPTIMIZER_BUCKETS if b.comm is world), default=0)


def _announce(world, fields):
    """One announcement (collective over all ranks): a training rank passes what comes next
    (a list of numbers), a joined rank None. Returns what the training ranks announced, or None
    once every rank has joined."""
    from mpi4py import MPI  # imported here: importing mpi4py's MPI initializes MPI
    message = np.zeros(7, dtype=np.int64)
    if fields is not None:
        message[0], message[1:1 + len(fields)] = 1, fields
    wait_for_collective(world.mpi.Iallreduce(MPI.IN_PLACE, message, op=MPI.SUM), world.mpi,
                       what="announcement to the ranks waiting in hvd.join()")
    training = int(message[0])
    if training == 0:
        return None
    if (message[1:] % training).any():
        raise MismatchError("the ranks still training announced different operations to the ranks waiting in "
                            "hvd.join(): every rank must run the same collectives in the same order")
    return (message[1:] // training).tolist()


def check_joinable_allreduce(comm, tensor, op, wire_dtype=None) -> None:
    """Before an all-reduce over all ranks (and before anything changes `tensor`, so that a
    refusal leaves it as it was): refuse one that ranks waiting in join() could not take part in
    with zeros, as far as this rank knows of them (from its DistributedOptimizer's exchanges; the
    negotiation refuses the others). `wire_dtype` is the dtype the tensor is sent in, where
    compression changes it."""
    if comm is not _comm.world() or not ranks_waiting_in_join(comm):
        return
    dtype = wire_dtype or tensor.dtype
    name = str(dtype).removeprefix("torch.")
    # Any dtype of the package's table but bool, which has no sum.
    if op not in _JOINABLE_OPS or name not in wire.ITEMSIZE or name == "bool" \
            or tensor.device.type not in _JOINABLE_DEVICES:
        raise MpidistError(f"ranks wait in hvd.join() and take part in all-reduces with zeros: op={op!r} of a "
                           f"{dtype} tensor on {tensor.device.type} is not one they can join (sum or "
                           "average of a CPU or CUDA tensor of a standard dtype)")


def announce_exchange(buckets) -> None:
    """Before each gradient exchange of the DistributedOptimizer (GradientBuckets.before_exchange)."""
    if buckets.active_ranks < buckets.comm.size:
        _announce(buckets.comm, [_NEXT_EXCHANGE])


def _take_part_while_joined(world, buckets) -> None:
    """A joined rank's side: take part in what the training ranks announce until all have joined."""
    while (fields := _announce(world, None)) is not None:
        if fields[0] == _NEXT_EXCHANGE:
            buckets.shadow()
        else:
            raise MismatchError(f"rank {world.rank} waits in hvd.join() and was told of an operation it does "
                                f"not know ({fields})")


def _live_optimizer_buckets(comm) -> list:
    """The gradient buckets of the live DistributedOptimizers on `comm`."""
    live = [b for b in _OPTIMIZER_BUCKETS if b.comm is comm]
    if len(live) > 1:
        gc.collect()  # an optimizer the program dropped may only wait for the cycle collector
        live = [b for b in _OPTIMIZER_BUCKETS if b.comm is comm]
    return live
