"""The node window's protocol (mpidist/collectives/node_window.py) on 2 to 5 ranks of one node,
in host memory: all-reduce, reduce-scatter, broadcast and allgather on one window, against float64
NumPy references, the same bits on every rank, and a silent local rank named in a DeadlineError,
in a round of the window's own and in the all-reduce whose steps run in the extension.

Each test runs twice: on HostMemory, and on DeferredMemory, which holds every copy and reduction
back until settle(), as a CUDA stream holds its kernels until it is synchronized. The device
window (device_window.py) runs this same protocol on such memory, so a round that read a peer's
slot before the peer had settled its writes would give wrong results here.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py)."""
import os
import time
import types

import numpy as np
import pytest
from conftest import make_array, raw_bytes, to_float64
from mpi4py import MPI
from test_collectives import rank_values
from tolerances import reduction_bound, reduction_reference

import mpidist as md
from mpidist.buffers import describe
from mpidist.collectives.common import kernel_op, split_counts
from mpidist.collectives.node_window import (
    ONE_SHOT_BYTES,
    SIGNATURE_BYTES,
    HostMemory,
    NodeWindow,
    allgather_on_node,
    allreduce_on_node,
    broadcast_on_node,
    one_shot_on_node,
    reduce_scatter_on_node,
)

pytestmark = pytest.mark.mpi_shared_launch

DTYPES = ["float32", "bfloat16", "float16", "float64"]


class DeferredMemory(HostMemory):
    """Host memory whose copies and reductions run only at the next settle(), in the order given."""

    steps_in_extension = False  # the protocol's Python steps, as the device window runs them

    def __init__(self, node_comm):
        super().__init__(node_comm)
        self.queued = []

    def copy(self, dst, src, nbytes):
        self.queued.append(lambda: HostMemory.copy(dst, src, nbytes))

    def reduce_and_publish(self, dst, sources, nbytes, dtype, op, scale, publish):
        self.queued.append(lambda: HostMemory.reduce_and_publish(dst, sources, nbytes, dtype, op, scale, publish))

    def settle(self):
        queued, self.queued = self.queued, []
        for operation in queued:
            operation()


BOTH_MEMORIES = pytest.mark.parametrize("window", [HostMemory, DeferredMemory], ids=["host", "deferred"],
                                        indirect=True)


@pytest.fixture
def window(request, monkeypatch):
    """A node window over the whole world (one node) on a communicator of its own, in the memory
    the test names (HostMemory unless it names one)."""
    memory = getattr(request, "param", HostMemory)
    monkeypatch.delenv("MPIDIST_RANKS_PER_NODE", raising=False)
    comm = md.Communicator(MPI.COMM_WORLD)
    node = comm.node_comm
    window = NodeWindow(node, memory(node), alternates=node.Get_size() > 2)
    yield window
    window.free()
    comm.free()


def same_on_every_rank(array, where):
    everyone = MPI.COMM_WORLD.allgather(raw_bytes(array))
    assert all(b == everyone[0] for b in everyone), f"{where}: ranks differ"


def check_allreduce(window, dtype, op, count, seed):
    p, r = window.local_size, window.local_rank
    inputs = [rank_values(seed, k, count, dtype, op) for k in range(p)]
    array = make_array("torch", inputs[r], dtype)
    allreduce_on_node(window, describe(array), kernel_op(op), 1.0 / p if op == "avg" else 1.0)
    where = f"allreduce {dtype} {op} n={count} p={p}"
    error = np.abs(to_float64(array) - reduction_reference(inputs, op))
    assert (error <= reduction_bound(inputs, op, dtype)).all(), f"{where}: error {error.max()}"
    same_on_every_rank(array, where)


def check_reduce_scatter(window, dtype, count, seed):
    p, r = window.local_size, window.local_rank
    inputs = [rank_values(seed, k, count, dtype, "sum") for k in range(p)]
    array = make_array("torch", inputs[r], dtype)
    before = raw_bytes(array)
    chunks = split_counts(count, p)
    offset, mine = chunks[r]
    out = make_array("torch", np.zeros(mine), dtype)
    reduce_scatter_on_node(window, describe(array), chunks, describe(out), "sum")
    assert raw_bytes(array) == before, "reduce_scatter changed its input"
    reference = reduction_reference(inputs, "sum")[offset:offset + mine]
    bound = reduction_bound([x[offset:offset + mine] for x in inputs], "sum", dtype)
    error = np.abs(to_float64(out) - reference)
    assert (error <= bound).all(), f"reduce_scatter {dtype} n={count} p={p}: error {error.max()}"


