"""mpidist.torch's errors against Horovod's: a name used twice while in flight, a collective the
ranks waiting in hvd.join() cannot take part in, a barrier nobody else enters, a non-tensor, a
DistributedOptimizer on a rank outside its process set, a missing optimizer state to broadcast,
step() after synchronize(), and Horovod's exception names. Each error comes on every rank that
made the call, at once: MPIDIST_TIMEOUT is set far beyond the tests' own time limit, so none of
them can pass by waiting it out (except the one that checks the deadline itself)."""
import gc
import itertools
import re
import time
import warnings

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpidist as md
import mpidist.torch as hvd
from mpidist.torch import arguments

# The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order.
pytestmark = pytest.mark.mpi_shared_launch

BEYOND_THE_TEST_TIME_LIMIT = "3600"  # seconds; pyproject.toml gives a rank 240


@pytest.fixture
def no_deadline_in_reach(monkeypatch):
    monkeypatch.setenv("MPIDIST_TIMEOUT", BEYOND_THE_TEST_TIME_LIMIT)


def prompt(error_info):
    """The error of a pytest.raises block, checked not to be the deadline's."""
    assert not isinstance(error_info.value, md.DeadlineError), error_info.value
    return str(error_info.value)


@pytest.mark.mpi(ranks=[2, 3])
def test_a_name_in_flight_is_refused_on_every_rank(mpi_world, no_deadline_in_reach):
    hvd.init()
    size = hvd.size()
    handle = hvd.allreduce_async(torch.ones(3), name="loss", op=hvd.Sum)
    for call in (lambda: hvd.allreduce_async(torch.ones(3), name="loss"),
                 lambda: hvd.allgather_async(torch.ones(3), name="loss"),
                 lambda: hvd.broadcast(torch.ones(3), root_rank=0, name="loss")):  # synchronous ones too
        with pytest.raises(ValueError, match=r"name='loss' is that of an asynchronous operation still in flight"):
            call()
    assert hvd.synchronize(handle).tolist() == [size] * 3  # the first one is untouched
    again = hvd.allreduce_async(torch.ones(3), name="loss", op=hvd.Sum)  # free once synchronized
    assert hvd.synchronize(again).tolist() == [size] * 3
    hvd.barrier()


@pytest.mark.mpi(ranks=[2, 3])
def test_a_name_reused_by_ranks_at_different_points_is_refused_where_reused(mpi_world, no_deadline_in_reach):
    """Horovod's test_horovod_allreduce_duplicate_name_error: rank 0 reuses the name before a
    barrier, the others after it. Operations meet by name, as in Horovod, so the barrier and the
    all-reduce complete on every rank, and each rank's second use of the name while its first is
    in flight is refused there alone, at once."""
    hvd.init()
    rank = hvd.rank()
    tensor = torch.ones(17)

    def first_then_twice():
        handle = hvd.allreduce_async(tensor, name="duplicate_name")
        with pytest.raises(ValueError, match="name='duplicate_name' is that of an asynchronous operation"):
            hvd.allreduce_async(tensor, name="duplicate_name")
        return handle

    if rank == 0:
        handle = first_then_twice()
    hvd.barrier()
    if rank > 0:
        handle = first_then_twice()
    assert hvd.synchronize(handle).tolist() == [1.0] * 17
    hvd.barrier()


