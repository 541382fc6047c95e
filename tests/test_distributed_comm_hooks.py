"""torch's DDP over the "mpidist" backend with torch's own compression hooks, as torch ships them.

fp16 and bf16: every run trains as the same DDP with the same hook over gloo does, on the same
batches. PowerSGD (PowerSGDState with powerSGD_hook): every rank's parameters equal, bit for bit,
every other rank's, and, within float64's rounding, a one-process float64 replay of PowerSGD on
the gradients of all ranks (`powersgd_reference`; a run over gloo in the same launch aborted the
launch now and then, so gloo is no reference here). batched_powerSGD_hook fails by itself in this
torch: it fails alike on every rank and leaves the process group working.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py); the default
process group, mpidist's, made by the first test stays for the others."""
import gc

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import mpidist  # noqa: F401  (registers the "mpidist" backend)

pytestmark = pytest.mark.mpi_shared_launch

STEPS = 5
LR = 0.1
START_POWERSGD = 2  # PowerSGD's first steps are plain all-reduces
# One bucket for the whole model; a bucket per parameter, whose hooks overlap.
BUCKET_SIZES = pytest.mark.parametrize("bucket_mb", [25, 0.0003], ids=["one_bucket", "bucket_per_parameter"])


def world() -> int:
    """This rank in the default process group over the backend, made once per process."""
    if not dist.is_initialized():
        dist.init_process_group("mpidist")
    return dist.get_rank()


def make_model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(dtype)


def batch(step, rank, dtype):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 10, generator=generator, dtype=dtype), torch.randint(0, 3, (8,), generator=generator)


def bf16_compress(state, bucket):
    # torch's bf16 hook as it is. DDP refuses to register a function of that name on builds
    # without CUDA and NCCL, whatever the process group's backend; the hook itself needs neither.
    return default_hooks.bf16_compress_hook(state, bucket)


def trained(group, make_hook, dtype, bucket_mb):
    """The parameters after STEPS steps of DDP over `group` (None: the default group, mpidist's)
    with the hook `make_hook(group)` returns as (state, hook)."""
    model = make_model(dtype)
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb)
    state, hook = make_hook(group)
    ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    rank = dist.get_rank()
    for step in range(STEPS):
        x, y = batch(step, rank, dtype)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def over_mpidist_and_gloo(make_hook, dtype, bucket_mb):
    """(parameters trained over mpidist, over gloo), or the exceptions each raised."""
    world()
    gloo = dist.new_group(backend="gloo")
    outcomes = []
    try:
        for group in (None, gloo):
            try:
                outcomes.append(trained(group, make_hook, dtype, bucket_mb))
            except Exception as error:  # noqa: BLE001  (compared with gloo's below)
                outcomes.append(error)
    finally:
        # DDP's reducers before the gloo group (test_distributed_backend.py says why)
        gc.collect()
        dist.destroy_process_group(gloo)
        del gloo
    return outcomes


def assert_same_training(over_mpidist, over_gloo, bounds):
    """Every parameter over mpidist within `bounds` (one tensor per parameter, or one number)
    of gloo's."""
    for error in (over_mpidist, over_gloo):
        if isinstance(error, Exception):
            raise error
    if not isinstance(bounds, list):
        bounds = [bounds] * len(over_gloo)
    for index, (ours, theirs, bound) in enumerate(zip(over_mpidist, over_gloo, bounds)):
        excess = ((ours - theirs).abs() - bound).max().item()
        assert excess <= 0, f"parameter {index}: {(ours - theirs).abs().max().item()} apart, {excess} past the bound"


def gradient_magnitudes(size):
    """Elementwise, over STEPS steps of one-process SGD on the mean of every rank's gradient
    (float64): the sum of LR x the mean over ranks of |that rank's gradient|."""
    model = make_model(torch.float64)
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for step in range(STEPS):
        gradients = [torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
                     for x, y in (batch(step, k, torch.float64) for k in range(size))]
        with torch.no_grad():
            for p, magnitude, *of_ranks in zip(params, total, *gradients):
                magnitude += LR * sum(g.abs() for g in of_ranks) / size
                p -= LR * sum(of_ranks) / size
    return total


@pytest.mark.mpi(ranks=[2, 3])
@BUCKET_SIZES
@pytest.mark.parametrize("hook, wire", [(default_hooks.fp16_compress_hook, torch.float16), (bf16_compress, torch.bfloat16)],
                         ids=["fp16", "bf16"])
def test_half_precision_compression_trains_as_over_gloo(mpi_world, hook, wire, bucket_mb):
    over_mpidist, over_gloo = over_mpidist_and_gloo(lambda group: (group, hook), torch.float32, bucket_mb)
    # Both send each rank's gradient / size rounded to `wire` alike; gloo adds them up in `wire`,
    # mpidist in float32 and rounds once, so an averaged gradient may differ by size - 1 + 1
    # roundings of `wire` of the ranks' mean magnitude: twice that (for the runs drifting apart
    # over the steps) times the learning rate, summed over the steps, and float32's rounding.
    size = dist.get_world_size()
    assert_same_training(over_mpidist, over_gloo,
                         [size * torch.finfo(wire).eps * magnitude.float() + 1e-6
                          for magnitude in gradient_magnitudes(size)])


