"""CentralStorage: the first rank of each node (real, or emulated with MPIDIST_RANKS_PER_NODE)
holds the variables and the other ranks compute; training equals one-process synchronous SGD on
the workers' batches, computed in float64.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py)."""
import pytest
import torch
from mpi4py import MPI

import mpidist as md

pytestmark = pytest.mark.mpi_shared_launch

LR, MOMENTUM, STEPS = 0.1, 0.9, 3


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def loss_of(model, worker, step):
    generator = torch.Generator().manual_seed(100 * worker + step)
    x = torch.randn(5, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=generator)
    return torch.nn.functional.cross_entropy(model(x), y)


def one_process_sgd(workers, chief):
    model = make_model(chief)
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        optimizer.zero_grad()
        (sum(loss_of(model, w, step) for w in workers) / len(workers)).backward()
        optimizer.step()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


@pytest.fixture
def comm(ranks_per_node, monkeypatch):
    monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", ranks_per_node)
    comm = md.Communicator(MPI.COMM_WORLD)
    yield comm
    comm.free()


@pytest.mark.mpi(ranks=[3, 4])
@pytest.mark.parametrize("ranks_per_node", ["2", "3"])
def test_each_node_stores_the_variables_on_its_first_rank_and_training_is_synchronous_sgd(comm, ranks_per_node):
    per_node = int(ranks_per_node)
    storage = [r for r in range(comm.size) if r % per_node == 0]
    model = make_model(seed=comm.rank)  # different on every rank: the chief's must win
    optimizer = make_optimizer(model) if comm.rank in storage else None
    cs = md.CentralStorage(model, optimizer, comm=comm)
    assert cs.servers == storage and cs.mode == "sync"
    workers = [r for r in range(comm.size) if r not in storage]
    if cs.is_server:
        cs.serve()
    else:
        for step in range(STEPS):
            model.zero_grad()
            loss_of(model, comm.rank, step).backward()
            cs.step()
        cs.close()
    final = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    torch.testing.assert_close(final, one_process_sgd(workers, min(workers)), rtol=1e-12, atol=1e-14)


@pytest.mark.mpi(ranks=[3])
@pytest.mark.parametrize("ranks_per_node", ["1"])
def test_nodes_of_one_rank_leave_no_rank_to_compute_and_every_rank_says_so(comm, ranks_per_node):
    with pytest.raises(md.InvalidArgumentError, match="central storage needs a node with at least two ranks"):
        md.CentralStorage(make_model(0), None, comm=comm)
