"""The hierarchical (shared-memory window + leaders) all-reduce on 1 to 5 ranks, on one node and
on emulated nodes of two ranks (MPIDIST_RANKS_PER_NODE=2, so 5 ranks make nodes of 2, 2 and 1),
against the float64 NumPy reference and tolerances of test_collectives.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), each on a
communicator of its own, freed at its end."""
import itertools
import time

import numpy as np
import pytest
from conftest import make_array, raw_bytes, to_float64
from mpi4py import MPI
from node_steps import stepwise
from test_collectives import FLOAT_DTYPES, INT_DTYPES, OPS, rank_values, size_classes
from tolerances import reduction_bound, reduction_reference

import mpidist as md
from mpidist import _C
from mpidist.collectives import hierarchical, node_window

pytestmark = pytest.mark.mpi_shared_launch

ON_NODES = pytest.mark.parametrize("ranks_per_node", [None, "2"], ids=["one_node", "nodes_of_two"])


def check(comm, dtype, op, count, kind, seed=0):
    p, r = comm.size, comm.rank
    inputs = [rank_values(seed, k, count, dtype, op) for k in range(p)]
    array = make_array(kind, inputs[r], dtype)
    assert comm.allreduce(array, op=op, algorithm="hierarchical") is array
    error = np.abs(to_float64(array) - reduction_reference(inputs, op))
    where = f"hierarchical {dtype} {op} n={count} p={p} nodes={comm.num_nodes}"
    assert (error <= reduction_bound(inputs, op, dtype)).all(), f"{where}: error {error.max()}"
    everyone = comm.mpi.allgather(raw_bytes(array))
    assert all(b == everyone[0] for b in everyone), f"{where}: ranks differ"
    return array


@pytest.fixture
def comm(ranks_per_node, monkeypatch):
    """A communicator on one node (ranks_per_node None) or on emulated nodes of `ranks_per_node`."""
    if ranks_per_node:
        monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", ranks_per_node)
    else:
        monkeypatch.delenv("MPIDIST_RANKS_PER_NODE", raising=False)
    comm = md.Communicator(MPI.COMM_WORLD)
    yield comm
    comm.free()


def hierarchical_grid(p):
    """(dtype, op, count, kind) of every dtype x op x size class of `p` ranks below segmented
    messages; NumPy and torch inputs in turn. Sizes grow and shrink again, so the window is grown
    and then reused."""
    case = 0
    for dtype in FLOAT_DTYPES + INT_DTYPES:
        for op in OPS:
            if op == "avg" and dtype in INT_DTYPES:
                continue
            for count in [c for c in size_classes(p) if c < 70001] + [3]:
                yield dtype, op, count, "torch" if dtype == "bfloat16" or case % 2 else "numpy"
                case += 1


@pytest.mark.mpi(ranks=[1, 2, 3, 4, 5])
@ON_NODES
def test_nodes(mpi_ranks, comm, ranks_per_node):
    assert comm.num_nodes == ((mpi_ranks + 1) // 2 if ranks_per_node else 1)


@pytest.mark.mpi(ranks=[1, 2, 3, 4, 5])
@ON_NODES
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INT_DTYPES)
def test_hierarchical_grid(mpi_ranks, comm, dtype):
    cases = [case for case in hierarchical_grid(mpi_ranks) if case[0] == dtype]
    assert cases
    for case in cases:
        check(comm, *case)


@pytest.mark.mpi(ranks=[1, 2, 3, 4, 5])
@ON_NODES
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INT_DTYPES)
def test_hierarchical_segmented_messages(comm, dtype):
    """Messages segmented across nodes."""
    check(comm, dtype, "sum", 300001, "torch")


@pytest.mark.mpi(ranks=[1, 2, 3, 4, 5])
@ON_NODES
def test_hierarchical_is_deterministic(comm):
    first = check(comm, "bfloat16", "sum", 70001, "torch", seed=5)
    second = check(comm, "bfloat16", "sum", 70001, "torch", seed=5)
    assert raw_bytes(first) == raw_bytes(second), "hierarchical is not deterministic"


