"""Adasum (md.adasum_allreduce, hvd.allreduce and hvd.grouped_allreduce with op=hvd.Adasum,
DistributedOptimizer(op=hvd.Adasum)) against a float64 NumPy reference of the pairwise tree, and
its refusals on every rank.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order."""
import sys

import numpy as np
import pytest
import torch

import mpidist as md
import mpidist.torch as hvd

pytestmark = pytest.mark.mpi_shared_launch
# One rank: Adasum of one vector is that vector; three ranks are refused.
POWERS_OF_TWO = pytest.mark.mpi(ranks=[2, 4])
TINY = np.sqrt(sys.float_info.min)


def adasum_pair(a, b):
    """Adasum of two float64 vectors, written from the paper's formula."""
    dot, a_norm, b_norm = a @ b, a @ a, b @ b
    a_coefficient = 1 - dot / (2 * a_norm) if a_norm >= TINY else 1.0
    b_coefficient = 1 - dot / (2 * b_norm) if b_norm >= TINY else 1.0
    return a_coefficient * a + b_coefficient * b


def adasum_reference(vectors, sizes, dtype):
    """Ranks combined in pairs (0, 1), (2, 3), ..., then the pairs' results, each tensor of the
    concatenation on its own; rounded to `dtype` after each level, as the collective stores."""
    bounds = np.cumsum([0] + list(sizes))
    level = [np.asarray(v, dtype=np.float64) for v in vectors]
    while len(level) > 1:
        pairs = []
        for a, b in zip(level[0::2], level[1::2]):
            combined = np.concatenate([adasum_pair(a[lo:hi], b[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])])
            pairs.append(combined.astype(dtype).astype(np.float64))
        level = pairs
    return level[0]


def rank_vector(rank, count, seed, dtype):
    rng = np.random.default_rng(1000 * seed + rank)
    return rng.standard_normal(count).astype(dtype)


TOLERANCE = {"float16": 2e-3, "float32": 1e-6, "float64": 1e-12}


@POWERS_OF_TWO
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("seed, sizes", list(enumerate([[1], [7], [1000], [5, 0, 12, 1, 3], [33, 64]])),
                         ids=["one", "seven", "thousand", "five_tensors", "two_tensors"])
def test_adasum_matches_the_reference(mpi_ranks, mpi_world, dtype, seed, sizes):
    count = sum(sizes)
    mine = rank_vector(mpi_world.rank, count, seed, dtype)
    expected = adasum_reference([rank_vector(r, count, seed, dtype) for r in range(mpi_ranks)], sizes, dtype)
    result = md.adasum_allreduce(mine, sizes=None if len(sizes) == 1 else sizes)
    assert result is mine
    np.testing.assert_allclose(mine.astype(np.float64), expected, rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype] * np.abs(expected).max(), err_msg=f"{dtype} {sizes}")
    # Every rank holds the same bits.
    gathered = mpi_world.mpi.allgather(mine.tobytes())
    assert all(g == gathered[0] for g in gathered)


@POWERS_OF_TWO
def test_parallel_vectors_average(mpi_ranks, mpi_world):
    direction = np.linspace(-1.0, 2.0, 11)
    parallel = direction * (mpi_world.rank + 1.0)
    md.adasum_allreduce(parallel)
    np.testing.assert_allclose(parallel, direction * (mpi_ranks + 1) / 2, rtol=1e-13)


@POWERS_OF_TWO
def test_orthogonal_vectors_add(mpi_ranks, mpi_world):
    orthogonal = np.zeros(2 * mpi_ranks)
    orthogonal[mpi_world.rank] = 1.0 + mpi_world.rank
    md.adasum_allreduce(orthogonal)
    expected = np.zeros(2 * mpi_ranks)
    expected[:mpi_ranks] = 1.0 + np.arange(mpi_ranks)
    np.testing.assert_array_equal(orthogonal, expected)


@POWERS_OF_TWO
def test_vectors_below_the_threshold_add(mpi_ranks, mpi_world):
    tiny = np.full(8, 1e-300) * (mpi_world.rank + 1)  # below Horovod's threshold: a plain sum
    md.adasum_allreduce(tiny)
    np.testing.assert_allclose(tiny, np.full(8, 1e-300) * sum(range(1, mpi_ranks + 1)), rtol=1e-13)


