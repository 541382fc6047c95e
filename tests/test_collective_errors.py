"""Wrong calls become clear errors on every rank, never hangs, raw MPI errors or wrong values:
row shapes, the asynchronous engine's start, unusual NumPy arrays, environment variables, and
arguments refused on one rank only.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order.
The tests that start an asynchronous engine, or need none started, run on a communicator of their
own (own_comm), which they free: the world communicator's engine stays unstarted."""
import textwrap

import numpy as np
import pytest
import torch
from conftest import run_python

import mpidist as md
from mpidist import buffers
from mpidist.collectives import callcheck
from mpidist.runtime import deadlines

pytestmark = pytest.mark.mpi_shared_launch


# ---- row shapes (allgather, reduce_scatter) ----------------------------------------------------

@pytest.mark.mpi(ranks=[2, 3])
def test_reduce_scatter_with_different_row_shapes_raises_on_every_rank(mpi_ranks, mpi_world):
    # Same element count (12) on every rank: only the row shapes differ.
    x = np.arange(12.0).reshape((4, 3) if mpi_world.rank == 0 else (12, 1))
    with pytest.raises(md.MismatchError) as excinfo:
        md.reduce_scatter(x)
    message = str(excinfo.value)
    others = list(range(1, mpi_ranks))
    assert f"row shape (shape[1:]): ranks [0] have (3,); ranks {others} have (1,)" in message, message
    assert (md.reduce_scatter(np.ones((mpi_ranks, 2))) == mpi_ranks).all()  # still usable


@pytest.mark.mpi(ranks=[2])
@pytest.mark.parametrize("rank_0_shape, expected", [
    ((2, 4), "row shape (shape[1:]): ranks [0] have (4,); ranks [1] have (3,)"),
    ((2, 3, 1), "ranks [0] have (3, 1); ranks [1] have (3,)"),
], ids=["row_length", "row_dimensions"])
def test_allgather_row_shape_mismatch_names_the_shapes(mpi_world, rank_0_shape, expected):
    with pytest.raises(md.MismatchError) as excinfo:
        md.allgather(np.ones((2, 3) if mpi_world.rank else rank_0_shape))
    message = str(excinfo.value)
    assert expected in message, message


def test_describe_mismatch_survives_values_that_are_no_signature():
    table = np.zeros((2, len(callcheck.SIGNATURE_FIELDS)), dtype=np.int64)
    table[1, 0] = 99  # not a collective: some other MPI message crossed the check
    assert "ranks [1] have an unknown value 99" in callcheck.describe_mismatch(table)
    table[1, callcheck.SIGNATURE_FIELDS.index("row shape")] = 12345
    assert "12345" not in callcheck.describe_mismatch(table)


# ---- different collectives: only the fields they share ---------------------------------------------

@pytest.mark.mpi(ranks=[2, 3])
def test_allreduce_against_broadcast_names_no_field_broadcast_lacks(mpi_ranks, mpi_world):
    # A broadcast has no algorithm (nor op): the all-reduce's "mpi" is no difference to name.
    with pytest.raises(md.MismatchError) as excinfo:
        if mpi_world.rank == 0:
            md.allreduce(np.ones(4), algorithm="mpi")
        else:
            md.broadcast(np.ones(4))
    others = list(range(1, mpi_ranks))
    assert str(excinfo.value) == \
        f"ranks called different collectives: collective: ranks [0] have allreduce; ranks {others} have broadcast"


@pytest.mark.mpi(ranks=[2, 3])
def test_different_collectives_name_the_fields_they_share_that_differ(mpi_ranks, mpi_world):
    # Shared: count (equal), dtype and op; not the all-reduce's algorithm, nor the shapes, which
    # mean a row to reduce_scatter and the whole buffer to an all-reduce.
    with pytest.raises(md.MismatchError) as excinfo:
        if mpi_world.rank == 0:
            md.reduce_scatter(np.ones(4 * mpi_ranks), op="max")
        else:
            md.allreduce(np.ones(4 * mpi_ranks, dtype=np.float32), op="sum", algorithm="ring")
    others = list(range(1, mpi_ranks))
    assert str(excinfo.value) == (
        f"ranks called different collectives: collective: ranks [0] have reduce_scatter; ranks {others} have "
        f"allreduce | dtype: ranks [0] have float64; ranks {others} have float32 | op: ranks [0] have max; "
        f"ranks {others} have sum")


def test_every_collective_says_which_fields_it_has():
    from mpidist.collectives.common import COLLECTIVES
    assert set(callcheck.FIELDS_OF) == set(COLLECTIVES)


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


@pytest.mark.mpi(ranks=[2, 3])
def test_async_on_one_rank_and_blocking_on_another_raise_on_every_rank(mpi_ranks, monkeypatch):
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


def read_only_array():
    """[0, 1, 2, 3] in memory NumPy may not write, and the bytes it was made from."""
    data = np.arange(4.0).tobytes()
    return np.frombuffer(data), data


# On a communicator of its own: the read-only array is refused at the first allreduce_async,
# before the engine exists.
@pytest.mark.mpi(ranks=[1, 2])
@pytest.mark.parametrize("call", [
    lambda comm, read_only: comm.allreduce(read_only),
    lambda comm, read_only: comm.allreduce(np.ones(4), out=read_only),
    lambda comm, read_only: comm.allreduce_async(read_only).wait(),
], ids=["in_place", "out", "async"])
def test_read_only_arrays_are_refused_where_written(mpi_ranks, own_comm, call):
    read_only, data = read_only_array()
    with pytest.raises(md.InvalidArgumentError, match="read-only NumPy array"):
        call(own_comm, read_only)
    assert np.frombuffer(data).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert (own_comm.allreduce(np.ones(2)) == mpi_ranks).all()


