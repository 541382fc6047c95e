"""Top-k with error feedback (compressors.TopK) step by step against a float64 NumPy reference:
each rank adds its residual to its gradient, sends its k = ceil(fraction * n) elements largest in
magnitude, keeps the rest as its residual; the result is the sum of what the ranks sent (over the
rank count for "avg"). Compared: the (index, value) pairs each rank sends, its residual and the
result, at every step, for buckets below and above the size where the candidates come from a
sample (topk_codec.DIRECT_TOPK_NUMEL); in one process over simulated ranks, over MPI, and
through md.DataParallel's buckets."""
import math

import numpy as np
import pytest
import torch

import mpidist as md
from mpidist.parallel import topk_codec
from mpidist.parallel.compressors import TopK

pytestmark = pytest.mark.mpi_shared_launch

STEPS = 6
LARGE = 3 * topk_codec.DIRECT_TOPK_NUMEL + 11  # the candidates come from a strided sample


def gradient(rank, step, numel):
    """Rank `rank`'s float64 gradient of step `step`: heavy-tailed, with blocks of very different
    scale (as a bucket's parameters have), and the same scales every step, so the residual of the
    small blocks grows for several steps before it is sent."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    values = torch.randn(numel, generator=generator, dtype=torch.float64)
    scales = torch.logspace(-3, 1, 9, dtype=torch.float64).repeat_interleave(math.ceil(numel / 9))[:numel]
    return values * torch.randn(numel, generator=generator, dtype=torch.float64).exp() * scales


def reference(size, numel, fraction, op, steps=STEPS):
    """Per step: each rank's sent elements (index -> value), each rank's residual after the step,
    and the result; float64 NumPy."""
    k = max(1, math.ceil(fraction * numel))
    residual = np.zeros((size, numel))
    out = []
    for step in range(steps):
        sent, total = [], np.zeros(numel)
        for rank in range(size):
            accumulated = gradient(rank, step, numel).numpy() + residual[rank]
            largest = np.argsort(-np.abs(accumulated), kind="stable")[:k]
            sent.append(dict(zip(largest.tolist(), accumulated[largest].tolist())))
            total[largest] += accumulated[largest]
            residual[rank] = accumulated
            residual[rank, largest] = 0
        out.append((sent, residual.copy(), total / size if op == "avg" else total))
    return out


def decode(payload, k, dtype=torch.float64):
    """A rank's top-k payload: its int32 indices, then its values."""
    indices = payload[:4 * k].clone().view(torch.int32).long()
    values = payload[4 * k:].clone().view(dtype)
    return dict(zip(indices.tolist(), values.tolist()))


class SimulatedWorld:
    """The ranks' allgather in one process: each rank posts its payload, then every wait() gets
    all of them in rank order."""

    def __init__(self, size):
        self.size = size
        self.posted = {}

    def comm(self, rank):
        world = self

        class Comm:
            def __init__(self):
                self.rank, self.size = rank, world.size

            def allgather_async(self, payload):
                assert rank not in world.posted, "two exchanges of one rank in one step"
                world.posted[rank] = payload.clone()

                class Handle:
                    def wait(self):
                        assert len(world.posted) == world.size, "waited before every rank sent"
                        return torch.cat([world.posted[r] for r in range(world.size)])
                return Handle()
        return Comm()


def simulate(size, numel, fraction, op, steps=STEPS):
    """mpidist's TopKBucket of each simulated rank over `steps`: per step, what each rank sent,
    each rank's residual and each rank's result."""
    world = SimulatedWorld(size)
    buckets = [TopK(fraction).bucket_exchange([torch.zeros(numel, dtype=torch.float64)], world.comm(rank), "auto")
               for rank in range(size)]
    out = []
    for step in range(steps):
        world.posted = {}
        flats = [gradient(rank, step, numel) for rank in range(size)]
        exchanges = [bucket.start(flat, op) for bucket, flat in zip(buckets, flats)]
        for exchange in exchanges:
            exchange.wait()
        k = buckets[0].k
        sent = [decode(world.posted[rank], k) for rank in range(size)]
        out.append((sent, np.stack([b.residual.numpy().copy() for b in buckets]), [f.numpy() for f in flats]))
    return out


@pytest.mark.parametrize("numel", [1000, LARGE], ids=["small", "sampled"])
@pytest.mark.parametrize("fraction", [0.01, 0.1])
@pytest.mark.parametrize("op", ["avg", "sum"])
def test_simulated_ranks_match_the_float64_reference_step_by_step(numel, fraction, op):
    size = 4
    expected = reference(size, numel, fraction, op)
    actual = simulate(size, numel, fraction, op)
    k = math.ceil(fraction * numel)
    for step, ((want_sent, want_residual, want_result), (sent, residual, results)) in \
            enumerate(zip(expected, actual)):
        for rank in range(size):
            # exactly the requested fraction, k distinct elements, the largest ones
            assert len(sent[rank]) == k, f"step {step} rank {rank}: {len(sent[rank])} elements sent, k = {k}"
            assert sent[rank].keys() == want_sent[rank].keys(), f"step {step} rank {rank}: other elements sent"
            np.testing.assert_array_equal([sent[rank][i] for i in sorted(sent[rank])],
                                          [want_sent[rank][i] for i in sorted(sent[rank])])
            np.testing.assert_array_equal(residual[rank], want_residual[rank], err_msg=f"step {step} rank {rank}")
            # the same additions in the same (rank) order: the same float64 bits
            np.testing.assert_array_equal(results[rank], want_result, err_msg=f"step {step} rank {rank}")


