"""Data-parallel training equals single-process training on the union of the ranks' batches.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order:
each launch starts every rank's interpreter (torch included), which costs more than most tests.
The first test measures this process's shared mappings, which windows dropped by earlier tests
would shrink while it runs (they are freed at the next DataParallel construction); the refusals,
raised on every rank, come last."""
import copy
import gc
import warnings

import pytest
import torch
from mpi4py import MPI

import mpidist as md

pytestmark = pytest.mark.mpi_shared_launch

STEPS = 4
BATCH = 8

# The world as one node (None), or with every rank on an emulated node of its own ("1").
ON_NODES = pytest.mark.parametrize("ranks_per_node", [None, "1"], ids=["one_node", "node_per_rank"])
# One bucket for the whole model; a bucket per parameter.
BUCKET_SIZES = pytest.mark.parametrize("bucket_mb", [25, 0.0005], ids=["one_bucket", "bucket_per_parameter"])


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(step, rank):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 10, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator)


def reference_parameters(size, steps=STEPS, lr=0.1):
    """Single-process training on the union of every rank's batch."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        parts = [batch(step, r) for r in range(size)]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def assert_close_to_reference(params, reference, tolerance=1e-5):
    for mine, ref in zip(params, reference):
        relative = (mine - ref).norm() / ref.norm()
        assert relative < tolerance, f"relative difference {relative}"


def emulate_nodes(ranks_per_node, monkeypatch):
    """The world as one node (None), or with every rank on an emulated node of its own ("1"):
    the buckets then go through the asynchronous engine instead of the shared slots."""
    if ranks_per_node:
        monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", ranks_per_node)
    else:
        monkeypatch.delenv("MPIDIST_RANKS_PER_NODE", raising=False)


def communicator(ranks_per_node, monkeypatch):
    """The world on the nodes of `ranks_per_node` (emulate_nodes)."""
    emulate_nodes(ranks_per_node, monkeypatch)
    return md.Communicator(MPI.COMM_WORLD)


def train_steps(wrapped, rank, steps):
    """`steps` steps of SGD with momentum through `wrapped` on this rank's batches."""
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = batch(step, rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(wrapped(x), y).backward()
        optimizer.step()


def train_and_compare(wrapped, model, rank, ranks):
    """STEPS steps of SGD through `wrapped` on this rank's batches; `model`'s parameters must then
    match single-process training on every rank's batches."""
    train_steps(wrapped, rank, STEPS)
    assert_close_to_reference(list(model.parameters()), reference_parameters(ranks))


def shared_mapping_bytes() -> int:
    """Bytes of this process's writable shared mappings (the MPI shared windows among them)."""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            addresses, permissions = line.split()[:2]
            if permissions == "rw-s":
                low, high = (int(a, 16) for a in addresses.split("-"))
                total += high - low
    return total


def local_gradients(x, y):
    """This rank's own gradients of the test model (nothing averaged)."""
    model = make_model()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("views", [False, True], ids=["copied", "views"])
def test_dropped_data_parallel_stops_and_gives_back_its_memory(mpi_world, views):
    # A program that wraps its model again (a new bucket size, another trial) must neither keep
    # all-reducing through the old wrapper's hooks nor keep its shared window.
    model = make_model()
    wide = torch.nn.Linear(256, 256)  # 256 KB of gradients: windows big enough to see
    x, y = batch(0, mpi_world.rank)

    def wrap_and_step(model, wide):
        ddp = md.DataParallel(model, gradient_as_bucket_view=views)
        wide_ddp = md.DataParallel(wide, gradient_as_bucket_view=views)
        for _ in range(2):  # with views, the gradients are slot views from the second step on
            model.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            wide_ddp(torch.ones(1, 256)).sum().backward()
        return ddp, wide_ddp

    kept = wrap_and_step(model, wide)
    before = shared_mapping_bytes()
    also_kept = wrap_and_step(make_model(), torch.nn.Linear(256, 256))
    one_wrap = shared_mapping_bytes() - before  # the windows of one wrap
    del also_kept
    for _ in range(5):
        del kept
        model.zero_grad()
        wide.zero_grad()
        kept = wrap_and_step(model, wide)
    grown = shared_mapping_bytes() - before
    assert one_wrap > 256 * 1024, (views, one_wrap)
    assert grown <= one_wrap, f"views={views}: shared mappings grew by {grown} bytes over five wraps (one wrap: {one_wrap})"
    del kept
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for mine, own in zip(model.parameters(), local_gradients(x, y)):
        torch.testing.assert_close(mine.grad, own)  # not averaged any more


@pytest.mark.mpi(ranks=[2, 3])
@ON_NODES
@BUCKET_SIZES
def test_data_parallel_matches_single_process(mpi_ranks, mpi_world, monkeypatch, ranks_per_node, bucket_mb):
    # On one node the buckets go through the shared slots polled from the hooks; on (emulated)
    # separate nodes through the asynchronous engine.
    comm = communicator(ranks_per_node, monkeypatch)
    model = make_model(seed=mpi_world.rank)  # different starts: construction broadcasts rank 0's
    ddp = md.DataParallel(model, comm=comm, bucket_mb=bucket_mb)
    assert (ddp.buckets.slots is None) == bool(ranks_per_node)
    train_and_compare(ddp, model, mpi_world.rank, mpi_ranks)


def train_with_views(comm, rank, views, set_to_none, compression, bucket_mb):
    """Trains STEPS steps with gradient clipping in place; returns the parameters, a copy of the
    gradients of every step and the DataParallel."""
    model = make_model(seed=rank)
    ddp = md.DataParallel(model, comm=comm, bucket_mb=bucket_mb, compression=compression,
                          gradient_as_bucket_view=views)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        optimizer.zero_grad(set_to_none=set_to_none)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # changes the gradients in place
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], grads, ddp


