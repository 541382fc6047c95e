"""Horovod's behaviours on the launch's device, as Horovod's own tests for horovod.torch check them:
asynchronous all-reduces of several dtypes and a fused pair, CPU and GPU tensors mixed in one call
refused on every rank, alltoall with splits, hvd.join(device) with all-reduces on the other ranks,
SyncBatchNorm against BatchNorm over every rank's batch, and a model split over two devices
trained with the DistributedOptimizer. In the order written: join() refuses to run beside a live
DistributedOptimizer, so the test that makes one comes after it."""
import numpy as np
import pytest
import torch
from device_training import STEPS, assert_trained_like, batch, union_of_batches
from tolerances import assert_reduced, assert_within

import mpidist.torch as hvd

pytestmark = pytest.mark.training


@pytest.fixture(scope="module")
def ranks(comm):
    """(size, rank, the sum of the factors rank + 1 over the ranks)."""
    hvd.init()
    return hvd.size(), hvd.rank(), hvd.size() * (hvd.size() + 1) / 2


def on(device: str, tensor) -> bool:
    return tensor.device.type == torch.device(device).type


def test_allreduce_async_averages_float32_and_float16_and_sums_int32_and_a_fused_pair(device, ranks):
    size, rank, total = ranks
    handles, wrong = [], []
    for dtype, op in ((torch.float32, hvd.Average), (torch.float16, hvd.Average), (torch.int32, hvd.Sum)):
        tensor = torch.arange(17, device=device).to(dtype) * (rank + 1)
        handles.append((dtype, op, hvd.allreduce_async(tensor, name=f"async {dtype}", op=op)))
    pair = [torch.full((5,), rank + 1.0, device=device), torch.full((3,), 2.0 * (rank + 1), device=device)]
    group = hvd.grouped_allreduce_async(pair, name="fused pair", op=hvd.Sum)
    for dtype, op, handle in handles:
        got = hvd.synchronize(handle)
        want = np.arange(17) * total / (size if op == hvd.Average else 1)  # exact in every dtype here
        if not on(device, got) or got.dtype != dtype or not np.array_equal(got.cpu().double().numpy(), want):
            wrong.append(f"{dtype}: got {got.cpu().tolist()[:4]}... on {got.device}, want {want[:4].tolist()}...")
    first, second = hvd.synchronize(group)
    if not (torch.all(first.cpu() == total) and torch.all(second.cpu() == 2 * total)):
        wrong.append(f"fused pair: got {first.cpu().tolist()}, {second.cpu().tolist()}, want {total}, {2 * total}")
    assert not wrong, "; ".join(wrong)


@pytest.mark.gpu_only
def test_allreduce_of_cpu_and_gpu_tensors_mixed_is_refused_on_every_rank(device, ranks):
    rank = ranks[1]
    tensor = torch.ones(4, device=device if rank % 2 == 0 else "cpu")
    with pytest.raises(RuntimeError) as refusal:  # Horovod raises a RuntimeError on every rank
        hvd.allreduce(tensor)
    assert "cpu" in str(refusal.value) and "cuda" in str(refusal.value), \
        f"the error does not name both devices: {refusal.value}"


def test_alltoall_with_splits(device, ranks):
    size, rank, _ = ranks
    # Rank r sends k + 1 rows holding 100 r + k to rank k.
    rows = [torch.full((k + 1, 3), 100.0 * rank + k, device=device) for k in range(size)]
    splits = torch.arange(1, size + 1, dtype=torch.int32)
    got, received = hvd.alltoall(torch.cat(rows), splits=splits)
    want = torch.cat([torch.full((rank + 1, 3), 100.0 * source + rank) for source in range(size)])
    assert on(device, got) and torch.equal(got.cpu(), want) and received.tolist() == [rank + 1] * size, \
        f"got {got.cpu().tolist()} on {got.device}, splits {received.tolist()}"


def test_join_on_the_device_while_the_other_ranks_average(device, ranks):
    size, rank, _ = ranks
    # Rank 0 runs out of data at once; the others average two tensors, then join too.
    device_id = torch.device(device).index if torch.device(device).type == "cuda" else -1
    results = []
    if rank != 0:
        for step in range(2):
            results.append(hvd.allreduce(torch.full((6,), rank + 1.0 + step, device=device), name=f"join {step}"))
    last = hvd.join(-1 if device_id is None else device_id)
    assert last == size - 1, f"join() returned {last}, want {size - 1} (the rank that joined last)"
    for step, got in enumerate(results):  # rank 0 took part with zeros; the average counts it
        assert on(device, got), f"step {step}: the result is on {got.device}"
        assert_reduced(got.cpu(), [np.zeros(6)] + [np.full(6, r + 1.0 + step) for r in range(1, size)], "avg")


def test_sync_batchnorm_matches_batchnorm_over_every_ranks_rows(device, ranks):
    size, rank, _ = ranks
    generator = torch.Generator().manual_seed(7)
    full = torch.randn(4 * size, 3, 5, generator=generator, dtype=torch.float64)
    weights = torch.randn(full.shape, generator=generator, dtype=torch.float64)
    mine = slice(4 * rank, 4 * (rank + 1))
    layer = hvd.SyncBatchNorm(3).double().to(device)
    x = full[mine].to(device).requires_grad_()
    y = layer(x)
    (y * weights[mine].to(device)).sum().backward()
    reference = torch.nn.BatchNorm1d(3).double()
    x_all = full.clone().requires_grad_()
    y_all = reference(x_all)
    (y_all * weights).sum().backward()
    # As tests/test_sync_batchnorm.py counts them: the sums over a channel's samples forward and
    # backward, the ranks' partial results combined, and the elementwise formulas.
    roundings = 2 * (4 * size * 5) + size + 16
    for what, got, want in (("output", y, y_all[mine]), ("input gradient", x.grad, x_all.grad[mine]),
                            ("running mean", layer.running_mean, reference.running_mean),
                            ("running variance", layer.running_var, reference.running_var)):
        try:
            assert_within(got.detach().cpu(), want.detach(), roundings=roundings)
        except AssertionError as error:
            raise AssertionError(f"{what}: {error}") from None


class Split(torch.nn.Module):
    """Horovod's model parallelism test's model: its first layer on `device`, its second on the CPU."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.first, self.second = torch.nn.Linear(10, 16).double(), torch.nn.Linear(16, 3).double()

    def forward(self, x):
        return self.second(torch.tanh(self.first(x.to(self.first.weight.device))).to("cpu"))


def test_distributed_optimizer_over_a_model_split_between_the_device_and_the_cpu(device, ranks):
    size, rank, _ = ranks
    model = Split(seed=rank)
    model.first.to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
    reference = Split(seed=0)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        x_all, y_all = union_of_batches(step, range(size))
        reference_optimizer.zero_grad()
        torch.nn.functional.cross_entropy(reference(x_all), y_all).backward()
        reference_optimizer.step()
    assert_trained_like(list(model.parameters()), list(reference.parameters()), f"a model on {device} and cpu",
                        rows=len(x_all), sizes=(10, 16, 3))