def test_residual_is_kept_and_sent_later():
    """An element too small to be sent in one step is sent once its residual has grown: the
    residual is carried over from step to step, not reset."""
    size, numel, fraction = 2, 1000, 0.01
    world = SimulatedWorld(size)
    buckets = [TopK(fraction).bucket_exchange([torch.zeros(numel, dtype=torch.float64)], world.comm(rank), "auto")
               for rank in range(size)]
    # Ten large elements (k = 10) on every step, and element 500 a little every step.
    first_sent = None
    for step in range(40):
        world.posted = {}
        flats = []
        for rank in range(size):
            flat = torch.zeros(numel, dtype=torch.float64)
            flat[:10] = 1.0
            flat[500] = 0.1
            flats.append(flat)
        exchanges = [bucket.start(flat, "sum") for bucket, flat in zip(buckets, flats)]
        for exchange in exchanges:
            exchange.wait()
        if flats[0][500] != 0 and first_sent is None:
            first_sent = step
            # everything it accumulated, from both ranks
            assert flats[0][500].item() == pytest.approx(2 * 0.1 * (step + 1))
    # Element 500 accumulates 0.1 a step; the ten large ones are sent every step they lead, so
    # element 500 goes once its residual passes 1.0 (after 10 steps at most).
    assert first_sent is not None and first_sent <= 11, first_sent


# ---- every rank -------------------------------------------------------------------------------

@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("numel", [1000, LARGE], ids=["small", "sampled"])
def test_topk_over_mpi_matches_the_float64_reference(mpi_world, numel):
    """The exchange over MPI: every rank's result and its own residual at every step."""
    comm = mpi_world
    expected = reference(comm.size, numel, 0.01, "avg")
    bucket = TopK(0.01).bucket_exchange([torch.zeros(numel, dtype=torch.float64)], comm, "auto")
    for step, (_, want_residual, want_result) in enumerate(expected):
        flat = gradient(comm.rank, step, numel)
        bucket.start(flat, "avg").wait()
        np.testing.assert_array_equal(flat.numpy(), want_result, err_msg=f"step {step}")
        np.testing.assert_array_equal(bucket.residual.numpy(), want_residual[comm.rank], err_msg=f"step {step}")


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.ReLU(), torch.nn.Linear(300, 300),
                               torch.nn.ReLU(), torch.nn.Linear(300, 4)).double()


def batch(rank, step):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 20, generator=generator, dtype=torch.float64), torch.randint(0, 4, (16,),
                                                                                          generator=generator)


@pytest.mark.mpi(ranks=[2, 3])
def test_data_parallel_buckets_match_the_float64_reference(mpi_world):
    """md.DataParallel(compression=TopK(0.05)) in several buckets (one of them above
    DIRECT_TOPK_NUMEL), SGD with momentum: after each backward the gradients are the reference's
    per-bucket top-k average of every rank's gradients with error feedback, and each bucket's
    residual is this rank's reference residual. Every rank's gradients come from a plain copy of
    the model at the same weights."""
    comm = mpi_world
    fraction = 0.05
    model, plain = mlp(), mlp()
    ddp = md.DataParallel(model, compression=TopK(fraction), bucket_mb=0.5)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    position = {id(p): i for i, p in enumerate(model.parameters())}
    layout = [[position[id(p)] for p in bucket.params] for bucket in ddp.buckets.buckets]
    params = list(model.parameters())
    sizes = [sum(params[i].numel() for i in bucket) for bucket in layout]
    assert len(layout) >= 3 and max(sizes) > topk_codec.DIRECT_TOPK_NUMEL, sizes
    residuals = [np.zeros((comm.size, n)) for n in sizes]
    for step in range(5):
        plain.load_state_dict(model.state_dict())
        grads = []  # per rank: parameter index -> gradient
        for rank in range(comm.size):
            plain.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.cross_entropy(plain(x), y).backward()
            grads.append([p.grad.numpy().ravel().copy() for p in plain.parameters()])
        optimizer.zero_grad()
        x, y = batch(comm.rank, step)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        for index, bucket in enumerate(layout):
            k = math.ceil(fraction * sizes[index])
            total = np.zeros(sizes[index])
            for rank in range(comm.size):
                accumulated = np.concatenate([grads[rank][i] for i in bucket]) + residuals[index][rank]
                largest = np.argsort(-np.abs(accumulated), kind="stable")[:k]
                total[largest] += accumulated[largest]
                residuals[index][rank] = accumulated
                residuals[index][rank, largest] = 0
            actual = np.concatenate([params[i].grad.numpy().ravel() for i in bucket])
            np.testing.assert_allclose(actual, total / comm.size, rtol=1e-12, atol=1e-15,
                                       err_msg=f"step {step} bucket {index}")
            state = ddp.compression_state_dict()[f"bucket{index}.residual"].numpy()
            np.testing.assert_allclose(state, residuals[index][comm.rank], rtol=1e-12, atol=1e-15,
                                       err_msg=f"step {step} bucket {index} residual")
        optimizer.step()