@pytest.mark.mpi(ranks=[2, 3])
def test_non_tensors_are_a_type_error_on_every_rank(mpi_world, no_deadline_in_reach):
    hvd.init()
    rank = hvd.rank()
    calls = {"broadcast": lambda t: hvd.broadcast(t, root_rank=0), "allreduce": hvd.allreduce,
             "allreduce_async": lambda t: hvd.synchronize(hvd.allreduce_async(t)), "allgather": hvd.allgather,
             "alltoall": hvd.alltoall,
             "grouped_allreduce": lambda t: hvd.grouped_allreduce([torch.ones(2), t])}
    for name, call in calls.items():
        # A group holding a non-tensor is an InvalidArgumentError (a ValueError), as before.
        refusal, message = ((md.InvalidArgumentError, "a non-empty list of tensors, got ['Tensor', 'NoneType']")
                            if name.startswith("grouped") else (TypeError, "a torch tensor, got NoneType"))
        with pytest.raises(refusal, match=rf"^hvd.{name} takes {re.escape(message)}"):
            call(None)
        # One rank's None: it raises its own error, the others a MismatchError naming it.
        with pytest.raises((refusal, md.MismatchError)) as error:
            call(None if rank == 1 else torch.ones(6))  # 6 rows: alltoall splits them over 2 or 3 ranks
        if rank == 1:
            assert isinstance(error.value, refusal) and not isinstance(error.value, md.MismatchError)
        else:
            assert "ranks [1] refused their arguments" in prompt(error)
    hvd.barrier()


@pytest.mark.mpi(ranks=[2, 3])
def test_a_barrier_nobody_else_enters_ends_at_the_deadline(mpi_world, monkeypatch):
    monkeypatch.setenv("MPIDIST_TIMEOUT", "1")
    comm = md.Communicator(MPI.COMM_WORLD)  # its own: left behind by a rank, it is ours to mend
    try:
        others = re.escape(str(list(range(1, comm.size))))
        if comm.rank == 0:
            with pytest.raises(md.DeadlineError, match=rf"barrier call check did not complete .* ranks {others}"):
                comm.barrier()
        MPI.COMM_WORLD.Barrier()
        monkeypatch.setenv("MPIDIST_TIMEOUT", BEYOND_THE_TEST_TIME_LIMIT)
        if comm.rank > 0:
            comm.barrier()  # the late ranks complete the one rank 0 left
        MPI.COMM_WORLD.Barrier()
        comm.barrier()
    finally:
        comm.free()


@pytest.mark.mpi(ranks=[2, 3])
def test_collectives_with_join_fail_at_once_on_the_ranks_that_call_them(mpi_world, no_deadline_in_reach):
    """Horovod's test_horovod_join_allgather and _broadcast (and a barrier): while one rank waits
    in join(), the others' allgather raises there at once, naming it; the joined rank waits on
    until they join too, and join() returns the same rank everywhere."""
    hvd.init()
    gc.collect()  # no DistributedOptimizer of an earlier test is left for join() to take part for
    rank, size = hvd.rank(), hvd.size()
    calls = {"allgather": lambda: hvd.allgather(torch.ones(2, 3)),
             "broadcast": lambda: hvd.broadcast(torch.ones(2), root_rank=rank, name="test_horovod_join_broadcast"),
             "barrier": hvd.barrier}
    for first_to_join in range(size):
        for name, call in calls.items():
            if rank != first_to_join:
                with pytest.raises(hvd.HorovodInternalError) as error:
                    call()
                assert prompt(error).startswith(f"{name} is not supported with join: ranks [{first_to_join}] have run "
                                                "out of data and wait in join()")
            last = hvd.join()
            assert hvd.allgather_object(last) == [last] * size


