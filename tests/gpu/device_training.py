"""What the rank tests of tests/gpu/ share about training: a small float64 model, every worker's
batches (known on every rank), one-process CPU training on all of them as the reference, and the
bound between the two (tests/tolerances.py's assert_within)."""
from __future__ import annotations

import torch
from tolerances import assert_within

SIZES = (10, 16, 16, 3)  # the widths of the model's layers
ROWS = 8  # a worker's batch
STEPS = 3


def mlp(seed: int, sizes=SIZES) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).double()


def batch(step: int, worker: int, rows: int = ROWS, features: int = SIZES[0]):
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return (torch.randn(rows, features, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (rows,), generator=generator))


def union_of_batches(step: int, workers) -> tuple:
    """Every worker's batch of `step` in one."""
    return tuple(torch.cat(parts) for parts in zip(*[batch(step, worker) for worker in workers]))


def train_reference(seed: int, batches, sizes=SIZES):
    """One process on the CPU: SGD with momentum, each step on the mean loss of its batch."""
    model = mlp(seed, sizes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def training_roundings(rows: int, sizes=SIZES, steps: int = STEPS) -> int:
    """Roundings between training on the ranks and in one process, as tests/tolerances.py counts
    them: each step's gradients sum over the rows of every worker's batch and through the layers'
    widths, in another order on each side."""
    return steps * (rows + sum(sizes))


def assert_trained_like(got, want, what: str, rows: int, sizes=SIZES) -> None:
    """float64 parameters trained on a device (`got`) against those of the CPU reference
    (`want`), `rows` the rows of one step's batches together."""
    for index, (mine, reference) in enumerate(zip(got, want, strict=True)):
        try:
            assert_within(mine.detach().cpu(), reference.detach(), roundings=training_roundings(rows, sizes))
        except AssertionError as error:
            raise AssertionError(f"{what}: parameter {index} differs from one-process CPU training: {error}") from None


def train_data_parallel(wrap, device: str, rank: int, size: int, what: str,
                        wrap_optimizer=lambda optimizer, model: optimizer) -> None:
    """A float64 MLP on `device`, wrapped by wrap(model) (a data-parallel wrapper whose
    construction gives every rank rank 0's weights) and its optimizer by
    wrap_optimizer(optimizer, model), trained on each rank's batches, against one process on the
    CPU training on all of them."""
    model = mlp(seed=rank).to(device)
    wrapped = wrap(model)
    optimizer = wrap_optimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9), model)
    for step in range(STEPS):
        x, y = batch(step, rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(wrapped(x.to(device)), y.to(device)).backward()
        optimizer.step()
    reference, _ = train_reference(0, [union_of_batches(step, range(size)) for step in range(STEPS)])
    assert_trained_like(list(model.parameters()), list(reference.parameters()), what, ROWS * size)
