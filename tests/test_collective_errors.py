"""Wrong calls become clear errors on every rank, never hangs, raw MPI errors or wrong values:
row shapes, the asynchronous engine's start, unusual NumPy arrays, environment variables, and
arguments refused on one rank only."""
import textwrap

import numpy as np
import pytest
import torch
from conftest import run_python

import mpidist as md
from mpidist import buffers
from mpidist.collectives import callcheck
from mpidist.runtime import deadlines


@pytest.mark.mpi(ranks=[2, 3])
def test_calls_that_differ_between_ranks_raise_on_every_rank(mpi_ranks, mpi_world, monkeypatch):
    """The checks of one world size in one launch: each launch starts every rank's interpreter
    (torch included), which costs more than the checks themselves. The world communicator's
    asynchronous engine, once started, stays: the check that starts it comes last, so that the
    others run without one, as in a launch of their own."""
    check_reduce_scatter_with_different_row_shapes_raises_on_every_rank(mpi_ranks, mpi_world)
    if mpi_ranks == 2:
        check_allgather_row_shape_mismatch_names_the_shapes(mpi_world)
    # Each check's environment variables end with it.
    with monkeypatch.context() as patch:
        check_async_on_one_rank_and_blocking_on_another_raise_on_every_rank(mpi_ranks, patch)
    with monkeypatch.context() as patch:
        check_ranks_forcing_different_algorithms_raise_on_every_rank(mpi_ranks, mpi_world, patch)
    with monkeypatch.context() as patch:
        check_an_argument_refused_on_one_rank_fails_the_others_at_once(mpi_ranks, mpi_world, patch)


# ---- row shapes (allgather, reduce_scatter) ----------------------------------------------------

def check_reduce_scatter_with_different_row_shapes_raises_on_every_rank(mpi_ranks, mpi_world):
    # Same element count (12) on every rank: only the row shapes differ.
    x = np.arange(12.0).reshape((4, 3) if mpi_world.rank == 0 else (12, 1))
    with pytest.raises(md.MismatchError) as excinfo:
        md.reduce_scatter(x)
    message = str(excinfo.value)
    others = list(range(1, mpi_ranks))
    assert f"row shape (shape[1:]): ranks [0] have (3,); ranks {others} have (1,)" in message, message
    assert (md.reduce_scatter(np.ones((mpi_ranks, 2))) == mpi_ranks).all()  # still usable


def check_allgather_row_shape_mismatch_names_the_shapes(mpi_world):
    with pytest.raises(md.MismatchError) as excinfo:
        md.allgather(np.ones((2, 3) if mpi_world.rank else (2, 4)))
    message = str(excinfo.value)
    assert "row shape (shape[1:]): ranks [0] have (4,); ranks [1] have (3,)" in message, message
    with pytest.raises(md.MismatchError, match=r"ranks \[0\] have \(3, 1\); ranks \[1\] have \(3,\)"):
        md.allgather(np.ones((2, 3) if mpi_world.rank else (2, 3, 1)))


def test_describe_mismatch_survives_values_that_are_no_signature():
    table = np.zeros((2, len(callcheck.SIGNATURE_FIELDS)), dtype=np.int64)
    table[1, 0] = 99  # not a collective: some other MPI message crossed the check
    assert "ranks [1] have an unknown value 99" in callcheck.describe_mismatch(table)
    table[1, callcheck.SIGNATURE_FIELDS.index("row shape")] = 12345
    assert "12345" not in callcheck.describe_mismatch(table)


# ---- the asynchronous engine's start -------------------------------------------------------------

