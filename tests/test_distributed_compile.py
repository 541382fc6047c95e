"""torch.compile over the backend "mpidist" (mpidist/distributed/outside_compile.py): compiled
DDP and compiled FSDP2 train as over gloo and as one process, the functional collectives (those
of DTensor, tensor parallelism and compiled FSDP2) and the in-place ones inside a compiled
function give the float64 NumPy reference, and so do mpidist's own collectives called inside one
(run at a graph break).

Compiling costs seconds: each model and function is compiled once per launch (module fixtures)
and every test checks one thing of the results. Everything compiles with "aot_eager": Dynamo and
AOTAutograd, where the backend's process group and collectives are met; inductor, the default,
would only generate C++ kernels around the same collective ops, at many seconds each.
"""
import copy
import gc

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from tolerances import assert_exact, assert_reduced, assert_within

import mpidist  # noqa: F401 (registers the backend)

# The multi-rank tests run in one launch (mpi_shared_launch.py), in file order; the default
# process group (mpidist) and the gloo group made for the first one stay for the others.
pytestmark = pytest.mark.mpi_shared_launch

COMPILER = "aot_eager"
STEPS = 3  # DDP rebuilds its buckets before its second step, with a broadcast from C++


def world():
    """(rank, size) of the default process group over the backend, made once per process."""
    if not dist.is_initialized():
        dist.init_process_group("mpidist")
    return dist.get_rank(), dist.get_world_size()


def values(rank, shape, seed=0):
    """Rank `rank`'s input: any rank can rebuild every other rank's, for the references."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * seed + rank), dtype=torch.float64)


def tiny_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()


@pytest.fixture(scope="module")
def gloo():
    """A gloo group of the whole world: the peer every compiled training is compared with."""
    world()
    group = dist.new_group(backend="gloo")
    yield group
    # The trainings' DDP objects first, so that no Reducer is the gloo group's last owner
    # (test_distributed_backend.py's DDP test says why).
    gc.collect()
    dist.destroy_process_group(group)


def train(model, rank, size):
    """Per-step losses and the parameters after STEPS steps of SGD of the compiled `model` on
    rank `rank`'s batches of values(); the parameters as full tensors (FSDP2's are sharded)."""
    compiled = torch.compile(model, backend=COMPILER)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = compiled(values(rank, (4, 6), seed=step)).pow(2).sum()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), [p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                                 for p in model.parameters()]


def one_process(model, size):
    """The parameters after STEPS steps of SGD on the mean of every rank's loss, in one process."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        (sum(model(values(k, (4, 6), seed=step)).pow(2).sum() for k in range(size)) / size).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


# ---- compiled DDP -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ddp_runs(gloo):
    """{"mpidist" | "gloo" | "one process": the training's (losses or None, parameters)}."""
    from torch.nn.parallel import DistributedDataParallel
    rank, size = world()
    model = tiny_model(seed=0)
    runs = {name: train(DistributedDataParallel(copy.deepcopy(model), process_group=group), rank, size)
            for name, group in (("mpidist", None), ("gloo", gloo))}
    runs["one process"] = (None, one_process(model, size))
    return runs


@pytest.mark.mpi(ranks=[2])
def test_compiled_ddp_losses_are_gloos(mpi_world, ddp_runs):
    # The same compiled program on the same parameters: the first loss alike, the later ones
    # off by the ranks' order of additions in the gradients before them.
    size = world()[1]
    assert_within(ddp_runs["mpidist"][0], ddp_runs["gloo"][0], roundings=3 * STEPS * (4 * size + 16))


@pytest.mark.mpi(ranks=[2])
def test_compiled_ddp_trains_as_over_gloo(mpi_world, ddp_runs):
    # Over gloo only the order of the ranks' additions differs (as test_distributed_backend.py's DDP).
    size = world()[1]
    for ours, over_gloo in zip(ddp_runs["mpidist"][1], ddp_runs["gloo"][1]):
        assert_within(ours, over_gloo, roundings=3 * (size - 1))


@pytest.mark.mpi(ranks=[2])
def test_compiled_ddp_trains_as_one_process(mpi_world, ddp_runs):
    # Each step's gradients sum over every rank's 4 rows, each row's terms through the layers'
    # widths (6, 8, 2), as test_distributed_backend.py's eager DDP.
    size = world()[1]
    for ours, theirs in zip(ddp_runs["mpidist"][1], ddp_runs["one process"][1]):
        assert_within(ours, theirs, roundings=3 * (4 * size + 16))


