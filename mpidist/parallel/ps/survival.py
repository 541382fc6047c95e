"""What a parameter server does when one of its ranks dies, under the MPI library's fault
tolerance (ULFM: `mpirun --with-ft ulfm`; runtime/mpi.py says whether it is on).

A worker's death reaches the coordinating server as MPI_ERR_PROC_FAILED on the receive it keeps
posted for that worker. In async and n-softsync mode, and in sync mode with backup workers, the
coordinator drops the worker (dead_workers): it stops waiting for it, forgets its gradient not
yet applied, tells the other servers in its order of commands (so every server drops it after
the same update), prints the report (report: rank, the gradients it pushed, when) and goes on
with the workers left; an update then takes its share of gradients, or every living worker's
when fewer are left. Every server keeps the same list of Lost workers (ServerRole.lost).
Every server records each worker dropped (runtime/losses.py), and the coordinator sums them up in
one line when serve() returns.
A send still going to a dropped worker (its reply, on its way when it died) is let go when its
failure comes, before or after the drop.

A worker that dies after its close(), with the final weights on their way to it, is let go in
every mode (wait_last_sends): its training is over, and the servers hold the final weights.

A worker that dies in the middle of a message to the coordinator (its header come, the rest
not) is dropped the same way: the other servers take a worker's message only when the
coordinator commands it, after the coordinator has it whole.

Any other death ends the parameter server (ends_on_death): a server's (it holds its range of
the weights and its optimizer's state alone), a worker's in plain sync mode (each update needs
every worker's gradient), or a worker's in the middle of a message to another server, after the
coordinator had its part whole (the servers could no longer drop it together). The rank
that meets it revokes the parameter server's communicator, so every survivor's next call on it
fails too, and each raises the same RankDiedError naming the dead ranks. A death while the
parameter server is being built ends it the same way (ending_at_start), revoking the communicator
it was given as well, where the building's collectives wait. Without ULFM a death
ends the job as it always did: the MPI library ends every rank.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import time

from ...errors import RankDiedError
from ...runtime import losses
from ...runtime.mpi import failed_ranks, fault_tolerant, is_process_failure
from .protocol import DiedHeader, encode_push
from .roles import Role, ServerRole

# How long a rank whose call failed on a revoked communicator waits to hear which rank died.
NAMING_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class Lost:
    """A worker the servers dropped: its rank, the gradients it had pushed (its last step is
    steps - 1; -1 when not known to this server) and when its death was seen (time.time())."""
    worker: int
    steps: int
    time: float


class Death:
    """Stands in the coordinator's pending receives for a worker that died; its fields, as a
    message's, say so (those of a DiedHeader)."""
    fields = encode_push(DiedHeader())


def dead_workers(role: ServerRole, error: BaseException, waited_for) -> list:
    """The workers among `waited_for` whose death `error` reports, when the parameter server goes
    on without them (none when all of them were dropped already); otherwise `error` is raised
    again (called in the except block of the wait that met it)."""
    mpi, rules = role.endpoint.mpi, role.settings
    if not (fault_tolerant() and is_process_failure(error, [mpi])) or mpi.Is_revoked() \
            or (rules.mode == "sync" and not rules.backup_workers):
        raise error
    known = {lost.worker for lost in role.lost}
    if waited_for and all(rank in known for rank in waited_for):
        # A death met again: a send to a worker already dropped (a reply on its way when it
        # died) fails after the receive from it did. The servers dropped it together then.
        return []
    dead = [rank for rank in failed_ranks(mpi, wait=NAMING_SECONDS) if rank not in known]
    dropped = [rank for rank in dead if rank in waited_for]
    if not dropped or any(rank in rules.servers for rank in dead):
        raise error
    return dropped


def pending(role: ServerRole, sends: list) -> list:
    """The sends (wire.Outgoing) still going. One to a worker that died is dropped when the
    parameter server goes on without it (the coordinator sees the death at its next wait, or
    saw it already: the receive from it may fail first)."""
    going = []
    for outgoing in sends:
        try:
            if not outgoing.test():
                going.append(outgoing)
        except Exception as error:
            dead_workers(role, error, [outgoing.dest])
    return going


