"""hvd's operations meet by name, as Horovod's (mpidist/torch/negotiation.py): ranks that submit
the same named operations in different orders, or between other operations, get the results of
the ordered calls (references from every rank's input in float64 NumPy); fused or not; a
DistributedOptimizer whose gradient hooks fire in a different order on each rank trains as one
process does; a name still in flight is refused on its rank alone; differing arguments, a name
some rank never submits, and join()."""
import gc
import math
import time

import numpy as np
import pytest
import torch
from tolerances import assert_exact, assert_reduced

import mpidist as md
import mpidist.torch as hvd
from mpidist.torch import negotiation

pytestmark = pytest.mark.mpi_shared_launch

SIGNAL_TAG = 0x4E47  # rank 0's point-to-point "go on" to the other ranks
SIGNAL_WAIT_S = 60  # a waiting rank gives up on that message after this long, instead of hanging


def values(rank, shape, seed):
    """Rank `rank`'s input, as float64 NumPy: any rank can rebuild every other rank's."""
    return np.random.default_rng(1000 * seed + rank).standard_normal(shape)


def wait_for_rank_0(world):
    """The other ranks' bounded wait for rank 0's signal: a failure, never a hang."""
    request = world.Irecv(np.empty(1, dtype=np.int64), source=0, tag=SIGNAL_TAG)
    deadline = time.monotonic() + SIGNAL_WAIT_S
    while not request.Test():
        if time.monotonic() > deadline:
            request.Cancel()
            pytest.fail(f"rank 0's signal did not come within {SIGNAL_WAIT_S} s")
        time.sleep(0.001)


def signal_the_others(world):
    for peer in range(1, world.Get_size()):
        world.Send(np.zeros(1, dtype=np.int64), dest=peer, tag=SIGNAL_TAG)


@pytest.mark.mpi(ranks=[2, 3])
def test_a_named_allreduce_and_a_barrier_in_different_orders_both_complete(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tensor = torch.from_numpy(values(rank, (5,), seed=1))
    if rank == 0:
        handle = hvd.allreduce_async(tensor, name="x", op=hvd.Sum)
        hvd.barrier()
    else:
        hvd.barrier()
        handle = hvd.allreduce_async(tensor, name="x", op=hvd.Sum)
    assert_reduced(hvd.synchronize(handle), [values(k, (5,), seed=1) for k in range(size)], "sum")


def start_named(kind, index, rank, size):
    """(name, handle, reference) of named operation `index` of `kind` on rank `rank`."""
    name = f"{kind}.{index}"
    shape = (index % 3 + 1, 2)
    if kind == "allreduce":
        tensor = torch.from_numpy(values(rank, shape, seed=index)).float()
        inputs = [values(k, shape, seed=index) for k in range(size)]
        return name, hvd.allreduce_async(tensor, name=name), ("avg", inputs)
    if kind == "broadcast":
        tensor = torch.from_numpy(values(rank, shape, seed=index))
        root = index % size
        return name, hvd.broadcast_async(tensor, root_rank=root, name=name), ("exact", values(root, shape, seed=index))
    rows = (rank + index) % 3 + 1  # allgather: rows differ by rank
    tensor = torch.from_numpy(values(rank, (rows, 2), seed=index))
    gathered = np.concatenate([values(k, ((k + index) % 3 + 1, 2), seed=index) for k in range(size)])
    return name, hvd.allgather_async(tensor, name=name), ("exact", gathered)


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("threshold", ["0", "64", "67108864"])  # no fusion, a few tensors at a time, all
def test_named_operations_submitted_in_shuffled_orders_give_the_ordered_results(mpi_world, monkeypatch, threshold):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", threshold)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    operations = [(kind, index) for index in range(12) for kind in ("allreduce", "broadcast", "allgather")]
    for seed in range(3):
        order = np.random.default_rng(seed * 100 + rank).permutation(len(operations))
        started = [start_named(*operations[k], rank, size) for k in order]
        # Synchronized in yet another order: each waits for its own operation only.
        for name, handle, (check, expected) in reversed(started):
            result = hvd.synchronize(handle)
            if check == "avg":
                assert_reduced(result, expected, "avg", dtype=torch.float32)
            else:
                assert_exact(result, torch.from_numpy(expected))


class TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 3)
        self.second = torch.nn.Linear(4, 3)
        self.rarely = torch.nn.Linear(4, 3)

    def forward(self, x, rank, step):
        # The branch made last is reached first by autograd: each rank's hooks fire in its own
        # order, and `rarely` takes part on some steps of some ranks only (no gradient there).
        branches = [self.first, self.second] if rank % 2 else [self.second, self.first]
        if (rank + step) % 2:
            branches.append(self.rarely)
        return sum(branch(x) for branch in branches).square().mean()


