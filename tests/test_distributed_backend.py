"""The torch.distributed backend "mpidist" (mpidist/distributed/): every c10d operation against a
float64 reference computed from every rank's input in one process, async Work, sub-groups and
their call check, and torch's own DDP, FSDP2, DeviceMesh/DTensor, pipelining and distributed
checkpoint on it, each against the same training in one process."""
import copy
import gc
import time

import pytest
import torch
import torch.distributed as dist
from conftest import run_python
from tolerances import assert_exact, assert_reduced, assert_within

import mpidist as md

# The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order;
# the default process group made by the first one stays for the others.
pytestmark = pytest.mark.mpi_shared_launch


def world():
    """(rank, size) of the default process group over the backend, made once per process."""
    if not dist.is_initialized():
        dist.init_process_group("mpidist")
    return dist.get_rank(), dist.get_world_size()


def values(rank, shape, seed=0):
    """Rank `rank`'s input: any rank can rebuild every other rank's, for the references."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * seed + rank), dtype=torch.float64)


def test_importing_mpidist_registers_the_backend():
    assert "mpidist" in dist.Backend.backend_list
    assert dist.Backend("mpidist") == "mpidist"


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("op", ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"])
def test_all_reduce(mpi_world, op):
    rank, size = world()
    reduce_op = dist._make_nccl_premul_sum(0.5) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)
    tensor = values(rank, (5,))
    dist.all_reduce(tensor, op=reduce_op)
    if op == "PREMUL_SUM":
        assert_reduced(tensor, [0.5 * values(k, (5,)) for k in range(size)], "sum", scalings=1)
    else:
        kind = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MIN": "min", "MAX": "max"}[op]
        assert_reduced(tensor, [values(k, (5,)) for k in range(size)], kind)


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("op", ["BAND", "BOR", "BXOR"])
def test_all_reduce_bitwise(mpi_world, op):
    rank, size = world()
    everyone = [torch.tensor([3, 5, 6, 12], dtype=torch.int64) << k for k in range(size)]
    fold = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    expected = everyone[0]
    for other in everyone[1:]:
        expected = fold(expected, other)
    tensor = everyone[rank].clone()
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
    assert torch.equal(tensor, expected)


@pytest.mark.mpi(ranks=[2])
def test_all_reduce_bitwise_refuses_floats(mpi_world):
    world()
    with pytest.raises(md.InvalidArgumentError, match="BAND reduces integer"):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)


@pytest.mark.mpi(ranks=[2, 3])
def test_all_reduce_half_precision(mpi_world):
    rank, size = world()
    for dtype in (torch.float16, torch.bfloat16):
        tensor = values(rank, (7,)).to(dtype)
        dist.all_reduce(tensor)
        assert_reduced(tensor, [values(k, (7,)).to(dtype) for k in range(size)], "sum")


@pytest.mark.mpi(ranks=[2, 3])
def test_all_reduce_coalesced(mpi_world):
    rank, size = world()
    tensors = [values(rank, (2, 3)), values(rank, (4,), seed=1)]
    dist.all_reduce_coalesced(tensors)
    assert_reduced(tensors[0], [values(k, (2, 3)) for k in range(size)], "sum")
    assert_reduced(tensors[1], [values(k, (4,), seed=1) for k in range(size)], "sum")


@pytest.mark.mpi(ranks=[2, 3])
def test_broadcast_and_reduce(mpi_world):
    rank, size = world()
    root = size - 1
    tensor = values(rank, (3, 2))
    dist.broadcast(tensor, src=root)
    assert_exact(tensor, values(root, (3, 2)))
    tensor = values(rank, (4,))
    dist.reduce(tensor, dst=root, op=dist.ReduceOp.MAX)
    expected = torch.stack([values(k, (4,)) for k in range(size)]).max(0).values if rank == root else values(rank, (4,))
    assert_exact(tensor, expected)


@pytest.mark.mpi(ranks=[2, 3])
def test_all_gather_forms(mpi_world):
    rank, size = world()
    outputs = [torch.empty(2, 3, dtype=torch.float64) for _ in range(size)]
    dist.all_gather(outputs, values(rank, (2, 3)))
    for k, output in enumerate(outputs):
        assert_exact(output, values(k, (2, 3)))
    gathered = torch.empty(size * 2, 3, dtype=torch.float64)
    dist.all_gather_into_tensor(gathered, values(rank, (2, 3)))
    assert_exact(gathered, torch.cat([values(k, (2, 3)) for k in range(size)]))


@pytest.mark.mpi(ranks=[2, 3])
def test_reduce_scatter_forms(mpi_world):
    rank, size = world()
    rows = [values(k, (size, 4))[rank] for k in range(size)]  # what the ranks reduce into this rank's
    output = torch.empty(4, dtype=torch.float64)
    dist.reduce_scatter(output, list(values(rank, (size, 4)).unbind(0)))
    assert_reduced(output, rows, "sum")
    output = torch.empty(2, 2, dtype=torch.float64)
    dist.reduce_scatter_tensor(output, values(rank, (size, 4)).reshape(size * 2, 2), op=dist.ReduceOp.AVG)
    assert_reduced(output, [row.reshape(2, 2) for row in rows], "avg")


@pytest.mark.mpi(ranks=[2, 3])
def test_all_to_all_forms(mpi_world):
    rank, size = world()
    # Rank r sends k + r + 1 rows to rank k.
    splits = [[k + r + 1 for k in range(size)] for r in range(size)]
    inputs = [values(r, (sum(splits[r]), 2)) for r in range(size)]
    expected = torch.cat([inputs[r].split(splits[r])[rank] for r in range(size)])
    output = torch.empty(expected.shape, dtype=torch.float64)
    dist.all_to_all_single(output, inputs[rank], output_split_sizes=[splits[r][rank] for r in range(size)],
                           input_split_sizes=splits[rank])
    assert_exact(output, expected)
    outputs = [torch.empty(splits[r][rank], 2, dtype=torch.float64) for r in range(size)]
    dist.all_to_all(outputs, list(inputs[rank].split(splits[rank])))
    assert_exact(torch.cat(outputs), expected)


@pytest.mark.mpi(ranks=[2, 3])
def test_gather_and_scatter(mpi_world):
    rank, size = world()
    root = size - 1
    gathered = [torch.empty(3, dtype=torch.float64) for _ in range(size)] if rank == root else None
    dist.gather(values(rank, (3,)), gathered, dst=root)
    if rank == root:
        for k, tensor in enumerate(gathered):
            assert_exact(tensor, values(k, (3,)))
    output = torch.empty(2, 2, dtype=torch.float64)
    dist.scatter(output, [values(k, (2, 2), seed=3) for k in range(size)] if rank == 0 else None, src=0)
    assert_exact(output, values(rank, (2, 2), seed=3))


@pytest.mark.mpi(ranks=[2, 3])
def test_send_recv_and_any_source(mpi_world):
    rank, size = world()
    if rank == 0:
        received = {}
        for _ in range(size - 1):
            tensor = torch.empty(4, dtype=torch.float64)
            source = dist.recv(tensor)
            received[source] = tensor
        assert sorted(received) == list(range(1, size))
        for source, tensor in received.items():
            assert_exact(tensor, values(source, (4,)))
        dist.send(values(0, (2,)), dst=size - 1, tag=7)
    else:
        dist.send(values(rank, (4,)), dst=0)
        if rank == size - 1:
            tensor = torch.empty(2, dtype=torch.float64)
            request = dist.irecv(tensor, src=0, tag=7)
            request.wait()
            assert_exact(tensor, values(0, (2,)))
    dist.barrier()


@pytest.mark.mpi(ranks=[2, 3])
def test_async_work_completes_in_the_background(mpi_world):
    rank, size = world()
    tensors = [values(rank, (50,), seed=s) for s in range(3)]
    works = [dist.all_reduce(tensor, async_op=True) for tensor in tensors]
    futures = [work.get_future() for work in works]
    for seed, (work, future) in enumerate(zip(works, futures)):
        assert work.wait()
        assert work.is_completed()
        assert_reduced(future.wait()[0], [values(k, (50,), seed=seed) for k in range(size)], "sum")
    work = dist.broadcast(values(rank, (3,)), src=0, async_op=True)
    work.wait()
    assert work.is_completed()


def background_group(monkeypatch):
    """A group of every rank whose asynchronous collectives go to its background thread even on
    one node."""
    monkeypatch.setenv("MPIDIST_EAGER_ON_NODE", "0")
    group = dist.new_group(backend="mpidist")
    monkeypatch.delenv("MPIDIST_EAGER_ON_NODE")
    return group


@pytest.mark.mpi(ranks=[2, 3])
def test_async_collectives_on_one_node_run_at_once(mpi_world, monkeypatch):
    rank, size = world()
    monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", "1")  # every rank an emulated node of its own
    across_nodes = dist.new_group(backend="mpidist")
    monkeypatch.delenv("MPIDIST_RANKS_PER_NODE")
    groups = {"one node": (dist.new_group(backend="mpidist"), True),
              "background thread": (background_group(monkeypatch), False), "across nodes": (across_nodes, False)}
    for name, (group, at_once) in groups.items():
        tensor, rows = values(rank, (50,)), [torch.empty(3, dtype=torch.float64) for _ in range(size)]
        if not at_once and rank == 1:
            # The others' collectives wait for this rank on their background threads. The pause is
            # long enough that, on a loaded machine, the others check their handles within it.
            time.sleep(1.0)
        works = [dist.all_reduce(tensor, group=group, async_op=True),
                 dist.all_gather(rows, values(rank, (3,), seed=1), group=group, async_op=True)]
        if at_once:
            assert all(work.is_completed() for work in works), name
        elif rank != 1:
            assert not any(work.is_completed() for work in works), name
        for work in works:
            work.wait()
        assert (group.comm._engine is None) == at_once, name
        assert_reduced(tensor, [values(k, (50,)) for k in range(size)], "sum")
        assert_exact(torch.stack(rows), torch.stack([values(k, (3,), seed=1) for k in range(size)]))
    for group, _ in groups.values():
        dist.destroy_process_group(group)


MESSAGE_INSIDE_AN_ALL_REDUCE = """
import os
import torch, torch.distributed as dist
import mpidist as md
dist.init_process_group("mpidist")
os.environ["MPIDIST_EAGER_ON_NODE"] = "0"
background = dist.new_group(backend="mpidist")
dist.all_reduce(torch.zeros(1), group=background, async_op=True).wait()  # its engine made (collective)
rank = dist.get_rank()