@pytest.mark.mpi(ranks=[2, 3])
@ON_NODES
@pytest.mark.parametrize("compression", [None, "bf16"])
@BUCKET_SIZES
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
def test_gradient_as_bucket_view_trains_like_copying(mpi_world, monkeypatch, ranks_per_node, compression,
                                                     bucket_mb, set_to_none):
    # gradient_as_bucket_view leaves the averages in the buckets' memory (the shared slots on one
    # node, the flat buffers otherwise) and makes the gradients views of it; training must not
    # change by a bit, with zero_grad setting the gradients to None or zeroing them in place.
    comm = communicator(ranks_per_node, monkeypatch)
    copied, copied_grads, _ = train_with_views(comm, mpi_world.rank, False, set_to_none, compression, bucket_mb)
    viewed, viewed_grads, ddp = train_with_views(comm, mpi_world.rank, True, set_to_none, compression, bucket_mb)
    for a, b in zip(copied, viewed):
        assert torch.equal(a, b)
    for step_a, step_b in zip(copied_grads, viewed_grads):
        for a, b in zip(step_a, step_b):
            assert torch.equal(a, b)
    # After backward each gradient is its view (a bucket of one gradient without
    # compression is all-reduced in that gradient itself: it has none).
    grads = {id(p.grad) for p in ddp.module.parameters()}
    with_views = [b for b in ddp.buckets.buckets if b.views is not None]
    assert with_views or (bucket_mb < 1 and compression is None and ranks_per_node)
    assert all(id(v) in grads for b in with_views for v in b.views)


@pytest.mark.mpi(ranks=[2, 3])
@ON_NODES
def test_gradient_as_bucket_view_trains_as_one_process(mpi_ranks, mpi_world, monkeypatch, ranks_per_node):
    # The same as one process on all the batches, without clipping.
    comm = communicator(ranks_per_node, monkeypatch)
    model = make_model(seed=mpi_world.rank)
    ddp = md.DataParallel(model, comm=comm, gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, mpi_world.rank)
        optimizer.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    assert_close_to_reference(list(model.parameters()), reference_parameters(mpi_ranks))


class ChannelsLast(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = torch.nn.Conv2d(3, 8, 3)
        self.conv2 = torch.nn.Conv2d(8, 8, 3)
        self.head = torch.nn.Linear(8, 3)
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(x.mean(dim=(2, 3)))


def image_batch(step, rank):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 3, 12, 12, generator=generator).to(memory_format=torch.channels_last)
    return x, torch.randint(0, 3, (4,), generator=generator)


@pytest.mark.mpi(ranks=[2, 3])
@ON_NODES
@pytest.mark.parametrize("bucket_mb", [25, 0.001], ids=["one_bucket", "bucket_per_parameter"])
def test_channels_last_copied_and_viewed_gradients(mpi_ranks, mpi_world, monkeypatch, ranks_per_node, bucket_mb):
    # Gradients of channels_last weights are not contiguous: they are packed and unpacked by
    # torch copies, and with gradient_as_bucket_view the shared slots read contiguous copies of
    # them, which must live until the all-reduce has read them.
    comm = communicator(ranks_per_node, monkeypatch)

    def train(views):
        model = ChannelsLast(seed=mpi_world.rank)  # construction broadcasts rank 0's weights
        ddp = md.DataParallel(model, comm=comm, bucket_mb=bucket_mb, gradient_as_bucket_view=views)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            x, y = image_batch(step, mpi_world.rank)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            assert views or not model.conv1.weight.grad.is_contiguous()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    reference = ChannelsLast()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        parts = [image_batch(step, r) for r in range(mpi_ranks)]
        optimizer.zero_grad()
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        optimizer.step()
    copied, viewed = train(False), train(True)
    assert_close_to_reference(copied, [p.detach() for p in reference.parameters()])
    for a, b in zip(copied, viewed):
        assert torch.equal(a, b)