def check_broadcast(window, dtype, count, root, seed):
    inputs = [rank_values(seed, k, count, dtype, "sum") for k in range(window.local_size)]
    array = make_array("torch", inputs[window.local_rank], dtype)
    broadcast_on_node(window, describe(array), root)
    assert raw_bytes(array) == raw_bytes(make_array("torch", inputs[root], dtype)), \
        f"broadcast {dtype} n={count} from {root}"


def check_allgather(window, dtype, counts, seed):
    p, r = window.local_size, window.local_rank
    inputs = [rank_values(seed, k, counts[k], dtype, "sum") for k in range(p)]
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    chunks = [(int(o), c) for o, c in zip(offsets, counts)]
    out = make_array("torch", np.zeros(sum(counts)), dtype)
    out[chunks[r][0]:chunks[r][0] + counts[r]] = make_array("torch", inputs[r], dtype)
    allgather_on_node(window, describe(out), chunks)
    assert raw_bytes(out) == raw_bytes(make_array("torch", np.concatenate(inputs), dtype)), \
        f"allgather {dtype} counts {counts}"


@pytest.mark.mpi(ranks=[2, 3, 4, 5])
@pytest.mark.parametrize("window", [DeferredMemory], ids=["deferred"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce(mpi_ranks, window, dtype):
    """Sizes grow and shrink again, so the window grows and is reused; with more than two ranks
    consecutive calls alternate between the slots' halves. (HostMemory's all-reduce is the
    hierarchical one's on one node, tested in test_hierarchical.py.)"""
    for seed, count in enumerate([5, 40001, 1, mpi_ranks - 1, 3000]):
        for op in ("sum", "avg", "max"):
            check_allreduce(window, dtype, op, count, seed)


@pytest.mark.mpi(ranks=[2, 3, 4, 5])
@BOTH_MEMORIES
def test_every_collective_on_one_window(mpi_ranks, window):
    """All four collectives back to back on one window, with changing sizes: none overwrites what
    another rank has still to read."""
    p = mpi_ranks
    for call, count in enumerate([7, 40001, 2, 9000, 3]):
        dtype = DTYPES[call % len(DTYPES)]
        check_allreduce(window, dtype, "sum", count, call)
        check_reduce_scatter(window, dtype, count, call)
        check_broadcast(window, dtype, count, call % p, call)
        check_allgather(window, dtype, [(count + 11 * k) % 50000 for k in range(p)], call)
        check_allreduce(window, dtype, "avg", count + 1, call)


@pytest.mark.mpi(ranks=[2, 3, 4, 5])
def test_a_silent_rank_is_named_in_a_deadline_error(mpi_ranks, window, monkeypatch):
    """The last local rank does not come to a round: the others raise a DeadlineError naming it
    instead of waiting on its flag forever. It then catches up, and the window works on."""
    silent = mpi_ranks - 1
    check_allreduce(window, "float32", "sum", 1000, seed=1)
    if window.local_rank != silent:
        monkeypatch.setenv("MPIDIST_TIMEOUT", "1")
        with pytest.raises(md.DeadlineError, match=rf"no answer from local ranks \[{silent}\] of this node") as error:
            window.sync()
        assert list(error.value.peers) == [silent]
        monkeypatch.delenv("MPIDIST_TIMEOUT")
    MPI.COMM_WORLD.Barrier()
    if window.local_rank == silent:
        window.sync()  # the round the others entered; they raised their flags before waiting
    check_allreduce(window, "float32", "sum", 1000, seed=2)


@pytest.mark.mpi(ranks=[2, 3, 4, 5])
@pytest.mark.parametrize("dtype", DTYPES + ["int32"])
def test_a_checked_one_shot_compares_the_signatures_before_it_reduces(mpi_ranks, window, dtype):
    """A one-shot with a signature (the call check's round, with the fast path's message along):
    where every rank wrote the same signature it is the all-reduce (float64 reference, the same
    bits everywhere); where one rank's differs in one field, every rank says so and no buffer
    changes; with no message it is the check alone."""
    p, r = window.local_size, window.local_rank
    inputs = [rank_values(3, k, 777, dtype, "max") for k in range(p)]
    signature = np.arange(SIGNATURE_BYTES // 8, dtype=np.int64)

    def checked(array, header):
        return one_shot_on_node(window, array.data_ptr(), array.numel(), dtype, "max", 1.0,
                                SIGNATURE_BYTES + array.numel() * array.element_size(), header.ctypes.data)

    array = make_array("torch", inputs[r], dtype)
    assert checked(array, signature)
    assert (to_float64(array) == reduction_reference(inputs, "max")).all(), dtype
    same_on_every_rank(array, f"checked one-shot {dtype}")
    for odd in sorted({0, p - 1}):
        mine = signature.copy()
        mine[odd + 1] += r == odd
        array = make_array("torch", inputs[r], dtype)
        before = raw_bytes(array)
        assert not checked(array, mine), f"rank {odd}'s signature differs"
        assert raw_bytes(array) == before, "reduced although the signatures differ"
    assert one_shot_on_node(window, 0, 0, "int64", "sum", 1.0, SIGNATURE_BYTES, signature.ctypes.data)
    check_allreduce(window, dtype, "sum", 1000, seed=4)  # the window goes on as before


@pytest.mark.mpi(ranks=[2, 3, 4, 5])
@pytest.mark.parametrize("count", [1000, 100000], ids=["one_shot", "sliced"])
def test_a_rank_silent_in_the_extensions_allreduce_is_named_in_a_deadline_error(mpi_ranks, window, count,
                                                                                 monkeypatch):
    """The steps of the host all-reduce run in the extension, which hands a long wait back to the
    window's own: a local rank that does not come is named in a DeadlineError on the others. The
    window is not used again (the others left the call in its middle)."""
    assert (count * 4 <= ONE_SHOT_BYTES) == (count == 1000)
    silent = mpi_ranks - 1
    check_allreduce(window, "float32", "sum", count, seed=1)
    if window.local_rank != silent:
        monkeypatch.setenv("MPIDIST_TIMEOUT", "1")
        array = np.ones(count, dtype=np.float32)
        with pytest.raises(md.DeadlineError, match=rf"round {window.rounds + 1} of the node window did not complete "
                                                   rf".* no answer from local ranks \[{silent}\] of this node") as error:
            allreduce_on_node(window, describe(array), "sum")
        assert list(error.value.peers) == [silent]
    MPI.COMM_WORLD.Barrier()


def copy_seconds_alone(node_comm, nbytes: int) -> float:
    """The fastest of a few copies of `nbytes` on this rank while the other local ranks sleep:
    the local ranks take turns in rank order (a rank waiting for its turn naps instead of polling,
    so it takes no CPU from the one copying)."""
    source = np.ones(nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    fastest = float("inf")
    for turn in range(node_comm.Get_size()):
        if turn == node_comm.Get_rank():
            for _ in range(20):
                start = time.perf_counter()
                np.copyto(target, source)
                fastest = min(fastest, time.perf_counter() - start)
        request = node_comm.Ibarrier()
        while not request.Test():
            time.sleep(0.001)
    return fastest


@pytest.mark.mpi(ranks=[3])
def test_the_cpu_bound_gives_ranks_that_share_a_core_a_share_of_it(mpi_ranks):
    """bench's CPU bound (bench_bound.host_copy_seconds) with every local rank on one CPU: a copy
    takes each rank about three times as long as it takes one rank alone, since the three take
    turns on that core, as they do in an all-reduce. (Each rank copying once, as the bound did
    before, measured a rank that had the core to itself.)"""
    from mpidist.cli import bench_bound
    node = types.SimpleNamespace(node_comm=MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED))
    nbytes = 1 << 20
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {MPI.COMM_WORLD.allreduce(min(allowed), op=MPI.MIN)})
    try:
        alone = MPI.COMM_WORLD.allreduce(copy_seconds_alone(node.node_comm, nbytes), op=MPI.MAX)
        shared = bench_bound.host_copy_seconds(node, nbytes)
    finally:
        os.sched_setaffinity(0, allowed)
        node.node_comm.Free()
    assert shared > 2 * alone, f"a copy took {shared * 1e6:.0f} us on one core shared by three, {alone * 1e6:.0f} alone"
