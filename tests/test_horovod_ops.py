"""mpidist.torch's operations against Horovod's documented results: reducescatter's gradient,
every dtype Horovod's torch ops take in each operation, integer averages and scale factors, the
cross-rank refusals (dtypes and shapes that differ, 0-d reducescatter, float splits) and the
pickled object functions. References are float64 NumPy or plain torch on every rank's data,
rebuilt in each process."""
import numpy as np
import pytest
import torch
from tolerances import assert_within

import mpidist as md
import mpidist.torch as hvd

# The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order.
pytestmark = pytest.mark.mpi_shared_launch


def values(rank, shape, seed=0):
    """Rank `rank`'s input: any rank can rebuild every other rank's, for the references."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * seed + rank), dtype=torch.float64)


def local_loss(rank, output):
    """A different non-linear loss on every rank, so that each rank's output gradient differs."""
    return ((output ** 2) * (rank + 1) + output * (rank - 0.5)).sum()


def row_counts(rows, size):
    """Horovod's split of the first dimension: the first rows % size ranks get one row more."""
    return [rows // size + (k < rows % size) for k in range(size)]


# ---- reducescatter's gradient -----------------------------------------------------------------
# Horovod's HorovodReducescatter.backward all-gathers the output gradients and scales them by the
# prescale and postscale factors, and for Sum by the process set's size: its test_torch.py expects
# size for Sum and 1 for Average from output gradients of ones. Both are size times the gradient
# of the ranks' summed losses, which plain autograd gives in one process.

def summed_loss_gradients(members, rank_of_input, shapes, op, prescale, postscale):
    """Every member's input gradients of the members' summed local losses (plain autograd)."""
    inputs = [[values(k, shape, seed).requires_grad_() for seed, shape in enumerate(shapes)] for k in members]
    losses = []
    for seed in range(len(shapes)):
        combined = sum(prescale * mine[seed] for mine in inputs) * postscale
        if op == hvd.Average:
            combined = combined / len(members)
        blocks = torch.split(combined, row_counts(shapes[seed][0], len(members)))
        losses += [local_loss(k, block) for k, block in zip(members, blocks)]
    sum(losses).backward()
    return [t.grad for t in inputs[members.index(rank_of_input)]]


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("op, prescale, postscale", [(hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0),
                                                     (hvd.Sum, 0.5, 3.0), (hvd.Average, 2.0, 0.25)],
                         ids=["sum", "average", "scaled_sum", "scaled_average"])
@pytest.mark.parametrize("grouped", [False, True], ids=["single", "grouped"])
@pytest.mark.parametrize("subset", [False, True], ids=["all_ranks", "process_set"])
def test_reducescatter_gradient_is_horovods(mpi_world, op, prescale, postscale, grouped, subset):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    members = [0, size - 1] if subset else list(range(size))
    process_set = hvd.add_process_set(members) if subset else hvd.global_process_set
    try:
        if rank in members:
            shapes = [(2 * len(members) + 1, 3), (len(members), 2)]  # the first uneven
            inputs = [values(rank, shape, seed).requires_grad_() for seed, shape in enumerate(shapes)]
            settings = dict(op=op, prescale_factor=prescale, postscale_factor=postscale, process_set=process_set)
            if grouped:
                outputs = hvd.grouped_reducescatter(inputs, **settings)
            else:
                outputs = [hvd.reducescatter(t, **settings) for t in inputs]
            sum(local_loss(rank, out) for out in outputs).backward()
            expected = summed_loss_gradients(members, rank, shapes, op, prescale, postscale)
            for mine, reference in zip(inputs, expected):
                # The members' own loss gradients, gathered and scaled: a few roundings.
                assert_within(mine.grad, len(members) * reference, roundings=4)
    finally:
        if subset:
            hvd.remove_process_set(process_set)


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("op, factor", [(hvd.Sum, "size"), (hvd.Average, 1)], ids=["sum", "average"])
def test_reducescatter_gradient_of_ones_as_horovods_test(mpi_world, op, factor):
    hvd.init()
    size = hvd.size()
    x = torch.ones(size * 4, 3, dtype=torch.float64, requires_grad=True)
    hvd.reducescatter(x, op=op).backward(torch.ones(4, 3, dtype=torch.float64))
    assert x.grad.tolist() == torch.full((size * 4, 3), float(size if factor == "size" else factor)).tolist()


# ---- dtypes x operations ----------------------------------------------------------------------
# Horovod's torch ops take uint8, int8, int16, int32, int64, float16, float32 and float64 (allreduce
# and reducescatter fewer); mpidist takes them all, and bfloat16, in every operation, and bool in
# those that only move data. Small integer values: every sum is exact in every dtype.

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64]