def message_inside_an_all_reduce(group):
    # Rank 0 starts an all-reduce, then sends; rank 1 receives, then joins the all-reduce.
    tensor = torch.ones(3)
    if rank == 0:
        work = dist.all_reduce(tensor, group=group, async_op=True)
        dist.send(torch.full((2,), 7.0), dst=1, group=group)
        work.wait()
    else:
        message = torch.empty(2)
        dist.recv(message, src=0, group=group)
        dist.all_reduce(tensor, group=group)
    return tensor.tolist()


print(rank, "background:", message_inside_an_all_reduce(background), flush=True)
try:
    message_inside_an_all_reduce(dist.group.WORLD)
except md.DeadlineError as error:
    print(rank, "at once:", error, flush=True)
"""


def test_a_program_that_needs_async_not_to_block_needs_the_background_thread():
    """What docs/distributed-backend.md says of MPIDIST_EAGER_ON_NODE=0: with the all-reduce
    queued, the message sent after it arrives; run at once, both ranks wait out MPIDIST_TIMEOUT
    and the errors name the missing rank."""
    result = run_python(MESSAGE_INSIDE_AN_ALL_REDUCE, ranks=2, env={"MPIDIST_TIMEOUT": "3"}, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert lines["0 background"] == lines["1 background"] == "[2.0, 2.0, 2.0]", result.stdout
    assert lines["0 at once"].startswith("rank 0: the allreduce call check did not complete within 3 s") \
        and "no answer from ranks [1]" in lines["0 at once"], result.stdout
    assert lines["1 at once"].startswith("rank 1: receive from rank 0") and "no answer from rank 0" in lines["1 at once"]


@pytest.mark.mpi(ranks=[2])
def test_a_future_callback_may_call_a_blocking_collective(mpi_world, monkeypatch):
    rank, size = world()
    group = background_group(monkeypatch)
    first, second = values(rank, (4,)), values(rank, (4,), seed=1)
    # The callback runs on the group's engine thread as the first all-reduce completes there (on
    # rank 0 surely: rank 1 joins that all-reduce late); its blocking call runs at once on that
    # thread, ahead of the call queued after it.
    if rank == 1:
        time.sleep(0.2)
    chained = dist.all_reduce(first, group=group, async_op=True).get_future().then(
        lambda future: dist.all_reduce(second, group=group))
    third = values(rank, (4,), seed=2)
    dist.all_reduce(third, group=group)
    chained.wait()
    for seed, tensor in enumerate((first, second, third)):
        assert_reduced(tensor, [values(k, (4,), seed=seed) for k in range(size)], "sum")
    dist.destroy_process_group(group)


@pytest.mark.mpi(ranks=[3])
def test_new_group_is_a_sub_communicator(mpi_world):
    rank, size = world()
    members = [0, size - 1]
    group = dist.new_group(members, backend="mpidist")
    if rank in members:
        tensor = values(rank, (4,))
        dist.all_reduce(tensor, group=group)
        assert_reduced(tensor, [values(k, (4,)) for k in members], "sum")
        assert dist.get_group_rank(group, rank) == members.index(rank)
        with pytest.raises(md.MismatchError, match="count"):  # the group keeps the call check
            dist.all_reduce(torch.ones(2 + rank), group=group)
    dist.barrier()


def ddp_trained(model, rank, process_group=None):
    """A copy of `model` after three steps of torch's DDP over `process_group` (the default
    group: mpidist), on every rank's batches of values()."""
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.0001,  # several buckets
                                  process_group=process_group)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        optimizer.zero_grad()
        ddp(values(rank, (4, 6), seed=step)).pow(2).sum().backward()
        optimizer.step()
    return ddp.module