@pytest.mark.mpi(ranks=[2, 3])
def test_joined_rank_takes_part_in_async_allreduces_with_zeros(mpi_world, no_deadline_in_reach):
    """Horovod's test_horovod_join_allreduce: while one rank waits in join(), the others'
    allreduce_async + synchronize of a fused pair (average=True, integer and float dtypes, with
    and without the names already used) average over every rank, the joined one adding zeros;
    join() returns the rank that joined last, never the first, the same on every rank."""
    hvd.init()
    gc.collect()  # no DistributedOptimizer of an earlier test is left for join() to take part for
    rank, size = hvd.rank(), hvd.size()
    for dtype, first_to_join, caching in itertools.product((torch.int32, torch.int64, torch.float32, torch.float64),
                                                           range(size), (False, True)):
        generator = torch.Generator().manual_seed(1234)  # the same tensors on every rank, as Horovod's test
        tensor_a = torch.randint(-100, 100, (5, 5), generator=generator).to(dtype)
        tensor_b = torch.randint(-100, 100, (17, 17), generator=generator).to(dtype)

        def averaged_pair():
            handles = [hvd.allreduce_async(tensor_a, name="tensor_a", average=True),
                       hvd.allreduce_async(tensor_b, name="tensor_b", average=True)]
            return [hvd.synchronize(handle) for handle in handles]

        if caching:
            averaged_pair()
        if rank != first_to_join:
            for averaged, tensor in zip(averaged_pair(), (tensor_a, tensor_b)):
                # Horovod: the sum of the size - 1 training ranks' tensors over size; an integer
                # quotient truncated toward zero (ScaleBuffer's conversion)
                expected = tensor.double() * (size - 1) / size
                expected = expected.trunc() if not dtype.is_floating_point else expected
                assert averaged.dtype == dtype
                assert torch.equal(averaged.double(), expected) if not dtype.is_floating_point \
                    else torch.allclose(averaged.double(), expected, rtol=1e-6, atol=0)
        last = hvd.join()
        assert last != first_to_join
        assert hvd.allgather_object(last) == [last] * size


@pytest.mark.mpi(ranks=[2, 3])
def test_distributed_optimizer_outside_its_process_set_steps_alone(mpi_world, no_deadline_in_reach):
    """As in Horovod (test_optimizer_process_sets): every rank builds the optimizer; the set's
    ranks average their gradients, a rank outside it steps on its own."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    members = list(range(size - 1))
    process_set = hvd.add_process_set(members)

    def model_and_data(k):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2).double()
        data = torch.randn(4, 3, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
        return model, data

    def reference(ranks):
        """Float64 SGD on the average of `ranks`' gradients, in one process."""
        models = [model_and_data(k) for k in ranks]
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m, _ in models]
        for _ in range(2):
            for (model, data), optimizer in zip(models, optimizers):
                optimizer.zero_grad()
                model(data).pow(2).sum().backward()
            for params in zip(*(m.parameters() for m, _ in models)):
                average = sum(p.grad for p in params) / len(params)
                for p in params:
                    p.grad = average.clone()
            for optimizer in optimizers:
                optimizer.step()
        return list(models[0][0].parameters())

    model, data = model_and_data(rank)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters(), process_set=process_set)
    for _ in range(2):
        optimizer.zero_grad()
        model(data).pow(2).sum().backward()
        optimizer.step()
    expected = reference(members if rank in members else [rank])
    for param, value in zip(model.parameters(), expected):
        torch.testing.assert_close(param.detach(), value.detach())
    del optimizer
    hvd.remove_process_set(process_set)


@pytest.mark.mpi(ranks=[2, 3])
def test_step_after_synchronize_warns_as_in_horovod(mpi_world, no_deadline_in_reach):
    hvd.init()
    model = torch.nn.Linear(3, 2)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def backward():
        model.zero_grad()
        model(torch.ones(1, 3)).sum().backward()

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        backward()
        optimizer.step()  # synchronizes itself: no warning
        backward()
        optimizer.synchronize()
        with optimizer.skip_synchronize():
            optimizer.step()  # the documented pattern: no warning
    backward()
    optimizer.synchronize()
    with pytest.warns(UserWarning, match=r"^optimizer.step\(\) called without optimizer.skip_synchronize\(\)"):
        optimizer.step()
    del optimizer


def adam_state(optimizer):
    """{parameter index: {name: value}} of the optimizer's state (tensors cloned)."""
    return {index: {name: value.clone() if torch.is_tensor(value) else value for name, value in entries.items()}
            for index, entries in optimizer.state_dict()["state"].items()}


