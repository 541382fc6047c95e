"""Every collective against a float64 NumPy reference, on 1 to 5 ranks under mpirun.

Tolerances are derived from the dtype's unit roundoff u (conftest.UNIT_ROUNDOFF):
- integers, min and max: exact.
- sum: at most p-1 additions round once each (half types accumulate in float32 inside a
  kernel and round once per kernel call), so |error| <= (p-1) * u * sum_i |x_i|.
- avg: the sum's bound divided by p, plus two roundings of the scaling: + 2u * |result|.
- prod: p-1 multiplications, each off by a relative u: |error| <= (p-1) * u * |result|.
The float64 reference rounds too, so u is replaced by u + 2^-53 (this matters for float64).
A factor 1.01 covers the second-order terms of these first-order bounds.
"""
import numpy as np
import pytest
import torch
from conftest import UNIT_ROUNDOFF, make_array, raw_bytes, to_float64
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mpidist as md

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


def reference(inputs, op):
    stacked = np.stack(inputs)
    return {"sum": np.sum, "avg": np.mean, "min": np.min, "max": np.max, "prod": np.prod}[op](stacked, axis=0)


def tolerance(inputs, op, dtype):
    p = len(inputs)
    if dtype in INT_DTYPES or op in ("min", "max"):
        return 0.0
    u = UNIT_ROUNDOFF[dtype] + UNIT_ROUNDOFF["float64"]
    stacked = np.stack(inputs)
    result = np.abs(reference(inputs, op))
    if op == "sum":
        return 1.01 * (p - 1) * u * np.abs(stacked).sum(axis=0)
    if op == "avg":
        return 1.01 * ((p - 1) * u * np.abs(stacked).sum(axis=0) / p + 2 * u * result)
    return 1.01 * (p - 1) * u * result  # prod


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
    error = np.abs(to_float64(result) - reference(inputs, op))
    bound = tolerance(inputs, op, dtype)
    where = f"{algorithm} {dtype} {op} n={count} {kind} {'in-place' if in_place else 'out='} p={p}"
    assert (error <= bound).all(), f"{where}: error {error.max()} > bound at {np.argmax(error - bound)}"
    # Every rank holds bitwise the same result.
    everyone = comm.mpi.allgather(raw_bytes(result))
    assert all(b == everyone[0] for b in everyone), f"{where}: ranks differ"
    return result


def size_classes(p):
    return sorted({0, 1, max(p - 1, 0), 7, 1009, 70001})


def check_allreduce_grid(comm):
    """Every algorithm x dtype x op x size class; NumPy and torch inputs, in place and out=."""
    variants = [("numpy", True), ("torch", False), ("torch", True), ("numpy", False)]
    case = 0
    for algorithm in ALGORITHMS:
        for dtype in FLOAT_DTYPES + INT_DTYPES:
            for op in OPS:
                if op == "avg" and dtype in INT_DTYPES:
                    continue
                for count in size_classes(comm.size):
                    kind, in_place = variants[case % len(variants)]
                    case += 1
                    if dtype == "bfloat16":
                        kind = "torch"
                    check_allreduce(comm, algorithm, dtype, op, count, kind, in_place)


def check_allreduce_is_deterministic(comm):
    for algorithm in ALGORITHMS:
        for dtype in ("float32", "bfloat16"):
            first = check_allreduce(comm, algorithm, dtype, "sum", 70001, "torch", True, seed=3)
            second = check_allreduce(comm, algorithm, dtype, "sum", 70001, "torch", True, seed=3)
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


def check_forced_algorithm_and_segmented_messages(mpi_world, monkeypatch):
    from mpi4py import MPI

    from mpidist.collectives.select import choose_allreduce
    mpi_ranks = mpi_world.size
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
    monkeypatch.setenv("MPIDIST_ALLREDUCE_ALGORITHM", "bogus")
    comm = md.Communicator(MPI.COMM_WORLD)
    try:
        if mpi_ranks > 1:
            with pytest.raises(md.InvalidArgumentError, match="MPIDIST_ALLREDUCE_ALGORITHM='bogus'"):
                comm.allreduce(np.zeros(4), algorithm="auto")
    finally:
        comm.free()