@pytest.mark.mpi(ranks=[2])
@ON_NODES
def test_shared_slot_buckets_hold_at_most_4_mb(mpi_world, monkeypatch, ranks_per_node):
    # Through the shared slots (one node) buckets are capped at 4 MiB whatever bucket_mb says;
    # a gradient larger than that gets a bucket of its own. Through the engine bucket_mb rules.
    comm = communicator(ranks_per_node, monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 600), torch.nn.Linear(600, 600),
                                torch.nn.Linear(600, 1800), torch.nn.Linear(1800, 10))
    ddp = md.DataParallel(model, comm=comm, bucket_mb=25)
    sizes = [sum(p.numel() * 4 for p in bucket.params) for bucket in ddp.buckets.buckets]
    assert sum(sizes) == sum(p.numel() * 4 for p in model.parameters())
    if ranks_per_node:
        assert ddp.buckets.slots is None and len(sizes) == 2 and sizes[0] <= 1024 * 1024
    else:
        alone = 600 * 1800 * 4  # 4.3 MB: more than the cap
        assert ddp.buckets.slots is not None and len(sizes) > 2
        assert all(size <= 4 * 1024 * 1024 for size in sizes if size != alone), sizes
        assert alone in sizes
    plain = copy.deepcopy(model)
    x = torch.randn(4, 600, generator=torch.Generator().manual_seed(mpi_world.rank))
    ddp(x).square().mean().backward()
    plain(x).square().mean().backward()
    for param, local in zip(model.parameters(), plain.parameters()):
        expected = local.grad.numpy().astype("float64")  # MPI's own sum of the local gradients
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, expected, op=MPI.SUM)
        torch.testing.assert_close(param.grad.double(), torch.from_numpy(expected) / comm.size,
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.mpi(ranks=[2, 3])
def test_channels_last_parameter_averaging_and_horovod_broadcast(mpi_ranks, mpi_world):
    import mpidist.torch as hvd
    model = ChannelsLast(seed=mpi_world.rank)
    assert not model.conv1.weight.is_contiguous()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for mine, ref in zip(model.parameters(), ChannelsLast(seed=0).parameters()):
        assert torch.equal(mine, ref)
    averaging = md.ParameterAveraging(model, every=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(mpi_world.rank))
    assert averaging.step()
    for mine, ref in zip(model.parameters(), ChannelsLast(seed=0).parameters()):
        torch.testing.assert_close(mine, ref + sum(range(mpi_ranks)) / mpi_ranks)
    assert not model.conv1.weight.is_contiguous()  # still channels_last


class TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 2)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x, use_b):
        return self.a(x) + (self.b(x) if use_b else 0)


@pytest.mark.mpi(ranks=[2, 3])
def test_parameters_without_gradients_do_not_hang(mpi_ranks, mpi_world):
    model = TwoBranches()
    ddp = md.DataParallel(model, bucket_mb=0.00001)
    use_b = mpi_world.rank == 0  # only rank 0 touches branch b
    x = torch.ones(1, 4)
    ddp(x, use_b).sum().backward()
    ones = torch.ones(2, 4)
    torch.testing.assert_close(model.a.weight.grad, ones)  # same on every rank: average of ones
    torch.testing.assert_close(model.b.weight.grad, ones / mpi_ranks)  # rank 0's ones, zeros elsewhere


@pytest.mark.mpi(ranks=[2, 3])
def test_parameter_averaging_of_mixed_dtypes(mpi_ranks, mpi_world):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).double())
    averaging = md.ParameterAveraging(model)
    start = [p.detach().clone() for p in model.parameters()]  # rank 0's, after the broadcast
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(mpi_world.rank))
    assert averaging.step() is True
    for mine, first in zip(model.parameters(), start):
        assert mine.dtype == first.dtype
        torch.testing.assert_close(mine.detach(), first + sum(range(mpi_ranks)) / mpi_ranks)


class NormedWithStridedBuffer(torch.nn.Module):
    """Batch norm (float32 statistics, an int64 count) and a float64 buffer that is not contiguous."""

    def __init__(self):
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)
        self.register_buffer("table", torch.zeros(3, 5, dtype=torch.float64).t())

    def forward(self, x):
        return self.norm(self.linear(x)) + self.table.sum()