@pytest.mark.mpi(ranks=[2, 3])
def test_broadcast_optimizer_state_makes_a_missing_state(mpi_world, no_deadline_in_reach):
    """As Horovod: a rank whose optimizer has no state yet makes it with a zero-gradient step of
    the wrapped optimizer (here the parameters and gradients are then put back as they were,
    weight decay notwithstanding), then takes the root's."""
    hvd.init()
    rank = hvd.rank()

    def fresh(distributed):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        adam = torch.optim.Adam(model.parameters(), lr=0.1, weight_decay=0.5)
        return model, hvd.DistributedOptimizer(adam, named_parameters=model.named_parameters()) if distributed else adam

    def equal_states(mine, expected):
        assert sorted(mine) == sorted(expected) == [0, 1]
        for index in expected:
            assert sorted(mine[index]) == sorted(expected[index]) == ["exp_avg", "exp_avg_sq", "step"]
            for name, value in expected[index].items():
                torch.testing.assert_close(mine[index][name], value, rtol=0, atol=0)

    # No rank has a state: each makes the one of a zero-gradient step of torch's own Adam.
    reference_model, reference = fresh(distributed=False)
    for param in reference_model.parameters():
        param.grad = torch.zeros_like(param)
    reference.step()
    model, optimizer = fresh(distributed=True)
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    equal_states(adam_state(optimizer), adam_state(reference))
    assert adam_state(reference)[0]["exp_avg"].abs().sum() > 0  # weight decay moved the reference
    for param, value in zip(model.parameters(), before):
        assert torch.equal(param.detach(), value)  # but not these
        assert torch.equal(param.grad, torch.zeros_like(param))  # Horovod leaves the zero gradients
    del optimizer

    # The root has a state (a checkpoint's), the others none: they get the root's.
    checkpoint_model, checkpoint = fresh(distributed=False)
    checkpoint_model(torch.arange(3.0)[None]).sum().backward()
    checkpoint.step()
    model, optimizer = fresh(distributed=True)
    if rank == 0:
        optimizer.load_state_dict(checkpoint.state_dict())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    equal_states(adam_state(optimizer), adam_state(checkpoint))
    del optimizer


@pytest.mark.mpi(ranks=[2, 3])
def test_a_collective_failing_across_ranks_is_a_horovod_internal_error(mpi_world, no_deadline_in_reach):
    hvd.init()
    rank = hvd.rank()
    with pytest.raises(hvd.HorovodInternalError) as error:
        hvd.allreduce(torch.ones(2 + rank))  # the ranks' counts differ
    assert "count" in prompt(error)
    assert hvd.HorovodInternalError is md.MismatchError and issubclass(md.DeadlineError, hvd.HorovodInternalError)
    interrupt = hvd.HostsUpdatedInterrupt(skip_sync=True)
    assert isinstance(interrupt, RuntimeError) and interrupt.skip_sync
    assert issubclass(hvd.HorovodVersionMismatchError, ImportError)
    assert {"HorovodInternalError", "HostsUpdatedInterrupt", "HorovodVersionMismatchError"} <= set(hvd.__all__)


@pytest.mark.mpi(ranks=[2, 3])
def test_a_process_set_one_rank_refuses_is_refused_on_every_rank_in_its_words(mpi_world, no_deadline_in_reach):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    def refused_everywhere(call, error=md.InvalidArgumentError):
        """The message of `call`'s error, checked to be the same on every rank."""
        with pytest.raises(error) as raised:
            call()
        message = prompt(raised)
        assert MPI.COMM_WORLD.allgather(message) == [message] * size
        return message

    # Rank 1 names a rank outside the world; the others give a good set.
    message = refused_everywhere(lambda: hvd.add_process_set([0, size] if rank == 1 else [0, 1]))
    assert message == (f"registering a ProcessSet failed: rank 1: ProcessSet ranks [0, {size}] must be distinct ranks "
                       f"of 0..{size - 1}, at least one")
    # Rank 0 gives a list ProcessSet() refuses: its ValueError, in its words, on every rank.
    message = refused_everywhere(lambda: hvd.add_process_set(["0", 1] if rank == 0 else [0, 1]))
    assert message == ("registering a ProcessSet failed: rank 0: ValueError: ProcessSet takes a list of process "
                       "ranks or an mpi4py communicator, got ['0', 1]")
    # Registration goes on, ids in order, and the sets work.
    pair = hvd.add_process_set([0, 1])
    if rank < 2:
        assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=pair).item() == 2.0
    # The last rank passes that set again, the others a new one: every rank names the last rank.
    message = refused_everywhere(lambda: hvd.add_process_set(pair if rank == size - 1 else hvd.ProcessSet([0, 1])))
    assert message == f"registering a ProcessSet failed: rank {size - 1}: {pair} is registered already"
    # Sets the ranks disagree on (each valid on its own): the same MismatchError on every rank.
    message = refused_everywhere(lambda: hvd.add_process_set([0] if rank == 0 else [0, 1]),
                                 md.MismatchError)
    assert message.startswith("ranks registered different process sets at the same point")
    again = hvd.add_process_set([0, size - 1])
    assert again.process_set_id == pair.process_set_id + 1
    assert hvd.remove_process_set(pair) and hvd.remove_process_set(again)
    hvd.barrier()


