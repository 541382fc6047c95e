"""The parameter server's modules work on explicit role objects (roles.py), never on the whole
ParameterServer: checked on their signatures, and the pieces that need no MPI run in one process
against float64 references."""
import importlib
import inspect

import numpy as np
import pytest
import torch
from torch import nn

from mpidist.parallel.ps import ParameterServer, model, roles, server

MODULES = ("coordinator", "follower", "server", "worker", "state", "survival", "settings", "model", "sparse",
           "shards")
# The decorator of the front's methods: it receives the front by design.
FRONT = {("survival", "ends_on_death")}


def functions():
    for name in MODULES:
        module = importlib.import_module(f"mpidist.parallel.ps.{name}")
        for function_name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ == module.__name__ and (name, function_name) not in FRONT:
                yield f"{name}.{function_name}", function


def test_no_function_of_the_package_takes_the_front():
    taking = [(name, parameter) for name, function in functions()
              for parameter in inspect.signature(function).parameters
              if parameter == "ps" or "ParameterServer" in str(inspect.signature(function).parameters[parameter])]
    assert taking == []
    assert len(dict(functions())) > 40, "the modules' functions were not found"


@pytest.mark.parametrize("name, kind", [("server.apply", "ServerRole"), ("coordinator.coordinate", "ServerRole"),
                                        ("follower.follow", "ServerRole"), ("state.gather", "ServerRole"),
                                        ("survival.dead_workers", "ServerRole"), ("worker.step", "WorkerRole"),
                                        ("worker.receive_replies", "WorkerRole")])
def test_the_loops_and_the_sides_take_their_role(name, kind):
    first = next(iter(inspect.signature(dict(functions())[name]).parameters.values()))
    assert (first.name, first.annotation) == ("role", kind)


def test_the_front_reads_its_state_from_the_role():
    """ParameterServer's attributes of today's API are the role's, settings' and model's."""
    front = ParameterServer.__new__(ParameterServer)
    linear = nn.Linear(3, 2)
    front.model = model.take_model(linear, None, 1, False)
    front.settings = None
    front.role = roles.WorkerRole(None, front.model, roles.Endpoint(None, 1, "rank 1 (a worker)"), version=4)
    front.role.steps, front.role.bytes_pushed = 3, 96
    assert (front.version, front.steps, front.bytes_pushed, front.numel) == (4, 3, 96, 8)
    assert front.dropped == [] and front.lost == [] and not front.is_server
    front.role = roles.ServerRole(None, front.model, roles.Endpoint(None, 0, "rank 0 (the parameter server)"))
    front.role.dropped.append((1, 0, 0))
    assert (front.steps, front.dropped, front.is_server) == (0, [(1, 0, 0)], True)


def test_flat_and_load_lay_the_dense_parameters_end_to_end():
    net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    held = model.take_model(net, None, 1, False)
    expected = np.concatenate([p.detach().double().numpy().reshape(-1) for p in net.parameters()])
    flat = held.flat(held.params)
    assert held.numel == expected.size == flat.numel() and np.array_equal(flat.double().numpy(), expected)
    held.load(torch.arange(held.numel, dtype=torch.float32))
    assert np.array_equal(held.flat(held.params).double().numpy(), np.arange(held.numel, dtype=np.float64))


def test_one_servers_step_scales_the_rate_for_that_update_alone():
    torch.manual_seed(0)
    net = nn.Linear(3, 2).double()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.0)
    held = model.take_model(net, optimizer, 1, False)
    before = held.flat(held.params).numpy().copy()
    gradient = torch.linspace(-1, 1, held.numel, dtype=torch.float64)
    server.step_whole(held, gradient, lr_scale=0.25)
    assert np.allclose(held.flat(held.params).numpy(), before - 0.5 * 0.25 * gradient.numpy(), rtol=0, atol=1e-15)
    assert optimizer.param_groups[0]["lr"] == 0.5 and all(p.grad is None for p in net.parameters())
