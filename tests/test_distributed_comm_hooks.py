"""torch's DDP over the "mpidist" backend with torch's own compression hooks, as torch ships them
(fp16 and bf16): every run trains as the same DDP with the same hook over gloo does, on the same
batches. (PowerSGD's hook is not compared here: its reference run over gloo aborted the process
now and then.)

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py); the default
process group, mpidist's, made by the first test stays for the others."""
import gc

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
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