GROUPED_ALLREDUCES = {
    "grouped_allreduce": lambda tensors, name: hvd.grouped_allreduce(tensors, name=name, op=hvd.Sum),
    "grouped_allreduce_": lambda tensors, name: hvd.grouped_allreduce_(tensors, name=name, op=hvd.Sum),
    "grouped_allreduce_async": lambda tensors, name: hvd.synchronize(
        hvd.grouped_allreduce_async(tensors, name=name, op=hvd.Sum)),
    "grouped_allreduce_async_": lambda tensors, name: hvd.synchronize(
        hvd.grouped_allreduce_async_(tensors, name=name, op=hvd.Sum)),
}


@pytest.mark.mpi(ranks=[2, 3])
def test_a_grouped_allreduce_one_rank_refuses_is_refused_on_every_rank(mpi_world, monkeypatch):
    """A group of two kinds (float32, float64), which the ranks negotiate as two operations, named
    or not: rank 1 gives a non-tensor or a dtype the reductions do not take. It raises its own
    error; the others a MismatchError naming it, at once (a rank left waiting for rank 1 would
    raise the DeadlineError of the low MPIDIST_TIMEOUT, which prompt() fails on). Then the same
    group and an unnamed all-reduce still meet on every rank."""
    monkeypatch.setenv("MPIDIST_TIMEOUT", "30")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    group = [torch.ones(2), torch.ones(3, dtype=torch.float64), torch.ones(4)]
    refusals = {  # what rank 1 puts in place of the last tensor, and the error it raises
        "non-tensor": (5, md.InvalidArgumentError, "takes a non-empty list of tensors, got ['Tensor', 'Tensor', 'int']"),
        "complex": (torch.ones(4, dtype=torch.complex64), md.UnsupportedDtypeError, "not torch.complex64"),
    }
    for operation, call in GROUPED_ALLREDUCES.items():
        for refusal, (replacement, error_class, words) in refusals.items():
            for name in ("g", None):
                tensors = [tensor.clone() for tensor in group]
                if rank == 1:
                    tensors[-1] = replacement
                with pytest.raises((error_class, md.MismatchError)) as error:
                    call(tensors, name)
                case = f"{operation}, {refusal}, name={name!r}"
                if rank == 1:
                    assert type(error.value) is error_class and words in str(error.value), case
                else:
                    assert type(error.value) is md.MismatchError, case
                    assert "ranks [1] refused their arguments" in prompt(error), case
                reduced = call([tensor.clone() for tensor in group], name)
                assert [tensor.tolist() for tensor in reduced] == [[size] * 2, [size] * 3, [size] * 4], case
                assert hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum).item() == sum(range(size)), case
    hvd.barrier()


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("refusals_apart", [False, True], ids=["refusals_together", "refusals_apart"])
def test_a_grouped_allgather_or_reducescatter_one_rank_refuses_is_refused_on_every_rank(mpi_world, monkeypatch,
                                                                                         refusals_apart):
    """Their asynchronous forms negotiate a member per tensor: rank 1's non-tensor is refused
    under each member's name, so no rank waits for it (the low MPIDIST_TIMEOUT's DeadlineError
    would fail prompt()). Then the same group and an unnamed all-reduce still meet. With
    `refusals_apart` rank 1's refusals reach the others in cycles apart: a group's error comes once
    every member has ended, so the same name used again meets only the new call's members."""
    monkeypatch.setenv("MPIDIST_TIMEOUT", "30")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if refusals_apart and rank == 1:
        share_refusal = arguments.share_refusal

        def one_cycle_apart(*args, **kwargs):
            share_refusal(*args, **kwargs)
            time.sleep(0.1)  # a hundred cycles
        monkeypatch.setattr(arguments, "share_refusal", one_cycle_apart)
    group = [torch.ones(size, 2), torch.ones(size, dtype=torch.float64)]
    calls = {"grouped_allgather_async": lambda tensors, name: hvd.grouped_allgather_async(tensors, name=name),
             "grouped_reducescatter_async": lambda tensors, name: hvd.grouped_reducescatter_async(
                 tensors, name=name, op=hvd.Sum)}
    expected = {"grouped_allgather_async": [[[1.0, 1.0]] * size * size, [1.0] * size * size],
                "grouped_reducescatter_async": [[[float(size)] * 2], [float(size)]]}
    for operation, call in calls.items():
        for name in ("g", None):
            case = f"{operation}, name={name!r}"
            with pytest.raises((md.InvalidArgumentError, md.MismatchError)) as error:
                hvd.synchronize(call(group[:1] + [5] if rank == 1 else group, name))
            if rank == 1:
                assert type(error.value) is md.InvalidArgumentError, case
                assert "takes a non-empty list of tensors, got ['Tensor', 'int']" in str(error.value), case
            else:
                assert type(error.value) is md.MismatchError, case
                assert "ranks [1] refused their arguments" in prompt(error), case
            results = hvd.synchronize(call(group, name))
            assert [result.tolist() for result in results] == expected[operation], case
            assert hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum).item() == sum(range(size)), case
    hvd.barrier()


