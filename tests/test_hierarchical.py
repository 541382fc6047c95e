"""The hierarchical (shared-memory window + leaders) all-reduce on 1 to 5 ranks, on one node and
on emulated nodes of two ranks (MPIDIST_RANKS_PER_NODE=2, so 5 ranks make nodes of 2, 2 and 1),
against the float64 NumPy reference and tolerances of test_collectives."""
import numpy as np
import pytest
from conftest import make_array, raw_bytes, to_float64
from mpi4py import MPI
from test_collectives import FLOAT_DTYPES, INT_DTYPES, OPS, rank_values, reference, size_classes, tolerance

import mpidist as md


def check(comm, dtype, op, count, kind, seed=0):
    p, r = comm.size, comm.rank
    inputs = [rank_values(seed, k, count, dtype, op) for k in range(p)]
    array = make_array(kind, inputs[r], dtype)
    assert comm.allreduce(array, op=op, algorithm="hierarchical") is array
    error = np.abs(to_float64(array) - reference(inputs, op))
    where = f"hierarchical {dtype} {op} n={count} p={p} nodes={comm.num_nodes}"
    assert (error <= tolerance(inputs, op, dtype)).all(), f"{where}: error {error.max()}"
    everyone = comm.mpi.allgather(raw_bytes(array))
    assert all(b == everyone[0] for b in everyone), f"{where}: ranks differ"
    return array


# One launch per rank count covers both topologies: a launch costs more than the checks.
@pytest.mark.mpi(ranks=[1, 2, 3, 4, 5])
def test_hierarchical_on_one_node_and_on_emulated_nodes(mpi_ranks, monkeypatch):
    for ranks_per_node in (None, "2"):
        check_topology(mpi_ranks, ranks_per_node, monkeypatch)
        check_async_beside_blocking(mpi_ranks, ranks_per_node, monkeypatch)


def check_topology(mpi_ranks, ranks_per_node, monkeypatch):
    if ranks_per_node:
        monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", ranks_per_node)
    else:
        monkeypatch.delenv("MPIDIST_RANKS_PER_NODE", raising=False)
    comm = md.Communicator(MPI.COMM_WORLD)
    expected_nodes = (mpi_ranks + 1) // 2 if ranks_per_node else 1
    assert comm.num_nodes == expected_nodes
    case = 0
    for dtype in FLOAT_DTYPES + INT_DTYPES:
        for op in OPS:
            if op == "avg" and dtype in INT_DTYPES:
                continue
            # Sizes grow and shrink again, so the window is grown and then reused; the largest
            # size (segmented messages across nodes) runs once per dtype below.
            for count in [c for c in size_classes(mpi_ranks) if c < 70001] + [3]:
                kind = "torch" if dtype == "bfloat16" or case % 2 else "numpy"
                case += 1
                check(comm, dtype, op, count, kind)
    for dtype in FLOAT_DTYPES + INT_DTYPES:
        check(comm, dtype, "sum", 300001, "torch")
    first = check(comm, "bfloat16", "sum", 70001, "torch", seed=5)
    second = check(comm, "bfloat16", "sum", 70001, "torch", seed=5)
    assert raw_bytes(first) == raw_bytes(second), "hierarchical is not deterministic"
    comm.free()


def check_async_beside_blocking(mpi_ranks, ranks_per_node, monkeypatch):
    """The asynchronous engine runs hierarchical on its own node communicator and window while
    the caller's thread runs it on the Communicator's."""
    comm = md.Communicator(MPI.COMM_WORLD)
    arrays = [np.full(50001, float(comm.rank + k)) for k in range(3)]
    handles = [comm.allreduce_async(a, algorithm="hierarchical") for a in arrays]
    blocking = np.full(999, 1.0, dtype=np.float32)
    comm.allreduce(blocking, algorithm="hierarchical")
    assert (blocking == mpi_ranks).all()
    for k, (handle, array) in enumerate(zip(handles, arrays)):
        assert handle.wait() is array
        assert (array == sum(range(mpi_ranks)) + mpi_ranks * k).all()
    comm.free()
