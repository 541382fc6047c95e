"""What a parameter server trains, as every rank holds it: the module's dense parameters laid end
to end (their flat vector is what travels), its sparse tables (sparse.py) and the optimizers;
take_model checks them.
"""
from __future__ import annotations

import dataclasses

import torch

from ...errors import InvalidArgumentError
from ...runtime import wire
from . import sparse


@dataclasses.dataclass
class Model:
    """`params`: the dense path's trained parameters, in order; `numels` their sizes, `numel`
    their total and `shapes` their shapes; `tables`: the sparse.Table of each embedding weight
    that goes by rows; `optimizers`: the optimizers given (none on a worker)."""
    module: torch.nn.Module
    optimizer: object
    optimizers: list
    params: list
    tables: list
    dtype: torch.dtype
    numels: list = dataclasses.field(init=False)
    numel: int = dataclasses.field(init=False)
    shapes: list = dataclasses.field(init=False)

    def __post_init__(self):
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        self.shapes = [tuple(p.shape) for p in self.params]

    def flat(self, tensors) -> torch.Tensor:
        """The tensors end to end in one contiguous CPU tensor (what travels)."""
        return torch.cat([t.detach().reshape(-1).cpu() for t in tensors]) if tensors else \
            torch.empty(0, dtype=self.dtype)

    def load(self, weights: torch.Tensor) -> None:
        """Copy the flat dense `weights` into the parameters."""
        with torch.no_grad():
            for param, part in zip(self.params, weights.split(self.numels)):
                param.copy_(part.view_as(param))


def take_model(module: torch.nn.Module, optimizer, servers: int, sparse_embeddings: bool) -> Model:
    """The module's trained parameters, split into the dense path's and the tables (each table's
    rows split over `servers` servers)."""
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [] if optimizer is None else [optimizer]
    trained = [p for p in module.parameters() if p.requires_grad]
    if not trained:
        raise InvalidArgumentError("the module has no parameters that require a gradient")
    dtypes = {p.dtype for p in trained}
    if len(dtypes) > 1 or not trained[0].is_floating_point() \
            or str(trained[0].dtype).removeprefix("torch.") not in wire.ITEMSIZE:
        raise InvalidArgumentError(f"the parameters must share one floating-point dtype, got "
                                   f"{sorted(str(d) for d in dtypes)}")
    tables = sparse.find_tables(module, servers, sparse_embeddings)
    by_rows = {id(table.weight) for table in tables}
    params = [p for p in trained if id(p) not in by_rows]
    return Model(module, optimizer, optimizers, params, tables, trained[0].dtype)