def small_values(rank, rows, dtype):
    """(rows, 2) values in 0..39 (a sum over 3 ranks fits int8), or alternating booleans."""
    data = (np.arange(rows * 2).reshape(rows, 2) * 7 + rank * 3) % 40
    if dtype == torch.bool:
        data = data % 2
    return data.astype(np.float64)


def as_tensor(data, dtype):
    return torch.from_numpy(data).to(dtype)


def reference_allreduce(rank, size, dtype):
    return sum(small_values(k, 3, dtype) for k in range(size))


def reference_allgather(rank, size, dtype):
    return np.concatenate([small_values(k, k + 1, dtype) for k in range(size)])


def reference_broadcast(rank, size, dtype):
    return small_values(size - 1, 3, dtype)


def reference_alltoall(rank, size, dtype):
    # Rank k sends rank r the block of rows k + r + 1 rows long, after k + j + 1 rows for each j < r.
    return np.concatenate([small_values(k, sum(k + j + 1 for j in range(size)), dtype)
                           [sum(k + j + 1 for j in range(rank)):][:k + rank + 1] for k in range(size)])


def reference_reducescatter(rank, size, dtype):
    rows = 2 * size + 1
    total = sum(small_values(k, rows, dtype) for k in range(size))
    start = sum(row_counts(rows, size)[:rank])
    return total[start:start + row_counts(rows, size)[rank]]


def run_allreduce(rank, size, dtype):
    return hvd.allreduce(as_tensor(small_values(rank, 3, dtype), dtype), op=hvd.Sum)


def run_allgather(rank, size, dtype):
    return hvd.allgather(as_tensor(small_values(rank, rank + 1, dtype), dtype))


def run_broadcast(rank, size, dtype):
    tensor = as_tensor(small_values(rank, 3, dtype), dtype)
    result = hvd.broadcast(tensor, root_rank=size - 1)
    assert hvd.broadcast_(tensor, root_rank=size - 1) is tensor and torch.equal(tensor, result)
    return result


def run_alltoall(rank, size, dtype):
    splits = [rank + j + 1 for j in range(size)]
    output, received = hvd.alltoall(as_tensor(small_values(rank, sum(splits), dtype), dtype), splits=splits)
    assert received.tolist() == [k + rank + 1 for k in range(size)]
    return output


def run_reducescatter(rank, size, dtype):
    return hvd.reducescatter(as_tensor(small_values(rank, 2 * size + 1, dtype), dtype), op=hvd.Sum)


OPERATIONS = {"allreduce": (run_allreduce, reference_allreduce), "allgather": (run_allgather, reference_allgather),
              "broadcast": (run_broadcast, reference_broadcast), "alltoall": (run_alltoall, reference_alltoall),
              "reducescatter": (run_reducescatter, reference_reducescatter)}
CASES = [(name, dtype) for name in OPERATIONS for dtype in DTYPES] + \
        [(name, torch.bool) for name in ("allgather", "broadcast", "alltoall")]


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("operation, dtype", CASES, ids=[f"{name}-{str(dtype)[6:]}" for name, dtype in CASES])
def test_every_dtype_in_every_operation(mpi_world, operation, dtype):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    run, reference = OPERATIONS[operation]
    result = run(rank, size, dtype)
    assert result.dtype == dtype
    assert np.array_equal(result.double().numpy(), reference(rank, size, dtype))


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("operation", ["allreduce", "reducescatter"])
def test_bool_reductions_are_refused(mpi_world, operation):
    # Horovod's torch ops take no bool; the moving ones here do, the reductions refuse it (on
    # every rank, before anything is sent).
    hvd.init()
    with pytest.raises(md.UnsupportedDtypeError, match="bool"):
        getattr(hvd, operation)(torch.ones(hvd.size(), dtype=torch.bool), op=hvd.Sum)
    group = [torch.ones(2), torch.ones(2, dtype=torch.bool)]
    with pytest.raises(md.UnsupportedDtypeError, match="bool"):
        getattr(hvd, f"grouped_{operation}_" if operation == "allreduce" else f"grouped_{operation}")(group)
    assert group[0].tolist() == [1.0, 1.0]  # refused before the first is sent


# ---- integer averages and scale factors ---------------------------------------------------------
# Horovod (MPI on CPU) scales an integer tensor in float64 and converts the product back with
# C++'s conversion, which truncates toward zero (ScaleBufferCPUImpl), and averages as a sum
# scaled by postscale_factor / size (operations.cc): the result keeps the tensor's dtype.

INTEGER_INPUTS = np.array([[-7, -5, -1, 0], [1, 2, 5, 7], [9, -11, 13, -17]], dtype=np.float64)


def horovod_integer_reduction(size, rank, op, prescale, postscale, rows=None):
    """Horovod's result in float64 NumPy: truncated prescale, exact sum, truncated postscale."""
    summed = sum(np.trunc((INTEGER_INPUTS + k) * prescale) for k in range(size))
    factor = postscale / size if op == hvd.Average else postscale
    result = np.trunc(summed * factor)
    if rows is None:
        return result
    start = sum(rows[:rank])
    return result[start:start + rows[rank]]