POWERSGD_STEPS = 7


def powersgd_model():
    """Two layers of one shape (PowerSGD's batching groups by shape), and a last one that the
    higher ranks leave uncompressed."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).double()


def loss(model, step, rank):
    x, y = batch(step, rank, torch.float64)
    return torch.nn.functional.cross_entropy(model(x), y)


def trained_with_powersgd(settings, hook, bucket_mb, group=None):
    """(the parameters after POWERSGD_STEPS steps of DDP over mpidist (the default group, else
    `group`) with torch's `hook` on a PowerSGDState of `settings`, the parameter indices of each
    bucket in the order DDP handed the buckets to the hook at each step)."""
    model = powersgd_model()
    index_of = {id(p): i for i, p in enumerate(model.parameters())}
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb, process_group=group)
    state = powerSGD_hook.PowerSGDState(process_group=group, start_powerSGD_iter=START_POWERSGD, random_seed=0,
                                        **settings)
    calls = [[] for _ in range(POWERSGD_STEPS)]
    step = 0

    def recording_hook(state, bucket):
        calls[step].append((bucket.index(), [index_of[id(p)] for p in bucket.parameters()]))
        return hook(state, bucket)

    ddp.register_comm_hook(state, recording_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(POWERSGD_STEPS):  # noqa: B007  (recording_hook reads it)
        optimizer.zero_grad()
        loss(ddp, step, dist.get_rank()).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], calls


def orthonormal(matrix):
    """Orthonormal columns spanning `matrix`'s. torch's hook uses Gram-Schmidt up to rank 2 and a
    QR factorization above; the two differ at most in the sign of a column, which PowerSGD's
    product P Q^T (Q computed from that P) does not see."""
    return np.linalg.qr(matrix)[0]


def powersgd_reference(size, settings, buckets):
    """The parameters after POWERSGD_STEPS steps of SGD, in one process in float64, where each
    step's gradient is what torch's PowerSGD hook (as its documentation and source describe it)
    makes of the gradients of `size` ranks, with all-reduce as the plain sum over those ranks.
    `buckets`: the parameter indices of each bucket, in bucket index order.

    Per bucket and step from START_POWERSGD on: each rank adds its error-feedback residual to its
    gradient; a parameter viewed as rows x columns is compressed when (rows + columns) * r *
    min_compression_rate < rows * columns (r: the rank, at most rows and columns), else averaged
    as it is; the compressed ones take Q from the last step (warm start) or, where there is none,
    from torch.randn seeded with the state's NumPy random state, one draw per parameter or, with
    batch_tensors_with_same_shape, per group of one shape; then P = sum over ranks of M Q,
    orthonormalized, Q = mean over ranks of M^T P, and the gradient is P Q^T; the residual is
    what the rank had minus what it got."""
    rank_r = settings.get("matrix_approximation_rank", 1)
    rate = settings.get("min_compression_rate", 2)
    error_feedback = settings.get("use_error_feedback", True)
    warm_start = settings.get("warm_start", True)
    batched = settings.get("batch_tensors_with_same_shape", False)
    model = powersgd_model()
    params = list(model.parameters())
    shapes = [tuple(p.shape) for p in params]
    random_state = np.random.RandomState(0)
    residuals = {}  # (bucket, rank): that rank's residual, a float64 vector over the bucket
    q_memory = {}  # bucket: {parameter index: Q}
    for step in range(POWERSGD_STEPS):
        gradients = [[g.numpy().ravel() for g in torch.autograd.grad(loss(model, step, k), params)]
                     for k in range(size)]
        averaged = [sum(gradients[k][i] for k in range(size)) / size for i in range(len(params))]
        if step >= START_POWERSGD:
            for b, members in enumerate(buckets):
                offsets = np.cumsum([0] + [int(np.prod(shapes[i])) for i in members])
                local = [np.concatenate([gradients[k][i] for i in members]) + residuals.get((b, k), 0.0)
                         for k in range(size)]
                part = {i: (offsets[j], offsets[j + 1]) for j, i in enumerate(members)}
                matrix = {i: [local[k][slice(*part[i])].reshape(shapes[i][0], -1) for k in range(size)] for i in members}
                compressed = []
                for i in members:
                    rows, columns = matrix[i][0].shape
                    r = min(rows, columns, rank_r)
                    if (rows + columns) * r * rate < rows * columns:
                        compressed.append(i)
                    else:
                        averaged[i] = sum(local[k][slice(*part[i])] for k in range(size)) / size
                if b not in q_memory:
                    by_shape = {}
                    for i in compressed:
                        by_shape.setdefault(matrix[i][0].shape, []).append(i)
                    generator = torch.Generator().manual_seed(int(random_state.randint(1_000_000_000)))
                    qs = {}
                    for (rows, columns), group in by_shape.items():
                        r = min(rows, columns, rank_r)
                        for draw in ([group] if batched else [[i] for i in group]):
                            values = torch.randn(len(draw), columns, r, generator=generator, dtype=torch.float64)
                            qs.update({i: values[j].numpy() for j, i in enumerate(draw)})
                    q_memory[b] = qs
                for i in compressed:
                    q = orthonormal(q_memory[b][i])
                    p = orthonormal(sum(m @ q for m in matrix[i]))
                    q = sum(m.T @ p for m in matrix[i]) / size
                    q_memory[b][i] = q
                    averaged[i] = (p @ q.T).ravel()
                if error_feedback:
                    sent = np.concatenate([averaged[i] for i in members])
                    for k in range(size):
                        residuals[b, k] = local[k] - sent
                if not warm_start:
                    del q_memory[b]
        with torch.no_grad():
            for p, gradient in zip(params, averaged):
                p -= LR * torch.from_numpy(gradient.reshape(p.shape))
    return [p.detach() for p in params]


def assert_same_bits_on_every_rank(params):
    """Compared over mpi4py's world communicator, not over the backend under test."""
    mine = b"".join(p.numpy().tobytes() for p in params)
    for rank, theirs in enumerate(MPI.COMM_WORLD.allgather(mine)):
        assert theirs == mine, f"rank {dist.get_rank()}'s parameters differ from rank {rank}'s"