@pytest.mark.mpi(ranks=[1, 2, 3, 4, 5])
@ON_NODES
def test_async_beside_blocking(mpi_ranks, comm):
    """The asynchronous engine runs hierarchical on its own node communicator and window while
    the caller's thread runs it on the Communicator's."""
    arrays = [np.full(50001, float(comm.rank + k)) for k in range(3)]
    handles = [comm.allreduce_async(a, algorithm="hierarchical") for a in arrays]
    blocking = np.full(999, 1.0, dtype=np.float32)
    comm.allreduce(blocking, algorithm="hierarchical")
    assert (blocking == mpi_ranks).all()
    for k, (handle, array) in enumerate(zip(handles, arrays)):
        assert handle.wait() is array
        assert (array == sum(range(mpi_ranks)) + mpi_ranks * k).all()


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("ranks_per_node", [None], ids=["one_node"])
@pytest.mark.parametrize("one_shot_bytes, rounds", [(0, 2), (1 << 20, 1)], ids=["never", "up_to_1MiB"])
def test_the_window_takes_its_channels_one_shot_bound(comm, one_shot_bytes, rounds):
    """A channel's one_shot_bytes (the tuning file's, measured by `mpidist tune`) decides in its
    window which all-reduces go one-shot (one round) and which sliced (two), the default's 64 KiB
    aside; the results are right either way. With the call check on it compares in the window,
    one round of its own, which also carries a message of the fast path that goes one-shot (one
    round in all)."""
    comm.one_shot_bytes = one_shot_bytes
    for count in (3, 100000):  # 400 KB: sliced by default
        check(comm, "float32", "sum", count, "numpy")  # the first call of a size makes or grows the slots
        before = comm.node_window.rounds
        check(comm, "float32", "sum", count, "numpy", seed=1)
        carried = comm.check_calls and 4 * count <= one_shot_bytes
        check_round = 1 if comm.check_calls and not carried else 0
        assert comm.node_window.rounds - before == (rounds + check_round if comm.size > 1 else 0), count
    assert comm.node_window.one_shot_bytes == one_shot_bytes


@pytest.mark.mpi(ranks=[2, 3])
@ON_NODES
def test_back_to_back_calls_of_changing_sizes(mpi_ranks, comm, monkeypatch):
    """The last rank reads its results late while the others go on to the next call, of another
    size: on one node a pause before the last step of the extension's all-reduce (the copy-out,
    or the one-shot's reduction of every slot), across nodes after every second node barrier.
    Sliced and one-shot calls in turn (ONE_SHOT_BYTES; the one-shot in slots of its own, in
    alternating halves): no result and no slot is overwritten before the last rank has read it."""
    lagging = comm.rank == mpi_ranks - 1
    barriers = itertools.count(1)
    synchronize = hierarchical.NodeWindow.sync

    def synchronize_then_lag(window):
        synchronize(window)
        if lagging and next(barriers) % 2 == 0:
            time.sleep(0.003)

    def lag_before_the_last_step(step, last):
        if lagging and step == last:
            time.sleep(0.003)

    if comm.num_nodes > 1:
        monkeypatch.setattr(hierarchical.NodeWindow, "sync", synchronize_then_lag)
    else:
        for name, function in stepwise(lag_before_the_last_step).items():
            monkeypatch.setattr(_C, name, function)
    comm.check_calls = False  # the call check is a collective: it would hold the fast ranks back
    # A one-shot call followed by one that writes where its slots lie: another one-shot, and a
    # sliced one whose second slice starts inside the one-shot's message.
    assert 9000 * 4 <= node_window.ONE_SHOT_BYTES < 16500 * 4
    counts = [[70001, 3, 5, 9000, 16500, 65536, 20000][call % 7] for call in range(28)]
    inputs = [[rank_values(call, k, count, "float32", "sum") for k in range(mpi_ranks)]
              for call, count in enumerate(counts)]
    # Back to back, for the same reason: each result is checked afterwards.
    results = [comm.allreduce(values[comm.rank].astype(np.float32), algorithm="hierarchical") for values in inputs]
    for call, (values, result) in enumerate(zip(inputs, results)):
        error = np.abs(result.astype(np.float64) - reduction_reference(values, "sum"))
        assert (error <= reduction_bound(values, "sum", "float32")).all(), f"call {call} (n={counts[call]}): {error.max()}"
