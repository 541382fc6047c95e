"""hvd's asynchronous allgather, broadcast and reducescatter (and their in-place and grouped
forms) run in the background as allreduce_async does: results against float64 NumPy references
within the bounds of tolerances.py (data that only travels: bit for bit), poll()
False while a peer has not joined the operation, several in flight finished in any order, and
mismatched calls raising on every rank."""
import time
import typing

import numpy as np
import pytest
import torch
from tolerances import assert_exact, assert_reduced

import mpidist as md
import mpidist.torch as hvd

# The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order;
# the ones that raise on every rank come last.
pytestmark = pytest.mark.mpi_shared_launch

LATE_PEER_TAG = 0x4D50  # the point-to-point message that lets the late ranks call
LATE_PEER_WAIT_S = 60  # a late rank gives up on that message after this long, instead of hanging


def values(rank, shape, seed=0):
    """Rank `rank`'s input, as float64 NumPy: any rank can rebuild every other rank's."""
    return np.random.default_rng(100 * seed + rank).standard_normal(shape)


KINDS = {hvd.Average: "avg", hvd.Sum: "sum", hvd.Min: "min", hvd.Max: "max"}


class Reduced(typing.NamedTuple):
    """A reduction's expected result: every rank's input (prescaled), for assert_reduced."""
    inputs: list
    op: str
    postscale: float = 1.0
    scalings: int = 0