@pytest.mark.mpi(ranks=[1, 2])
def test_read_only_arrays_are_read(mpi_ranks, own_comm):
    read_only, _ = read_only_array()
    assert (own_comm.allreduce(read_only, out=np.empty(4)) == mpi_ranks * read_only).all()
    assert own_comm.allgather(read_only).shape == (4 * mpi_ranks,)
    # Rank r gets block r of the sum, the first `4 % ranks` blocks one element longer.
    expected = np.array_split(mpi_ranks * np.arange(4.0), mpi_ranks)[own_comm.rank]
    np.testing.assert_array_equal(own_comm.reduce_scatter(read_only), expected)
    own_comm.broadcast(read_only, root=0) if own_comm.rank == 0 else own_comm.broadcast(np.empty(4), root=0)
    assert (own_comm.allreduce(np.ones(2)) == mpi_ranks).all()


@pytest.mark.mpi(ranks=[2])
def test_a_read_only_array_is_refused_where_broadcast_writes(mpi_ranks, own_comm):
    read_only, _ = read_only_array()
    with pytest.raises(md.InvalidArgumentError if own_comm.rank else md.MismatchError,
                       match="broadcast writes root 0's data" if own_comm.rank else "ranks .* refused"):
        own_comm.broadcast(read_only, root=0)
    assert (own_comm.allreduce(np.ones(2)) == mpi_ranks).all()


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


@pytest.mark.mpi(ranks=[2, 3])
def test_ranks_forcing_different_algorithms_raise_on_every_rank(mpi_ranks, mpi_world, monkeypatch):
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
    "bad root": (lambda comm, r: comm.broadcast(np.ones(3), root=5 if r == 0 else 0), md.InvalidArgumentError),
    "bad op": (lambda comm, r: comm.allreduce(np.ones(3), op="mean" if r == 0 else "sum"), md.InvalidArgumentError),
    "non-contiguous": (lambda comm, r: comm.allreduce(np.ones((3, 2)).T if r == 0 else np.ones(6)),
                       md.NonContiguousError),
    "allgather": (lambda comm, r: comm.allgather(np.ones((3, 2)).T if r == 0 else np.ones((2, 3))),
                  md.NonContiguousError),
    "reduce_scatter": (lambda comm, r: comm.reduce_scatter(np.ones(4), op="mean" if r == 0 else "sum"),
                       md.InvalidArgumentError),
    "async": (lambda comm, r: comm.allreduce_async(np.ones(3), op="mean" if r == 0 else "sum").wait(),
              md.InvalidArgumentError),
}


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("engine", [False, True], ids=["engine_idle", "engine_running"])
@pytest.mark.parametrize("case", ONE_RANK_REFUSES)
def test_an_argument_refused_on_one_rank_fails_the_others_at_once(mpi_ranks, own_comm, monkeypatch, engine, case):
    import time
    monkeypatch.setenv("MPIDIST_TIMEOUT", "60")
    r = own_comm.rank
    if engine:  # once the async engine runs, every collective goes through its communicator
        assert (own_comm.allreduce_async(np.ones(2)).wait() == mpi_ranks).all()
    call, error = ONE_RANK_REFUSES[case]
    start = time.monotonic()
    with pytest.raises(error if r == 0 else md.MismatchError) as excinfo:
        call(own_comm, r)
    assert time.monotonic() - start < 30, case
    if r != 0:
        assert "ranks [0] refused their arguments" in str(excinfo.value), (case, str(excinfo.value))
    assert (own_comm.allreduce(np.ones(2)) == mpi_ranks).all()  # still usable


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


@pytest.mark.mpi(ranks=[2, 3])
def test_on_one_node_the_call_check_compares_in_the_node_window_and_exchanges_only_to_name_a_difference(
        mpi_ranks, own_comm, monkeypatch):
    """Once the hierarchical all-reduce has made the node window, the ranks' signatures are compared
    there (each field's minimum and maximum); the MPI exchange of every signature runs only when
    they differ, to name the difference, and a rank that never comes ends the others' wait with the
    call check's own deadline."""
    exchanges = []
    exchange = callcheck.exchange_signatures
    monkeypatch.setattr(callcheck, "exchange_signatures", lambda mpi, fields: exchanges.append(fields) or
                        exchange(mpi, fields))
    own_comm.allreduce(np.ones(4), algorithm="hierarchical")  # makes the window
    assert own_comm.node_window is not None and own_comm.num_nodes == 1
    before = len(exchanges)
    for call in (lambda: own_comm.allreduce(np.ones(5)), lambda: own_comm.broadcast(np.ones(3)),
                 lambda: own_comm.allgather(np.ones((2, 2))), own_comm.barrier):
        call()
    assert len(exchanges) == before, "signatures that agree were exchanged through MPI"
    # Fields of every size: a row shape's code, a negative "not applicable", a large count.
    assert (own_comm.allreduce(np.ones(70000, dtype=np.int8)) == mpi_ranks).all()
    with pytest.raises(md.MismatchError, match=r"count: ranks \[0\] have 3; ranks \[1(, 2)?\] have 4"):
        own_comm.allreduce(np.ones(3 + min(own_comm.rank, 1)))
    assert len(exchanges) == before + 1
    monkeypatch.setenv("MPIDIST_TIMEOUT", "1")
    if own_comm.rank == 0:  # it waits in its call check for the others, which never come
        with pytest.raises(md.DeadlineError, match=r"rank 0: the barrier call check did not complete within 1 s"):
            own_comm.barrier()
    own_comm.mpi.Barrier()  # rank 0 gave up; the window's rounds now differ: the communicator is done
