"""Point-to-point helpers and the node topology, on 2 to 5 ranks under mpirun."""
import numpy as np
import pytest
from conftest import make_array, raw_bytes

import mpidist as md

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "int8"]


@pytest.mark.mpi(ranks=[2, 3, 4, 5])
def test_point_to_point_and_node_topology(mpi_ranks, mpi_world, monkeypatch):
    """The checks of one world size in one launch: each launch starts every rank's interpreter
    (torch included), which costs more than the checks themselves. The size mismatch comes last:
    it is the one check in which MPI itself reports an error (a truncated receive)."""
    check_send_recv_sendrecv_every_kind_and_dtype(mpi_ranks, mpi_world)
    if mpi_ranks in (3, 5):
        with monkeypatch.context() as patch:
            check_node_and_leader_communicators(mpi_ranks, patch)
    if mpi_ranks == 2:
        check_bad_peer_is_refused(mpi_world)
        check_communicator_messages_do_not_mix_with_the_users(mpi_world)
        check_receive_size_mismatch_is_an_error(mpi_world)


def check_send_recv_sendrecv_every_kind_and_dtype(mpi_ranks, mpi_world):
    comm = mpi_world
    assert (comm.size, md.size(), md.rank()) == (mpi_ranks, mpi_ranks, comm.rank)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for dtype in DTYPES:
        for kind in ("numpy", "torch"):
            if kind == "numpy" and dtype == "bfloat16":
                continue
            for count in (0, 1, 1000):
                mine = make_array(kind, np.arange(count) % 100 + comm.rank, dtype)
                expected = make_array(kind, np.arange(count) % 100 + left, dtype)
                got = make_array(kind, np.zeros(count), dtype)
                comm.sendrecv(mine, right, got, left, tag=5)
                assert raw_bytes(got) == raw_bytes(expected), (dtype, kind, count)
                # Blocking send/recv around the ring: even ranks send first to avoid deadlock.
                got2 = make_array(kind, np.zeros(count), dtype)
                if comm.rank % 2 == 0:
                    comm.send(mine, right)
                    comm.recv(got2, left)
                else:
                    comm.recv(got2, left)
                    comm.send(mine, right)
                assert raw_bytes(got2) == raw_bytes(expected), (dtype, kind, count)


def check_receive_size_mismatch_is_an_error(mpi_world):
    comm = mpi_world
    if comm.rank == 0:
        comm.send(np.zeros(10, dtype=np.float32), 1)
        comm.send(np.zeros(3, dtype=np.float32), 1)
    else:
        with pytest.raises(md.InvalidArgumentError, match="expected 16 bytes from rank 0"):
            comm.recv(np.zeros(4, dtype=np.float32), 0)
        with pytest.raises(md.InvalidArgumentError, match="expected 16 bytes from rank 0, received 12"):
            comm.recv(np.zeros(4, dtype=np.float32), 0)


def check_bad_peer_is_refused(mpi_world):
    with pytest.raises(md.InvalidArgumentError, match="dest=7 is not a rank"):
        mpi_world.send(np.zeros(1), 7)
    with pytest.raises(md.InvalidArgumentError, match="source=-1 is not a rank"):
        mpi_world.recv(np.zeros(1), -1)


def check_node_and_leader_communicators(mpi_ranks, monkeypatch):
    from mpi4py import MPI
    comm = md.Communicator(MPI.COMM_WORLD)
    assert (comm.local_size, comm.num_nodes, comm.node_rank) == (mpi_ranks, 1, 0)
    assert comm.local_rank == comm.rank
    assert (comm.leader_comm is not None) == (comm.rank == 0)
    monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", "2")
    emulated = md.Communicator(MPI.COMM_WORLD)
    assert emulated.local_rank == comm.rank % 2
    assert emulated.local_size == min(2, mpi_ranks - (comm.rank // 2) * 2)
    assert emulated.node_rank == comm.rank // 2
    assert emulated.num_nodes == (mpi_ranks + 1) // 2
    assert (emulated.leader_comm is not None) == (comm.rank % 2 == 0)
    if emulated.leader_comm is not None:
        assert emulated.leader_comm.Get_size() == emulated.num_nodes


def check_communicator_messages_do_not_mix_with_the_users(mpi_world):
    from mpi4py import MPI
    user = MPI.COMM_WORLD
    if user.rank == 0:
        user.Send(np.full(2, 7.0), dest=1, tag=5)
        mpi_world.send(np.full(2, 9.0), 1, tag=5)
    else:
        ours = np.zeros(2)
        mpi_world.recv(ours, 0, tag=5)
        theirs = np.zeros(2)
        user.Recv(theirs, source=0, tag=5)
        assert ours.tolist() == [9.0, 9.0] and theirs.tolist() == [7.0, 7.0]