@pytest.mark.mpi(ranks=[2, 3])
def test_ddp_trains_as_one_process_and_as_over_gloo(mpi_world):
    rank, size = world()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    gloo = dist.new_group(backend="gloo")
    try:
        mine = ddp_trained(model, rank)
        glooed = ddp_trained(model, rank, process_group=gloo)
    finally:
        # torch frees a DDP's Reducer with the GIL held. Were the Reducer the gloo group's last
        # owner, the group's destructor would join gloo's worker threads with the GIL held while
        # a worker may still need it to free the Work it just finished: a deadlock (seen in this
        # test under load; pytorch/pytorch#56297). So the DDP objects (in reference cycles)
        # are freed first, and the group last, by its own Python object, which releases the GIL.
        gc.collect()
        dist.destroy_process_group(gloo)
        del gloo
    # DDP averages the ranks' gradients: the mean of the per-rank losses in one process.
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        reference_optimizer.zero_grad()
        (sum(reference(values(k, (4, 6), seed=step)).pow(2).sum() for k in range(size)) / size).backward()
        reference_optimizer.step()
    # Each step's gradients sum over every rank's 4 rows, each row's terms through the layers'
    # widths (6, 8, 2); over gloo only the order of the ranks' additions differs.
    for ours, theirs, over_gloo in zip(mine.parameters(), reference.parameters(), glooed.parameters()):
        assert_within(ours, theirs, roundings=3 * (4 * size + 16))
        assert_within(ours, over_gloo, roundings=3 * (size - 1))