POWERSGD_SETTINGS = pytest.mark.parametrize("settings", [
    dict(matrix_approximation_rank=1),
    dict(matrix_approximation_rank=2),
    dict(matrix_approximation_rank=3, min_compression_rate=1, use_error_feedback=False, warm_start=False,
         batch_tensors_with_same_shape=True),
], ids=["rank1", "rank2", "rank3_qr_batched_no_error_feedback_no_warm_start"])


@pytest.mark.mpi(ranks=[2, 3])
@BUCKET_SIZES
@POWERSGD_SETTINGS
def test_powersgd_hook_trains_as_the_float64_replay(mpi_world, settings, bucket_mb):
    world()
    params, calls = trained_with_powersgd(settings, powerSGD_hook.powerSGD_hook, bucket_mb)
    assert_trained_as_the_float64_replay(params, calls, settings)


@pytest.mark.mpi(ranks=[2, 3], timeout=300)
def test_powersgd_hook_on_the_background_thread_trains_as_the_float64_replay(mpi_world, monkeypatch):
    # MPIDIST_EAGER_ON_NODE=0 queues async_op collectives on the group's engine thread, as a group
    # across nodes does; the hook's callbacks then run there, and their all-reduces with them.
    world()
    monkeypatch.setenv("MPIDIST_EAGER_ON_NODE", "0")
    group = dist.new_group(list(range(dist.get_world_size())))
    try:
        settings = dict(matrix_approximation_rank=1)
        params, calls = trained_with_powersgd(settings, powerSGD_hook.powerSGD_hook, 0.0003, group)
        assert_trained_as_the_float64_replay(params, calls, settings)
    finally:
        dist.destroy_process_group(group)


def assert_trained_as_the_float64_replay(params, calls, settings):
    assert_same_bits_on_every_rank(params)
    # The reference draws Q's random start per bucket in index order: DDP hands the buckets to
    # the hook in that order once it has settled them (after the first step).
    for step in range(1, POWERSGD_STEPS):
        assert [index for index, _ in calls[step]] == list(range(len(calls[step]))), calls[step]
        assert calls[step] == calls[1], (step, calls[step], calls[1])
    buckets = [members for _, members in calls[1]]
    assert sorted(i for members in buckets for i in members) == list(range(len(params)))
    expected = powersgd_reference(dist.get_world_size(), settings, buckets)
    plain = powersgd_reference(dist.get_world_size(), dict(settings, min_compression_rate=float("inf")), buckets)
    compressed_somewhere = False
    for index, (ours, theirs, uncompressed) in enumerate(zip(params, expected, plain)):
        gap = (ours - theirs).abs().max().item()
        # The two agree to a few float64 roundings; an all-reduce off by one part in 1e9 moves
        # them further apart than this.
        assert gap <= 1e-12, f"parameter {index}: {gap} from the float64 replay"
        if (ours - uncompressed).abs().max().item() > 1e-6:
            compressed_somewhere = True
    # Else the comparison could not tell PowerSGD from a plain all-reduce.
    assert compressed_somewhere


@pytest.mark.mpi(ranks=[2, 3])
def test_batched_powersgd_hook_fails_alike_on_every_rank(mpi_world):
    # torch 2.13's batched hook hands its orthogonalization one matrix where that asserts a batch
    # of them, at the first compressed step, before any of that step's collectives.
    world()
    with pytest.raises(AssertionError) as raised:
        trained_with_powersgd(dict(matrix_approximation_rank=1), powerSGD_hook.batched_powerSGD_hook, 25)
    assert "_orthogonalize" in "".join(str(entry) for entry in raised.traceback), raised.traceback
    assert len(set(MPI.COMM_WORLD.allgather(str(raised.value)))) == 1
    gc.collect()  # the failed DDP's reducer, before the group's next collective
    ones = torch.ones(3, dtype=torch.float64)
    dist.all_reduce(ones)
    assert torch.equal(ones, torch.full((3,), float(dist.get_world_size()), dtype=torch.float64))