def wait_last_sends(role: ServerRole, sends: list) -> None:
    """Wait for serve()'s last sends (wire.Outgoing). A worker that died after its close(), with
    the final weights on their way to it, loses nothing (its training is over and the servers
    hold them): its sends are let go, and the server that meets its death says so on standard
    error. Any other failure is raised."""
    mpi, gone = role.endpoint.mpi, set()
    for outgoing in sends:
        try:
            outgoing.wait(role.endpoint.who, f"the message sent to rank {outgoing.dest}", f"rank {outgoing.dest}")
        except Exception as error:
            if outgoing.dest in role.settings.servers or mpi.Is_revoked() or \
                    not (fault_tolerant() and is_process_failure(error, [mpi])):
                raise
            if outgoing.dest not in gone:
                gone.add(outgoing.dest)
                losses.record(losses.RankLoss(_worker_named(role, outgoing.dest), "its close()", time.time(),
                                              "nothing: its training was over, and the servers hold the final weights"),
                              reports=role.coordinating)
                print(f"mpidist parameter server: rank {role.endpoint.rank}: worker {outgoing.dest} died after its "
                      "close(), before the final weights reached it; nothing is lost (the servers hold them)",
                      file=sys.stderr, flush=True)


def report(role: ServerRole, worker: int, steps: int, started: float) -> Lost:
    """Remember that `worker` was dropped after pushing `steps` gradients; the coordinator says so
    on standard error (when, how far into serve() it was)."""
    lost = Lost(worker, steps, time.time())
    role.lost.append(lost)
    losses.record(losses.RankLoss(_worker_named(role, worker), f"update {role.version}, after its {steps} gradients",
                                  lost.time, "its gradient not yet applied, if any, and the steps it had yet to take "
                                  "(its share of the data, unless the script deals it to the other workers)"),
                  reports=role.coordinating)
    if role.coordinating:
        living = [w for w in role.settings.workers if w not in {gone.worker for gone in role.lost}]
        when = time.strftime("%H:%M:%S", time.gmtime(lost.time))
        print(f"mpidist parameter server: worker {worker} died (seen at {when} UTC, {lost.time - started:.1f} s into "
              f"serve(), after {steps} steps, its last step {steps - 1}); dropped, going on with workers {living} "
              f"({role.settings.mode})", file=sys.stderr, flush=True)
    return lost


def _worker_named(role: ServerRole, worker: int) -> str:
    return f"rank {worker} of {role.endpoint.mpi.Get_size()} (a worker of the parameter server, {role.settings.mode})"


def ends_on_death(method):
    """Decorate a ParameterServer call: a death it meets and the parameter server does not survive
    revokes the parameter server's communicator and raises RankDiedError naming the dead."""
    @functools.wraps(method)
    def call(ps, *args, **kwargs):
        try:
            return method(ps, *args, **kwargs)
        except Exception as error:
            if not (fault_tolerant() and is_process_failure(error, [ps.mpi])):
                raise
            raise ending(ps.role) from error

    return call


def ending_at_start(comm, mpi) -> RankDiedError:
    """The error that ends the building of a parameter server after a death, the same on every
    survivor: the communicator `comm` it was given and its own `mpi`, if made (MPI makes a
    communicator on every survivor or on none), are revoked first, so that every other survivor
    meets it too."""
    if mpi is not None and not mpi.Is_revoked():
        mpi.Revoke()
    comm.abandon()
    dead = failed_ranks(comm.mpi, wait=NAMING_SECONDS)
    named = f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))}" if dead else \
        "a rank (which one could not be learnt)"
    return RankDiedError(f"rank {comm.rank}: {named} of its communicator died while the parameter server was being "
                         f"built, and the parameter server cannot start without {'them' if len(dead) > 1 else 'it'}. "
                         "The communicator given to it is revoked (it lost a rank); `mpidist train --resume` "
                         "continues from the newest checkpoint", ranks=dead)


def ending(role: Role) -> RankDiedError:
    """The error that ends the parameter server after a death, the same on every survivor; its
    communicator is revoked first, so that every other survivor meets it too."""
    mpi, rules = role.endpoint.mpi, role.settings
    if not mpi.Is_revoked():
        mpi.Revoke()
    role.closed = True
    dead = failed_ranks(mpi, wait=NAMING_SECONDS)
    servers = [rank for rank in dead if rank in rules.servers]
    if servers:
        named = f"the server{'s' if len(servers) > 1 else ''} (rank{'s' if len(servers) > 1 else ''} " \
                f"{', '.join(map(str, servers))})"
        why = "a server alone holds its range of the weights and its optimizer's state"
    elif dead:
        named = f"worker{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))}"
        why = "each update of sync mode without backup workers waits for every worker's gradient" \
            if rules.mode == "sync" and not rules.backup_workers else \
            "it died in the middle of a message to a server after the coordinating server had its part, so the " \
            "servers could not drop it together"
    else:
        named, why = "a rank (which one could not be learnt)", "the parameter server's communicator was revoked"
    return RankDiedError(f"{role.endpoint.who}: {named} died, and the parameter server cannot go on without "
                         f"{'them' if len(servers or dead) > 1 else 'it'}: {why}. It ends here; `mpidist train "
                         "--resume` continues from the newest checkpoint", ranks=dead)
