"""mpidist's collectives on the launch's arrays (torch and CuPy on the GPU, NumPy and torch on the
CPU): every all-reduce algorithm, max into out=, broadcast, allgather, reduce_scatter and
allreduce_async, against float64 references of every rank's inputs within tests/tolerances.py's
bounds, the same bits on every rank, and for a GPU buffer the route it took: through the node
window in GPU memory (CUDA IPC) for the hierarchical and auto all-reduces, broadcast, allgather and
reduce_scatter with --device-window yes; otherwise through pinned host memory when the MPI
library is not CUDA-aware (MPIDIST_CUDA_AWARE=0 forces this), straight from GPU memory when it is.

Every test runs all its collectives before its first assertion, so that a rank failing one does
not leave the others waiting in the next collective."""
import numpy as np
import pytest
from device_arrays import COUNT, assert_reduced_values, disagreement, rounded
from tolerances import assert_exact

import mpidist as md
from mpidist.collectives.registry import HOST_MEMORY_ALGORITHMS

ALGORITHMS = ("auto", "ring", "tree", "recursive_halving", "recursive_doubling", "reduce_bcast", "hierarchical",
              "mpi")
# The algorithms whose CUDA buffers take the device route (the node window in GPU memory) where
# the node can open it; elsewhere auto's choice is its table's.
DEVICE_ROUTE_ALGORITHMS = ("hierarchical", "auto")


def route_problem(staging, before, arrays, comm, settings, host_only=False) -> str:
    """What was wrong with the route of the collective that ran since `before` ("" if nothing)."""
    return staging.route_problem(before, arrays.on_gpu, host_only, comm.is_cuda_aware(), settings.device_window)


@pytest.mark.parametrize("op", ("sum", "avg"))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce(comm, arrays, dtype, count, algorithm, op, inputs, staging, settings):
    per_rank = inputs.get(dtype, count)
    buf = arrays.make(per_rank[comm.rank], dtype)
    before = staging.count
    out = md.allreduce(buf, op=op, algorithm=algorithm)
    got = arrays.float64(out)
    differs = disagreement(comm, got)
    assert out is buf, "the result is not the input array (in place)"
    assert_reduced_values(got, per_rank, op, dtype)
    assert not differs, differs
    windowed = settings.device_window and algorithm in DEVICE_ROUTE_ALGORITHMS
    if algorithm != "auto" or windowed:  # without the window, auto's choice is its table's
        route = staging.route_problem(before, arrays.on_gpu, algorithm in HOST_MEMORY_ALGORITHMS,
                                      comm.is_cuda_aware(), windowed)
        assert not route, route


def test_allreduce_max_into_out(comm, arrays, dtype, inputs):
    per_rank = inputs.get(dtype, COUNT)
    source = arrays.make(per_rank[comm.rank], dtype)
    out = arrays.make(np.zeros(COUNT), dtype)
    md.allreduce(source, op="max", out=out)
    assert_exact(arrays.float64(out), np.max(per_rank, axis=0))
    assert_exact(arrays.float64(source), per_rank[comm.rank])  # the input is left as it was


def test_broadcast(comm, arrays, dtype, inputs, staging, settings):
    per_rank = inputs.get(dtype, COUNT)
    root = comm.size - 1
    buf = arrays.make(per_rank[comm.rank], dtype)
    before = staging.count
    md.broadcast(buf, root=root)
    route = route_problem(staging, before, arrays, comm, settings)
    assert_exact(arrays.float64(buf), per_rank[root])
    assert not route, route


def test_allgather_of_unequal_row_counts(comm, arrays, dtype, staging, settings):
    # Ranks give different numbers of rows, as Horovod allows.
    rows = [rounded(np.random.default_rng([7, r]).standard_normal((r + 1, 3)), dtype) for r in range(comm.size)]
    before = staging.count
    got = arrays.float64(md.allgather(arrays.make(rows[comm.rank], dtype)))
    route = route_problem(staging, before, arrays, comm, settings)
    assert_exact(got, np.concatenate(rows))
    assert not route, route


@pytest.mark.parametrize("op", ("sum", "avg"))
def test_reduce_scatter_of_unequal_blocks(comm, arrays, dtype, op, staging, settings):
    rows = 2 * comm.size + 1  # blocks of unequal size
    parts = [rounded(np.random.default_rng([9, r]).standard_normal((rows, 5)), dtype) for r in range(comm.size)]
    blocks = np.array_split(np.arange(rows), comm.size)
    mine = slice(blocks[comm.rank][0], blocks[comm.rank][-1] + 1)
    source = arrays.make(parts[comm.rank], dtype)
    before = staging.count
    got = arrays.float64(md.reduce_scatter(source, op=op))
    route = route_problem(staging, before, arrays, comm, settings)
    assert_reduced_values(got, [part[mine] for part in parts], op, dtype)
    assert_exact(arrays.float64(source), parts[comm.rank])  # the input is left as it was
    assert not route, route


@pytest.mark.gpu_only
@pytest.mark.device_window
def test_the_device_window_was_opened(comm):
    """After the collectives that open it."""
    windows = comm.device_window
    assert windows is not None and windows.window is not None, \
        f"not opened: {windows.refusal if windows is not None else 'never asked for'}"


def test_allreduce_async_sum_and_avg(comm, arrays, dtype, inputs):
    """After the blocking collectives: from the first asynchronous call on, every collective of
    the communicator runs on its background engine, whose host staging is its own."""
    per_rank = inputs.get(dtype, COUNT)
    handles = {op: md.allreduce_async(arrays.make(per_rank[comm.rank], dtype), op=op) for op in ("sum", "avg")}
    results = {op: arrays.float64(handle.wait()) for op, handle in handles.items()}
    for op, got in results.items():
        assert_reduced_values(got, per_rank, op, dtype)
