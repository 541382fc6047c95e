"""mpidist.torch against Horovod's semantics: differentiable collectives (checked against plain
autograd on every rank's data in one process, float64), handles, argument rules and the names
Horovod has that mpidist offers or refuses."""
import json

import pytest
import torch
from tolerances import assert_exact, assert_reduced, assert_within

import mpidist as md
import mpidist.torch as hvd

# The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order;
# the ones that raise on every rank come last.
pytestmark = pytest.mark.mpi_shared_launch


def values(rank, shape, seed=0):
    """Rank `rank`'s input: any rank can rebuild every other rank's, for the references."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * seed + rank), dtype=torch.float64)


def local_loss(rank, output):
    """A different non-linear loss on every rank, so that each rank's output gradient differs."""
    return ((output ** 2) * (rank + 1) + output * (rank - 0.5)).sum()


KINDS = {hvd.Average: "avg", hvd.Sum: "sum", hvd.Max: "max"}


def group_inputs(rank, seed=0):
    """Tensors of three kinds (float64 twice, float32, int64), one non-contiguous."""
    a = values(rank, (2, 3), seed)
    b = values(rank, (4,), seed + 1).float()
    c = values(rank, (3, 2), seed + 2).t()  # non-contiguous
    d = torch.arange(5, dtype=torch.int64) * (rank + 1)
    return [a, b, c, d]


@pytest.mark.mpi(ranks=[1, 2, 3])
@pytest.mark.parametrize("op, prescale, postscale", [(hvd.Average, 1.0, 1.0), (hvd.Sum, 2.0, 0.5), (hvd.Max, 1.0, 1.0)],
                         ids=["average", "scaled_sum", "max"])
def test_grouped_allreduce_variants(mpi_world, op, prescale, postscale):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    everyone = [group_inputs(k) for k in range(size)]
    # The int64 tensor, as Horovod: scaled in float64 and truncated toward zero, an average as a
    # sum scaled by postscale / size (test_horovod_ops.py checks the rule itself).
    stack = torch.stack([torch.trunc(inputs[3].double() * prescale) for inputs in everyone])
    reduced = stack.max(0).values * postscale if op == hvd.Max else \
        stack.sum(0) * (postscale / size if op == hvd.Average else postscale)
    integers = torch.trunc(reduced).to(torch.int64)
    settings = dict(op=op, prescale_factor=prescale, postscale_factor=postscale)

    def check(results):
        for i, result in enumerate(results[:3]):
            assert_reduced(result, [inputs[i].double() * prescale for inputs in everyone], KINDS[op],
                           postscale=postscale, scalings=(prescale != 1) + (postscale != 1))
        assert_exact(results[3], integers)

    def inputs_of():
        return group_inputs(rank)

    inputs = inputs_of()
    results = hvd.grouped_allreduce(inputs, **settings)
    assert [r.dtype for r in results] == [t.dtype for t in inputs]
    check(results)
    for untouched, original in zip(inputs, inputs_of()):
        assert torch.equal(untouched, original)  # the out-of-place form leaves its inputs alone

    in_place = inputs_of()
    assert hvd.grouped_allreduce_(in_place, **settings) == in_place
    check(in_place)  # the non-contiguous one too

    for variant in (hvd.grouped_allreduce_async, hvd.grouped_allreduce_async_):
        tensors = inputs_of()
        handle = variant(tensors, **settings)
        results = hvd.synchronize(handle)
        assert hvd.poll(handle) and hvd.synchronize(handle) is results  # finishes once
        check(results)
        if variant is hvd.grouped_allreduce_async_:
            assert all(r is t for r, t in zip(results, tensors))