# ---- compiled FSDP2 -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fsdp2_runs(gloo):
    """{"mpidist" | "gloo": the compiled FSDP2 training's (losses, full parameters)}."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    rank, size = world()
    runs = {}
    for name, group in (("mpidist", dist.group.WORLD), ("gloo", gloo)):
        mesh = DeviceMesh.from_group(group, "cpu")
        model = tiny_model(seed=1)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        runs[name] = train(model, rank, size)
    return runs


@pytest.mark.mpi(ranks=[2])
def test_compiled_fsdp2_losses_are_gloos(mpi_world, fsdp2_runs):
    size = world()[1]
    assert_within(fsdp2_runs["mpidist"][0], fsdp2_runs["gloo"][0], roundings=3 * STEPS * (4 * size + 16))


@pytest.mark.mpi(ranks=[2])
def test_compiled_fsdp2_trains_as_over_gloo(mpi_world, fsdp2_runs):
    # FSDP2 reduce-scatters the gradients: as DDP's, only the order of the ranks' additions differs.
    size = world()[1]
    for ours, over_gloo in zip(fsdp2_runs["mpidist"][1], fsdp2_runs["gloo"][1]):
        assert_within(ours, over_gloo, roundings=3 * (size - 1))


# ---- collectives inside a compiled function -------------------------------------------------------

def functional_collectives(x, group):
    """What DTensor and tensor parallelism trace: the functional collectives of `x`."""
    return {"all_reduce": funcol.all_reduce(x * 2, "sum", group),
            "all_gather_tensor": funcol.all_gather_tensor(x + 1, 0, group),
            "reduce_scatter_tensor": funcol.reduce_scatter_tensor(x.repeat(group.size(), 1), "sum", 0, group)}


@pytest.fixture(scope="module")
def functional_results(gloo):
    """{"mpidist" | "gloo": functional_collectives of the rank's values, compiled}."""
    rank, _ = world()
    compiled = torch.compile(functional_collectives, backend=COMPILER, fullgraph=True)
    return {name: compiled(values(rank, (2, 3)), group) for name, group in (("mpidist", dist.group.WORLD),
                                                                         ("gloo", gloo))}


@pytest.mark.mpi(ranks=[2])
def test_compiled_functional_all_reduce(mpi_world, functional_results):
    _, size = world()
    assert_reduced(functional_results["mpidist"]["all_reduce"], [values(k, (2, 3)) * 2 for k in range(size)], "sum")


@pytest.mark.mpi(ranks=[2])
def test_compiled_functional_all_gather_tensor(mpi_world, functional_results):
    _, size = world()
    expected = np.concatenate([values(k, (2, 3)).numpy() + 1 for k in range(size)])
    assert_exact(functional_results["mpidist"]["all_gather_tensor"], torch.from_numpy(expected))


@pytest.mark.mpi(ranks=[2])
def test_compiled_functional_reduce_scatter_tensor(mpi_world, functional_results):
    _, size = world()
    # Every rank's (size * 2, 3) input is its values repeated: rank r's rows of the sum are the
    # sum of the values.
    assert_reduced(functional_results["mpidist"]["reduce_scatter_tensor"], [values(k, (2, 3)) for k in range(size)],
                   "sum")


@pytest.mark.mpi(ranks=[2])
def test_compiled_functional_collectives_are_gloos(mpi_world, functional_results):
    for name, ours in functional_results["mpidist"].items():
        assert_within(ours, functional_results["gloo"][name], roundings=world()[1] - 1)


def in_place_collectives(x):
    """torch.distributed's in-place calls, which Dynamo traces as the functional collectives where
    it can and runs eagerly at a graph break where it cannot (barrier, send and receive)."""
    rank = dist.get_rank()
    broadcast = x * 2
    dist.broadcast(broadcast, src=1)
    summed = x + 1
    dist.all_reduce(summed, async_op=True).wait()
    gathered = x.new_empty(dist.get_world_size() * x.numel())
    dist.all_gather_into_tensor(gathered, x - 1)
    scattered = torch.empty_like(x)
    dist.reduce_scatter_tensor(scattered, x.repeat(dist.get_world_size()))
    dist.barrier()
    received = torch.empty_like(x)
    peer = 1 - rank
    if rank == 0:
        dist.send(x * 3, peer)
        dist.recv(received, peer)
    else:
        dist.recv(received, peer)
        dist.send(x * 3, peer)
    return {"broadcast": broadcast, "all_reduce": summed, "all_gather_into_tensor": gathered,
            "reduce_scatter_tensor": scattered, "received": received}


@pytest.fixture(scope="module")
def in_place_results():
    rank, _ = world()
    return torch.compile(in_place_collectives, backend=COMPILER)(values(rank, (5,)))


@pytest.mark.mpi(ranks=[2])
def test_compiled_broadcast(mpi_world, in_place_results):
    assert_exact(in_place_results["broadcast"], values(1, (5,)) * 2)


@pytest.mark.mpi(ranks=[2])
def test_compiled_async_all_reduce(mpi_world, in_place_results):
    _, size = world()
    assert_reduced(in_place_results["all_reduce"], [values(k, (5,)) + 1 for k in range(size)], "sum")


@pytest.mark.mpi(ranks=[2])
def test_compiled_all_gather_into_tensor(mpi_world, in_place_results):
    _, size = world()
    assert_exact(in_place_results["all_gather_into_tensor"], torch.cat([values(k, (5,)) - 1 for k in range(size)]))


@pytest.mark.mpi(ranks=[2])
def test_compiled_reduce_scatter_tensor(mpi_world, in_place_results):
    # Every rank's input is its values repeated: each rank's part of the sum is the values' sum.
    _, size = world()
    assert_reduced(in_place_results["reduce_scatter_tensor"], [values(k, (5,)) for k in range(size)], "sum")


@pytest.mark.mpi(ranks=[2])
def test_compiled_send_and_recv(mpi_world, in_place_results):
    rank, _ = world()
    assert_exact(in_place_results["received"], values(1 - rank, (5,)) * 3)



def mpidist_collectives(x):
    import mpidist as md
    doubled = x * 2
    md.allreduce(doubled)  # the default communicator's
    halved = md.world().allreduce(x / 2, op="avg")
    return doubled + 1, halved, md.broadcast(x.clone(), root=1)


@pytest.fixture(scope="module")
def mpidist_results():
    rank, _ = world()
    compiled = torch.compile(mpidist_collectives, backend=COMPILER)
    return compiled(values(rank, (5,), seed=3))


@pytest.mark.mpi(ranks=[2])
def test_mpidists_own_collectives_in_a_compiled_function(mpi_world, mpidist_results):
    _, size = world()
    doubled, halved, broadcast = mpidist_results
    inputs = [values(k, (5,), seed=3) for k in range(size)]
    assert_reduced(doubled - 1, [x * 2 for x in inputs], "sum")
    assert_reduced(halved, [x / 2 for x in inputs], "avg")
    assert_exact(broadcast, inputs[1])