@pytest.mark.mpi(ranks=[2, 3])
def test_each_forward_broadcasts_rank_0s_buffers_in_one_broadcast_per_dtype(mpi_ranks, mpi_world, monkeypatch):
    """As DDP's broadcast_buffers: before each training forward every rank gets rank 0's buffers,
    whatever their strides, coalesced into one broadcast per dtype (three here), not one per buffer."""
    model = NormedWithStridedBuffer()
    ddp = md.DataParallel(model)
    rank = mpi_world.rank

    def rank_dependent_buffers(r):
        with torch.no_grad():
            model.norm.running_mean.fill_(r + 1.0)
            model.norm.running_var.fill_(r + 2.0)
            model.norm.num_batches_tracked.fill_(10 * (r + 1))
            model.table.copy_(torch.arange(15, dtype=torch.float64).reshape(5, 3) * (r + 1))

    rank_dependent_buffers(rank)
    broadcasts = []
    broadcast = ddp.comm.broadcast
    monkeypatch.setattr(ddp.comm, "broadcast", lambda tensor, **kw: broadcasts.append(tensor.dtype) or
                        broadcast(tensor, **kw))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    ddp(x).sum().backward()
    assert sorted(map(str, broadcasts)) == ["torch.float32", "torch.float64", "torch.int64"], broadcasts
    assert not model.table.is_contiguous()
    torch.testing.assert_close(model.table, torch.arange(15, dtype=torch.float64).reshape(5, 3), rtol=0, atol=0)
    assert int(model.norm.num_batches_tracked) == 10 + 1  # rank 0's count, then this forward's
    # Rank 0's statistics, then this forward's update with this rank's batch (momentum 0.1).
    with torch.no_grad():
        features = model.linear(x)
    expected_mean = 0.9 * 1.0 + 0.1 * features.mean(0)
    expected_var = 0.9 * 2.0 + 0.1 * features.var(0, unbiased=True)
    torch.testing.assert_close(model.norm.running_mean, expected_mean)
    torch.testing.assert_close(model.norm.running_var, expected_var)


@pytest.mark.mpi(ranks=[2, 3])
def test_a_coalesced_broadcast_fills_buckets_up_to_their_size_and_gives_every_rank_rank_0s_values(
        mpi_world, monkeypatch):
    from mpidist.parallel import model_state
    monkeypatch.setattr(model_state, "BROADCAST_BUCKET_BYTES", 16)
    rank = mpi_world.rank
    tensors = [torch.full((count,), float(rank + k)) for k, count in enumerate([4, 2, 2, 5, 1])]
    sizes = []
    broadcast = mpi_world.broadcast
    monkeypatch.setattr(mpi_world, "broadcast", lambda tensor, **kw: sizes.append(tensor.numel()) or
                        broadcast(tensor, **kw))
    model_state.broadcast_coalesced(mpi_world, tensors)
    assert sizes == [4, 2 + 2, 5, 1], sizes  # 16 bytes, 16, a tensor over the size alone, the rest
    for k, tensor in enumerate(tensors):
        torch.testing.assert_close(tensor, torch.full_like(tensor, float(k)), rtol=0, atol=0)


@pytest.mark.mpi(ranks=[2, 3])
def test_ddp_arguments_are_accepted_as_ddp_takes_them(mpi_ranks, mpi_world):
    model = make_model(seed=mpi_world.rank)
    ddp = md.DataParallel(model, device_ids=None, output_device=None, find_unused_parameters=True,
                          static_graph=True, bucket_cap_mb=0.0005)
    same_size = md.DataParallel(make_model(), bucket_mb=0.0005)  # bucket_cap_mb is bucket_mb
    assert len(ddp.buckets.buckets) == len(same_size.buckets.buckets) > 1
    del same_size
    train_and_compare(ddp, model, mpi_world.rank, mpi_ranks)


@pytest.mark.mpi(ranks=[2, 3])
def test_gradient_views_outlive_their_data_parallel(mpi_world):
    model = make_model()
    ddp = md.DataParallel(model, gradient_as_bucket_view=True)
    x, y = batch(0, mpi_world.rank)
    for _ in range(2):
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
    grads = [p.grad for p in model.parameters()]  # views of the shared slots now
    expected = [g.clone() for g in grads]
    del ddp, model
    for _ in range(3):  # each construction frees the windows every rank has dropped
        md.DataParallel(make_model())
    for grad, value in zip(grads, expected):
        torch.testing.assert_close(grad, value)


@pytest.mark.mpi(ranks=[2, 3])
def test_freed_communicator_gives_back_dropped_windows(mpi_world):
    """Windows of dropped DataParallels wait for the next construction on their communicator;
    freeing the communicator gives them back instead, and forgets the communicator."""
    from mpidist.collectives import node_buckets
    x, y = batch(0, mpi_world.rank)
    before = shared_mapping_bytes()
    with md.Communicator(MPI.COMM_WORLD) as comm:
        wide = md.DataParallel(torch.nn.Linear(256, 256), comm=comm)
        wide(x.new_ones(1, 256)).sum().backward()
        assert shared_mapping_bytes() - before > 256 * 1024
        node_comm = comm.node_comm
        del wide
        gc.collect()
        assert id(node_comm) in node_buckets._released  # released, not freed yet
    assert id(node_comm) not in node_buckets._released
    assert shared_mapping_bytes() <= before
    comm.free()  # a second time does nothing