@pytest.mark.mpi(ranks=[2, 3])
def test_barrier_objects_and_process_sets(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    hvd.barrier()
    gathered = hvd.allgather_object({"rank": rank, 1: (rank, "x" * rank)})
    assert gathered == [{"rank": k, 1: (k, "x" * k)} for k in range(size)]  # pickled: keys and tuples kept
    with pytest.raises(ValueError, match=r"rank\(s\) \[0\]"):
        hvd.allgather_object((lambda: 0) if rank == 0 else [rank])  # every rank raises, none hangs
    assert hvd.is_homogeneous()
    everyone = hvd.global_process_set
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=everyone).tolist() == [size, size]
    assert hvd.broadcast_object(rank, root_rank=0, process_set=everyone) == 0
    with pytest.raises(md.InvalidArgumentError, match=r"broadcast_object: rank\(s\) \[1\] passed an object pickle"):
        hvd.broadcast_object((lambda: 0) if rank == 1 else None, root_rank=1)  # every rank raises, none hangs
    assert (everyone.size(), everyone.rank(), everyone.included()) == (size, rank, True)
    with pytest.raises(md.InvalidArgumentError, match="process_set= takes an hvd.ProcessSet, got object"):
        hvd.allreduce(torch.ones(2), process_set=object())


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("op, prescale, postscale", [(hvd.Average, 1.0, 1.0), (hvd.Sum, 1.0, 1.0), (hvd.Sum, 2.0, 0.25),
                                                     (hvd.Average, 0.5, 3.0)],
                         ids=["average", "sum", "scaled_sum", "scaled_average"])
def test_allreduce_is_differentiable(mpi_world, op, prescale, postscale):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = values(rank, (2, 3)).requires_grad_()
    y = hvd.allreduce(x, op=op, prescale_factor=prescale, postscale_factor=postscale)
    local_loss(rank, y).backward()

    # Reference: every rank's input in one process; the objective is the sum of the ranks' losses.
    xs = [values(k, (2, 3)).requires_grad_() for k in range(size)]
    combined = sum(prescale * v for v in xs) * postscale
    if op == hvd.Average:
        combined = combined / size
    sum(local_loss(k, combined) for k in range(size)).backward()
    assert_reduced(y, [prescale * v for v in xs], KINDS[op], postscale=postscale,
                   scalings=(prescale != 1) + (postscale != 1))
    # The ranks' loss gradients summed (size - 1 additions), each a few roundings, and scaled.
    assert_within(x.grad, xs[rank].grad, roundings=size + 4)


