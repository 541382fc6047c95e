"""torch.distributed over the "mpidist" backend on torch tensors on the launch's device: the c10d
collectives and point-to-point against float64 references of every rank's inputs, and torch's
own DistributedDataParallel against one-process CPU training."""
import numpy as np
import pytest
import torch
from device_arrays import COUNT, Arrays, assert_reduced_values
from device_training import train_data_parallel
from tolerances import assert_exact


@pytest.fixture(scope="module")
def process_group(comm):
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("mpidist")
    return dist


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_c10d_collectives_and_point_to_point(comm, device, dtype, inputs, process_group):
    """all_reduce (blocking and async), broadcast, all_gather_into_tensor, reduce_scatter_tensor
    and isend/irecv around the ranks."""
    dist, size, rank = process_group, comm.size, comm.rank
    arrays = Arrays("torch", device)
    per_rank = inputs.get(dtype, COUNT)
    blocking, queued = arrays.make(per_rank[rank], dtype), arrays.make(per_rank[rank], dtype)
    dist.all_reduce(blocking)
    dist.all_reduce(queued, async_op=True).wait()
    broadcast = arrays.make(per_rank[rank], dtype)
    dist.broadcast(broadcast, src=0)
    gathered = arrays.make(np.zeros(size * COUNT), dtype)
    dist.all_gather_into_tensor(gathered, arrays.make(per_rank[rank], dtype))
    # reduce_scatter_tensor: rank r keeps the sum of every rank's r-th block of `rows`.
    rows = COUNT // size * size
    scattered = arrays.make(np.zeros(rows // size), dtype)
    dist.reduce_scatter_tensor(scattered, arrays.make(per_rank[rank][:rows], dtype))
    block = slice(rank * rows // size, (rank + 1) * rows // size)
    received = arrays.make(np.zeros(COUNT), dtype)
    works = [dist.isend(arrays.make(per_rank[rank], dtype), (rank + 1) % size),
             dist.irecv(received, (rank - 1) % size)]
    for work in works:
        work.wait()
    assert_reduced_values(arrays.float64(blocking), per_rank, "sum", dtype)
    assert_reduced_values(arrays.float64(queued), per_rank, "sum", dtype)
    assert_exact(arrays.float64(broadcast), per_rank[0])
    assert_exact(arrays.float64(gathered), np.concatenate(per_rank))
    assert_reduced_values(arrays.float64(scattered), [part[block] for part in per_rank], "sum", dtype)
    assert_exact(arrays.float64(received), per_rank[(rank - 1) % size])


@pytest.mark.training
def test_torch_ddp_over_mpidist_trains_as_one_process(comm, device, process_group):
    train_data_parallel(torch.nn.parallel.DistributedDataParallel, device, comm.rank, comm.size,
                        "DDP over mpidist")