def integer_input(rank, dtype):
    return torch.from_numpy(INTEGER_INPUTS + rank).to(dtype)


INTEGER_CALLS = {
    "allreduce": lambda t, **kw: hvd.allreduce(t, **kw),
    "allreduce_": lambda t, **kw: hvd.allreduce_(t, **kw),
    "allreduce_async_": lambda t, **kw: hvd.synchronize(hvd.allreduce_async_(t, **kw)),
    "grouped_allreduce": lambda t, **kw: hvd.grouped_allreduce([t, t.clone()], **kw)[1],
    "grouped_allreduce_async": lambda t, **kw: hvd.synchronize(hvd.grouped_allreduce_async([t], **kw))[0],
    "reducescatter": lambda t, **kw: hvd.reducescatter(t, **kw),
}


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("op, prescale, postscale", [(hvd.Average, 1.0, 1.0), (hvd.Sum, 1.5, 0.7),
                                                     (hvd.Average, 0.3, 2.5)],
                         ids=["average", "scaled_sum", "scaled_average"])
@pytest.mark.parametrize("call", list(INTEGER_CALLS))
def test_integer_average_and_scaling_as_horovod(mpi_world, op, prescale, postscale, call):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    rows = row_counts(len(INTEGER_INPUTS), size) if call == "reducescatter" else None
    expected = horovod_integer_reduction(size, rank, op, prescale, postscale, rows)
    for dtype in (torch.int16, torch.int32, torch.int64):
        result = INTEGER_CALLS[call](integer_input(rank, dtype), op=op, prescale_factor=prescale,
                                     postscale_factor=postscale)
        assert result.dtype == dtype
        assert np.array_equal(result.numpy().astype(np.float64), expected), dtype


@pytest.mark.mpi(ranks=[2, 3])
def test_integer_average_truncates_toward_zero(mpi_world):
    # The rule on its own: -1 and 0 average to 0 (not -1: truncated, not floored), 1 and 2 to 1.
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    result = hvd.allreduce(torch.tensor([-1 if rank == 0 else 0, 1 if rank == 0 else 2], dtype=torch.int32))
    assert result.dtype == torch.int32
    assert result.tolist() == [int(-1 / size), int((1 + 2 * (size - 1)) / size)]


# ---- objects ----------------------------------------------------------------------------------