@pytest.mark.mpi(ranks=[2, 3])
def test_grouped_allreduce_is_differentiable(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    xs = [t.requires_grad_() for t in group_inputs(rank)[:3]]
    outputs = hvd.grouped_allreduce(xs, op=hvd.Sum, prescale_factor=3.0)
    sum(local_loss(rank, out) for out in outputs).backward()

    every = [[t.requires_grad_() for t in group_inputs(k)[:3]] for k in range(size)]
    combined = [sum(3.0 * inputs[i] for inputs in every) for i in range(3)]
    sum(local_loss(k, out) for k in range(size) for out in combined).backward()
    for mine, reference in zip(xs, every[rank]):
        assert_within(mine.grad, reference.grad, roundings=size + 4)  # as in test_allreduce_is_differentiable


def row_blocks(tensor, size):
    """Horovod's split of the first dimension: the first rows % size ranks get one row more."""
    rows = tensor.shape[0]
    return torch.split(tensor, [rows // size + (k < rows % size) for k in range(size)])


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("op, prescale, postscale",
                         [(hvd.Average, 1.0, 1.0), (hvd.Sum, 1.0, 1.0), (hvd.Average, 0.5, 3.0)],
                         ids=["average", "sum", "scaled_average"])
def test_reducescatter_is_differentiable_and_its_variants_agree(mpi_world, op, prescale, postscale):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    shape = (2 * size + 1, 3)  # uneven: rank 0 gets one row more
    x = values(rank, shape).requires_grad_()
    y = hvd.reducescatter(x, op=op, prescale_factor=prescale, postscale_factor=postscale)
    local_loss(rank, y).backward()

    xs = [values(k, shape).requires_grad_() for k in range(size)]
    combined = sum(prescale * v for v in xs) * postscale
    if op == hvd.Average:
        combined = combined / size
    blocks = row_blocks(combined, size)
    sum(local_loss(k, blocks[k]) for k in range(size)).backward()
    assert_reduced(y, [row_blocks(prescale * v, size)[rank] for v in xs], KINDS[op], postscale=postscale,
                   scalings=(prescale != 1) + (postscale != 1))
    # Horovod's gradient is size times that of the ranks' summed losses (test_horovod_ops.py):
    # this rank's own loss gradient, gathered and scaled, a few roundings.
    assert_within(x.grad, size * xs[rank].grad, roundings=4)

    handle = hvd.reducescatter_async(x, op=op, prescale_factor=prescale, postscale_factor=postscale)
    assert_exact(hvd.synchronize(handle), y.detach())


@pytest.mark.mpi(ranks=[2, 3])
def test_reducescatter_with_fp16_compression(mpi_world):
    # fp16 on the wire: the result comes back in the tensor's dtype, rounded through float16.
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    shape = (2 * size + 1, 3)  # uneven: rank 0 gets one row more
    x = values(rank, shape).float()
    y = hvd.reducescatter(x, compression=hvd.Compression.fp16, op=hvd.Sum)
    assert y.dtype == torch.float32
    # A sum in float16, its inputs rounded to it first (one scaling each).
    assert_reduced(y, [row_blocks(values(k, shape).float(), size)[rank] for k in range(size)], "sum",
                   dtype=torch.float16, scalings=1)


@pytest.mark.mpi(ranks=[2, 3])
def test_reducescatter_refusals(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    shape = (2 * size + 1, 3)
    x = values(rank, shape).float()
    with pytest.raises(md.InvalidArgumentError, match="not 0-d"):  # on every rank, nothing sent
        hvd.grouped_reducescatter([x, torch.tensor(1.0)], op=hvd.Sum, prescale_factor=2.0)
    with pytest.raises(hvd.NotOfferedError, match="no gradient"):
        hvd.reducescatter(values(rank, shape).requires_grad_(), op=hvd.Max).sum().backward()


@pytest.mark.mpi(ranks=[2, 3])
def test_grouped_allgather_and_reducescatter(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    firsts = [values(rank, (rank + 1, 2)), values(rank, (2,), seed=1)]
    gathered = hvd.grouped_allgather(firsts)
    assert_exact(gathered[0], torch.cat([values(k, (k + 1, 2)) for k in range(size)]))
    assert_exact(gathered[1], torch.cat([values(k, (2,), seed=1) for k in range(size)]))
    assert [t.shape for t in hvd.synchronize(hvd.grouped_allgather_async(firsts))] == [t.shape for t in gathered]

    rows = [values(rank, (size * 2, 3)), values(rank, (size,), seed=1)]
    scattered = hvd.grouped_reducescatter(rows, op=hvd.Sum)
    for mine, index in zip(scattered, range(2)):
        per_rank = rows[index].shape[0] // size
        assert_reduced(mine, [values(k, rows[index].shape, seed=index)[rank * per_rank:(rank + 1) * per_rank]
                              for k in range(size)], "sum")
    again = hvd.synchronize(hvd.grouped_reducescatter_async(rows, op=hvd.Sum))
    for a, b in zip(again, scattered):
        assert_exact(a, b)


@pytest.mark.mpi(ranks=[2, 3])
def test_allgather_is_differentiable(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = values(rank, (rank + 1, 2)).requires_grad_()  # ranks differ in the first dimension
    gathered = hvd.allgather(x)
    local_loss(rank, gathered).backward()

    # Horovod averages the gradient over ranks: the objective is the mean of the ranks' losses.
    xs = [values(k, (k + 1, 2)).requires_grad_() for k in range(size)]
    everything = torch.cat(xs)
    (sum(local_loss(k, everything) for k in range(size)) / size).backward()
    assert_exact(gathered.detach(), everything.detach())
    assert_within(x.grad, xs[rank].grad, roundings=size + 4)  # the ranks' loss gradients averaged


@pytest.mark.mpi(ranks=[2, 3])
def test_broadcast_is_differentiable(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    root = size - 1
    x = values(rank, (3,)).requires_grad_()
    y = hvd.broadcast(x, root_rank=root)
    local_loss(rank, y).backward()

    source = values(root, (3,)).requires_grad_()
    (sum(local_loss(k, source) for k in range(size)) / size).backward()
    assert_exact(y.detach(), source.detach())
    expected = source.grad if rank == root else torch.zeros(3, dtype=torch.float64)
    assert_within(x.grad, expected, roundings=size + 4)  # the ranks' loss gradients averaged


def sent_rows(rank, size, splits_of):
    return values(rank, (sum(splits_of(rank)), 2), seed=1)


@pytest.mark.mpi(ranks=[2, 3])
def test_alltoall_matches_reference_and_is_differentiable(mpi_world):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    def splits_of(k):
        return [(k + j) % 3 for j in range(size)]  # includes zero-row splits

    x = sent_rows(rank, size, splits_of).requires_grad_()
    received, received_splits = hvd.alltoall(x, splits=splits_of(rank))
    local_loss(rank, received).backward()

    xs = [sent_rows(k, size, splits_of).requires_grad_() for k in range(size)]
    pieces = [torch.split(v, splits_of(k)) for k, v in enumerate(xs)]
    outputs = [torch.cat([pieces[k][j] for k in range(size)]) for j in range(size)]
    sum(local_loss(j, outputs[j]) for j in range(size)).backward()
    assert received_splits.dtype == torch.int32
    assert received_splits.tolist() == [splits_of(k)[rank] for k in range(size)]
    assert_exact(received.detach(), outputs[rank].detach())
    assert_exact(x.grad, xs[rank].grad)  # each row's gradient comes back from the rank it went to

    # As Horovod's, the asynchronous form gives (rows, received splits), with or without splits=.
    rows, splits = hvd.synchronize(hvd.alltoall_async(x, splits=splits_of(rank)))
    assert_exact(rows, outputs[rank].detach())
    assert splits.tolist() == received_splits.tolist()
    rows, splits = hvd.synchronize(hvd.alltoall_async(torch.full((size, 1), float(rank))))
    assert rows.flatten().tolist() == [float(k) for k in range(size)] and splits.tolist() == [1] * size


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16, torch.bool])
def test_alltoall_equal_splits_returns_the_tensor(mpi_world, dtype):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    sent = (torch.arange(2 * size * 3).reshape(2 * size, 3) + 100 * rank).to(dtype)
    received = hvd.alltoall(sent)  # no splits=: a tensor, not a tuple (as Horovod)
    expected = torch.cat([(torch.arange(2 * size * 3).reshape(2 * size, 3) + 100 * k)[2 * rank:2 * rank + 2]
                          for k in range(size)]).to(dtype)
    assert received.dtype == dtype
    assert torch.equal(received, expected)


@pytest.mark.mpi(ranks=[2, 3])
def test_alltoall_without_splits_needs_rows_that_divide_evenly(mpi_world):
    hvd.init()
    with pytest.raises(ValueError, match="evenly"):
        hvd.alltoall(torch.ones(hvd.size() + 1, 2))


def sparse_input(rank):
    """A 6 x 3 sparse tensor with rank + 1 nonzero rows (rank 1: none), some shared with others."""
    if rank == 1:
        return torch.sparse_coo_tensor(torch.zeros((2, 0), dtype=torch.int64), torch.zeros(0, dtype=torch.float64), (6, 3))
    rows = torch.arange(rank + 1) % 6
    columns = (torch.arange(rank + 1) * 2) % 3
    return torch.sparse_coo_tensor(torch.stack([rows, columns]), values(rank, (rank + 1,)), (6, 3))


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average], ids=["sum", "average"])
def test_sparse_allreduce_async(mpi_world, op):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    result = hvd.sparse_allreduce_async(sparse_input(rank), name="embedding", op=op)()
    assert result.is_sparse and result.shape == (6, 3)
    assert_reduced(result.to_dense(), [sparse_input(k).to_dense() for k in range(size)], KINDS[op])


@pytest.mark.mpi(ranks=[2, 3])
def test_sparse_allreduce_async_refusals(mpi_world):
    hvd.init()
    rank = hvd.rank()
    with pytest.raises(md.MismatchError, match=r"different shapes \[\(6, 3\), \(7, 3\)"):
        hvd.sparse_allreduce_async(torch.zeros(6 + min(rank, 1), 3).to_sparse(), name="bad")
    with pytest.raises(md.InvalidArgumentError, match="sparse COO tensor, got layout torch.strided"):
        hvd.sparse_allreduce_async(torch.zeros(2), name="dense")


def sparse_embedding_lookups(rank):
    """Horovod's test_sparse_embeddings: the ranks look up different rows, and different numbers of them."""
    return torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]) if rank == 0 else torch.tensor([[1, 3 + rank, 4], [4, 7, 9]])


def sparse_embedding():
    return torch.nn.Embedding(10, 3, sparse=True, _weight=values(0, (10, 3), seed=7))


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embeddings_train_with_sparse_adam(mpi_world, sparse_as_dense):
    """Horovod's test_sparse_embeddings: torch.optim.SparseAdam over nn.Embedding(sparse=True) trains,
    with the gradient handed back sparse. Against one process stepping SparseAdam on Horovod's
    sparse average (every rank's rows, values divided by the number of ranks); the loss is
    linear in the weights, so each step's gradients are those of the first."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    def loss(model, k):
        return (model(sparse_embedding_lookups(k)) * (k + 1)).sum()

    local = []
    for k in range(size):
        model = sparse_embedding()
        loss(model, k).backward()
        local.append(model.weight.grad.coalesce())
    average = torch.sparse_coo_tensor(torch.cat([g.indices() for g in local], 1),
                                      torch.cat([g.values() for g in local]) / size, (10, 3)).coalesce()
    reference_model = sparse_embedding()
    reference = torch.optim.SparseAdam(list(reference_model.parameters()), lr=0.1)
    model = sparse_embedding()
    optimizer = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(model.parameters()), lr=0.1),
                                         sparse_as_dense=sparse_as_dense)
    for _ in range(3):
        reference_model.weight.grad = average.clone()
        reference.step()
        optimizer.zero_grad()
        loss(model, rank).backward()
        optimizer.step()
        assert model.weight.grad.is_sparse
        torch.testing.assert_close(model.weight.grad.to_dense(), average.to_dense())
    torch.testing.assert_close(model.weight.detach(), reference_model.weight.detach())
    del optimizer


@pytest.mark.mpi(ranks=[2, 3])
def test_parameter_names_are_unique_and_equal_on_every_rank(mpi_world):
    """Horovod's test_optimizer_no_named_parameters: without named_parameters, over several
    parameter groups, optimizer._parameter_names ({parameter: name}) are unique and the same on
    every rank; with them, the names given."""
    hvd.init()
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([{"params": model[0].parameters()},
                                                          {"params": model[1].parameters()}], lr=0.001))
    names = set(optimizer._parameter_names.values())
    assert len(names) == len(optimizer._parameter_names) == 4
    assert hvd.allgather_object(names) == [names] * hvd.size()
    del optimizer
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.001),
                                         named_parameters=model.named_parameters())
    assert optimizer._parameter_names == {p: name for name, p in model.named_parameters()}
    del optimizer


@pytest.mark.mpi(ranks=[2, 3])
def test_optimizer_state_broadcasts_with_a_frozen_parameter(mpi_world):
    """Horovod's test_broadcast_state_no_grad: a model with a frozen integer parameter (its
    gradient stays None); after broadcast_optimizer_state the other's gradient holds zeros that
    scripts broadcast, and the state is the root's."""
    hvd.init()
    rank = hvd.rank()

    class FrozenIndex(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
            self.b = torch.nn.Parameter(values(rank, (4,)))

        def forward(self, x):
            return torch.index_select(self.b, 0, self.a.long()) * x

    model = FrozenIndex()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True),
        named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    grad = optimizer.param_groups[0]["params"][1].grad
    assert optimizer.param_groups[0]["params"][0].grad is None
    assert torch.equal(hvd.broadcast(grad, root_rank=0), grad) and not grad.any()
    assert torch.equal(model.b.detach(), values(0, (4,)))
    del optimizer