def check_small_message_fast_path(mpi_world, monkeypatch):
    """With the call check off, small CPU messages go straight to MPI_Allreduce; the results are
    the general path's, and what the fast path cannot do falls back to the general path."""
    mpi_ranks = mpi_world.size
    from mpidist import collectives
    taken = []
    fast = collectives.small_cpu_allreduce
    monkeypatch.setattr(collectives, "small_cpu_allreduce", lambda *args: taken.append(fast(*args)) or taken[-1])
    monkeypatch.setattr(mpi_world, "check_calls", False)
    for dtype in FLOAT_DTYPES + INT_DTYPES:
        for op in OPS:
            if op == "avg" and dtype in INT_DTYPES:
                continue
            for kind in ("numpy", "torch"):
                for count in (0, 1, 7, 1009):
                    if dtype == "bfloat16":
                        kind = "torch"
                    taken.clear()
                    check_allreduce(mpi_world, "auto", dtype, op, count, kind, in_place=True)
                    expect_fast = mpi_ranks > 1 and count > 0
                    assert taken == [expect_fast], (dtype, op, kind, count, taken)
    # Explicit algorithm="mpi" takes it at any size; other algorithms never do.
    for algorithm, expect_fast in (("mpi", True), ("ring", False)):
        taken.clear()
        check_allreduce(mpi_world, algorithm, "float32", "sum", 70001, "torch", in_place=True)
        assert taken == [expect_fast]
    # Large messages under "auto" go to the tables' algorithms.
    taken.clear()
    check_allreduce(mpi_world, "auto", "float64", "sum", 300001, "numpy", in_place=True)
    assert taken == [False]
    # A torch Parameter is a tensor too; a non-contiguous array still gets the general path's error.
    weight = torch.nn.Parameter(torch.full((3, 4), float(mpi_world.rank)), requires_grad=False)
    md.allreduce(weight)
    assert torch.equal(weight, torch.full((3, 4), float(sum(range(mpi_ranks)))))
    with pytest.raises(md.NonContiguousError, match="not contiguous"):
        md.allreduce(torch.zeros(4, 4).t())
    with pytest.raises(md.UnsupportedDtypeError, match="op='avg' needs a floating-point dtype"):
        md.allreduce(np.zeros(3, dtype=np.int32), op="avg")


def check_broadcast_allgather_reduce_scatter(comm):
    p, r = comm.size, comm.rank
    for root in range(p):
        for count in (0, 1, 1009, 300001):  # 300001 float64 takes the scatter + allgather path
            for kind, dtype in (("numpy", "float64"), ("torch", "bfloat16"), ("numpy", "int32")):
                values = np.arange(count) % 251 + root
                array = make_array(kind, values if r == root else np.zeros(count), dtype)
                assert md.broadcast(array, root=root) is array
                assert raw_bytes(array) == raw_bytes(make_array(kind, values, dtype)), (root, count, kind)
    for rows in (0, 1, 3, 11):
        mine = make_array("torch", np.full((rows + r, 3), r + 1.0), "float32")
        gathered = md.allgather(mine)
        expected = np.concatenate([np.full((rows + k, 3), k + 1.0) for k in range(p)])
        assert gathered.shape == expected.shape and (to_float64(gathered) == expected).all()
    for rows in (0, 1, p, 2 * p + 1):
        for op in ("sum", "avg", "max"):
            inputs = [rank_values(7, k, rows * 2, "float64", op).reshape(rows, 2) for k in range(p)]
            before = inputs[r].copy()
            mine = inputs[r].copy()
            block = md.reduce_scatter(mine, op=op)
            assert (mine == before).all(), "reduce_scatter must not change its input"
            full = reference(inputs, op)
            base, extra = divmod(rows, p)
            start = r * base + min(r, extra)
            mine_rows = base + (1 if r < extra else 0)
            assert block.shape == (mine_rows, 2)
            np.testing.assert_allclose(block, full[start:start + mine_rows], rtol=1e-13, atol=1e-13)


def check_async_handles_progress_without_polling(mpi_world):
    import time
    p = mpi_world.size
    arrays = [np.full(100003, float(mpi_world.rank + k)) for k in range(4)]
    handles = [md.allreduce_async(a, op="sum", algorithm=alg)
               for a, alg in zip(arrays, ["ring", "tree", "auto", "mpi"])]
    deadline = time.monotonic() + 60
    while not all(h.done() for h in handles) and time.monotonic() < deadline:
        time.sleep(0.01)  # no MPI call here: the background thread must make progress alone
    assert all(h.done() for h in handles)
    for k, (h, a) in enumerate(zip(handles, arrays)):
        assert h.wait() is a
        assert (a == sum(range(p)) + p * k).all()
    bad = md.allreduce_async(np.zeros(3, dtype=np.int32), op="sum", algorithm="ring")
    assert (bad.wait() == 0).all()


