"""Point-to-point helpers and the node topology, on 2 to 5 ranks under mpirun.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order.
The larger message than the receive comes last: it is the one test in which MPI itself reports
an error (a truncated receive)."""
import numpy as np
import pytest
from conftest import make_array, raw_bytes

import mpidist as md

pytestmark = pytest.mark.mpi_shared_launch

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "int8"]
# NumPy has no bfloat16.
KINDS_AND_DTYPES = [(kind, dtype) for dtype in DTYPES for kind in ("numpy", "torch")
                    if not (kind == "numpy" and dtype == "bfloat16")]


@pytest.mark.mpi(ranks=[2, 3, 4, 5])
def test_world_size_and_rank(mpi_ranks, mpi_world):
    assert (mpi_world.size, md.size(), md.rank()) == (mpi_ranks, mpi_ranks, mpi_world.rank)


@pytest.mark.mpi(ranks=[2, 3, 4, 5])
@pytest.mark.parametrize("kind, dtype", KINDS_AND_DTYPES)
def test_send_recv_sendrecv_every_kind_and_dtype(mpi_world, kind, dtype):
    comm = mpi_world
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
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


@pytest.mark.mpi(ranks=[3, 5])
def test_node_and_leader_communicators(mpi_ranks):
    from mpi4py import MPI
    with md.Communicator(MPI.COMM_WORLD) as comm:
        assert (comm.local_size, comm.num_nodes, comm.node_rank) == (mpi_ranks, 1, 0)
        assert comm.local_rank == comm.rank
        assert (comm.leader_comm is not None) == (comm.rank == 0)


@pytest.mark.mpi(ranks=[3, 5])
def test_emulated_nodes_of_two_ranks(mpi_ranks, monkeypatch):
    from mpi4py import MPI
    monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", "2")
    with md.Communicator(MPI.COMM_WORLD) as emulated:
        rank = emulated.rank
        assert emulated.local_rank == rank % 2
        assert emulated.local_size == min(2, mpi_ranks - (rank // 2) * 2)
        assert emulated.node_rank == rank // 2
        assert emulated.num_nodes == (mpi_ranks + 1) // 2
        assert (emulated.leader_comm is not None) == (rank % 2 == 0)
        if emulated.leader_comm is not None:
            assert emulated.leader_comm.Get_size() == emulated.num_nodes


@pytest.mark.mpi(ranks=[2])
@pytest.mark.parametrize("call, message", [
    (lambda comm: comm.send(np.zeros(1), 7), "dest=7 is not a rank"),
    (lambda comm: comm.recv(np.zeros(1), -1), "source=-1 is not a rank"),
], ids=["dest", "source"])
def test_bad_peer_is_refused(mpi_world, call, message):
    with pytest.raises(md.InvalidArgumentError, match=message):
        call(mpi_world)


@pytest.mark.mpi(ranks=[2])
def test_communicator_messages_do_not_mix_with_the_users(mpi_world):
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


@pytest.mark.mpi(ranks=[2])
def test_a_smaller_message_than_the_receive_is_an_error(mpi_world):
    if mpi_world.rank == 0:
        mpi_world.send(np.zeros(3, dtype=np.float32), 1)
    else:
        with pytest.raises(md.InvalidArgumentError, match="expected 16 bytes from rank 0, received 12"):
            mpi_world.recv(np.zeros(4, dtype=np.float32), 0)


@pytest.mark.mpi(ranks=[2])
def test_a_larger_message_than_the_receive_is_an_error(mpi_world):
    if mpi_world.rank == 0:
        mpi_world.send(np.zeros(10, dtype=np.float32), 1)
    else:
        with pytest.raises(md.InvalidArgumentError, match="expected 16 bytes from rank 0"):
            mpi_world.recv(np.zeros(4, dtype=np.float32), 0)
