"""SyncBatchNorm against torch's BatchNorm run in one process on every rank's samples together
(float64): outputs, input and parameter gradients, running statistics; uneven and empty
batches; no communication in eval mode; errors on every rank; training under DataParallel and
hvd.DistributedOptimizer equal to single-process training with plain BatchNorm."""
import math

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_exact, assert_within

import mpidist as md
import mpidist.torch as hvd
from mpidist.errors import MismatchError

# The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order;
# the refusals, raised on every rank, come last.
pytestmark = pytest.mark.mpi_shared_launch

CHANNELS = 3


def values(rank, shape, seed=0):
    """Rank `rank`'s input: any rank can rebuild every other rank's, for the references."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * seed + rank), dtype=torch.float64) * 2 + 1


def local_loss(rank, output):
    """A different non-linear loss on every rank, so that each rank's output gradient differs."""
    return ((output ** 2) * (rank + 1) + output * (rank - 0.5)).sum()


def make_norm(affine=True, momentum=0.3, track_running_stats=True):
    norm = md.SyncBatchNorm(CHANNELS, momentum=momentum, affine=affine,
                            track_running_stats=track_running_stats).double()
    if affine:
        with torch.no_grad():
            norm.weight.copy_(torch.tensor([0.5, -1.5, 2.0]))
            norm.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    return norm


def reference(shapes, steps=1, affine=True, momentum=0.3, track_running_stats=True):
    """torch's BatchNorm on every rank's samples at once, the objective the sum of the ranks'
    losses: returns the outputs, inputs (with .grad) and the module, after `steps` passes."""
    norm = torch.nn.BatchNorm1d(CHANNELS, momentum=momentum, affine=affine,
                                track_running_stats=track_running_stats).double()
    if affine:
        with torch.no_grad():
            norm.weight.copy_(torch.tensor([0.5, -1.5, 2.0]))
            norm.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    for step in range(steps):
        xs = [values(k, shape, seed=step).requires_grad_() for k, shape in enumerate(shapes)]
        whole = torch.cat(xs)
        # BatchNorm1d takes (N, C) and (N, C, L); any other shape goes through (N, C, L).
        y = norm(whole.reshape(whole.shape[0], CHANNELS, -1)).reshape(whole.shape)
        outputs = y.split([s[0] for s in shapes])
        sum(local_loss(k, out) for k, out in enumerate(outputs)).backward()
    return outputs, xs, norm


def roundings(shapes, steps=1):
    """Roundings between a normalization over every rank's samples and torch's in one process,
    per pass: the sums over a channel's samples (mean and variance forward, the output gradient's
    two sums backward), the ranks' partial results combined, and the elementwise formulas (the
    gradient's a difference of three terms)."""
    samples = sum(math.prod(shape) for shape in shapes) // CHANNELS
    return steps * (2 * samples + len(shapes) + 16)


def summed_over_ranks(tensor):
    total = tensor.detach().clone()
    md.allreduce(total, op="sum")
    return total


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 3)).double()


def batch(step, rank):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(8, 6, generator=generator, dtype=torch.float64) * 3 + 1,
            torch.randint(0, 3, (8,), generator=generator))


