"""A parameter server's sparse tables: the embedding weights that travel by rows. Which tables a
model has, how each one's rows are split over the servers (one contiguous row range per server),
the rows of a worker's gradient (unique indices and their summed rows), the servers' mean of the
workers' rows as a torch sparse gradient (coalesced, its invariants checked, as are those of the
tensors the optimizer builds from it: invariants_checked), and the check that an optimizer can
apply one.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ...errors import InvalidArgumentError
from .shards import optimizer_like

EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)


@dataclasses.dataclass
class Table:
    """One embedding weight sent by rows. `bounds`: the first row of each server's range, and
    the table's row count last (server i owns rows bounds[i] .. bounds[i + 1] - 1)."""
    name: str
    module: torch.nn.Module
    weight: torch.nn.Parameter
    bounds: list

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    @property
    def row_size(self) -> int:
        return self.weight[0].numel()

    def row_range(self, server_index: int) -> tuple:
        return self.bounds[server_index], self.bounds[server_index + 1]

    def split(self, indices: torch.Tensor) -> list:
        """Where each server's part begins and ends in sorted row indices."""
        cuts = torch.searchsorted(indices, torch.tensor(self.bounds, dtype=indices.dtype)).tolist()
        return list(zip(cuts[:-1], cuts[1:]))


class Rows(NamedTuple):
    """Rows of a table's gradient: their `indices` (sorted, unique) and the summed gradient
    `values` of each."""
    indices: torch.Tensor
    values: torch.Tensor


def find_tables(module: torch.nn.Module, servers: int, sparse_embeddings: bool) -> list:
    """The Table of every embedding weight that goes by rows: nn.Embedding and nn.EmbeddingBag
    with sparse=True, and with sparse_embeddings=True the dense ones too."""
    tables = []
    for name, child in module.named_modules():
        if isinstance(child, EMBEDDINGS) and (child.sparse or sparse_embeddings) and child.weight.requires_grad:
            rows = child.weight.shape[0]
            bounds = [rows * index // servers for index in range(servers + 1)]
            tables.append(Table(f"{name}.weight" if name else "weight", child, child.weight, bounds))
    return tables


def gradient_rows(table: Table, pulled) -> Rows:
    """The Rows of a worker's gradient of `table`; `pulled` the rows the worker pulled in this
    step (None: none). A sparse gradient gives its own rows (as torch's optimizers see them); a
    dense one the pulled rows. Raises InvalidArgumentError for a gradient on rows that were not pulled."""
    grad = table.weight.grad
    pulled = torch.empty(0, dtype=torch.int64) if pulled is None else pulled
    if grad is None:
        return Rows(torch.empty(0, dtype=torch.int64), torch.empty((0, *table.weight.shape[1:]), dtype=table.weight.dtype))
    grad = grad.detach().cpu()
    if grad.is_sparse:
        grad = grad.coalesce()
        indices, values = grad.indices()[0], grad.values()
        outside = indices[~torch.isin(indices, pulled)]
    else:
        indices, values = pulled, grad[pulled]
        outside = grad.index_fill(0, pulled, 0).reshape(grad.shape[0], -1).any(dim=1).nonzero().reshape(-1)
    if outside.numel():
        raise InvalidArgumentError(f"the gradient of the sparse table {table.name} has rows that were not pulled "
                                   f"in this step (rows {outside[:8].tolist()}): call pull_rows(module, ids) with "
                                   "every id of the batch before the forward pass")
    return Rows(indices.contiguous(), values.contiguous())


def mean_gradient(table: Table, parts: list, count: int) -> torch.Tensor:
    """The torch sparse gradient of `table` holding the workers' rows `parts` (their Rows, in
    the order summed) divided by `count`, the number of gradients averaged: rows
    several workers sent are summed, as torch sums the rows of one sparse gradient."""
    indices = torch.cat([part.indices for part in parts]) if parts else torch.empty(0, dtype=torch.int64)
    values = torch.cat([part.values for part in parts]) if parts else \
        torch.empty((0, *table.weight.shape[1:]), dtype=table.weight.dtype)
    # Checked (the indices against the table's rows: one pass over them) and coalesced here, once:
    # an optimizer that needs unique rows (Adagrad) finds them so.
    return torch.sparse_coo_tensor(indices.unsqueeze(0), values / count, table.weight.shape,
                                   check_invariants=True).coalesce().to(table.weight.device)


def invariants_checked():
    """The context of an optimizer step on sparse gradients. torch's optimizers build sparse
    tensors of their own from one (Adagrad: the squared rows, the step) without saying whether
    torch should check their invariants, and torch warns at the first such tensor that memory
    errors may follow. The server's steps opt in: a check is one pass over the indices, small
    beside the update of their rows."""
    return torch.sparse.check_sparse_tensor_invariants(enable=True)


def refusal(optimizers: list, table: Table):
    """Why none of `optimizers` can apply a sparse gradient to `table` (None when one can): the
    optimizer holding the weight steps a throwaway copy of its settings on a probe."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if any(param is table.weight for param in group["params"]):
                named = f"the optimizer {type(optimizer).__name__}"
                probe = torch.zeros((2, 1), dtype=table.weight.dtype, requires_grad=True)
                try:
                    trial = optimizer_like(optimizer, [(group, [probe])])
                    probe.grad = torch.sparse_coo_tensor([[0]], torch.ones((1, 1), dtype=probe.dtype), (2, 1),
                                                         check_invariants=True, is_coalesced=True)
                    with invariants_checked():
                        trial.step()
                except Exception as error:  # whatever the optimizer raises, it cannot apply the gradient
                    return (f"{named} cannot apply a sparse gradient, which the sparse table {table.name} sends "
                            f"({type(error).__name__}: {error}); use SGD, Adagrad or SparseAdam for it")
                return None
    return f"no optimizer of the server holds the sparse table {table.name}"
