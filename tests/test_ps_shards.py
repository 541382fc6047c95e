"""A server's own range of the parameters (ps.shards.OwnedRange) against the user's optimizer
stepping the whole tensors in one process: the same rows, bit for bit, with state the optimizer
had before (a resumed one), learning rates a scheduler changes between updates, and the
staleness scale of one update; a sparse table's rows the same way, with their state alone."""
import pytest
import torch

from mpidist.parallel.ps import sparse
from mpidist.parallel.ps.shards import OwnedRange

SHAPES = [(4, 3), (5,), (3, 2)]  # 23 elements; the range below cuts the first two tensors' rows


def parameters(seed):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for shape in SHAPES]


def adam(params):
    return torch.optim.Adam([dict(params=params[:2], lr=0.1), dict(params=params[2:], lr=0.01)], amsgrad=True)


@pytest.mark.parametrize("span", [(6, 15), (0, 23), (17, 23)])
def test_owned_rows_step_as_the_whole_tensors(span):
    owned_params, whole_params = parameters(0), parameters(0)
    user, whole = adam(owned_params), adam(whole_params)
    torch.manual_seed(1)
    first = [torch.randn(shape, dtype=torch.float64) for shape in SHAPES]
    for optimizer, params in ((user, owned_params), (whole, whole_params)):  # state before the range is made
        for param, grad in zip(params, first):
            param.grad = grad.clone()
        optimizer.step()
    owned = OwnedRange(owned_params, span, [user])
    start, end = span
    for update, lr_scale in enumerate((1.0, 0.5, 1.0)):
        gradient = torch.randn(23, dtype=torch.float64)
        for group in user.param_groups + whole.param_groups:  # a scheduler's change
            group["lr"] = 0.1 * (update + 1)
        for param, part in zip(whole_params, gradient.split([3 * 4, 5, 3 * 2])):
            param.grad = part.view_as(param).clone()
        for group in whole.param_groups:
            group["lr"] *= lr_scale
        whole.step()
        for group in whole.param_groups:
            group["lr"] /= lr_scale
        owned.set_gradients(gradient[start:end])
        owned.step(lr_scale)
    expected = torch.cat([param.detach().reshape(-1) for param in whole_params])[start:end]
    assert torch.equal(owned.weights(), expected)
    assert all(group["lr"] == 0.1 * 3 for group in user.param_groups)  # the user's settings untouched
    owned.to_module()
    assert torch.equal(torch.cat([param.detach().reshape(-1) for param in owned_params])[start:end], expected)


@pytest.mark.parametrize("kind", [torch.optim.Adagrad, torch.optim.SparseAdam])
def test_owned_table_rows_step_as_the_whole_table_with_the_state_of_their_rows_alone(kind):
    """A sparse table's rows 3..6 held by a server: sparse gradients on them (a row twice) step
    the module's table in place as the user's optimizer steps the whole table, and the state
    kept is that of the four rows (Adagrad's, made whole by the user's optimizer, cut to them)."""
    torch.manual_seed(0)
    owned_table = torch.nn.Parameter(torch.randn(10, 3, dtype=torch.float64))
    whole_table = torch.nn.Parameter(owned_table.detach().clone())
    user, whole = kind([owned_table], lr=0.1), kind([whole_table], lr=0.1)
    owned = OwnedRange([], (0, 0), [user], [(owned_table, (3, 7))])
    for lr_scale in (1.0, 0.5, 1.0):
        ids = torch.tensor([[3, 5, 6, 5]])
        gradient = torch.sparse_coo_tensor(ids, torch.randn(4, 3, dtype=torch.float64), (10, 3), check_invariants=False)
        whole_table.grad = gradient.clone()
        whole.param_groups[0]["lr"] = 0.1 * lr_scale
        with sparse.invariants_checked():  # as the server steps (torch warns otherwise)
            whole.step()
            owned.set_table_gradient(owned_table, gradient)
            owned.step(lr_scale)
    assert torch.equal(owned_table.detach(), whole_table.detach())
    state = [value for optimizer in owned.optimizers for values in optimizer.state.values()
             for value in values.values() if torch.is_tensor(value) and value.dim()]
    assert state and all(value.shape == (4, 3) for value in state)
