"""md.ZeroRedundancyOptimizer with DataParallel equals one process training on the union of the
ranks' batches with the plain optimizer (float64), holds only its share of the state, and its
consolidated state dict is the plain optimizer's.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), in file order;
the refusals, raised on every rank, come last."""
import copy

import pytest
import torch

import mpidist as md

pytestmark = pytest.mark.mpi_shared_launch

STEPS = 4


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).double()


def batch(step, rank):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=generator, dtype=torch.float64), torch.randint(0, 3, (5,), generator=generator)


def param_groups(model):
    """Two groups with their own learning rates: the first two layers, and the last."""
    params = list(model.parameters())
    return [{"params": params[:4]}, {"params": params[4:], "lr": 0.02}]


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def train(model, optimizer, scheduler, ranks, steps, wrapped=None, rank=None, first=0):
    """Steps first .. first + steps - 1; with `wrapped` (a DataParallel) on this rank's batch,
    otherwise on the union of every rank's batches in one process."""
    for step in range(first, first + steps):
        if wrapped is None:
            parts = [batch(step, r) for r in range(ranks)]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            output = model(x)
        else:
            x, y = batch(step, rank)
            output = wrapped(x)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(output, y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def make_adam(model, zero):
    """Adam over param_groups, sharded by ZeRO (`zero`) or plain, with its scheduler."""
    settings = dict(lr=0.01, betas=(0.8, 0.99))
    optimizer = (md.ZeroRedundancyOptimizer(param_groups(model), torch.optim.Adam, **settings) if zero
                 else torch.optim.Adam(param_groups(model), **settings))
    return optimizer, make_scheduler(optimizer)


def train_zero(ranks, rank):
    """STEPS steps of ZeRO with DataParallel on this rank's batches: (model, optimizer)."""
    model = make_model()
    wrapped = md.DataParallel(model)
    optimizer, scheduler = make_adam(model, zero=True)
    train(model, optimizer, scheduler, ranks, STEPS, wrapped, rank)
    return model, optimizer


def train_plain(ranks):
    """STEPS steps of the plain optimizer on the union of the ranks' batches: (model, optimizer,
    scheduler)."""
    reference = make_model()
    plain, plain_scheduler = make_adam(reference, zero=False)
    train(reference, plain, plain_scheduler, ranks, STEPS)
    return reference, plain, plain_scheduler


@pytest.mark.mpi(ranks=[2, 3])
def test_zero_matches_the_plain_optimizer(mpi_ranks, mpi_world):
    model, _ = train_zero(mpi_ranks, mpi_world.rank)
    reference, _, _ = train_plain(mpi_ranks)
    for mine, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.detach(), expected.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.mpi(ranks=[2, 3])
def test_each_parameters_state_is_on_exactly_one_rank(mpi_ranks, mpi_world):
    model, optimizer = train_zero(mpi_ranks, mpi_world.rank)
    index = {id(p): k for k, p in enumerate(model.parameters())}
    owned = sorted(index[id(p)] for group in optimizer.optim.param_groups for p in group["params"])
    held = sorted(index[id(p)] for p in optimizer.optim.state)
    assert owned == held == sorted(index[id(p)] for p in optimizer.owned_by(mpi_world.rank))
    everyone = mpi_world.mpi.allgather(owned)
    assert sorted(k for share in everyone for k in share) == list(range(len(index)))
    if mpi_ranks > 1:  # the largest weights land on different ranks
        assert all(share for share in everyone)


@pytest.mark.mpi(ranks=[2, 3])
def test_the_consolidated_state_dict_is_the_plain_optimizers(mpi_ranks, mpi_world):
    _, optimizer = train_zero(mpi_ranks, mpi_world.rank)
    _, plain, _ = train_plain(mpi_ranks)
    optimizer.consolidate_state_dict(to=mpi_ranks - 1)
    if mpi_world.rank == mpi_ranks - 1:
        consolidated, expected = optimizer.state_dict(), plain.state_dict()
        assert consolidated["param_groups"] == expected["param_groups"]
        assert sorted(consolidated["state"]) == sorted(expected["state"])
        for k, entries in expected["state"].items():
            for name, value in entries.items():
                torch.testing.assert_close(consolidated["state"][k][name], value, rtol=1e-10, atol=1e-12)
    else:
        with pytest.raises(md.MpidistError, match="call consolidate_state_dict"):
            optimizer.state_dict()


@pytest.mark.mpi(ranks=[2, 3])
def test_training_on_from_the_plain_optimizers_state_stays_the_same(mpi_ranks, mpi_world):
    """Loading the plain optimizer's state (on every rank) and training on."""
    reference, plain, plain_scheduler = train_plain(mpi_ranks)
    resumed_model = make_model()
    with torch.no_grad():
        for mine, value in zip(resumed_model.parameters(), reference.parameters()):
            mine.copy_(value)
    resumed_wrapped = md.DataParallel(resumed_model)
    resumed, resumed_scheduler = make_adam(resumed_model, zero=True)
    resumed.load_state_dict(copy.deepcopy(plain.state_dict()))  # as from a file: no tensors shared with `plain`
    resumed_scheduler.load_state_dict(plain_scheduler.state_dict())
    train(resumed_model, resumed, resumed_scheduler, mpi_ranks, 2, resumed_wrapped, mpi_world.rank, first=STEPS)
    train(reference, plain, plain_scheduler, mpi_ranks, 2, first=STEPS)
    for mine, expected in zip(resumed_model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.detach(), expected.detach(), rtol=1e-10, atol=1e-12)
    del resumed_wrapped


def fine_tune(ranks, rank):
    """The last layer joins the optimizer after two steps (every rank adds it), with ZeRO under
    DataParallel and with the plain optimizer: (model, ZeRO, reference model, plain optimizer)."""
    def run(model, make_optimizer, wrapped=None):
        params = list(model.parameters())
        optimizer = make_optimizer([{"params": params[:4]}])
        train(model, optimizer, None, ranks, 2, wrapped, rank)
        optimizer.add_param_group({"params": params[4:], "lr": 0.03})
        train(model, optimizer, None, ranks, 3, wrapped, rank, first=2)
        return optimizer

    model = make_model()
    zero = run(model, lambda groups: md.ZeroRedundancyOptimizer(groups, torch.optim.Adam, lr=0.01), md.DataParallel(model))
    reference = make_model()
    plain = run(reference, lambda groups: torch.optim.Adam(groups, lr=0.01))
    return model, zero, reference, plain


@pytest.mark.mpi(ranks=[2, 3])
def test_a_group_added_later_trains_as_with_the_plain_optimizer(mpi_ranks, mpi_world):
    model, _, reference, _ = fine_tune(mpi_ranks, mpi_world.rank)
    for mine, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.detach(), expected.detach(), rtol=1e-10, atol=1e-12)
    assert not torch.equal(list(model.parameters())[-1], list(make_model().parameters())[-1])  # it did train