def single_process_training(size, steps):
    """Plain BatchNorm in one process on the union of every rank's batch."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        parts = [batch(step, r) for r in range(size)]
        optimizer.zero_grad()
        F.cross_entropy(model(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
        optimizer.step()
    return model


@pytest.mark.mpi(ranks=[1, 2, 3, 5])
# BatchNorm1d's (N, C) and (N, C, L), BatchNorm2d's (N, C, H, W)
@pytest.mark.parametrize("trailing", [(), (4,), (2, 3)], ids=["N_C", "N_C_L", "N_C_H_W"])
def test_matches_batchnorm_on_all_samples(mpi_world, trailing):
    rank, size = mpi_world.rank, mpi_world.size
    shapes = [(k + 2, CHANNELS) + trailing for k in range(size)]  # uneven batches
    norm = make_norm()
    x = values(rank, shapes[rank]).requires_grad_()
    y = norm(x)
    local_loss(rank, y).backward()

    outputs, xs, ref = reference(shapes)
    within = roundings(shapes)
    assert_within(y, outputs[rank], roundings=within)
    assert_within(x.grad, xs[rank].grad, roundings=within)
    assert_within(summed_over_ranks(norm.weight.grad), ref.weight.grad, roundings=within)
    assert_within(summed_over_ranks(norm.bias.grad), ref.bias.grad, roundings=within)
    assert_within(norm.running_mean, ref.running_mean, roundings=within)
    assert_within(norm.running_var, ref.running_var, roundings=within)
    assert norm.num_batches_tracked.item() == 1


@pytest.mark.mpi(ranks=[2])
def test_eval_mode_uses_running_statistics_without_communicating(mpi_world):
    rank, size = mpi_world.rank, mpi_world.size
    norm = make_norm()
    with torch.no_grad():
        norm.running_mean.copy_(torch.tensor([1.0, -2.0, 0.5]))
        norm.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
    norm.eval()
    x = values(rank, (rank + 1, CHANNELS, 2))
    # Rank 0 alone runs extra passes: a collective inside would pair with the next one below.
    for _ in range(3 if rank == 0 else 1):
        y = norm(x)
    expected = F.batch_norm(x, norm.running_mean, norm.running_var, norm.weight, norm.bias, training=False)
    assert_exact(y, expected)

    norm.train()
    shapes = [(k + 2, CHANNELS) for k in range(size)]
    norm.running_mean.zero_()
    norm.running_var.fill_(1.0)
    x = values(rank, shapes[rank]).requires_grad_()
    local_loss(rank, norm(x)).backward()
    outputs, xs, _ = reference(shapes)
    assert_within(x.grad, xs[rank].grad, roundings=roundings(shapes))


@pytest.mark.mpi(ranks=[3])
def test_a_rank_without_samples_takes_part(mpi_world):
    rank, size = mpi_world.rank, mpi_world.size
    shapes = [(0 if k == 0 else 3, CHANNELS, 2) for k in range(size)]
    norm = make_norm()
    x = values(rank, shapes[rank]).requires_grad_()
    y = norm(x)
    local_loss(rank, y).backward()

    outputs, xs, ref = reference(shapes)
    assert y.shape == shapes[rank]
    within = roundings(shapes)
    assert_within(y, outputs[rank], roundings=within)
    assert_within(x.grad, xs[rank].grad, roundings=within)
    assert_within(summed_over_ranks(norm.weight.grad), ref.weight.grad, roundings=within)
    assert_within(norm.running_var, ref.running_var, roundings=within)


@pytest.mark.mpi(ranks=[3])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)],
                         ids=["float32", "bfloat16"])
def test_float32_and_bfloat16_inputs(mpi_world, dtype, tolerance):
    rank, size = mpi_world.rank, mpi_world.size
    shapes = [(k + 4, CHANNELS, 5) for k in range(size)]
    outputs, _, _ = reference(shapes)
    norm = make_norm().to(torch.float32)
    x = values(rank, shapes[rank]).to(dtype)
    y = norm(x)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), outputs[rank].detach(), atol=tolerance * 10, rtol=tolerance)


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("affine, momentum, track", [(False, None, True), (True, None, True), (False, 0.1, False)],
                         ids=["cumulative_average", "affine_cumulative_average", "no_running_statistics"])
def test_options_as_batchnorm(mpi_world, affine, momentum, track):
    rank, size = mpi_world.rank, mpi_world.size
    shapes = [(k + 2, CHANNELS) for k in range(size)]
    norm = make_norm(affine=affine, momentum=momentum, track_running_stats=track)
    for step in range(3):
        x = values(rank, shapes[rank], seed=step).requires_grad_()
        y = norm(x)
        local_loss(rank, y).backward()

    outputs, xs, ref = reference(shapes, steps=3, affine=affine, momentum=momentum, track_running_stats=track)
    assert_within(y, outputs[rank], roundings=roundings(shapes))
    assert_within(x.grad, xs[rank].grad, roundings=roundings(shapes))
    if track:  # the running statistics of all 3 passes
        assert_within(norm.running_mean, ref.running_mean, roundings=roundings(shapes, steps=3))
        assert_within(norm.running_var, ref.running_var, roundings=roundings(shapes, steps=3))
        assert norm.num_batches_tracked.item() == ref.num_batches_tracked.item() == 3
    else:
        assert norm.running_mean is None and norm.running_var is None


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("wrapper", ["DataParallel", "hvd"])
def test_training_matches_one_process_with_batchnorm(mpi_world, wrapper):
    rank, ranks = mpi_world.rank, mpi_world.size
    steps = 4
    model = md.SyncBatchNorm.convert_sync_batchnorm(make_model())
    assert isinstance(model[1], md.SyncBatchNorm) and model[1] is hvd.SyncBatchNorm.convert_sync_batchnorm(model[1])
    if wrapper == "DataParallel":
        forward = md.DataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        hvd.init()
        forward = model
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                             named_parameters=model.named_parameters())
    for step in range(steps):
        x, y = batch(step, rank)
        optimizer.zero_grad()
        F.cross_entropy(forward(x), y).backward()
        optimizer.step()

    expected = single_process_training(ranks, steps)
    # Per step: the sums over every rank's 8 samples forward and backward through the widths 6,
    # 8 and 3, and the ranks' gradients combined.
    within = steps * (2 * 8 * ranks + 17 + ranks)
    for mine, ref in zip(model.state_dict().values(), expected.state_dict().values()):
        assert_within(mine, ref, roundings=within)
    model.eval()
    x, _ = batch(99, 0)
    expected.eval()
    assert_within(model(x), expected(x), roundings=within)


@pytest.mark.mpi(ranks=[2, 3])
def test_input_of_fewer_than_2_dimensions_is_refused(mpi_world):
    norm = make_norm()
    with pytest.raises(ValueError, match="expected at least 2D input"):
        norm(torch.zeros(CHANNELS, dtype=torch.float64))


@pytest.mark.mpi(ranks=[2, 3])
def test_input_of_another_channel_count_is_refused(mpi_world):
    norm = make_norm()
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(3\) got an input with 4 channels"):
        norm(torch.zeros(2, 4, dtype=torch.float64))


@pytest.mark.mpi(ranks=[2, 3])
def test_one_value_per_channel_over_all_ranks_is_refused_on_every_rank(mpi_world):
    # One value per channel over all ranks: no variance to take, on every rank.
    norm = make_norm()
    x = torch.ones((1 if mpi_world.rank == 0 else 0, CHANNELS), dtype=torch.float64)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training over all ranks, got 1"):
        norm(x)


@pytest.mark.mpi(ranks=[2, 3])
def test_channel_counts_that_differ_between_ranks_are_refused_on_every_rank(mpi_world):
    # Channel counts that differ between ranks: the gathered statistics disagree in shape.
    rank = mpi_world.rank
    other = md.SyncBatchNorm(CHANNELS + rank).double()
    with pytest.raises(MismatchError, match=r"SyncBatchNorm\(\d\): the ranks normalize different numbers of "
                                            r"channels .*ranks \[0\] have \(7,\)"):
        other(torch.ones((2, CHANNELS + rank), dtype=torch.float64))