def test_duplicate_parameter_names_are_refused_before_anything_else(monkeypatch):
    """Horovod's test_duplicate_names, which runs before hvd.init(): a ValueError naming them."""
    import mpidist.comm
    monkeypatch.setattr(mpidist.comm, "_world", None)  # not initialized
    first, second = torch.nn.Conv2d(1, 1, 1), torch.nn.Conv2d(1, 1, 1)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="must be unique. Found duplicates: bias, weight"):
        hvd.DistributedOptimizer(optimizer, named_parameters=[*first.named_parameters(), *second.named_parameters()])
    with pytest.raises(ValueError, match="sequence of tuples"):
        hvd.DistributedOptimizer(optimizer, named_parameters=[["weight", first.weight]])


@pytest.mark.mpi(ranks=[2])
def test_synchronize_twice_finishes_once(mpi_world):
    hvd.init()
    tensor = torch.full((3,), float(hvd.rank() + 1))
    handle = hvd.allreduce_async_(tensor, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    first = hvd.synchronize(handle)
    second = hvd.synchronize(handle)
    assert first is second
    assert tensor.tolist() == [3.0, 3.0, 3.0]  # (1 + 2) * 2 * 0.5, postscale applied once


@pytest.mark.mpi(ranks=[2])
def test_in_place_and_async_variants_stay_out_of_autograd(mpi_world):
    hvd.init()
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    assert not hvd.synchronize(hvd.allreduce_async(x)).requires_grad
    assert not hvd.synchronize(hvd.allgather_async(x)).requires_grad
    assert not hvd.synchronize(hvd.broadcast_async(x, 0)).requires_grad
    y = hvd.allreduce(x * 2, op=hvd.Max)
    with pytest.raises(hvd.NotOfferedError, match="Average and Sum"):
        y.sum().backward()  # every rank raises: no rank waits for another's gradient


@pytest.mark.mpi(ranks=[2])
def test_distributed_optimizer_and_data_parallel_on_the_same_parameters_are_refused(mpi_world):
    hvd.init()
    model = torch.nn.Linear(3, 2)
    wrapped = md.DataParallel(model)
    with pytest.raises(md.InvalidArgumentError, match="already has its gradient all-reduced by a DataParallel"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    del wrapped
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(md.InvalidArgumentError, match="by a DistributedOptimizer that is still alive"):
        md.DataParallel(model)
    del optimizer


@pytest.mark.mpi(ranks=[2])
@pytest.mark.parametrize("call", [lambda: hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum),
                                  lambda: hvd.allreduce_(torch.ones(2), average=False, op=hvd.Average),
                                  lambda: hvd.allreduce_async(torch.ones(2), average=True, op=hvd.Average)],
                         ids=["allreduce", "allreduce_", "allreduce_async"])
def test_average_and_op_together_are_refused(mpi_world, call):
    hvd.init()
    message = "The op parameter supersedes average. Please provide only one of them."
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == message


@pytest.mark.mpi(ranks=[2])
def test_average_false_alone_sums(mpi_world):
    hvd.init()
    assert hvd.allreduce(torch.ones(2), average=False).tolist() == [2.0, 2.0]


@pytest.mark.mpi(ranks=[2, 3])
def test_alltoall_rows_must_agree(mpi_world):
    hvd.init()
    width = 2 if hvd.rank() == 0 else 3
    # On every rank, before any data moves: the call check names the row shapes.
    with pytest.raises(md.MismatchError, match=r"row shape \(shape\[1:\]\): ranks \[0\] have \(2,\)"):
        hvd.alltoall(torch.ones(hvd.size(), width))


@pytest.mark.mpi(ranks=[3, 4])
def test_process_sets_run_their_own_collectives(mpi_world):
    from mpi4py import MPI
    rank, size = mpi_world.rank, mpi_world.size
    even, odd = hvd.ProcessSet(range(0, size, 2)), hvd.ProcessSet(list(range(1, size, 2)))
    hvd.init(process_sets=[even, odd])
    mine, other = (even, odd) if rank % 2 == 0 else (odd, even)
    members = mine.ranks
    assert even.process_set_id + 1 == odd.process_set_id and even.process_set_id > 0
    assert (mine.size(), mine.rank(), mine.included()) == (len(members), members.index(rank), True)
    assert (other.included(), other.rank()) == (False, -1)

    value = torch.tensor([float(rank), 1.0])
    assert hvd.allreduce(value, op=hvd.Sum, process_set=mine).tolist() == [float(sum(members)), len(members)]
    assert hvd.grouped_allreduce([value, value.double()], op=hvd.Max, process_set=mine)[1].tolist() == \
        [float(max(members)), 1.0]
    handle = hvd.allreduce_async(value, op=hvd.Sum, process_set=mine)
    assert hvd.synchronize(handle).tolist() == [float(sum(members)), len(members)]
    root = members[-1]  # a global rank of the set
    assert hvd.broadcast(value, root_rank=root, process_set=mine).tolist() == [float(root), 1.0]
    assert hvd.broadcast_object({"from": rank}, root_rank=root, process_set=mine) == {"from": root}
    assert hvd.allgather(torch.tensor([rank]), process_set=mine).tolist() == members
    assert hvd.allgather_object(rank, process_set=mine) == members
    rows = torch.arange(len(members), dtype=torch.float64) + 10 * rank
    assert hvd.alltoall(rows, process_set=mine).tolist() == [10.0 * m + mine.rank() for m in members]
    scattered = hvd.reducescatter(torch.ones(len(members), 2), op=hvd.Sum, process_set=mine)
    assert scattered.tolist() == [[float(len(members))] * 2]
    hvd.barrier(process_set=mine)
    with pytest.raises(md.InvalidArgumentError, match=f"rank {rank} is not in ProcessSet"):
        hvd.allreduce(value, process_set=other)
    with pytest.raises(md.InvalidArgumentError, match=f"root_rank={other.ranks[0]} is not in ProcessSet"):
        hvd.broadcast(value, root_rank=other.ranks[0], process_set=mine)

    # Added later, from a list of ranks or from an mpi4py communicator; removed.
    ends = hvd.add_process_set([0, size - 1])
    assert ends.process_set_id == odd.process_set_id + 1
    if rank in (0, size - 1):
        assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=ends).item() == 2.0
    split = MPI.COMM_WORLD.Split(rank % 2, rank)
    by_comm = hvd.add_process_set(hvd.ProcessSet(split))
    assert by_comm.ranks == members
    assert hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=by_comm).item() == sum(members)
    assert hvd.remove_process_set(ends) and hvd.remove_process_set(by_comm)
    assert not hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(md.InvalidArgumentError, match="is not registered"):
        hvd.allreduce(value, process_set=ends)
    assert hvd.allreduce(value, op=hvd.Sum, process_set=mine)[1] == len(members)  # the static sets still work
    split.Free()

    # Refusals reach every rank.
    with pytest.raises(md.MismatchError, match="registered different process sets"):
        hvd.add_process_set([0, 1] if rank == 0 else [0, 2])
    with pytest.raises(md.InvalidArgumentError, match=rf"ProcessSet ranks \[0, {size}\] must be distinct ranks"):
        hvd.add_process_set([0, size])
    with pytest.raises(ValueError, match="list of process ranks or an mpi4py communicator"):
        hvd.ProcessSet(["0"])


