"""A server's own range of the parameters (ps_shards.OwnedRange) against the user's optimizer
stepping the whole tensors in one process: the same rows, bit for bit, with state the optimizer
had before (a resumed one), learning rates a scheduler changes between updates, and the
staleness scale of one update."""
import pytest
import torch

from mpidist.parallel.ps_shards import OwnedRange

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
