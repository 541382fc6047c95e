"""mpidist across emulated nodes (tests/multinode/cluster.sh; `make test-multinode`): 4 ranks, 2 on
each of 2 nodes, each node a network, hostname and mount namespace of its own, ranks of different
nodes talking TCP over the nodes' shaped veth links.

Checked against the same references as on one node: the nodes found are the hosts the ranks run
on (MPI's shared-memory split, no MPIDIST_RANKS_PER_NODE), every all-reduce algorithm (hierarchical
included) over the link, the other collectives, DataParallel against one process, pipeline stages
on different nodes, parameter servers on one node with their workers on the other, and `auto`'s
table for one rank per node on a communicator of one rank from each node.

Collected only inside the emulated cluster (tests/conftest.py); the multi-rank tests run in one launch
(mpi_shared_launch.py)."""
import os
import socket

import numpy as np
import pytest
import test_data_parallel
import test_pipeline
import test_ps
import torch
from conftest import make_array, raw_bytes, to_float64
from mpi4py import MPI
from test_collectives import FLOAT_DTYPES, INT_DTYPES, OPS, check_allreduce, rank_values
from tolerances import reduction_reference

import mpidist as md
from mpidist.collectives import select
from mpidist.collectives.registry import ALGORITHMS, DEVICE_MEMORY_ALGORITHMS

pytestmark = [pytest.mark.mpi_shared_launch, pytest.mark.mpi(ranks=[4])]

if "MPIDIST_MN_NODES" not in os.environ:
    raise RuntimeError("tests/multinode needs the emulated cluster: make test-multinode (tests/multinode/cluster.sh run ...)")
NODES = int(os.environ["MPIDIST_MN_NODES"])


def sent_bytes() -> int:
    """Bytes this rank's node has sent over its link (/proc/net/dev: the reader's network namespace)."""
    with open("/proc/net/dev") as devices:
        for line in devices:
            name, _, counters = line.partition(":")
            if name.strip() == "eth0":
                return int(counters.split()[8])
    raise AssertionError("no eth0 in this rank's network namespace")


def test_nodes_are_the_hosts_the_ranks_run_on(mpi_world):
    assert "MPIDIST_RANKS_PER_NODE" not in os.environ
    hosts = MPI.COMM_WORLD.allgather(socket.gethostname())
    assert hosts == ["mpidist-node1", "mpidist-node1", "mpidist-node2", "mpidist-node2"]
    assert mpi_world.num_nodes == NODES == 2
    assert (md.local_rank(), md.local_size()) == (mpi_world.rank % 2, 2)
    node = mpi_world.node_comm.allgather(socket.gethostname())
    assert node == [socket.gethostname()] * 2, "a node communicator spans hosts"


def test_allreduce_crosses_the_link(mpi_world):
    """A ring all-reduce of 1 MiB per rank sends at least half of it out of each node: the ranks
    of different nodes are connected through the veth link, not through shared memory."""
    values = np.ones(1 << 18, dtype=np.float32)
    mpi_world.barrier()
    before = sent_bytes()
    md.allreduce(values, algorithm="ring")
    mpi_world.barrier()
    assert (values == 4).all()
    assert sent_bytes() - before >= values.nbytes // 2


def test_auto_with_one_rank_per_node_takes_that_layouts_table(mpi_world, monkeypatch):
    """Local rank k of every node, without a tuning file: 2 nodes found, the one-rank-per-node
    table chosen, and auto's all-reduce (MPI's own, then recursive doubling) right at both ends."""
    monkeypatch.setenv("MPIDIST_TUNING_FILE", "/nonexistent/mpidist-tuning.json")
    lane = MPI.COMM_WORLD.Split(md.local_rank(), mpi_world.rank)
    comm = md.Communicator(lane)
    try:
        assert (comm.size, comm.local_size, comm.num_nodes) == (2, 1, 2)
        assert comm.tuning_table == select.layout_table(2, 2) != select.layout_table(2, 1)
        for count in (1000, 1 << 20):  # 4 KB (MPI's own) and 4 MiB (recursive doubling)
            values = np.full(count, comm.rank + 1, dtype=np.float32)
            comm.allreduce(values)
            assert (values == 3).all()
    finally:
        comm.free()
        lane.Free()