def training_data(rank, step):
    return torch.from_numpy(values(rank, (6, 4), seed=50 + step)).float()


@pytest.mark.mpi(ranks=[2, 3])
def test_distributed_optimizer_with_hooks_in_different_orders_trains_as_one_process(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(7)
    model, reference = TwoBranches(), TwoBranches()
    reference.load_state_dict(model.state_dict())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), groups=[[model.first.weight],
                                                                                            [model.second.weight]])
    one_process = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        optimizer.zero_grad()
        model(training_data(rank, step), rank, step).backward()
        optimizer.step()
        # One process: the average over the ranks of each rank's gradient (zero where unused).
        one_process.zero_grad()
        for k in range(size):
            (reference(training_data(k, step), k, step) / size).backward()
        one_process.step()
    for (name, trained), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(trained, expected, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.mpi(ranks=[2, 3])
def test_a_name_in_flight_is_refused_on_its_rank_alone_and_the_first_completes(mpi_world):
    from mpi4py import MPI
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tensor = torch.full((3,), float(rank + 1))
    if rank == 0:
        handle = hvd.allreduce_async(tensor, name="twice", op=hvd.Sum)
        # Refused at once, while the other ranks wait for the signal below.
        with pytest.raises(ValueError, match="'twice' is that of an asynchronous operation still in flight"):
            hvd.allreduce_async(tensor, name="twice", op=hvd.Sum)
        signal_the_others(MPI.COMM_WORLD)
    else:
        wait_for_rank_0(MPI.COMM_WORLD)
        handle = hvd.allreduce_async(tensor, name="twice", op=hvd.Sum)
    assert hvd.synchronize(handle).tolist() == [size * (size + 1) / 2] * 3


# ---- errors: on every rank that submitted, never a hang --------------------------------------------

@pytest.mark.mpi(ranks=[2, 3])
def test_a_name_with_different_arguments_is_refused_on_every_rank(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    dtype = torch.float64 if rank == 1 else torch.float32
    handles = [hvd.allreduce_async(torch.zeros(2, dtype=dtype), name="dtypes"),
               hvd.allreduce_async(torch.zeros(2 if rank else 4, 2), name="shapes")]
    if rank:
        handles.reverse()  # the names still meet
    messages = {"dtypes": r"'dtypes' with different arguments: dtype: ranks \[0(, 2)?\] have \"float32\"; "
                          r"ranks \[1\] have \"float64\"",
                "shapes": r"'shapes' with different arguments: count: .*shape: ranks \[0\] have \(4, 2\)"}
    for handle, name in zip(handles, ["dtypes", "shapes"] if rank == 0 else ["shapes", "dtypes"]):
        with pytest.raises(md.MismatchError, match=messages[name]):
            hvd.synchronize(handle)
    assert hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="after", op=hvd.Sum)).item() == size


@pytest.mark.mpi(ranks=[2, 3])
def test_a_name_some_rank_never_submits_ends_in_the_stall_report_and_a_deadline_error(mpi_world, monkeypatch,
                                                                                       capfd):
    from mpi4py import MPI
    monkeypatch.setenv("MPIDIST_TIMEOUT", "2")  # the report comes after 1 s, before it
    monkeypatch.setenv("MPIDIST_STALL_WARNING", "1")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if rank == 0:
        handle = hvd.allreduce_async(torch.ones(2), name="only on rank 0")
        with pytest.raises(md.DeadlineError, match=rf"'only on rank 0' was not submitted by ranks "
                                                   rf"\[{', '.join(map(str, range(1, size)))}\]"):
            hvd.synchronize(handle)
        report = capfd.readouterr().err
        assert f"in the hvd operation 'only on rank 0' (MPIDIST_STALL_WARNING); ranks {list(range(1, size))} " \
               "have not arrived" in report, report
        signal_the_others(MPI.COMM_WORLD)
    else:
        wait_for_rank_0(MPI.COMM_WORLD)
    assert hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="after", op=hvd.Sum)).item() == size