@POWERS_OF_TWO
def test_horovod_allreduce_with_adasum(mpi_ranks, mpi_world):
    hvd.init()
    x = torch.from_numpy(rank_vector(mpi_world.rank, 50, 7, "float32")).reshape(5, 10)
    result = hvd.allreduce(x, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3.0)
    assert result.shape == (5, 10) and result.dtype == torch.float32
    scaled = [rank_vector(r, 50, 7, "float32") * np.float32(0.5) for r in range(mpi_ranks)]
    expected = adasum_reference(scaled, [50], "float32") * 3.0
    np.testing.assert_allclose(result.reshape(-1).double().numpy(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(x, torch.from_numpy(rank_vector(mpi_world.rank, 50, 7, "float32")).reshape(5, 10))


@POWERS_OF_TWO
def test_horovod_allreduce_async_in_place_with_adasum(mpi_ranks, mpi_world):
    hvd.init()
    x = torch.from_numpy(rank_vector(mpi_world.rank, 50, 7, "float32")).reshape(5, 10)
    handle = hvd.allreduce_async_(x, op=hvd.Adasum)
    assert hvd.synchronize(handle) is x
    np.testing.assert_allclose(x.reshape(-1).double().numpy(),
                               adasum_reference([rank_vector(r, 50, 7, "float32") for r in range(mpi_ranks)],
                                                [50], "float32"), rtol=1e-6, atol=1e-6)


# ---- DistributedOptimizer(op=hvd.Adasum) -----------------------------------------------------------

def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def batch(step, rank):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=generator, dtype=torch.float64), torch.randint(0, 3, (5,), generator=generator)


def adasum_training_reference(size, steps):
    """Every rank's model and optimizer in one process: each rank steps its own optimizer (its
    momentum stays its own) from the common parameters, and the parameters become the start plus
    the Adasum of the ranks' changes, tensor by tensor."""
    models = [make_model() for _ in range(size)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for step in range(steps):
        start = [p.detach().clone() for p in models[0].parameters()]
        deltas = []
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            x, y = batch(step, rank)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            deltas.append(torch.cat([(p.detach() - s).reshape(-1) for p, s in zip(model.parameters(), start)]))
        sizes = [s.numel() for s in start]
        combined = torch.from_numpy(adasum_reference([d.numpy() for d in deltas], sizes, "float64"))
        updated = [s + c.reshape(s.shape) for s, c in zip(start, combined.split(sizes))]
        for model in models:
            with torch.no_grad():
                for p, value in zip(model.parameters(), updated):
                    p.copy_(value)
    return [p.detach() for p in models[0].parameters()]


def adasum_optimizer(model):
    hvd.init()
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(), op=hvd.Adasum)


@POWERS_OF_TWO
def test_distributed_optimizer_with_adasum(mpi_ranks, mpi_world):
    model = make_model()
    optimizer = adasum_optimizer(model)
    for step in range(3):
        x, y = batch(step, mpi_world.rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.synchronize()  # accepted, as in Horovod: the change is reduced in step()
        optimizer.step()
    for mine, expected in zip(model.parameters(), adasum_training_reference(mpi_ranks, 3)):
        torch.testing.assert_close(mine.detach(), expected, rtol=1e-12, atol=1e-12)


@POWERS_OF_TWO
def test_skip_synchronize_is_refused_with_adasum(mpi_world):
    optimizer = adasum_optimizer(make_model())
    with pytest.raises(md.InvalidArgumentError, match="skip_synchronize"):
        with optimizer.skip_synchronize():
            pass


@POWERS_OF_TWO
def test_join_is_refused_beside_an_adasum_optimizer(mpi_world):
    optimizer = adasum_optimizer(make_model())
    with pytest.raises(hvd.NotOfferedError, match="join.*Adasum"):
        hvd.join()
    del optimizer


@POWERS_OF_TWO
def test_integer_vectors_are_refused(mpi_world):
    with pytest.raises(md.UnsupportedDtypeError, match="Adasum combines floating-point vectors"):
        md.adasum_allreduce(np.arange(4, dtype=np.int64))


@POWERS_OF_TWO
def test_sizes_that_do_not_add_up_are_refused(mpi_world):
    with pytest.raises(md.InvalidArgumentError, match=r"sizes \[3, 2\] must be counts >= 0 adding up to"):
        md.adasum_allreduce(np.ones(4), sizes=[3, 2])


# ---- hvd.grouped_allreduce(op=hvd.Adasum) -------------------------------------------------------
# A group of two float32 tensors and a float64 one (two packed buffers, one of two tensors): each
# tensor gets the result of its own allreduce(op=hvd.Adasum), with coefficients of its own.
GROUP = [((5, 10), "float32"), ((7,), "float64"), ((3,), "float32")]

GROUPED_ADASUMS = {
    "grouped_allreduce": lambda tensors, **kw: hvd.grouped_allreduce(tensors, op=hvd.Adasum, **kw),
    "grouped_allreduce_": lambda tensors, **kw: hvd.grouped_allreduce_(tensors, op=hvd.Adasum, **kw),
    "grouped_allreduce_async": lambda tensors, **kw: hvd.synchronize(
        hvd.grouped_allreduce_async(tensors, op=hvd.Adasum, **kw)),
    "grouped_allreduce_async_": lambda tensors, **kw: hvd.synchronize(
        hvd.grouped_allreduce_async_(tensors, op=hvd.Adasum, **kw)),
}


def group_of(rank, seed):
    return [torch.from_numpy(rank_vector(rank, int(np.prod(shape)), seed + index, dtype)).reshape(shape)
            for index, (shape, dtype) in enumerate(GROUP)]


def group_reference(size, seed, prescale, postscale):
    """Each tensor of the group on its own: the Adasum of the ranks' tensors, in float64."""
    expected = []
    for index, (shape, dtype) in enumerate(GROUP):
        scaled = [t.numpy() * getattr(np, dtype)(prescale) for t in (group_of(r, seed)[index] for r in range(size))]
        expected.append(adasum_reference([v.reshape(-1) for v in scaled], [int(np.prod(shape))], dtype) * postscale)
    return expected


@POWERS_OF_TWO
@pytest.mark.parametrize("operation", list(GROUPED_ADASUMS))
@pytest.mark.parametrize("name", [None, "group"])
def test_grouped_allreduce_with_adasum_is_each_tensors_adasum(mpi_ranks, mpi_world, operation, name):
    hvd.init()
    seed = 20 + list(GROUPED_ADASUMS).index(operation)
    mine = group_of(mpi_world.rank, seed)
    result = GROUPED_ADASUMS[operation]([t.clone() for t in mine], name=name, prescale_factor=0.5,
                                        postscale_factor=3.0)
    singles = [hvd.allreduce(t, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3.0) for t in mine]
    for index, (tensor, single, expected) in enumerate(zip(result, singles, group_reference(mpi_ranks, seed, 0.5, 3.0))):
        shape, dtype = GROUP[index]
        assert tensor.shape == shape and str(tensor.dtype) == f"torch.{dtype}", (operation, index)
        tolerance = TOLERANCE[dtype] * 10  # scaled twice and combined in another split of the work
        np.testing.assert_allclose(tensor.reshape(-1).double().numpy(), expected, rtol=tolerance, atol=tolerance,
                                   err_msg=f"{operation} tensor {index} against the reference")
        torch.testing.assert_close(tensor, single, rtol=tolerance, atol=tolerance,
                                   msg=f"{operation} tensor {index} against its own allreduce")
    # Every rank holds the same bits.
    gathered = mpi_world.mpi.allgather([t.numpy().tobytes() for t in result])
    assert all(g == gathered[0] for g in gathered)


@POWERS_OF_TWO
def test_grouped_adasum_of_parallel_and_orthogonal_tensors(mpi_ranks, mpi_world):
    """One group, one buffer: the parallel tensor is averaged and the orthogonal one summed, which
    coefficients shared by the whole buffer would not give."""
    hvd.init()
    rank = mpi_world.rank
    direction = torch.linspace(-1.0, 2.0, 11, dtype=torch.float64)
    orthogonal = torch.zeros(2 * mpi_ranks, dtype=torch.float64)
    orthogonal[rank] = 1.0 + rank
    averaged, summed = hvd.grouped_allreduce([direction * (rank + 1.0), orthogonal], op=hvd.Adasum)
    torch.testing.assert_close(averaged, direction * (mpi_ranks + 1) / 2, rtol=1e-13, atol=1e-13)
    expected = torch.zeros(2 * mpi_ranks, dtype=torch.float64)
    expected[:mpi_ranks] = 1.0 + torch.arange(mpi_ranks, dtype=torch.float64)
    assert torch.equal(summed, expected)


@POWERS_OF_TWO
def test_grouped_adasum_of_an_integer_tensor_is_refused_on_every_rank(mpi_world):
    """The whole group is refused before anything is sent: the in-place group stays as it was."""
    hvd.init()
    group = [torch.ones(3), torch.arange(4)]
    with pytest.raises(md.UnsupportedDtypeError, match="Adasum combines floating-point tensors.*int64"):
        hvd.grouped_allreduce_(group, op=hvd.Adasum)
    assert torch.equal(group[0], torch.ones(3)) and torch.equal(group[1], torch.arange(4))
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == mpi_world.size


@POWERS_OF_TWO
def test_grouped_adasum_on_a_process_set_is_refused_on_every_rank(mpi_world):
    """Horovod's grouped_allreduce takes Adasum on the global process set only."""
    hvd.init()
    every_rank = hvd.add_process_set(list(range(mpi_world.size)))
    try:
        with pytest.raises(hvd.NotOfferedError, match="global process set"):
            hvd.grouped_allreduce([torch.ones(2)], op=hvd.Adasum, process_set=every_rank)
        assert hvd.grouped_allreduce([torch.ones(2)], op=hvd.Sum, process_set=every_rank)[0].tolist() == \
            [mpi_world.size] * 2
    finally:
        hvd.remove_process_set(every_rank)


@POWERS_OF_TWO
def test_a_refusal_on_one_rank_fails_the_others_at_once(mpi_world):
    wrong = np.ones(5, dtype=np.int32 if mpi_world.rank == 0 else np.float64)
    expected = (md.UnsupportedDtypeError, "Adasum combines") if mpi_world.rank == 0 else \
        (md.MismatchError, r"ranks \[0\] refused their arguments")
    with pytest.raises(expected[0], match=expected[1]):
        md.adasum_allreduce(wrong)


@POWERS_OF_TWO
def test_different_counts_raise_on_every_rank(mpi_world):
    shorter = np.ones(5 if mpi_world.rank == 0 else 6)
    with pytest.raises(md.MismatchError, match="count"):
        md.adasum_allreduce(shorter)


@pytest.mark.mpi(ranks=[3])
def test_adasum_needs_a_power_of_two_ranks_on_every_rank(mpi_world):
    with pytest.raises(md.InvalidArgumentError, match="power-of-two number of ranks.*has 3"):
        md.adasum_allreduce(np.ones(5))
    with pytest.raises(md.InvalidArgumentError, match="power-of-two number of ranks"):
        hvd.DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), op=hvd.Adasum)
    hvd.init()
    for operation, call in GROUPED_ADASUMS.items():
        with pytest.raises(md.InvalidArgumentError, match="power-of-two number of ranks.*has 3"):
            call([torch.ones(2), torch.ones(3, dtype=torch.float64)])
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == 3, operation


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.mpi(ranks=[2])
def test_adasum_of_cuda_tensors_matches_the_reference(mpi_ranks, mpi_world):
    mine = torch.from_numpy(rank_vector(mpi_world.rank, 1001, 3, "float32")).cuda()
    md.adasum_allreduce(mine, sizes=[500, 501])
    expected = adasum_reference([rank_vector(r, 1001, 3, "float32") for r in range(mpi_ranks)], [500, 501], "float32")
    np.testing.assert_allclose(mine.cpu().double().numpy(), expected, rtol=1e-6, atol=1e-6)