@pytest.mark.mpi(ranks=[2, 3])
def test_objects_travel_pickled(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    def mine(k):
        return {k: {1, k}, (k, "x"): [k, 2.5], "tensor": torch.arange(k + 1)}
    received = hvd.broadcast_object(mine(rank), root_rank=size - 1)
    assert received.keys() == mine(size - 1).keys() and received[size - 1] == {1, size - 1}
    assert torch.equal(received["tensor"], torch.arange(size))
    gathered = hvd.allgather_object(mine(rank))
    for k, obj in enumerate(gathered):
        assert obj[k] == {1, k} and obj[(k, "x")] == [k, 2.5] and torch.equal(obj["tensor"], torch.arange(k + 1))
    with pytest.raises(md.InvalidArgumentError, match=r"allgather_object: rank\(s\) \[1\] passed an object pickle"):
        hvd.allgather_object((lambda: rank) if rank == 1 else rank)  # every rank raises, none hangs


@pytest.mark.mpi(ranks=[2, 3])
def test_an_unpicklable_broadcast_object_is_refused_on_every_rank_with_the_pickling_error(mpi_world):
    hvd.init()
    rank, root = hvd.rank(), hvd.size() - 1
    with pytest.raises(md.InvalidArgumentError, match=rf"^broadcast_object: rank\(s\) \[{root}\] passed an object "
                                                      r"pickle cannot serialize: \w+: Can't pickle"):
        hvd.broadcast_object((lambda: rank) if rank == root else None, root_rank=root)


# ---- refusals on every rank ---------------------------------------------------------------------

@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("check_calls", [True, False], ids=["call_check", "no_call_check"])
def test_alltoall_of_different_dtypes_raises_on_every_rank(mpi_world, monkeypatch, check_calls):
    # int32 and float32 rows have the same bytes: without a dtype check they would be swapped raw.
    hvd.init()
    monkeypatch.setattr(mpi_world, "check_calls", check_calls)
    rank, size = hvd.rank(), hvd.size()
    tensor = torch.ones(size, 2, dtype=torch.int32 if rank == 0 else torch.float32)
    with pytest.raises(md.MismatchError, match=r"dtype.*int32.*float32"):
        hvd.alltoall(tensor)


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("splits", [lambda size: [1.0] * size, lambda size: torch.ones(size)],
                         ids=["float_list", "float_tensor"])
def test_alltoall_refuses_float_splits(mpi_world, splits):
    hvd.init()
    size = hvd.size()
    with pytest.raises(md.InvalidArgumentError, match="splits=.* must be integers"):
        hvd.alltoall(torch.ones(size, 2), splits=splits(size))
    # Integer tensors are splits as Horovod takes them.
    output, received = hvd.alltoall(torch.ones(size, 2), splits=torch.ones(size, dtype=torch.int32))
    assert output.shape == (size, 2) and received.tolist() == [1] * size


SHAPE_CALLS = {
    "allreduce": lambda t: hvd.allreduce(t),
    "allreduce_": lambda t: hvd.allreduce_(t),
    "allreduce_async": lambda t: hvd.synchronize(hvd.allreduce_async(t)),
    "grouped_allreduce": lambda t: hvd.grouped_allreduce([torch.ones(2), t]),
    "grouped_allreduce_async_": lambda t: hvd.synchronize(hvd.grouped_allreduce_async_([t, torch.ones(2)])),
}


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("call", list(SHAPE_CALLS))
def test_reductions_of_different_shapes_raise_on_every_rank(mpi_world, call):
    # Horovod's test_horovod_allreduce_error: the same element count in different shapes.
    hvd.init()
    rank = hvd.rank()
    tensor = torch.ones(17, 1311) if rank == 0 else torch.ones(17, 23, 57)
    with pytest.raises(md.MismatchError, match=r"ranks \[0\] have .*\(17, 1311\).*\(17, 23, 57\)"):
        SHAPE_CALLS[call](tensor)
    # mpidist's own all-reduce reduces flat buffers: an equal count is all it asks.
    flat = mpi_world.allreduce(np.ones((2, 3) if rank == 0 else (6,)))
    assert flat.ravel().tolist() == [float(hvd.size())] * 6


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("everyone", [True, False], ids=["every_rank", "one_rank"])
def test_reducescatter_of_a_0d_tensor_raises_on_every_rank(mpi_world, everyone):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tensor = torch.tensor(float(rank)) if everyone or rank == 0 else torch.ones(size)
    refusal = md.InvalidArgumentError if everyone or rank == 0 else md.MismatchError
    with pytest.raises(refusal, match="0-d" if refusal is md.InvalidArgumentError else "refused their arguments"):
        hvd.reducescatter(tensor, op=hvd.Average)
    if everyone:
        with pytest.raises(md.InvalidArgumentError, match="0-d"):
            hvd.grouped_reducescatter([torch.ones(size), torch.tensor(1.0)])


ASYNC_REDUCESCATTERS = {
    "reducescatter_async": lambda tensors, name: hvd.reducescatter_async(tensors[0], name=name, op=hvd.Sum),
    "grouped_reducescatter_async": lambda tensors, name: hvd.grouped_reducescatter_async(tensors, name=name,
                                                                                          op=hvd.Sum),
}


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("name", [None, "scatter"], ids=["unnamed", "named"])
@pytest.mark.parametrize("call", list(ASYNC_REDUCESCATTERS))
def test_one_ranks_0d_asynchronous_reducescatter_raises_on_every_rank_naming_it(mpi_world, monkeypatch, call, name):
    # Negotiated by name: the refusing rank raises at the call; every other rank at synchronize,
    # naming it, in each of a group's members (a member left waiting for the refusing rank would
    # end at the deadline instead); afterwards the ranks' operations, unnamed ones too, still meet.
    monkeypatch.setenv("MPIDIST_TIMEOUT", "60")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    refusing = size - 1
    tensors = [torch.ones(size, 2) for _ in range(1 if call == "reducescatter_async" else 3)]
    if rank == refusing:
        tensors[-1] = torch.tensor(1.0)
        with pytest.raises(md.InvalidArgumentError, match="0-d"):
            ASYNC_REDUCESCATTERS[call](tensors, name)
    else:
        handle = ASYNC_REDUCESCATTERS[call](tensors, name)
        refused = rf"^ranks \[{refusing}\] refused their arguments to the hvd operation"
        with pytest.raises(md.MismatchError, match=refused):
            hvd.synchronize(handle)  # which frees the name
        for member in getattr(handle.handle, "handles", [handle.handle]):
            with pytest.raises(md.MismatchError, match=refused):
                member.wait()
    for _ in range(2):
        scattered = hvd.synchronize(hvd.grouped_reducescatter_async([torch.ones(size, 2)] * 2, op=hvd.Sum))
        assert [t.tolist() for t in scattered] == [[[float(size)] * 2]] * 2
    total = hvd.synchronize(hvd.allreduce_async(torch.tensor([float(rank)]), op=hvd.Sum))
    assert total.item() == sum(range(size))