def blocks(array, size):
    """Horovod's split of the first dimension: the first rows % size ranks get one row more."""
    rows = array.shape[0]
    return np.split(array, np.cumsum([rows // size + (k < rows % size) for k in range(size)])[:-1])


# Each case: (name, start(rank, size) -> (handle, the tensors the call was given), reference(rank, size)).
# Inputs are uneven where the operation allows (rows by rank) and the scale factors are not 1.

def start_allgather(rank, size):
    tensor = torch.from_numpy(values(rank, (rank + 1, 3)))
    return hvd.allgather_async(tensor, name="gathered"), [tensor]


def expect_allgather(rank, size):
    return np.concatenate([values(k, (k + 1, 3)) for k in range(size)])


def start_broadcast(rank, size):
    tensor = torch.from_numpy(values(rank, (4, 2))).float()
    return hvd.broadcast_async(tensor, root_rank=size - 1), [tensor]


def expect_broadcast(rank, size):
    return values(size - 1, (4, 2)).astype(np.float32)


def start_broadcast_in_place(rank, size):
    tensor = torch.arange(5, dtype=torch.int64) * (rank + 1)
    return hvd.broadcast_async_(tensor, root_rank=1), []  # the tensor is the result: not the caller's to change


def expect_broadcast_in_place(rank, size):
    return np.arange(5) * 2


def start_reducescatter(rank, size):
    tensor = torch.from_numpy(values(rank, (2 * size + 1, 2)))
    return hvd.reducescatter_async(tensor, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), [tensor]


def expect_reducescatter(rank, size):
    return Reduced([blocks(values(k, (2 * size + 1, 2)) * 2.0, size)[rank] for k in range(size)], "sum",
                   postscale=0.25, scalings=2)


def start_grouped_allgather(rank, size):
    tensors = [torch.from_numpy(values(rank, (rank + 2,), seed=1)), torch.full((1, 2), rank, dtype=torch.int32)]
    return hvd.grouped_allgather_async(tensors), tensors


def expect_grouped_allgather(rank, size):
    return [np.concatenate([values(k, (k + 2,), seed=1) for k in range(size)]),
            np.repeat(np.arange(size, dtype=np.int32), 2).reshape(size, 2)]


def start_grouped_reducescatter(rank, size):
    tensors = [torch.from_numpy(values(rank, (size + 2, 3), seed=2)), torch.from_numpy(values(rank, (size,), seed=3))]
    return hvd.grouped_reducescatter_async(tensors, op=hvd.Average, postscale_factor=3.0), tensors


def expect_grouped_reducescatter(rank, size):
    return [Reduced([blocks(values(k, shape, seed), size)[rank] for k in range(size)], "avg", postscale=3.0, scalings=1)
            for shape, seed in (((size + 2, 3), 2), ((size,), 3))]


CASES = {
    "allgather_async": (start_allgather, expect_allgather),
    "broadcast_async": (start_broadcast, expect_broadcast),
    "broadcast_async_": (start_broadcast_in_place, expect_broadcast_in_place),
    "reducescatter_async": (start_reducescatter, expect_reducescatter),
    "grouped_allgather_async": (start_grouped_allgather, expect_grouped_allgather),
    "grouped_reducescatter_async": (start_grouped_reducescatter, expect_grouped_reducescatter),
}


def assert_matches(result, expected):
    if isinstance(expected, list):
        assert isinstance(result, list) and len(result) == len(expected)
        for one, other in zip(result, expected):
            assert_matches(one, other)
        return
    assert isinstance(result, torch.Tensor) and not result.requires_grad
    if isinstance(expected, Reduced):
        assert result.dtype == torch.float64
        assert_reduced(result, expected.inputs, expected.op, postscale=expected.postscale, scalings=expected.scalings)
    else:
        assert_exact(result, torch.from_numpy(np.asarray(expected)))


def wait_for_message(request):
    """A late rank's bounded wait for rank 0's signal: a failure, never a hang, if it never comes."""
    deadline = time.monotonic() + LATE_PEER_WAIT_S
    while not request.Test():
        if time.monotonic() > deadline:
            request.Cancel()
            pytest.fail(f"rank 0's signal did not come within {LATE_PEER_WAIT_S} s")
        time.sleep(0.001)


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_poll_is_false_until_a_late_peer_joins(mpi_world, case):
    """Rank 0 calls first; the other ranks call only once rank 0's message says it has polled
    (twice, the second time after giving the background thread time to run), so poll() cannot
    have seen the operation done. Rank 0 also zeroes its inputs after the call: the operation
    sends what the call was given."""
    from mpi4py import MPI
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    start, expect = CASES[case]
    world = MPI.COMM_WORLD
    if rank == 0:
        handle, inputs = start(rank, size)
        for tensor in inputs:
            tensor.zero_()
        polled = [hvd.poll(handle)]
        time.sleep(0.1)
        polled.append(hvd.poll(handle))
        signal = np.array(polled, dtype=np.int64)
        requests = [world.Isend(signal, dest=peer, tag=LATE_PEER_TAG) for peer in range(1, size)]
    else:
        signal = np.empty(2, dtype=np.int64)
        wait_for_message(world.Irecv(signal, source=0, tag=LATE_PEER_TAG))
        handle, _ = start(rank, size)
    result = hvd.synchronize(handle)
    if rank == 0:
        MPI.Request.Waitall(requests)
    assert signal.tolist() == [0, 0], "rank 0's poll() said done before the other ranks had called"
    assert hvd.poll(handle)
    assert hvd.synchronize(handle) is result  # finishes once
    assert_matches(result, expect(rank, size))


@pytest.mark.mpi(ranks=[2, 3])
def test_async_results_match_the_references(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    inputs = [torch.from_numpy(values(k, (2 * size + 1, 3), seed=4)) for k in range(size)]
    x = inputs[rank].clone()
    assert_exact(hvd.synchronize(hvd.allgather_async(x[:rank + 1])), torch.cat([t[:k + 1] for k, t in enumerate(inputs)]))
    assert_exact(hvd.synchronize(hvd.broadcast_async(x, root_rank=0)), inputs[0])
    in_place = x.clone()
    handle = hvd.broadcast_async_(in_place, root_rank=0)
    assert hvd.synchronize(handle) is in_place
    assert_exact(in_place, inputs[0])
    for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max):
        assert_reduced(hvd.synchronize(hvd.reducescatter_async(x, op=op)), [blocks(t, size)[rank] for t in inputs],
                       KINDS[op])
    assert_exact(x, inputs[rank])  # inputs untouched


def small_integers(rank, size, dtype):
    """Rank `rank`'s rows of small whole numbers (0 to 89) in `dtype`: sums of 2 or 3 ranks' wrap
    around in int8 and uint8."""
    return (torch.arange(6 * (2 * size + 1)).reshape(2 * size + 1, 6) * (rank + 3) - 7).remainder(90).to(dtype)


def horovod_reducescatter(inputs, rank, op, postscale):
    """This rank's block of Horovod's reducescatter of `inputs` (one tensor per rank): for integers
    the sum (or max) in the tensors' dtype, wrapping around as MPI's does, then scaled in float64
    and truncated toward zero (test_horovod_ops.py)."""
    size, dtype = len(inputs), inputs[0].dtype
    stacked = torch.stack([torch.from_numpy(blocks(t.to(torch.int64).numpy(), size)[rank]) for t in inputs])
    reduced = (stacked.max(0).values if op == hvd.Max else stacked.sum(0)).to(dtype)
    factor = postscale / size if op == hvd.Average else postscale
    return reduced if factor == 1 else torch.trunc(reduced.double() * factor).to(dtype)


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                                   torch.bfloat16, torch.bool])
def test_async_results_equal_the_blocking_calls_in_every_dtype(mpi_world, dtype):
    # The dtypes the collectives move as bytes (int16, bool) or reduce in another (int16), and
    # integer averages and scale factors, against references built from every rank's input.
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    inputs = [small_integers(k, size, dtype) for k in range(size)]
    x = inputs[rank]
    gathered = hvd.synchronize(hvd.allgather_async(x[:rank + 1]))
    assert_exact(gathered, torch.cat([t[:k + 1] for k, t in enumerate(inputs)]))
    assert_exact(hvd.synchronize(hvd.broadcast_async(x, root_rank=size - 1)), inputs[size - 1])
    grouped = hvd.synchronize(hvd.grouped_allgather_async([x[:rank + 1], x[:1]]))
    assert_exact(grouped[0], gathered)
    assert_exact(grouped[1], torch.cat([t[:1] for t in inputs]))
    if dtype == torch.bool:
        return  # the reductions refuse bool (test_horovod_ops.py)
    for op, scale in ((hvd.Average, 1.0), (hvd.Sum, 0.5), (hvd.Max, 1.0)):
        result = hvd.synchronize(hvd.reducescatter_async(x, op=op, postscale_factor=scale))
        grouped = hvd.synchronize(hvd.grouped_reducescatter_async([x, x[:size]], op=op, postscale_factor=scale))
        for mine, rows in ((result, inputs), (grouped[0], inputs), (grouped[1], [t[:size] for t in inputs])):
            if dtype.is_floating_point:
                assert mine.dtype == dtype
                assert_reduced(mine, [blocks(t.double().numpy(), size)[rank] for t in rows], KINDS[op],
                               postscale=scale, scalings=int(scale != 1))
            else:
                assert_exact(mine, horovod_reducescatter(rows, rank, op, scale))


@pytest.mark.mpi(ranks=[2, 3])
def test_several_in_flight_finish_in_any_synchronize_order(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    started = {name: start(rank, size)[0] for name, (start, _) in CASES.items()}
    summed = torch.full((3,), float(rank))
    started["allreduce_async_"] = hvd.allreduce_async_(summed, op=hvd.Sum)
    # A blocking call while they are in flight runs behind them, in program order.
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [size, size]
    started["late allgather_async"] = hvd.allgather_async(torch.tensor([rank] * (rank + 1)))
    order = list(started)
    np.random.default_rng(rank).shuffle(order)  # each rank its own order
    results = {name: hvd.synchronize(started[name]) for name in order}
    for name, (_, expect) in CASES.items():
        assert_matches(results[name], expect(rank, size))
    assert results["allreduce_async_"] is summed and summed.tolist() == [size * (size - 1) / 2] * 3
    assert results["late allgather_async"].tolist() == [k for k in range(size) for _ in range(k + 1)]
    assert all(hvd.poll(handle) for handle in started.values())


@pytest.mark.mpi(ranks=[2, 3])
def test_async_operations_run_on_process_sets(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    evens = hvd.add_process_set(list(range(0, size, 2)))
    try:
        if evens.included():
            members = evens.ranks
            gathered = hvd.allgather_async(torch.tensor([rank]), process_set=evens)
            root = members[-1]  # a global rank of the set
            broadcast = hvd.broadcast_async(torch.tensor([float(rank)]), root_rank=root, process_set=evens)
            scattered = hvd.reducescatter_async(torch.ones(len(members), 2), op=hvd.Sum, process_set=evens)
            assert hvd.synchronize(scattered).tolist() == [[float(len(members))] * 2]
            assert hvd.synchronize(broadcast).tolist() == [float(root)]
            assert hvd.synchronize(gathered).tolist() == members
    finally:
        hvd.remove_process_set(evens)


# ---- errors: on every rank, never a hang ---------------------------------------------------------

@pytest.mark.mpi(ranks=[2, 3])
def test_mismatched_calls_raise_at_synchronize_on_every_rank(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    mismatched = [
        (lambda: hvd.allgather_async(torch.zeros(2, 1 + min(rank, 1))), r"row shape \(shape\[1:\]\)"),
        (lambda: hvd.broadcast_async(torch.zeros(3), root_rank=min(rank, 1)), "root: ranks"),
        (lambda: hvd.reducescatter_async(torch.ones(size, 2), op=hvd.Sum if rank == 0 else hvd.Max), "op: ranks"),
        (lambda: hvd.grouped_allgather_async([torch.zeros(2), torch.zeros(1, dtype=torch.float32 if rank else
                                                                          torch.float64)]), "dtype: ranks"),
    ]
    for start, message in mismatched:
        handle = start()  # returns at once: the ranks meet in the background
        with pytest.raises(md.MismatchError, match=message):
            hvd.synchronize(handle)
    # An argument refused on one rank raises there at the call, and at synchronize on the others.
    if rank == 1:
        with pytest.raises(md.InvalidArgumentError, match=f"root={size} is not a rank"):
            hvd.broadcast_async_(torch.zeros(2), root_rank=size)
    else:
        handle = hvd.broadcast_async_(torch.zeros(2), root_rank=0)
        with pytest.raises(md.MismatchError, match=r"ranks \[1\] refused their arguments"):
            hvd.synchronize(handle)
    # Still usable afterwards.
    assert hvd.synchronize(hvd.allgather_async(torch.tensor([rank]))).tolist() == list(range(size))


@pytest.mark.mpi(ranks=[2, 3])
def test_different_unnamed_asynchronous_calls_at_the_same_place_raise_on_every_rank(mpi_world):
    # Unnamed operations meet in call order: the first unnamed one of a fresh process set is an
    # allgather on rank 0 and a broadcast on the others. The calls return at once (the process
    # set's negotiation started with it) and the mismatch is raised at synchronize().
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    everyone = hvd.add_process_set(list(range(size)))
    try:
        if rank == 0:
            handle = hvd.allgather_async(torch.zeros(2), process_set=everyone)
        else:
            handle = hvd.broadcast_async(torch.zeros(2), root_rank=0, process_set=everyone)
        with pytest.raises(md.MismatchError, match=r"collective: ranks \[0\] have \"allgather\""):
            hvd.synchronize(handle)
        handle = hvd.reducescatter_async(torch.ones(size), op=hvd.Sum, process_set=everyone)
        assert hvd.synchronize(handle).tolist() == [float(size)]
    finally:
        hvd.remove_process_set(everyone)