@pytest.mark.mpi(ranks=[2])
def test_fsdp2_trains_as_one_process(mpi_world):
    from torch.distributed.fsdp import fully_shard
    rank, size = world()
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()
    reference = copy.deepcopy(model)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    for step in range(3):
        batches = [values(k, (4, 6), seed=step) for k in range(size)]
        optimizer.zero_grad()
        model(batches[rank]).pow(2).sum().backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        (sum(reference(batch).pow(2).sum() for batch in batches) / size).backward()
        reference_optimizer.step()
    # As DDP's (test_ddp_trains_as_one_process_and_as_over_gloo), layers of widths 6, 8 and 3.
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert_within(mine.full_tensor(), theirs, roundings=3 * (4 * size + 17))


@pytest.mark.mpi(ranks=[2])
def test_mismatched_calls_raise_on_every_rank(mpi_world):
    rank, _ = world()
    with pytest.raises(md.MismatchError, match="count"):
        dist.all_reduce(torch.ones(3 + rank))


def test_plain_python_is_a_world_of_one_and_a_rank_against_mpi_is_refused():
    result = run_python("import os, mpidist, torch, torch.distributed as dist\n"
                        "try:\n"
                        "    dist.init_process_group('mpidist')\n"
                        "except mpidist.InvalidArgumentError as error:\n"
                        "    print('refused:', error)\n"
                        "del os.environ['RANK'], os.environ['WORLD_SIZE']\n"
                        "dist.init_process_group('mpidist')\n"
                        "tensor = torch.arange(3.0)\n"
                        "dist.all_reduce(tensor, op=dist.ReduceOp.AVG)\n"
                        "print(dist.get_rank(), dist.get_world_size(), tensor.tolist())\n",
                        env={"RANK": "1", "WORLD_SIZE": "2"})
    assert result.returncode == 0, result.stderr
    refused, world = result.stdout.splitlines()
    assert "takes rank and size from MPI" in refused and "RANK=1 but MPI says 0" in refused
    assert world == "0 1 [0.0, 1.0, 2.0]"


