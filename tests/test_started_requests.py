"""collectives/common.started: a request an algorithm starts is held until it completes, so that
one left active by an error (a peer died under ULFM) is never freed by mpi4py when its object is
collected: Open MPI ends the whole job when a freed request later completes in error."""
import gc

import numpy as np
from mpi4py import MPI

from mpidist.collectives import common


def prune_at_the_next_call(monkeypatch):
    monkeypatch.setattr(common, "_PRUNE_AT", [1])


def test_an_active_request_outlives_its_object_and_leaves_once_completed(monkeypatch):
    monkeypatch.setattr(common, "_STARTED", [])
    received = np.zeros(4)
    request = common.started(MPI.COMM_SELF.Irecv(received, source=0, tag=77))
    handle = request.py2f()  # the MPI request, to find it again
    del request  # the algorithm's frame is gone, as after an error
    gc.collect()
    prune_at_the_next_call(monkeypatch)
    send = common.started(MPI.COMM_SELF.Isend(np.arange(4.0), dest=0, tag=78))
    held = [r for r in common._STARTED if r and r.py2f() == handle]
    assert len(held) == 1, "the active receive was dropped, and mpi4py would have freed it"
    MPI.COMM_SELF.Send(np.arange(4.0), dest=0, tag=77)
    held[0].Wait()
    MPI.COMM_SELF.Recv(np.zeros(4), source=0, tag=78)
    send.Wait()
    assert (received == np.arange(4.0)).all()
    prune_at_the_next_call(monkeypatch)
    last = common.started(MPI.COMM_SELF.Isend(np.arange(1.0), dest=0, tag=79))
    assert common._STARTED == [last]  # the completed ones are gone, the active one stays
    MPI.COMM_SELF.Recv(np.zeros(1), source=0, tag=79)
    last.Wait()