ALLREDUCES = {
    "allreduce": lambda tensor, name: hvd.allreduce(tensor, name=name, op=hvd.Sum),
    "allreduce_": lambda tensor, name: hvd.allreduce_(tensor, name=name, op=hvd.Sum),
    "allreduce_async": lambda tensor, name: hvd.synchronize(hvd.allreduce_async(tensor, name=name, op=hvd.Sum)),
    "allreduce_async_": lambda tensor, name: hvd.synchronize(hvd.allreduce_async_(tensor, name=name, op=hvd.Sum)),
}


@pytest.mark.mpi(ranks=[2, 3])
def test_an_allreduce_one_rank_refuses_is_refused_on_every_rank(mpi_world, monkeypatch):
    """Named or not, synchronous (the autograd form too) or not: rank 1 gives a non-tensor or a
    dtype the reductions do not take. It raises its own error; the others a MismatchError naming
    it, at once (a rank left waiting for rank 1 would raise the DeadlineError of the low
    MPIDIST_TIMEOUT, which prompt() fails on). Then the same name and an unnamed all-reduce still
    meet on every rank."""
    monkeypatch.setenv("MPIDIST_TIMEOUT", "30")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    refusals = {  # what rank 1 passes, and the error it raises
        "non-tensor": (None, TypeError, "takes a torch tensor, got NoneType"),
        "complex": (torch.ones(3, dtype=torch.complex64), md.UnsupportedDtypeError, "not torch.complex64"),
    }
    for operation, call in ALLREDUCES.items():
        for refusal, (replacement, error_class, words) in refusals.items():
            for name in ("x", None):
                case = f"{operation}, {refusal}, name={name!r}"
                with pytest.raises((error_class, md.MismatchError)) as error:
                    call(replacement if rank == 1 else torch.ones(3), name)
                if rank == 1:
                    assert isinstance(error.value, error_class), case
                    assert not isinstance(error.value, md.MismatchError) and words in str(error.value), case
                else:
                    assert type(error.value) is md.MismatchError, case
                    assert "ranks [1] refused their arguments" in prompt(error), case
                assert call(torch.ones(3), name).tolist() == [size] * 3, case
                assert hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum).item() == sum(range(size)), case
    hvd.barrier()