@pytest.mark.mpi(ranks=[2, 3])
def test_a_group_added_later_has_owners_and_state(mpi_ranks, mpi_world):
    """The new group's parameters have owners and state, each on one rank; the consolidated
    groups are the plain optimizer's."""
    model, zero, _, plain = fine_tune(mpi_ranks, mpi_world.rank)
    index = {id(p): k for k, p in enumerate(model.parameters())}
    everyone = mpi_world.mpi.allgather(sorted(index[id(p)] for p in zero.optim.state))
    assert sorted(k for share in everyone for k in share) == list(range(len(index)))
    zero.consolidate_state_dict(to=0)
    if mpi_world.rank == 0:
        assert zero.state_dict()["param_groups"] == plain.state_dict()["param_groups"]


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("optimizer_class, settings, error, refusal", [
    (torch.optim.SGD, {"overlap_with_ddp": True}, md.NotOfferedError, "overlap_with_ddp"),
    ("SGD", {}, md.InvalidArgumentError, "optimizer_class must be a torch.optim.Optimizer subclass"),
    (torch.optim.SGD, {"process_group": object()}, md.InvalidArgumentError, "process_group= is torch.distributed's"),
], ids=["overlap_with_ddp", "class_by_name", "process_group"])
def test_construction_refusals(mpi_world, optimizer_class, settings, error, refusal):
    with pytest.raises(error, match=refusal):
        md.ZeroRedundancyOptimizer(make_model().parameters(), optimizer_class, lr=0.1, **settings)


@pytest.mark.mpi(ranks=[2, 3])
def test_consolidating_to_a_rank_outside_the_world_is_refused(mpi_world):
    optimizer = md.ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(md.InvalidArgumentError, match=r"consolidate_state_dict\(to=5\): not a rank"):
        optimizer.consolidate_state_dict(to=5)


@pytest.mark.mpi(ranks=[2, 3])
def test_a_group_of_parameters_already_held_is_refused_unchanged(mpi_world):
    model = make_model()
    optimizer = md.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="more than one parameter group"):  # torch's own check, before any change
        optimizer.add_param_group({"params": [next(model.parameters())]})
    assert len(optimizer.param_groups) == len(optimizer.optim.param_groups) == 1