@pytest.mark.mpi(ranks=[2, 3])
def test_joined_ranks_take_part_with_zeros_in_named_allreduces_in_any_order(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if rank == 0:
        last = hvd.join()
    else:
        names = ["a", "b", "c"] if rank % 2 else ["c", "b", "a"]
        handles = {name: hvd.allreduce_async(torch.full((2,), float(rank)), name=name, op=hvd.Sum)
                   for name in names}
        for name in "abc":
            assert hvd.synchronize(handles[name]).tolist() == [float(sum(range(size)))] * 2
        last = hvd.join()
    assert last == size - 1
    # Afterwards everything runs as before the joins.
    assert hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="after join", op=hvd.Sum)).item() == size


JOINED_FUSION_ROUNDS = 6  # the ranks' submissions may straddle cycles: fusion is checked over them all
FUSED_SHAPES = [(3,), (2, 2), (5,), (1,)]  # float32 sums, one kind: fusable together


def integral(rank, shape, seed):
    """Rank `rank`'s input, whole numbers in float64: exact in every dtype used and any sum."""
    return np.random.default_rng(1000 * seed + rank).integers(-50, 50, shape).astype(np.float64)


@pytest.mark.mpi(ranks=[2, 3])
def test_joined_ranks_fill_fused_allreduces_with_zeros(mpi_world, monkeypatch):
    """Horovod's joined rank takes part in every pending all-reduce with zeros, fused or not (its
    TensorQueue::GetTensorEntriesFromResponse makes a zero tensor for each entry of a fused
    response). While one rank waits in join(), the others submit named all-reduces together, in
    orders that differ by rank: the results are those of the ordered calls with the joined rank's
    input zero (Sum: the training ranks' sum; Average: that sum over every rank, an integer one
    truncated toward zero), small ones are fused as when no rank waits (the largest all-reduce run
    is larger than any one tensor), and every rank, the joined one too, runs the same all-reduces."""
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "67108864")
    world = hvd.init()
    rank, size = hvd.rank(), hvd.size()
    private = negotiation.negotiator_of(world).private
    run_sizes = []  # the element count of each all-reduce the negotiation runs on this rank
    allreduce = private.allreduce

    def recorded(array, op="sum"):
        run_sizes.append(int(array.numel()))
        return allreduce(array, op=op)

    monkeypatch.setattr(private, "allreduce", recorded)
    gc.collect()  # no DistributedOptimizer of an earlier test is left for join() to take part for
    largest = []  # the largest all-reduce of each round
    for round_ in range(JOINED_FUSION_ROUNDS):
        joined = round_ % size
        run_sizes.clear()
        if rank != joined:
            training = [k for k in range(size) if k != joined]
            operations = [(f"f{k}.{round_}", shape, torch.float32, hvd.Sum) for k, shape in enumerate(FUSED_SHAPES)]
            operations += [(f"i.{round_}", (4,), torch.int32, hvd.Average),
                           (f"d.{round_}", (3,), torch.float64, hvd.Average)]
            if rank % 2:
                operations.reverse()
            handles = {name: hvd.allreduce_async(torch.from_numpy(integral(rank, shape, round_)).to(dtype),
                                                 name=name, op=op)
                       for name, shape, dtype, op in operations}
            for name, shape, dtype, op in operations:
                result = hvd.synchronize(handles[name])
                total = sum(integral(k, shape, round_) for k in training)  # the joined rank's zeros add nothing
                expected = total if op == hvd.Sum else total / size
                if not dtype.is_floating_point:
                    expected = np.trunc(expected)
                assert result.dtype == dtype and result.shape == shape, name
                np.testing.assert_allclose(result.double().numpy(), expected, rtol=1e-12, atol=0, err_msg=name)
        hvd.join()
        sizes_by_rank = hvd.allgather_object(list(run_sizes))
        assert sizes_by_rank == [sizes_by_rank[0]] * size, f"round {round_}: {sizes_by_rank}"
        assert sum(run_sizes) == sum(int(np.prod(shape)) for shape in FUSED_SHAPES) + 4 + 3, run_sizes
        largest.append(max(run_sizes))
    assert max(largest) > max(int(np.prod(shape)) for shape in FUSED_SHAPES), \
        f"no all-reduce was fused while a rank waited in join(): the largest of each round {largest}"