@pytest.mark.mpi(ranks=[2, 3])
def test_a_named_allreduce_meets_by_name_and_differentiates(mpi_world, no_deadline_in_reach):
    """hvd.allreduce(t, name=...) meets the others' call of that name, whatever unnamed operation
    a rank submitted before it: rank 0 starts an unnamed asynchronous all-reduce first, the others
    after their named one. Its gradient is the same reduction of every rank's output gradient:
    checked against the float64 gradient of the sum of the ranks' losses."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if rank == 0:
        pending = hvd.allreduce_async(torch.full((3,), 2.0), op=hvd.Sum)
    named = hvd.allreduce(torch.tensor([1.0, float(rank)]), name="b", op=hvd.Sum)
    if rank > 0:
        pending = hvd.allreduce_async(torch.full((3,), 2.0), op=hvd.Sum)
    assert named.tolist() == [size, sum(range(size))]
    assert hvd.synchronize(pending).tolist() == [2.0 * size] * 3

    weights = [np.arange(4.0) + 10 * r for r in range(size)]  # rank r's loss: weights[r] . output
    cases = itertools.product(((hvd.Sum, sum), (hvd.Average, lambda ws: sum(ws) / size)), ((1.0, 1.0), (0.5, 3.0)))
    for index, ((op, reduce), (prescale, postscale)) in enumerate(cases):
        source = torch.arange(4.0, dtype=torch.float64).add(rank).requires_grad_()
        output = hvd.allreduce(source, name=f"w{index}", op=op, prescale_factor=prescale,
                               postscale_factor=postscale)
        inputs = [np.arange(4.0) + r for r in range(size)]
        expected = reduce([prescale * x for x in inputs]) * postscale
        np.testing.assert_allclose(output.detach().numpy(), expected, rtol=1e-12)
        (output * torch.from_numpy(weights[rank])).sum().backward()
        # d(sum over r' of weights[r'] . output) / d source = the same reduction of the weights
        np.testing.assert_allclose(source.grad.numpy(), reduce([prescale * w for w in weights]) * postscale,
                                   rtol=1e-12)
    hvd.barrier()


def refused_everywhere(call, error):
    """The message of `call`'s error, checked to be the same on every rank and not the deadline's."""
    with pytest.raises(error) as raised:
        call()
    message = prompt(raised)
    assert MPI.COMM_WORLD.allgather(message) == [message] * MPI.COMM_WORLD.Get_size()
    return message


GROUPED_ALLREDUCES_WITH_OP = {
    "grouped_allreduce": lambda tensors, op: hvd.grouped_allreduce(tensors, name="g", op=op),
    "grouped_allreduce_": lambda tensors, op: hvd.grouped_allreduce_(tensors, op=op),
    "grouped_allreduce_async": lambda tensors, op: hvd.synchronize(hvd.grouped_allreduce_async(tensors, op=op)),
    "grouped_allreduce_async_": lambda tensors, op: hvd.synchronize(
        hvd.grouped_allreduce_async_(tensors, name="g", op=op)),
}


@pytest.mark.mpi(ranks=[2, 3])
def test_adasum_one_rank_asks_for_is_refused_on_every_rank(mpi_world, monkeypatch):
    """Rank 1 asks for Adasum where the others ask for Sum, in a group of two kinds (each
    grouped_allreduce form, named or not) and in a plain allreduce: every rank raises the same
    MismatchError naming both ops, at once (a rank left waiting for rank 1 would raise the
    DeadlineError of the low MPIDIST_TIMEOUT, which prompt() fails on). Then the group and an
    unnamed all-reduce still meet on every rank."""
    monkeypatch.setenv("MPIDIST_TIMEOUT", "30")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    others = [k for k in range(size) if k != 1]
    group = [torch.ones(2), torch.ones(3, dtype=torch.float64)]
    for operation, call in GROUPED_ALLREDUCES_WITH_OP.items():
        message = refused_everywhere(
            lambda: call([tensor.clone() for tensor in group], hvd.Adasum if rank == 1 else hvd.Sum),
            md.MismatchError)
        assert f'op: ranks {others} have "sum"; ranks [1] have "adasum"' in message, (operation, message)
        reduced = call([tensor.clone() for tensor in group], hvd.Sum)
        assert [tensor.tolist() for tensor in reduced] == [[size] * 2, [size] * 3], operation
        assert hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum).item() == sum(range(size)), operation
    for name in ("a", None):
        message = refused_everywhere(
            lambda: hvd.allreduce(torch.ones(4), name=name, op=hvd.Adasum if rank == 1 else hvd.Sum), md.MismatchError)
        assert f'op: ranks {others} have "sum"; ranks [1] have "adasum"' in message, message
        assert hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum).item() == sum(range(size))
    hvd.barrier()


@pytest.mark.mpi(ranks=[3])
def test_adasum_on_three_ranks_is_refused_on_every_rank(mpi_world, no_deadline_in_reach):
    """Adasum needs a power-of-two number of ranks: every rank raises the same error, at once."""
    hvd.init()
    message = refused_everywhere(lambda: hvd.allreduce(torch.ones(4), op=hvd.Adasum), md.InvalidArgumentError)
    assert "power-of-two number of ranks" in message
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == 3


@pytest.mark.mpi(ranks=[2, 3])
def test_init_with_process_sets_the_ranks_disagree_on_fails_on_every_rank(mpi_world, no_deadline_in_reach):
    """hvd.init(process_sets=[...]) registers the same sets in the same order on every rank: a rank
    passing one set more, or a set it registered already where the others pass a new one, or a
    list that is not of ProcessSet, gets the same error on every rank at once, and nothing is
    registered. The same list on every rank registers it; passing it again changes nothing."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    pair, first = hvd.ProcessSet([0, 1]), hvd.ProcessSet([0])
    others = list(range(1, size))
    message = refused_everywhere(lambda: hvd.init(process_sets=[pair, first] if rank == 0 else [pair]),
                                 md.MismatchError)
    assert message == ("hvd.init(process_sets=...): the ranks passed different lists of process sets (every rank "
                       f"must pass the same sets, in the same order): ranks [0]: [new, new]; ranks {others}: [new]")
    assert pair.process_set_id is None and first.process_set_id is None

    registered = hvd.add_process_set([0, 1])
    last = size - 1
    message = refused_everywhere(
        lambda: hvd.init(process_sets=[registered] if rank == last else [hvd.ProcessSet([0, 1])]), md.MismatchError)
    assert f"ranks {list(range(last))}: [new]; ranks [{last}]: [registered already as " \
           f"{registered.process_set_id}]" in message, message

    message = refused_everywhere(lambda: hvd.init(process_sets=[[0, 1]] if rank == 1 else [pair]),
                                 md.InvalidArgumentError)
    assert message == ("hvd.init(process_sets=...) failed: rank 1: hvd.init takes process_sets=None, \"dynamic\" "
                       "or a list of hvd.ProcessSet, got [[0, 1]]")
    assert pair.process_set_id is None

    hvd.init(process_sets=[pair, first])
    assert (pair.process_set_id, first.process_set_id) == (registered.process_set_id + 1,
                                                            registered.process_set_id + 2)
    hvd.init(process_sets=[pair, first])  # registered on every rank already: left as they are
    assert (pair.process_set_id, first.process_set_id) == (registered.process_set_id + 1,
                                                            registered.process_set_id + 2)
    if rank < 2:
        assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=pair).item() == 2.0
    for process_set in (registered, pair, first):
        assert hvd.remove_process_set(process_set)
    hvd.barrier()