@pytest.mark.mpi(ranks=[4])
def test_distributed_optimizer_on_a_process_set_matches_its_members_batches(mpi_world):
    hvd.init()
    rank = mpi_world.rank
    halves = [hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3])]
    mine = halves[rank // 2]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).double()
    reference = torch.nn.Linear(4, 2).double()
    reference.load_state_dict(model.state_dict())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), process_set=mine)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        batches = [values(member, (3, 4), seed=step) for member in mine.ranks]
        optimizer.zero_grad()
        model(batches[mine.rank()]).pow(2).mean().backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        reference(torch.cat(batches)).pow(2).mean().backward()
        reference_optimizer.step()
    # Each step's gradients sum over the 6 rows of a set's members, through the widths 4 and 2.
    for trained, expected in zip(model.parameters(), reference.parameters()):
        assert_within(trained, expected, roundings=3 * (6 + 6))
    del optimizer
    for half in halves:
        hvd.remove_process_set(half)


def test_grouped_operations_need_a_list_of_tensors():
    for function in (hvd.grouped_allreduce, hvd.grouped_allreduce_async, hvd.grouped_allgather):
        with pytest.raises(md.InvalidArgumentError, match="non-empty list of tensors"):
            function([])
        with pytest.raises(md.InvalidArgumentError, match="non-empty list of tensors"):
            function([torch.ones(1), 3.0])