# nccl reduces GPU buffers only (its refusal of host memory: tests/test_device_window.py)
@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a not in DEVICE_MEMORY_ALGORITHMS])
def test_every_algorithm_across_nodes(mpi_world, algorithm):
    """Every dtype and op, one message below and one above the segment sizes, NumPy and torch."""
    case = 0
    for dtype in FLOAT_DTYPES + INT_DTYPES:
        for op in OPS:
            if op == "avg" and dtype in INT_DTYPES:
                continue
            for count in (7, 300001):
                kind = "torch" if dtype == "bfloat16" or case % 2 else "numpy"
                check_allreduce(mpi_world, algorithm, dtype, op, count, kind, in_place=bool(case % 3))
                case += 1


def test_async_hierarchical_beside_blocking(mpi_world):
    arrays = [np.full(50001, float(mpi_world.rank + k)) for k in range(3)]
    handles = [mpi_world.allreduce_async(a, algorithm="hierarchical") for a in arrays]
    blocking = np.full(999, 1.0, dtype=np.float32)
    mpi_world.allreduce(blocking, algorithm="hierarchical")
    assert (blocking == 4).all()
    for k, (handle, array) in enumerate(zip(handles, arrays)):
        assert handle.wait() is array
        assert (array == 6 + 4 * k).all()


def test_broadcast_allgather_reduce_scatter(mpi_world):
    p, r = mpi_world.size, mpi_world.rank
    for root in range(p):
        values = np.arange(300001) % 251 + root
        array = make_array("numpy", values if r == root else np.zeros(values.size), "float64")
        md.broadcast(array, root=root)
        assert raw_bytes(array) == raw_bytes(make_array("numpy", values, "float64"))
    gathered = md.allgather(make_array("torch", np.full((3 + r, 2), r + 1.0), "float32"))
    expected = np.concatenate([np.full((3 + k, 2), k + 1.0) for k in range(p)])
    assert (to_float64(gathered) == expected).all()
    inputs = [rank_values(7, k, 2 * p + 1, "float64", "sum") for k in range(p)]
    block = md.reduce_scatter(inputs[r].copy(), op="sum")
    start = r * 2 + min(r, 1)
    np.testing.assert_allclose(block, reduction_reference(inputs, "sum")[start:start + block.shape[0]], rtol=1e-13)


@pytest.mark.parametrize("bucket_mb", [25, 0.0005], ids=["one_bucket", "bucket_per_parameter"])
def test_data_parallel_matches_single_process(mpi_world, bucket_mb):
    model = test_data_parallel.make_model(seed=mpi_world.rank)  # construction broadcasts rank 0's
    ddp = md.DataParallel(model, comm=mpi_world, bucket_mb=bucket_mb)
    test_data_parallel.train_and_compare(ddp, model, mpi_world.rank, mpi_world.size)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_stages_on_both_nodes(mpi_world, schedule):
    test_pipeline.pipeline_training_matches_one_process(mpi_world, schedule, chunks=4, balance=None)


def test_two_pipeline_replicas_one_per_node(mpi_world):
    """Replica k's two stages on node k+1; the replicas average their gradients over the link."""
    test_pipeline.replicas_match_one_process(mpi_world, 2, "1f1b", chunks=4)


def test_parameter_servers_on_one_node_workers_on_the_other(mpi_world):
    """Servers 0 and 1 (node 1) share the model; workers 2 and 3 (node 2) train synchronously."""
    history, versions, final, ps = test_ps.run(mpi_world, "sync", servers=2)
    workers = [2, 3]
    histories = mpi_world.mpi.gather(history, root=ps.server)
    if mpi_world.rank == ps.server:
        assert [histories[0], histories[1]] == [history, history]
        torch.testing.assert_close(final, test_ps.sync_reference(workers, min(workers)), rtol=1e-12, atol=1e-14)
        test_ps.check_every_step_once_in_order(history, workers)
    elif mpi_world.rank in workers:
        assert versions == list(range(test_ps.steps_of(mpi_world.rank)))