def check_local_argument_errors_are_refused_on_every_rank(mpi_world):
    with pytest.raises(md.InvalidArgumentError, match="unknown op 'mean'"):
        md.allreduce(np.zeros(3), op="mean")
    with pytest.raises(md.InvalidArgumentError, match="unknown all-reduce algorithm 'butterfly'"):
        md.allreduce(np.zeros(3), algorithm="butterfly")
    with pytest.raises(md.UnsupportedDtypeError, match="op='avg' needs a floating-point dtype, got int32"):
        md.allreduce(np.zeros(3, dtype=np.int32), op="avg")
    with pytest.raises(md.NonContiguousError):
        md.allreduce(np.zeros((3, 3))[:, 0])
    with pytest.raises(md.InvalidArgumentError, match="out= must match the input"):
        md.allreduce(np.zeros(3), out=np.zeros(4))
    with pytest.raises(md.InvalidArgumentError, match="root=9 is not a rank"):
        md.broadcast(np.zeros(3), root=9)
    # The communicator still works after refused calls.
    assert (md.allreduce(np.ones(3)) == mpi_world.size).all()


def check_mismatched_calls_raise_on_every_rank(mpi_world):
    r = mpi_world.rank
    mpi_ranks = mpi_world.size
    last = mpi_ranks - 1
    cases = [
        (dict(array=np.zeros(5 if r != last else 6)), "count: ranks"),
        (dict(array=np.zeros(5, dtype=np.float32 if r != last else np.float64)), "dtype: ranks"),
        (dict(array=np.zeros(5), op="sum" if r != last else "max"), "op: ranks"),
        (dict(array=np.zeros(5), algorithm="ring" if r != last else "tree"), "algorithm: ranks"),
    ]
    for kwargs, field in cases:
        with pytest.raises(md.MismatchError) as excinfo:
            md.allreduce(**kwargs)
        message = str(excinfo.value)
        assert field in message and f"[{last}]" in message, message
    # A refused call leaves out= as it was (the input is copied there only once the ranks agree).
    source = np.ones(5 if r != last else 6)
    out = np.full_like(source, -7.0)
    with pytest.raises(md.MismatchError, match="count: ranks"):
        md.allreduce(source, out=out)
    assert (out == -7.0).all() and (source == 1.0).all()
    with pytest.raises(md.MismatchError, match="root: ranks"):
        md.broadcast(np.zeros(4), root=0 if r != last else 1)
    with pytest.raises(md.MismatchError, match="collective: ranks"):
        if r == last:
            md.broadcast(np.zeros(4))
        else:
            md.allreduce(np.zeros(4))
    # After a detected mismatch the communicator is still usable.
    assert (md.allreduce(np.ones(2)) == mpi_ranks).all()


@pytest.mark.mpi(ranks=ALL_RANKS, timeout=900)
@pytest.mark.timeout(600)
def test_collectives_grid_and_checks(mpi_ranks, mpi_world, monkeypatch):
    """Every check of one world size in one launch: each launch starts every rank's interpreter
    (torch included), which costs more than most checks. The name keeps the Makefile's
    `-k grid` selection (the system-MPI run)."""
    check_allreduce_grid(mpi_world)
    check_broadcast_allgather_reduce_scatter(mpi_world)
    with monkeypatch.context() as patch:
        check_forced_algorithm_and_segmented_messages(mpi_world, patch)
    with monkeypatch.context() as patch:
        check_small_message_fast_path(mpi_world, patch)
    if mpi_ranks in (2, 3, 5):
        check_allreduce_is_deterministic(mpi_world)
        check_allreduce_properties()
    if mpi_ranks in (2, 3):
        check_async_handles_progress_without_polling(mpi_world)
        check_local_argument_errors_are_refused_on_every_rank(mpi_world)
        check_mismatched_calls_raise_on_every_rank(mpi_world)


@pytest.mark.mpi(ranks=[2])
def test_a_rank_that_never_joins_is_an_error_not_a_hang(mpi_ranks, mpi_world, monkeypatch):
    monkeypatch.setenv("MPIDIST_TIMEOUT", "3")
    if mpi_world.rank == 0:
        pass  # rank 0 never joins (one whose arguments are refused still joins the call check)
    else:
        with pytest.raises(md.MismatchError, match="did not complete within 3 s"):
            md.allreduce(np.zeros(3))