def test_is_homogeneous_false_for_uneven_nodes():
    from conftest import run_python
    code = ("import mpidist.torch as hvd\nhvd.init()\n"
            "print('result', hvd.rank(), hvd.local_size(), hvd.is_homogeneous(), flush=True)\n")
    result = run_python(code, ranks=3, env={"MPIDIST_RANKS_PER_NODE": "2"})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line.split()[1:] for line in result.stdout.splitlines() if line.startswith("result"))
    assert lines == [["0", "2", "False"], ["1", "2", "False"], ["2", "1", "False"]]


def test_compression_classes_follow_horovods_interface():
    x = torch.tensor([1.0, 2.5], dtype=torch.float32)
    for compression, wire in ((hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)):
        compressed, ctx = compression.compress(x)
        assert compressed.dtype == wire
        restored = compression.decompress(compressed, ctx)
        assert restored.dtype == torch.float32 and restored.tolist() == [1.0, 2.5]
        integers = torch.tensor([3, 4])  # only floating-point tensors are cast
        assert compression.decompress(*compression.compress(integers)) is integers
    compressed, ctx = hvd.Compression.none.compress(x)
    assert compressed is x and hvd.Compression.none.decompress(compressed, ctx) is x
    # DistributedOptimizer reads the names of the wire dtypes.
    assert [c.wire for c in (hvd.Compression.none, hvd.Compression.fp16, hvd.Compression.bf16)] == \
        [None, "fp16", "bf16"]


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        hvd.no_such_name  # noqa: B018