def test_a_rank_that_never_starts_the_async_engine_is_an_error_not_a_hang():
    # With the per-call check off, nothing checks before the communicator duplication that
    # starts the engine: it must time out too.
    code = textwrap.dedent("""
        import time, numpy as np, mpidist as md
        md.init(); r = md.rank()
        try:
            md.allreduce_async(np.ones(3), op="mean" if r == 0 else "sum").wait()
        except Exception as e:
            print(f"rank {r}: {type(e).__name__}: {e}", flush=True)
        if r == 0:
            time.sleep(6)  # alive, but never duplicating
    """)
    result = run_python(code, ranks=2, env={"MPIDIST_TIMEOUT": "2", "MPIDIST_CHECK": "0"}, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0: InvalidArgumentError: unknown op 'mean'" in result.stdout, result.stdout
    assert "rank 1: DeadlineError: rank 1: the duplication of the communicator for asynchronous" \
        in result.stdout, result.stdout


def check_async_on_one_rank_and_blocking_on_another_raise_on_every_rank(mpi_ranks, monkeypatch):
    from mpi4py import MPI
    monkeypatch.setenv("MPIDIST_TIMEOUT", "20")
    comm = md.Communicator(MPI.COMM_WORLD)  # a fresh one: no engine yet
    try:
        with pytest.raises(md.MismatchError) as excinfo:
            if comm.rank == 1:
                comm.allreduce_async(np.ones(3)).wait()
            else:
                comm.allreduce(np.ones(4))
        message = str(excinfo.value)
        assert "ranks [1] have first allreduce_async" in message, message
        assert (comm.allreduce(np.ones(2)) == mpi_ranks).all()  # still usable
    finally:
        comm.free()


# ---- unusual NumPy and torch arrays --------------------------------------------------------------

def test_non_native_byte_order_is_refused(mpi_world):
    swapped = np.array([1.0, 2.0], dtype=np.dtype(np.float32).newbyteorder("S"))
    with pytest.raises(md.UnsupportedDtypeError, match="not this machine's native byte order.*newbyteorder"):
        buffers.describe(swapped)
    with pytest.raises(md.UnsupportedDtypeError, match="byte order"):  # every time, not just the first
        md.allreduce(swapped)
    assert buffers.describe(swapped.astype(swapped.dtype.newbyteorder("="))).dtype == "float32"
    assert buffers.describe(np.zeros(2, dtype="|u1")).dtype == "uint8"  # no byte order at all


# A launch of its own: it starts the world communicator's asynchronous engine, which the check of
# an argument refused on one rank must find not yet started; and it refuses a read-only array at
# the first allreduce_async, before the engine exists, which it would no longer do after that check.
@pytest.mark.mpi(ranks=[1, 2])
def test_read_only_arrays_are_refused_only_where_written(mpi_ranks, mpi_world):
    data = np.arange(4.0).tobytes()
    read_only = np.frombuffer(data)
    for call in (lambda: md.allreduce(read_only),
                 lambda: md.allreduce(np.ones(4), out=read_only),
                 lambda: md.allreduce_async(read_only).wait()):
        with pytest.raises(md.InvalidArgumentError, match="read-only NumPy array"):
            call()
    assert np.frombuffer(data).tolist() == [0.0, 1.0, 2.0, 3.0]
    # Only read: allowed.
    assert (md.allreduce(read_only, out=np.empty(4)) == mpi_ranks * read_only).all()
    assert md.allgather(read_only).shape == (4 * mpi_ranks,)
    # Rank r gets block r of the sum, the first `4 % ranks` blocks one element longer.
    expected = np.array_split(mpi_ranks * np.arange(4.0), mpi_ranks)[mpi_world.rank]
    np.testing.assert_array_equal(md.reduce_scatter(read_only), expected)
    md.broadcast(read_only, root=0) if mpi_world.rank == 0 else md.broadcast(np.empty(4), root=0)
    if mpi_ranks > 1:
        with pytest.raises(md.InvalidArgumentError if mpi_world.rank else md.MismatchError,
                           match="broadcast writes root 0's data" if mpi_world.rank else "ranks .* refused"):
            md.broadcast(read_only, root=0)
    assert (md.allreduce(np.ones(2)) == mpi_ranks).all()


def test_sparse_torch_tensors_are_refused():
    with pytest.raises(md.UnsupportedBufferError, match=r"sparse.*to_dense\(\)"):
        buffers.describe(torch.eye(3).to_sparse())


# ---- environment variables --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["MPIDIST_SEGMENT_BYTES", "MPIDIST_BCAST_SCATTER_BYTES"])
def test_malformed_numeric_environment_variables_are_named(name):
    code = "import mpidist as md, numpy as np; md.init(); md.allreduce(np.ones(3))"
    result = run_python(code, env={name: "abc"})
    assert result.returncode != 0
    assert f"InvalidArgumentError: environment variable {name}='abc' must be" in result.stderr, result.stderr


def test_malformed_timeout_is_named(monkeypatch):
    monkeypatch.setenv("MPIDIST_TIMEOUT", "five")
    with pytest.raises(md.InvalidArgumentError, match="MPIDIST_TIMEOUT='five' must be a number >= 0"):
        deadlines.timeout()


def check_ranks_forcing_different_algorithms_raise_on_every_rank(mpi_ranks, mpi_world, monkeypatch):
    from mpi4py import MPI
    monkeypatch.setenv("MPIDIST_ALLREDUCE_ALGORITHM", "ring" if mpi_world.rank == 0 else "tree")
    comm = md.Communicator(MPI.COMM_WORLD)
    try:
        with pytest.raises(md.MismatchError) as excinfo:
            comm.allreduce(np.ones(100000))
        message = str(excinfo.value)
        assert "ranks [0] have ring" in message and "have tree" in message, message
        # An explicit algorithm= overrides the variable: agreement again.
        assert (comm.allreduce(np.ones(5), algorithm="tree") == mpi_ranks).all()
    finally:
        comm.free()


# ---- arguments refused on one rank only ------------------------------------------------------------

ONE_RANK_REFUSES = {
    "bad root": (lambda r: md.broadcast(np.ones(3), root=5 if r == 0 else 0), md.InvalidArgumentError),
    "bad op": (lambda r: md.allreduce(np.ones(3), op="mean" if r == 0 else "sum"), md.InvalidArgumentError),
    "non-contiguous": (lambda r: md.allreduce(np.ones((3, 2)).T if r == 0 else np.ones(6)), md.NonContiguousError),
    "allgather": (lambda r: md.allgather(np.ones((3, 2)).T if r == 0 else np.ones((2, 3))), md.NonContiguousError),
    "reduce_scatter": (lambda r: md.reduce_scatter(np.ones(4), op="mean" if r == 0 else "sum"),
                       md.InvalidArgumentError),
    "async": (lambda r: md.allreduce_async(np.ones(3), op="mean" if r == 0 else "sum").wait(),
              md.InvalidArgumentError),
}


def check_an_argument_refused_on_one_rank_fails_the_others_at_once(mpi_ranks, mpi_world, monkeypatch):
    import time
    monkeypatch.setenv("MPIDIST_TIMEOUT", "60")
    r = mpi_world.rank
    for engine in (False, True):
        if engine:  # once the async engine runs, every collective goes through its communicator
            assert (md.allreduce_async(np.ones(2)).wait() == mpi_ranks).all()
        for case, (call, error) in ONE_RANK_REFUSES.items():
            start = time.monotonic()
            with pytest.raises(error if r == 0 else md.MismatchError) as excinfo:
                call(r)
            assert time.monotonic() - start < 30, case
            if r != 0:
                assert "ranks [0] refused their arguments" in str(excinfo.value), (case, str(excinfo.value))
        assert (md.allreduce(np.ones(2)) == mpi_ranks).all()  # still usable


def test_a_refused_argument_does_not_communicate_with_the_check_off():
    code = textwrap.dedent("""
        import numpy as np, mpidist as md
        md.init(); r = md.rank()
        try:
            md.allreduce(np.ones(3), op="mean" if r == 0 else "sum")
        except Exception as e:
            print(f"rank {r}: {type(e).__name__}: {e}", flush=True)
        if r == 0:
            md.allreduce(np.ones(3))  # the call rank 1 is waiting in
    """)
    result = run_python(code, ranks=2, env={"MPIDIST_TIMEOUT": "5", "MPIDIST_CHECK": "0"}, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0: InvalidArgumentError" in result.stdout and "rank 1:" not in result.stdout, result.stdout
