"""Every collective against a float64 NumPy reference, on 1 to 5 ranks under mpirun.

Tolerances are derived from the dtype's unit roundoff and the rank count (tolerances.py):
integers, min and max exact, sums, averages and products within their first-order bounds.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order.
The tests that start an asynchronous engine, turn the call check off or need neither done run
on a communicator of their own (own_comm), which they free: the world communicator stays as
every test expects. The mismatch and refusal tests run with the engine idle and running: once it
runs, blocking collectives take its queue too.
"""
import numpy as np
import pytest
import torch
from conftest import make_array, raw_bytes, to_float64
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tolerances import reduction_bound, reduction_reference

import mpidist as md

pytestmark = pytest.mark.mpi_shared_launch

ALGORITHMS = ["ring", "tree", "recursive_halving", "recursive_doubling", "reduce_bcast", "mpi", "auto"]
FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"]
INT_DTYPES = ["int32", "int64"]
OPS = ["sum", "avg", "min", "max", "prod"]
ALL_RANKS = [1, 2, 3, 4, 5]


def rank_values(seed, rank, count, dtype, op):
    """Rank `rank`'s input as float64 values exactly representable in `dtype`."""
    rng = np.random.default_rng([seed, rank, count])
    if dtype in INT_DTYPES:
        high = 3 if op == "prod" else 1000
        return rng.integers(-high, high + 1, count).astype(np.float64)
    values = rng.uniform(0.5, 1.5, count) if op == "prod" else rng.uniform(-4, 4, count)
    return to_float64(make_array("torch", values, dtype))


def check_allreduce(comm, algorithm, dtype, op, count, kind, in_place, seed=0):
    p, r = comm.size, comm.rank
    inputs = [rank_values(seed, k, count, dtype, op) for k in range(p)]
    array = make_array(kind, inputs[r], dtype)
    before = raw_bytes(array)
    if in_place:
        result = comm.allreduce(array, op=op, algorithm=algorithm)
        assert result is array
    else:
        out = make_array(kind, np.zeros(count), dtype)
        result = comm.allreduce(array, op=op, algorithm=algorithm, out=out)
        assert result is out and raw_bytes(array) == before, "out= must leave the input alone"
    error = np.abs(to_float64(result) - reduction_reference(inputs, op))
    bound = reduction_bound(inputs, op, dtype)
    where = f"{algorithm} {dtype} {op} n={count} {kind} {'in-place' if in_place else 'out='} p={p}"
    assert (error <= bound).all(), f"{where}: error {error.max()} > bound at {np.argmax(error - bound)}"
    # Every rank holds bitwise the same result.
    everyone = comm.mpi.allgather(raw_bytes(result))
    assert all(b == everyone[0] for b in everyone), f"{where}: ranks differ"
    return result


def size_classes(p):
    return sorted({0, 1, max(p - 1, 0), 7, 1009, 70001})


GRID_VARIANTS = [("numpy", True), ("torch", False), ("torch", True), ("numpy", False)]


def allreduce_grid(p):
    """Every algorithm x dtype x op x size class of `p` ranks as the arguments of check_allreduce
    after the communicator: NumPy and torch inputs, in place and out=, in turn."""
    case = 0
    for algorithm in ALGORITHMS:
        for dtype in FLOAT_DTYPES + INT_DTYPES:
            for op in OPS:
                if op == "avg" and dtype in INT_DTYPES:
                    continue
                for count in size_classes(p):
                    kind, in_place = GRID_VARIANTS[case % len(GRID_VARIANTS)]
                    case += 1
                    yield algorithm, dtype, op, count, "torch" if dtype == "bfloat16" else kind, in_place


def start_engine(comm):
    """Start the communicator's asynchronous engine; blocking collectives then run in its queue."""
    assert (comm.allreduce_async(np.ones(2)).wait() == comm.size).all()


ENGINE = pytest.mark.parametrize("engine", [False, True], ids=["engine_idle", "engine_running"])