@pytest.mark.mpi(ranks=[2, 3])
def test_the_fusion_threshold_is_read_by_the_caller_and_rank_0s_decides(mpi_world, monkeypatch):
    """HOROVOD_FUSION_THRESHOLD is read where an operation is submitted, not in the negotiation's
    thread: a malformed value set while the thread cycles is the next call's InvalidArgumentError
    on every rank, and once it is unset the negotiation goes on. Where the ranks' thresholds differ
    (rank 0 fuses everything, the others nothing), rank 0's decides: every rank runs the same
    all-reduces and the results are the ordered calls'."""
    world = hvd.init()
    rank, size = hvd.rank(), hvd.size()
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "64MB")
    time.sleep(0.2)  # HOROVOD_CYCLE_TIME is 1 ms: the thread cycles meanwhile
    with pytest.raises(md.InvalidArgumentError, match="HOROVOD_FUSION_THRESHOLD='64MB' must be an integer"):
        hvd.allreduce(torch.ones(3), name="malformed threshold", op=hvd.Sum)
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "67108864" if rank == 0 else "0")
    private = negotiation.negotiator_of(world).private
    run_sizes = []
    allreduce = private.allreduce

    def recorded(array, op="sum"):
        run_sizes.append(int(array.numel()))
        return allreduce(array, op=op)

    monkeypatch.setattr(private, "allreduce", recorded)
    world.mpi.Barrier()  # every rank's threshold is set before any submits
    handles = {k: hvd.allreduce_async(torch.from_numpy(values(rank, (5,), seed=k)), name=f"t{k}", op=hvd.Sum)
               for k in range(6)}
    for k, handle in handles.items():
        expected = sum(values(r, (5,), seed=k) for r in range(size))
        np.testing.assert_allclose(hvd.synchronize(handle).numpy(), expected, rtol=1e-12, atol=1e-12)
    sizes_by_rank = hvd.allgather_object(list(run_sizes))
    assert sizes_by_rank == [sizes_by_rank[0]] * size, sizes_by_rank
    assert sum(run_sizes) == 6 * 5, run_sizes


@pytest.mark.mpi(ranks=[2, 3])
def test_an_idle_negotiation_pauses_and_a_submit_ends_the_pause(mpi_world, monkeypatch):
    """While no rank submits anything, the thread's pause grows to IDLE_PAUSE_LIMIT_S instead of
    cycling every HOROVOD_CYCLE_TIME (1 ms), so a training loop whose gradients go through the
    buckets keeps its cores: over an idle second the thread cycles at most a few dozen times, not
    hundreds. The operations submitted after that pause, on every rank, run as ever."""
    world = hvd.init()
    rank, size = hvd.rank(), hvd.size()
    negotiator = negotiation.negotiator_of(world)
    cycles = []
    exchange = negotiator._exchange

    def counted(message):
        cycles.append(time.monotonic())
        return exchange(message)

    monkeypatch.setattr(negotiator, "_exchange", counted)
    hvd.allreduce(torch.zeros(1), name="before the pause", op=hvd.Sum)
    cycles.clear()
    time.sleep(1.0)
    idle_cycles = len(cycles)
    # The pause doubles from 1 ms to the limit, then stays there.
    doublings = math.log2(negotiation.IDLE_PAUSE_LIMIT_S / 0.001)
    assert idle_cycles <= doublings + 2 / negotiation.IDLE_PAUSE_LIMIT_S, f"{idle_cycles} cycles in an idle second"
    for k in range(3):
        result = hvd.allreduce(torch.from_numpy(values(rank, (4,), seed=k)), name=f"after the pause {k}", op=hvd.Sum)
        np.testing.assert_allclose(result.numpy(), sum(values(r, (4,), seed=k) for r in range(size)),
                                   rtol=1e-12, atol=1e-12)