@pytest.mark.mpi(ranks=[2])
def test_no_sync_accumulates_then_averages(mpi_ranks, mpi_world):
    model = make_model()
    ddp = md.DataParallel(model)
    reference = make_model()
    x1, y1 = batch(0, mpi_world.rank)
    x2, y2 = batch(1, mpi_world.rank)
    with ddp.no_sync():
        torch.nn.functional.cross_entropy(ddp(x1), y1).backward()
    torch.nn.functional.cross_entropy(ddp(x2), y2).backward()
    for r in range(mpi_ranks):
        for step in (0, 1):
            x, y = batch(step, r)
            torch.nn.functional.cross_entropy(reference(x), y).backward()
    for mine, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, ref.grad / mpi_ranks, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(ranks=[2])
def test_bf16_compression_rounds_each_gradient_at_most_three_times(mpi_ranks, mpi_world):
    model = make_model(seed=mpi_world.rank)
    ddp = md.DataParallel(model, compression="bf16")
    x, y = batch(0, mpi_world.rank)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    reference = make_model()
    for r in range(mpi_ranks):
        xr, yr = batch(0, r)
        torch.nn.functional.cross_entropy(reference(xr), yr).backward()
    for mine, ref in zip(model.parameters(), reference.parameters()):
        # bf16 on the wire: each gradient rounded once per rank and once more after the sum.
        expected = ref.grad / mpi_ranks
        assert ((mine.grad - expected).abs() <= 3 * 2 ** -8 * ref.grad.abs().max() + 1e-7).all()


@pytest.mark.mpi(ranks=[2])
def test_parameter_averaging_every_second_step(mpi_ranks, mpi_world):
    averaging_model = make_model(seed=mpi_world.rank)
    averaging = md.ParameterAveraging(averaging_model, every=2)
    with torch.no_grad():
        for p in averaging_model.parameters():
            p.add_(float(mpi_world.rank))
    assert averaging.step() is False
    assert averaging.step() is True
    start = make_model(seed=0)
    for mine, ref in zip(averaging_model.parameters(), start.parameters()):
        torch.testing.assert_close(mine, ref + sum(range(mpi_ranks)) / mpi_ranks)


@pytest.mark.mpi(ranks=[2])
def test_dropped_distributed_optimizer_stops_exchanging(mpi_world):
    import mpidist.torch as hvd
    hvd.init()
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batch(0, mpi_world.rank)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.synchronize()
    average = [hvd.allreduce(g) for g in local_gradients(x, y)]
    for mine, expected in zip(model.parameters(), average):
        torch.testing.assert_close(mine.grad, expected)
    del optimizer
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for mine, own in zip(model.parameters(), local_gradients(x, y)):
        torch.testing.assert_close(mine.grad, own)


@pytest.mark.mpi(ranks=[2])
def test_a_second_live_wrapper_of_the_same_parameters_is_refused(mpi_world):
    model = make_model()
    first = md.DataParallel(model)
    with pytest.raises(md.InvalidArgumentError, match="already has its gradient all-reduced by a DataParallel"):
        md.DataParallel(model)
    first.__dict__["cycle"] = first  # only the cycle collector can free it now
    del first
    second = md.DataParallel(model)  # the refusal collects dropped wrappers first
    x, y = batch(0, mpi_world.rank)
    torch.nn.functional.cross_entropy(second(x), y).backward()
    average = [md.allreduce(g, op="avg") for g in local_gradients(x, y)]
    for mine, expected in zip(model.parameters(), average):
        torch.testing.assert_close(mine.grad, expected)