@pytest.mark.mpi(ranks=ALL_RANKS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INT_DTYPES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_grid(mpi_ranks, mpi_world, algorithm, dtype):
    """Every op and size class of one algorithm and dtype (the name keeps the Makefile's `-k grid`
    selection of the system-MPI run)."""
    cases = [case for case in allreduce_grid(mpi_ranks) if case[:2] == (algorithm, dtype)]
    assert cases
    for case in cases:
        check_allreduce(mpi_world, *case)


@pytest.mark.mpi(ranks=[2, 3, 5])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_is_deterministic(mpi_world, algorithm, dtype):
    first = check_allreduce(mpi_world, algorithm, dtype, "sum", 70001, "torch", True, seed=3)
    second = check_allreduce(mpi_world, algorithm, dtype, "sum", 70001, "torch", True, seed=3)
    assert raw_bytes(first) == raw_bytes(second), f"{algorithm} {dtype}: runs differ"


# derandomize=True: every rank draws the same examples, so they all call the same collective.
@settings(max_examples=40, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(algorithm=st.sampled_from(ALGORITHMS), dtype=st.sampled_from(FLOAT_DTYPES + INT_DTYPES),
       op=st.sampled_from(OPS), count=st.integers(0, 5000), seed=st.integers(0, 2 ** 31),
       kind=st.sampled_from(["numpy", "torch"]), in_place=st.booleans())
def check_allreduce_properties(algorithm, dtype, op, count, seed, kind, in_place):
    comm = md.init()
    if op == "avg" and dtype in INT_DTYPES:
        op = "sum"
    if dtype == "bfloat16":
        kind = "torch"
    check_allreduce(comm, algorithm, dtype, op, count, kind, in_place, seed=seed)


@pytest.mark.mpi(ranks=[2, 3, 5])
def test_allreduce_properties(mpi_world):
    check_allreduce_properties()


@pytest.mark.mpi(ranks=ALL_RANKS)
def test_forced_algorithm_and_segmented_messages(mpi_ranks, mpi_world, monkeypatch):
    from mpi4py import MPI

    from mpidist.collectives.select import choose_allreduce
    # A communicator reads MPIDIST_ALLREDUCE_ALGORITHM when it is created.
    monkeypatch.setenv("MPIDIST_ALLREDUCE_ALGORITHM", "tree")
    assert mpi_world.forced_algorithm is None
    comm = md.Communicator(MPI.COMM_WORLD)
    try:
        assert comm.forced_algorithm == "tree"
        assert choose_allreduce(10 ** 9, mpi_ranks, forced=comm.forced_algorithm) == "tree"
        check_allreduce(comm, "auto", "float32", "sum", 300001, "numpy", True)
        check_allreduce(comm, "auto", "float32", "sum", 3, "torch", True)  # small messages too
    finally:
        comm.free()


@pytest.mark.mpi(ranks=ALL_RANKS)
def test_unknown_forced_algorithm_is_named(monkeypatch):
    from mpi4py import MPI
    monkeypatch.setenv("MPIDIST_ALLREDUCE_ALGORITHM", "bogus")
    comm = md.Communicator(MPI.COMM_WORLD)
    try:
        with pytest.raises(md.InvalidArgumentError, match="MPIDIST_ALLREDUCE_ALGORITHM='bogus'"):
            comm.allreduce(np.zeros(4), algorithm="auto")
    finally:
        comm.free()


@pytest.fixture
def fast_path_tries(own_comm, monkeypatch):
    """The list to which every try of the small-message fast path appends whether it took the
    message (a try that raises appends nothing)."""
    from mpidist import collectives
    taken = []
    fast = collectives.fast_cpu_allreduce
    monkeypatch.setattr(collectives, "fast_cpu_allreduce", lambda *args: taken.append(fast(*args)) or taken[-1])
    return taken


@pytest.fixture
def fast_path_calls(own_comm, fast_path_tries):
    """fast_path_tries with the call check off: small CPU messages go straight to MPI_Allreduce."""
    own_comm.check_calls = False
    return fast_path_tries


@pytest.mark.mpi(ranks=ALL_RANKS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INT_DTYPES)
def test_small_message_fast_path(mpi_ranks, own_comm, fast_path_calls, dtype):
    """The results are the general path's; one rank or an empty message takes the general path."""
    for op in OPS:
        if op == "avg" and dtype in INT_DTYPES:
            continue
        for kind in ("numpy", "torch"):
            for count in (0, 1, 7, 1009):
                if dtype == "bfloat16":
                    kind = "torch"
                # MPI's own up to the bounds' first; then, on one node, the node protocol once
                # the first call there has made its window.
                mpi_below, node_below = own_comm.fast_path_bounds[dtype in ("float16", "bfloat16")]
                nbytes = count * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
                expect_fast = mpi_ranks > 1 and count > 0 and \
                    (nbytes < mpi_below or nbytes < node_below and own_comm.node_window is not None)
                fast_path_calls.clear()
                check_allreduce(own_comm, "auto", dtype, op, count, kind, in_place=True)
                assert fast_path_calls == [expect_fast], (dtype, op, kind, count, fast_path_calls)


@pytest.mark.mpi(ranks=ALL_RANKS)
@pytest.mark.parametrize("algorithm, expect_fast", [("mpi", True), ("ring", False)])
def test_fast_path_of_an_explicit_algorithm(own_comm, fast_path_calls, algorithm, expect_fast):
    """Explicit algorithm="mpi" takes it at any size; other algorithms never do."""
    check_allreduce(own_comm, algorithm, "float32", "sum", 70001, "torch", in_place=True)
    assert fast_path_calls == [expect_fast]


@pytest.mark.mpi(ranks=ALL_RANKS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INT_DTYPES)
def test_fast_path_into_the_node_protocol(mpi_ranks, own_comm, fast_path_calls, dtype, monkeypatch):
    """Messages that the hierarchical all-reduce takes on one node go straight into the node
    protocol once its window exists (the general path makes it at the first call), under "auto"
    too where its bounds give them to it: one-shot up to the one-shot's size, sliced above it; the
    results are the general path's, the same bits on every rank."""
    from mpidist.collectives import fastpath
    from mpidist.collectives.node_window import ONE_SHOT_BYTES
    protocols = []
    for name in ("one_shot_on_node", "host_allreduce_on_node"):
        run = getattr(fastpath, name)
        monkeypatch.setattr(fastpath, name, lambda *args, run=run, name=name: protocols.append(name) or run(*args))
    one_node = mpi_ranks > 1 and own_comm.num_nodes == 1
    if one_node:  # "auto" gives every size to the node protocol (the fast path's bounds, select.py)
        own_comm.fast_path_bounds = ((0, float("inf")), (0, float("inf")))
    largest = ONE_SHOT_BYTES // np.dtype(np.float32 if dtype == "bfloat16" else dtype).itemsize
    if dtype == "bfloat16":
        largest *= 2
    for algorithm in ("hierarchical", "auto"):
        for op in OPS:
            if op == "avg" and dtype in INT_DTYPES:
                continue
            for index, count in enumerate((1, 7, 1009, largest, largest + 1)):
                kind = "torch" if dtype == "bfloat16" or index % 2 else "numpy"
                expect_fast = one_node and own_comm.node_window is not None
                fast_path_calls.clear()
                protocols.clear()
                check_allreduce(own_comm, algorithm, dtype, op, count, kind, in_place=True)
                assert fast_path_calls == [expect_fast], (algorithm, op, count, fast_path_calls)
                expected = "one_shot_on_node" if count <= largest else "host_allreduce_on_node"
                assert protocols == ([expected] if expect_fast else []), (algorithm, op, count, protocols)
    assert own_comm.node_window is not None or not one_node


@pytest.mark.mpi(ranks=[2, 3])
def test_with_the_call_check_on_the_fast_path_checks_in_the_node_window(mpi_ranks, own_comm, fast_path_tries,
                                                                         monkeypatch):
    """With the call check on, small all-reduces take the fast path once the node window exists
    (the first checked all-reduce makes it, on one node): the check compares there (no MPI
    exchange of the signatures), the results are the general path's, a call agrees with the same
    call on the general path (out=; where the fast path's message went along with the check, the
    exchange settles that), and a difference is named on every rank, also against a rank on the
    general path."""
    from mpidist.collectives import callcheck, fastpath
    exchanges, along = [], []
    exchange = callcheck.exchange_signatures
    monkeypatch.setattr(callcheck, "exchange_signatures", lambda mpi, fields: exchanges.append(fields) or
                        exchange(mpi, fields))

    class FastPathCheck(callcheck.NodeCheck):
        def agreed(self, *message):
            along.append(bool(message))
            return super().agreed(*message)
    monkeypatch.setattr(fastpath, "NodeCheck", FastPathCheck)
    r = own_comm.rank
    assert own_comm.check_calls and own_comm.num_nodes == 1
    check_allreduce(own_comm, "mpi", "float32", "sum", 3, "numpy", in_place=True)
    assert fast_path_tries == [False] and len(exchanges) == 1, "no window yet: the general path checks through MPI"
    # After their first checked all-reduce the ranks made the window: the next checks are its
    # rounds, although no all-reduce was large enough for the hierarchical algorithm.
    assert own_comm.node_window is not None
    mpi_below, node_below = own_comm.fast_path_bounds[False]
    for algorithm in ("auto", "mpi", "hierarchical"):
        for dtype, op, count, kind in (("float32", "sum", 1, "numpy"), ("float64", "avg", 7, "torch"),
                                       ("int32", "max", 1009, "numpy"), ("float32", "prod", 300, "torch")):
            fast_path_tries.clear()
            along.clear()
            before = len(exchanges)
            check_allreduce(own_comm, algorithm, dtype, op, count, kind, in_place=True)
            nbytes = count * np.dtype(dtype).itemsize
            expect_fast = algorithm != "auto" or nbytes < max(mpi_below, node_below)
            assert fast_path_tries == [expect_fast], (algorithm, dtype, op, count, fast_path_tries)
            assert len(exchanges) == before, (algorithm, dtype, op, count, "agreeing signatures went through MPI")
            # The message goes with the check's round, but to MPI where algorithm="mpi" names it.
            assert along == ([algorithm != "mpi"] if expect_fast else []), (algorithm, dtype, op, count, along)
    for algorithm, settled in (("hierarchical", 1), ("mpi", 0)):  # out= takes the general path
        before = len(exchanges)
        check_allreduce(own_comm, algorithm, "float64", "sum", 5, "numpy", in_place=r % 2 == 0)
        assert len(exchanges) == before + settled, algorithm
    with pytest.raises(md.MismatchError, match=r"count: ranks \[0\] have 3; ranks \[1(, 2)?\] have 4"):
        own_comm.allreduce(np.ones(3 + min(r, 1)))
    with pytest.raises(md.MismatchError, match=r"count: ranks \[0\] have 5; ranks \[1(, 2)?\] have 6"):
        if r == 0:
            own_comm.allreduce(np.ones(5), out=np.empty(5))  # the general path
        else:
            own_comm.allreduce(np.ones(6))
    with pytest.raises(md.MismatchError, match=r"collective: ranks \[0\] have broadcast; ranks \[1(, 2)?\] have allreduce"):
        own_comm.broadcast(np.ones(3)) if r == 0 else own_comm.allreduce(np.ones(3))
    assert (own_comm.allreduce(np.ones(2)) == mpi_ranks).all()  # still usable
    monkeypatch.setenv("MPIDIST_TIMEOUT", "1")
    if r == 0:  # it waits in its call check for the others, which never come
        with pytest.raises(md.DeadlineError, match=r"rank 0: the allreduce call check did not complete within 1 s"):
            own_comm.allreduce(np.ones(2))
    own_comm.mpi.Barrier()  # rank 0 gave up; the window's rounds now differ: the communicator is done


@pytest.mark.mpi(ranks=ALL_RANKS)
def test_large_messages_leave_the_fast_path_unless_the_node_protocol_takes_them(own_comm, fast_path_calls):
    """Large messages under "auto" go to the tables' algorithms: straight into the node protocol
    where that is the hierarchical all-reduce on one node (the fast path's bounds), else the
    general path."""
    for expected in (False, True):
        own_comm.fast_path_bounds = ((0, float("inf") if expected else 0), (0, 0))
        fast_path_calls.clear()
        check_allreduce(own_comm, "auto", "float64", "sum", 300001, "numpy", in_place=True)
        assert fast_path_calls == [expected and own_comm.node_window is not None and own_comm.num_nodes == 1]


@pytest.mark.mpi(ranks=ALL_RANKS)
def test_fast_path_takes_a_parameter_and_leaves_errors_to_the_general_path(mpi_ranks, own_comm, fast_path_calls):
    """A torch Parameter is a tensor too; a non-contiguous array still gets the general path's error."""
    weight = torch.nn.Parameter(torch.full((3, 4), float(own_comm.rank)), requires_grad=False)
    own_comm.allreduce(weight)
    assert torch.equal(weight, torch.full((3, 4), float(sum(range(mpi_ranks)))))
    with pytest.raises(md.NonContiguousError, match="not contiguous"):
        own_comm.allreduce(torch.zeros(4, 4).t())
    with pytest.raises(md.UnsupportedDtypeError, match="op='avg' needs a floating-point dtype"):
        own_comm.allreduce(np.zeros(3, dtype=np.int32), op="avg")


@pytest.mark.mpi(ranks=ALL_RANKS)
@pytest.mark.parametrize("kind, dtype", [("numpy", "float64"), ("torch", "bfloat16"), ("numpy", "int32")])
def test_broadcast_from_every_root(mpi_world, kind, dtype):
    p, r = mpi_world.size, mpi_world.rank
    for root in range(p):
        for count in (0, 1, 1009, 300001):  # 300001 float64 takes the scatter + allgather path
            values = np.arange(count) % 251 + root
            array = make_array(kind, values if r == root else np.zeros(count), dtype)
            assert md.broadcast(array, root=root) is array
            assert raw_bytes(array) == raw_bytes(make_array(kind, values, dtype)), (root, count, kind)


@pytest.mark.mpi(ranks=ALL_RANKS)
@pytest.mark.parametrize("rows", [0, 1, 3, 11])
def test_allgather_of_different_row_counts(mpi_world, rows):
    p, r = mpi_world.size, mpi_world.rank
    mine = make_array("torch", np.full((rows + r, 3), r + 1.0), "float32")
    gathered = md.allgather(mine)
    expected = np.concatenate([np.full((rows + k, 3), k + 1.0) for k in range(p)])
    assert gathered.shape == expected.shape and (to_float64(gathered) == expected).all()


@pytest.mark.mpi(ranks=ALL_RANKS)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_reduce_scatter(mpi_world, op):
    p, r = mpi_world.size, mpi_world.rank
    for rows in (0, 1, p, 2 * p + 1):
        inputs = [rank_values(7, k, rows * 2, "float64", op).reshape(rows, 2) for k in range(p)]
        before = inputs[r].copy()
        mine = inputs[r].copy()
        block = md.reduce_scatter(mine, op=op)
        assert (mine == before).all(), "reduce_scatter must not change its input"
        full = reduction_reference(inputs, op)
        base, extra = divmod(rows, p)
        start = r * base + min(r, extra)
        mine_rows = base + (1 if r < extra else 0)
        assert block.shape == (mine_rows, 2)
        np.testing.assert_allclose(block, full[start:start + mine_rows], rtol=1e-13, atol=1e-13)


@pytest.mark.mpi(ranks=[2, 3])
def test_async_handles_progress_without_polling(own_comm):
    import time
    p = own_comm.size
    arrays = [np.full(100003, float(own_comm.rank + k)) for k in range(4)]
    handles = [own_comm.allreduce_async(a, op="sum", algorithm=alg)
               for a, alg in zip(arrays, ["ring", "tree", "auto", "mpi"])]
    deadline = time.monotonic() + 60
    while not all(h.done() for h in handles) and time.monotonic() < deadline:
        time.sleep(0.01)  # no MPI call here: the background thread must make progress alone
    assert all(h.done() for h in handles)
    for k, (h, a) in enumerate(zip(handles, arrays)):
        assert h.wait() is a
        assert (a == sum(range(p)) + p * k).all()


@pytest.mark.mpi(ranks=[2, 3])
def test_async_allreduce_of_integers(own_comm):
    bad = own_comm.allreduce_async(np.zeros(3, dtype=np.int32), op="sum", algorithm="ring")
    assert (bad.wait() == 0).all()


LOCAL_REFUSALS = {
    "unknown op": (lambda comm: comm.allreduce(np.zeros(3), op="mean"), md.InvalidArgumentError, "unknown op 'mean'"),
    "unknown algorithm": (lambda comm: comm.allreduce(np.zeros(3), algorithm="butterfly"), md.InvalidArgumentError,
                          "unknown all-reduce algorithm 'butterfly'"),
    "integer average": (lambda comm: comm.allreduce(np.zeros(3, dtype=np.int32), op="avg"), md.UnsupportedDtypeError,
                        "op='avg' needs a floating-point dtype, got int32"),
    "non-contiguous": (lambda comm: comm.allreduce(np.zeros((3, 3))[:, 0]), md.NonContiguousError, None),
    "out of another size": (lambda comm: comm.allreduce(np.zeros(3), out=np.zeros(4)), md.InvalidArgumentError,
                            "out= must match the input"),
    "root not a rank": (lambda comm: comm.broadcast(np.zeros(3), root=9), md.InvalidArgumentError,
                        "root=9 is not a rank"),
}


@pytest.mark.mpi(ranks=[2, 3])
@ENGINE
@pytest.mark.parametrize("case", LOCAL_REFUSALS)
def test_local_argument_errors_are_refused_on_every_rank(own_comm, engine, case):
    if engine:
        start_engine(own_comm)
    call, error, message = LOCAL_REFUSALS[case]
    with pytest.raises(error, match=message):
        call(own_comm)
    # The communicator still works after refused calls.
    assert (own_comm.allreduce(np.ones(3)) == own_comm.size).all()


def differing_on_the_last_rank(rank, last):
    """allreduce arguments that differ on rank `last` only, each with the field the error names."""
    return {
        "count": (dict(array=np.zeros(5 if rank != last else 6)), "count: ranks"),
        "dtype": (dict(array=np.zeros(5, dtype=np.float32 if rank != last else np.float64)), "dtype: ranks"),
        "op": (dict(array=np.zeros(5), op="sum" if rank != last else "max"), "op: ranks"),
        "algorithm": (dict(array=np.zeros(5), algorithm="ring" if rank != last else "tree"), "algorithm: ranks"),
    }


@pytest.mark.mpi(ranks=[2, 3])
@ENGINE
@pytest.mark.parametrize("field", ["count", "dtype", "op", "algorithm"])
def test_mismatched_calls_raise_on_every_rank(own_comm, engine, field):
    if engine:
        start_engine(own_comm)
    last = own_comm.size - 1
    kwargs, names = differing_on_the_last_rank(own_comm.rank, last)[field]
    with pytest.raises(md.MismatchError) as excinfo:
        own_comm.allreduce(**kwargs)
    message = str(excinfo.value)
    assert names in message and f"[{last}]" in message, message
    # After a detected mismatch the communicator is still usable.
    assert (own_comm.allreduce(np.ones(2)) == own_comm.size).all()


@pytest.mark.mpi(ranks=[2, 3])
@ENGINE
def test_mismatched_call_leaves_out_as_it_was(own_comm, engine):
    """The input is copied into out= only once the ranks agree."""
    if engine:
        start_engine(own_comm)
    source = np.ones(5 if own_comm.rank != own_comm.size - 1 else 6)
    out = np.full_like(source, -7.0)
    with pytest.raises(md.MismatchError, match="count: ranks"):
        own_comm.allreduce(source, out=out)
    assert (out == -7.0).all() and (source == 1.0).all()
    assert (own_comm.allreduce(np.ones(2)) == own_comm.size).all()


@pytest.mark.mpi(ranks=[2, 3])
@ENGINE
def test_mismatched_broadcast_roots_raise_on_every_rank(own_comm, engine):
    if engine:
        start_engine(own_comm)
    with pytest.raises(md.MismatchError, match="root: ranks"):
        own_comm.broadcast(np.zeros(4), root=0 if own_comm.rank != own_comm.size - 1 else 1)
    assert (own_comm.allreduce(np.ones(2)) == own_comm.size).all()


@pytest.mark.mpi(ranks=[2, 3])
@ENGINE
def test_mismatched_collectives_raise_on_every_rank(own_comm, engine):
    if engine:
        start_engine(own_comm)
    with pytest.raises(md.MismatchError, match="collective: ranks"):
        if own_comm.rank == own_comm.size - 1:
            own_comm.broadcast(np.zeros(4))
        else:
            own_comm.allreduce(np.zeros(4))
    assert (own_comm.allreduce(np.ones(2)) == own_comm.size).all()


# A launch of its own: rank 1's all-reduce stays unfinished, rank 0 never having joined it.
@pytest.mark.mpi_own_launch
@pytest.mark.mpi(ranks=[2])
def test_a_rank_that_never_joins_is_an_error_not_a_hang(mpi_ranks, mpi_world, monkeypatch):
    monkeypatch.setenv("MPIDIST_TIMEOUT", "1")
    if mpi_world.rank == 0:
        pass  # rank 0 never joins (one whose arguments are refused still joins the call check)
    else:
        with pytest.raises(md.MismatchError, match="did not complete within 1 s"):
            md.allreduce(np.zeros(3))