TIMELINE_SCRIPT = """
import torch
import mpidist.torch as hvd
from mpidist.torch import timeline

hvd.init()  # starts the timeline of HOROVOD_TIMELINE
print("writes", hvd.rank(), timeline.current() is not None, flush=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
for step in range(3):
    optimizer.zero_grad()
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
hvd.allreduce(torch.ones(3), name="loss")
hvd.synchronize(hvd.allreduce_async(torch.ones(3)))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.stop_timeline()
hvd.start_timeline(SECOND)
hvd.allgather(torch.ones(1), name="gathered")
"""  # the second timeline is finished at exit


def timeline_spans(path):
    """{row name: [(activity, start us, duration us), ...]} of a Chrome trace file."""
    events = json.load(open(path))
    rows = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans = {}
    for event in events:
        if event["ph"] == "X":
            spans.setdefault(rows[event["pid"]], []).append((event["name"], event["ts"], event["dur"]))
    return spans


def test_timeline_records_operations_and_gradient_buckets(tmp_path):
    from conftest import run_python
    first, second = tmp_path / "timeline.json", tmp_path / "second.json"
    result = run_python(f"SECOND = {str(second)!r}\n" + TIMELINE_SCRIPT, ranks=2,
                        env={"HOROVOD_TIMELINE": str(first)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("writes")) == \
        ["writes 0 True", "writes 1 False"]  # rank 0 writes it, as in Horovod
    spans = timeline_spans(first)
    bucket = "allreduce.1.bias+1.weight+0.bias+0.weight"  # one bucket, in backward's order
    assert sorted(spans) == sorted([bucket, "DistributedOptimizer", "loss", "allreduce.noname.1",
                                    "broadcast.noname.1"])
    assert [a for a, _, _ in spans[bucket]] == ["ALLREDUCE"] * 3
    assert [a for a, _, _ in spans["DistributedOptimizer"]] == ["SYNCHRONIZE"] * 3
    assert [a for a, _, _ in spans["loss"]] == ["ALLREDUCE"]
    assert [a for a, _, _ in spans["allreduce.noname.1"]] == ["ALLREDUCE"]
    assert [a for a, _, _ in spans["broadcast.noname.1"]] == ["BROADCAST"]  # its inner broadcasts are not rows
    for (_, launched, _), (_, waited, waiting) in zip(spans[bucket], spans["DistributedOptimizer"]):
        assert 0 <= launched <= waited + waiting  # launched during backward, done by the wait's end
    assert all(start >= 0 and duration >= 0 for row in spans.values() for _, start, duration in row)
    assert timeline_spans(second) == {"gathered": [("ALLGATHER", *timeline_spans(second)["gathered"][0][1:])]}