def train_with_optimizer(model, optimizer, rank):
    """STEPS steps of `optimizer` (a DistributedOptimizer) on this rank's batches."""
    for step in range(STEPS):
        x, y = batch(step, rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.fixture
def process_set_of_every_rank(mpi_ranks, monkeypatch, ranks_per_node):
    """A Horovod process set of every rank, on the nodes of `ranks_per_node` (emulate_nodes)."""
    import mpidist.torch as hvd
    hvd.init()
    emulate_nodes(ranks_per_node, monkeypatch)
    process_set = hvd.add_process_set(list(range(mpi_ranks)))
    yield process_set
    hvd.remove_process_set(process_set)


@pytest.mark.mpi(ranks=[2, 3])
@ON_NODES
# Parameters 0-5 are w1, b1, w2, b2, w3, b3; without groups all six make one bucket [5..0].
@pytest.mark.parametrize("groups, num_groups, layout", [(2, 0, [[5, 4, 3], [2, 1, 0]]),
                                                        ("b3 w1 | b1", 0, [[4, 3, 2], [1], [5, 0]]),
                                                        (None, 3, [[5, 4], [3, 2], [1, 0]])],
                         ids=["groups=2", "groups=lists", "num_groups=3"])
def test_distributed_optimizer_groups(mpi_ranks, mpi_world, ranks_per_node, process_set_of_every_rank,
                                      groups, num_groups, layout):
    """Horovod's groups: each group is one bucket of its own, ordered by when backward completes
    it, on the shared slots and on the engine; training is unchanged."""
    import mpidist.torch as hvd
    model = make_model()
    params = list(model.parameters())
    if isinstance(groups, str):
        groups = [[params[5], params[0]], [params[1]]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9),
                                             groups=groups, num_groups=num_groups,
                                             process_set=process_set_of_every_rank)
    assert [w.category for w in caught] == ([DeprecationWarning] if num_groups else [])
    index = {id(p): k for k, p in enumerate(params)}
    assert [[index[id(p)] for p in b.params] for b in optimizer._buckets.buckets] == layout
    assert (optimizer._buckets.slots is not None) == (ranks_per_node is None)
    train_with_optimizer(model, optimizer, mpi_world.rank)
    assert_close_to_reference(params, reference_parameters(mpi_ranks))


@pytest.mark.mpi(ranks=[2, 3])
# Gradient bytes, w1 to b3: 640, 64, 1024, 64, 192, 12.
@pytest.mark.parametrize("threshold, layout", [("0", [[5], [4], [3], [2], [1], [0]]),
                                               ("300", [[5, 4, 3], [2], [1], [0]])])
def test_horovod_fusion_threshold_sizes_the_buckets(mpi_ranks, mpi_world, monkeypatch, threshold, layout):
    # Horovod's fusion threshold sizes the automatic buckets (bytes; 0: one gradient per bucket).
    import mpidist.torch as hvd
    hvd.init()
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", threshold)
    model = make_model()
    params = list(model.parameters())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    index = {id(p): k for k, p in enumerate(params)}
    assert [[index[id(p)] for p in b.params] for b in optimizer._buckets.buckets] == layout
    train_with_optimizer(model, optimizer, mpi_world.rank)
    assert_close_to_reference(params, reference_parameters(mpi_ranks))


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("wrapper", ["DataParallel", "DistributedOptimizer"])
def test_sparse_gradients_are_averaged_as_dense(mpi_ranks, mpi_world, wrapper):
    import mpidist.torch as hvd
    hvd.init()

    def embedding_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(8, 2))

    def tokens(rank):
        return torch.tensor([[1, 2 + rank], [rank, 9]])

    def local_gradients(rank):
        model = embedding_model()
        model(tokens(rank)).pow(2).sum().backward()
        return [p.grad.to_dense() for p in model.parameters()]

    expected = [sum(grads) / mpi_ranks for grads in zip(*(local_gradients(r) for r in range(mpi_ranks)))]
    model = embedding_model()
    if wrapper == "DataParallel":
        wrapped, optimizer = md.DataParallel(model), None
    else:
        wrapped, optimizer = model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    wrapped(tokens(mpi_world.rank)).pow(2).sum().backward()
    if optimizer is not None:
        optimizer.synchronize()
    # DataParallel leaves the gradient dense; the DistributedOptimizer hands it back sparse, as Horovod's
    assert model[0].weight.grad.layout == (torch.strided if optimizer is None else torch.sparse_coo)
    for param, average in zip(model.parameters(), expected):
        torch.testing.assert_close(param.grad.to_dense(), average)


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("hook, wire, tolerance", [("allreduce_hook", None, 0.0),
                                                   ("fp16_compress_hook", torch.float16, 2e-3),
                                                   ("bf16_compress_hook", torch.bfloat16, 1e-2)])