@pytest.mark.mpi(ranks=[2])
def test_a_rank_given_another_rank_is_refused_on_every_rank_by_its_own_words(mpi_world):
    from mpidist.distributed.rendezvous import check_agrees_with_mpi
    given = (0, "RANK=0") if mpi_world.rank == 1 else None
    with pytest.raises(md.InvalidArgumentError, match=r"^the mpidist backend takes rank and size from MPI; rank 1 was "
                                                      r"given RANK=0 but MPI says 1: unset RANK and WORLD_SIZE"):
        check_agrees_with_mpi(mpi_world, given, None)


@pytest.mark.mpi(ranks=[2])
@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_pipelining_trains_as_one_process(mpi_world, schedule):
    from torch.distributed import pipelining
    rank, size = world()
    torch.manual_seed(2)
    layers = [torch.nn.Linear(4, 4).double() for _ in range(size)]
    reference = torch.nn.Sequential(*copy.deepcopy(layers))
    stage = pipelining.PipelineStage(layers[rank], rank, size, torch.device("cpu"))

    def loss_fn(output, target):
        return (output - target).pow(2).sum()

    runner = getattr(pipelining, schedule)(stage, n_microbatches=4, loss_fn=loss_fn)
    batch, target = values(0, (8, 4), seed=5), values(1, (8, 4), seed=5)
    if rank == 0:
        runner.step(batch)
    elif rank == size - 1:
        runner.step(target=target)
    else:
        runner.step()
    # The schedules average the microbatches' gradients (scale_grads): the loss over 4 in one process.
    (loss_fn(reference(batch), target) / 4).backward()
    # Sums over the 8 rows (in microbatches of 2 here) through the layers' widths (4 per layer).
    for mine, theirs in zip(layers[rank].parameters(), reference[rank].parameters()):
        assert_within(mine.grad, theirs.grad, roundings=8 + 4 * size)


@pytest.mark.mpi(ranks=[2])
def test_distributed_checkpoint_saves_and_loads(mpi_world, tmp_path_factory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    rank, size = world()
    mesh = init_device_mesh("cpu", (size,))
    full = values(0, (4 * size, 3), seed=6)
    directory = [str(tmp_path_factory.mktemp("dcp"))] if rank == 0 else [None]
    dist.broadcast_object_list(directory, src=0)
    dcp.save({"weight": distribute_tensor(full, mesh, [Shard(0)])}, checkpoint_id=directory[0])
    loaded = {"weight": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])}
    dcp.load(loaded, checkpoint_id=directory[0])
    assert_exact(loaded["weight"].full_tensor(), full)


@pytest.mark.mpi(ranks=[2])
def test_destroy_frees_the_communicators_and_a_new_init_works(mpi_world):
    from mpi4py import MPI
    world()
    pair = dist.new_group([0, 1], backend="mpidist")
    groups = [dist.group.WORLD, pair]
    for group in groups:  # each with its engine's communicator too
        dist.all_reduce(torch.ones(2), group=group, async_op=True).wait()
    communicators = [mpi for group in groups for mpi in group.comm.communicators() + [group._p2p]]
    dist.destroy_process_group()
    assert all(mpi == MPI.COMM_NULL for mpi in communicators)  # what MPI_Comm_free leaves
    rank, size = world()
    tensor = values(rank, (3,))
    dist.all_reduce(tensor, async_op=True).wait()
    dist.all_reduce(tensor)
    # Two sums: the second's size - 1 additions of the first's result count as scalings.
    assert_reduced(tensor, [size * values(k, (3,)) for k in range(size)], "sum", scalings=size - 1)


@pytest.mark.mpi(ranks=[4])
def test_device_mesh_2x2_dtensor_matmul(mpi_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    world()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a, b = values(0, (4, 6), seed=7), values(1, (6, 8), seed=7)
    product = distribute_tensor(a, mesh, [Shard(0), Replicate()]) @ distribute_tensor(b, mesh, [Replicate(), Shard(1)])
    assert_within(product.full_tensor(), a @ b, roundings=6)  # dot products of 6 terms
    row = values(0, (2,), seed=8)
    dist.all_reduce(row, group=mesh["tp"].get_group())  # a sub-mesh's group: the 2 ranks of a row
    assert_reduced(row, [values(0, (2,), seed=8)] * 2, "sum")