def test_ddp_comm_hooks(mpi_world, hook, wire, tolerance):
    """DDP's built-in hooks: the default average, and fp16/bf16 compression that divides before
    sending."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    x, y = batch(0, mpi_world.rank)
    average = [md.allreduce(g, op="avg") for g in local_gradients(x, y)]
    model = make_model()
    ddp = md.DataParallel(model)
    ddp.register_comm_hook(None, getattr(default_hooks, hook))
    assert [b.wire_dtype for b in ddp.buckets.buckets] == [wire] * len(ddp.buckets.buckets)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    for param, expected in zip(model.parameters(), average):
        torch.testing.assert_close(param.grad, expected, rtol=tolerance, atol=tolerance * expected.abs().max())


@pytest.mark.mpi(ranks=[2, 3])
def test_fp16_compress_hook_averages_gradients_whose_sum_overflows_float16(mpi_world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    # 40000 on every rank: a float16 sum would overflow (65504), the average does not.
    large = torch.nn.Linear(4, 1, bias=False)
    ddp = md.DataParallel(large)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    ddp(torch.full((1, 4), 40000.0)).sum().backward()
    assert large.weight.grad.tolist() == [[40000.0] * 4]


HOROVOD_SCRIPT = '''
import torch
import mpidist.torch as hvd

hvd.init()
torch.manual_seed(hvd.rank())
model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                            torch.nn.Tanh(), torch.nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size() / hvd.size(), momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     backward_passes_per_step=1, op=hvd.Average)
for step in range(4):
    generator = torch.Generator().manual_seed(1000 * step + hvd.rank())
    x, y = torch.randn(8, 10, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum)
assert total.item() == sum(range(hvd.size()))
handle = hvd.allreduce_async(torch.ones(3))
assert hvd.synchronize(handle).tolist() == [1.0, 1.0, 1.0]
gathered = hvd.allgather(torch.full((1, 2), float(hvd.rank())))
assert gathered[:, 0].tolist() == [float(r) for r in range(hvd.size())]
assert hvd.broadcast_object({"epoch": hvd.rank() + 5}, root_rank=0) == {"epoch": 5}
assert hvd.mpi_enabled() and not hvd.nccl_built()
if hvd.size() & (hvd.size() - 1) == 0:  # Adasum of parallel vectors: their mean
    parallel = hvd.allreduce(torch.full((3,), float(hvd.rank() + 1)), op=hvd.Adasum)
    assert torch.allclose(parallel, torch.full((3,), (hvd.size() + 1) / 2)), parallel
else:
    try:
        hvd.allreduce(torch.ones(1), op=hvd.Adasum)
    except ValueError as exc:
        assert "power-of-two" in str(exc)
    else:
        raise SystemExit("Adasum needs a power-of-two number of ranks")
if hvd.rank() == 0:
    torch.save({str(i): p.detach() for i, p in enumerate(model.parameters())}, OUTPUT)
'''


@pytest.mark.mpi(ranks=[2, 3])
def test_horovod_script_runs_unchanged(mpi_ranks, tmp_path):
    """A Horovod script as its users write it, run as a whole by every rank of the launch."""
    output = tmp_path / "params.pt"  # each rank's own: only rank 0 writes it
    namespace = {"__name__": "__main__"}
    exec(compile(f"OUTPUT = {str(output)!r}\n" + HOROVOD_SCRIPT, "horovod_script.py", "exec"), namespace)
    reference = reference_parameters(mpi_ranks)
    assert_close_to_reference([p.detach() for p in namespace["model"].parameters()], reference)
    if namespace["hvd"].rank() == 0:
        trained = torch.load(output)
        assert_close_to_reference([trained[str(i)] for i in range(len(trained))], reference)


@pytest.mark.mpi(ranks=[2, 3])
def test_comm_hooks_other_than_ddps_are_refused_naming_ddp_over_the_mpidist_backend(mpi_world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    ddp = md.DataParallel(make_model())
    for hook in (lambda state, bucket: None,):  # powerSGD_hook it runs itself (test_compressors.py)
        with pytest.raises(md.NotOfferedError, match=r"register_comm_hook\(.*\): md.DataParallel runs DDP's "
                           r"allreduce_hook.*use torch.nn.parallel.DistributedDataParallel over the mpidist backend"):
            ddp.register_comm_hook(None, hook)
    with pytest.raises(md.InvalidArgumentError, match="state is a torch.distributed process group"):
        ddp.register_comm_hook(object(), default_hooks.fp16_compress_hook)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # the refusals left it without a hook


@pytest.mark.mpi(ranks=[2])
def test_powersgd_runs_in_ddp_over_the_mpidist_backend_as_over_gloo(mpi_world):
    # The route the refusal above names: torch's DDP over the "mpidist" backend runs PowerSGD's
    # hook, and trains as the same DDP over gloo does.
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel
    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("mpidist")
    gloo = dist.new_group(backend="gloo")
    try:
        trained = []
        for group in (None, gloo):  # None: the default group, mpidist's
            model = make_model().double()
            ddp = DistributedDataParallel(model, process_group=group)
            ddp.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                                               start_powerSGD_iter=2, random_seed=0),
                                   powerSGD_hook.powerSGD_hook)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for step in range(4):  # two plain all-reduces, then two compressed exchanges
                x, y = batch(step, mpi_world.rank)
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x.double()), y).backward()
                optimizer.step()
            trained.append([p.detach().clone() for p in model.parameters()])
            del ddp, optimizer
    finally:
        gc.collect()  # DDP's reducers before the gloo group (test_distributed_backend.py says why)
        dist.destroy_process_group(gloo)
        del gloo
        if started_here:
            dist.destroy_process_group()
    for over_mpidist, over_gloo in zip(*trained):
        torch.testing.assert_close(over_mpidist, over_gloo, rtol=1e-12, atol=1e-12)


@pytest.mark.mpi(ranks=[2, 3])
def test_a_second_comm_hook_is_refused(mpi_world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    ddp = md.DataParallel(make_model())
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(md.MpidistError, match="can only be called once"):
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)


@pytest.mark.mpi(ranks=[2, 3])
def test_a_comm_hook_after_the_first_backward_is_refused(mpi_world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    trained = md.DataParallel(make_model())
    x, y = batch(0, 0)
    torch.nn.functional.cross_entropy(trained(x), y).backward()
    with pytest.raises(md.MpidistError, match="before the first backward"):
        trained.register_comm_hook(None, default_hooks.fp16_compress_hook)


@pytest.mark.mpi(ranks=[2, 3])
def test_a_comm_hook_beside_compression_is_refused(mpi_world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    compressed = md.DataParallel(make_model(), compression="bf16")
    with pytest.raises(md.InvalidArgumentError, match="compression='bf16': choose one"):
        compressed.register_comm_hook(None, default_hooks.fp16_compress_hook)


@pytest.mark.mpi(ranks=[2, 3])
def test_gradient_as_bucket_view_must_agree_on_one_node(mpi_world):
    with pytest.raises(md.InvalidArgumentError, match="gradient_as_bucket_view differs between ranks"):
        md.DataParallel(make_model(), gradient_as_bucket_view=mpi_world.rank == 1)


@pytest.mark.mpi(ranks=[2])
def test_unknown_algorithm_is_refused(mpi_world):
    with pytest.raises(md.InvalidArgumentError, match="unknown all-reduce algorithm 'bogus'"):
        md.DataParallel(make_model(), algorithm="bogus")


@pytest.mark.mpi(ranks=[2])
def test_parameter_averaging_without_parameters_is_refused(mpi_world):
    with pytest.raises(md.InvalidArgumentError, match="no parameters to average"):
        md.ParameterAveraging(torch.nn.ReLU())


@pytest.mark.mpi(ranks=[2])
@pytest.mark.parametrize("arguments, message", [
    (dict(device_ids=[0]), r"device_ids=\[0\]: the module's parameters are on \['cpu'\]"),
    (dict(device_ids=["cpu", "cpu"]), r"device_ids=\['cpu', 'cpu'\]"),
    (dict(output_device=0), "output_device= needs device_ids="),
    (dict(process_group=object()), "process_group= is torch.distributed's; pass comm="),
    (dict(bucket_mb=10, bucket_cap_mb=5), "bucket_mb=10 and bucket_cap_mb=5 disagree"),
], ids=["device_ids_not_the_parameters", "two_device_ids", "output_device_alone", "process_group", "two_bucket_sizes"])
def test_ddp_arguments_that_cannot_apply_are_refused(mpi_world, arguments, message):
    with pytest.raises(md.InvalidArgumentError, match=message):
        md.DataParallel(make_model(), **arguments)


@pytest.mark.mpi(ranks=[2])
def test_malformed_horovod_fusion_threshold_is_refused(mpi_world, monkeypatch):
    import mpidist.torch as hvd
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "64MB")
    with pytest.raises(md.InvalidArgumentError, match="HOROVOD_FUSION_THRESHOLD='64MB' must be an integer"):
        hvd.DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1))


@pytest.mark.mpi(ranks=[2])
@pytest.mark.parametrize("groups, message", [
    (lambda w1, b1: 0, "groups=0: pass a positive number"),
    (lambda w1, b1: "two", "groups must be a positive number or a list of lists of parameters, got str"),
    (lambda w1, b1: [w1], r"groups\[0\] is a Parameter; each group must be a list"),
    (lambda w1, b1: [[w1], [1.0]], r"groups\[1\] holds a float"),
    (lambda w1, b1: [[w1, b1], [w1]], r"groups\[1\]: a parameter can only appear once"),
    (lambda w1, b1: [[torch.zeros(2)]], r"groups\[0\] holds a tensor that is not a parameter"),
], ids=["zero", "a_string", "a_parameter", "a_float", "a_parameter_twice", "a_tensor"])
def test_distributed_optimizer_refuses_bad_groups(mpi_world, groups, message):
    import mpidist.torch as hvd
    model = make_model()
    w1, b1 = list(model.parameters())[:2]
    with pytest.raises(md.InvalidArgumentError, match=message):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=groups(w1, b1))
