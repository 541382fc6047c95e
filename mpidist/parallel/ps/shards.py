"""How a parameter server's model is partitioned over several server ranks: the parameters laid
end to end in one flat vector, cut into one contiguous range per server, balanced by size. A cut
falls on a row boundary, so a large tensor is split into row ranges (as TensorFlow's variable
partitioners and ps-lite's key ranges split theirs) and a small one stays whole. A server of
several keeps its own range in tensors of its own, stepped by optimizers over them alone
(OwnedRange), so that its work per update is its share of the model.
"""
from __future__ import annotations

import bisect
import zlib

import torch

from ...errors import InvalidArgumentError


def row_boundaries(shapes) -> list:
    """Every flat offset where a cut may fall: the start of each row of each parameter (a 0-d
    or 1-d tensor's rows are its elements), and the end of the last."""
    boundaries, offset = [0], 0
    for shape in shapes:
        numel = 1
        for size in shape:
            numel *= size
        rows = shape[0] if shape else 1
        row = numel // rows if rows else 0
        boundaries.extend(offset + row * index for index in range(1, rows + 1))
        offset += numel
    return sorted(set(boundaries))


def partition(shapes, servers: int) -> list:
    """[(start, end)] of the flat vector for each of `servers` servers: every range non-empty,
    each cut at the row boundary nearest to an equal share."""
    boundaries = row_boundaries(shapes)
    total = boundaries[-1]
    if len(boundaries) - 1 < servers:
        raise InvalidArgumentError(f"the model's parameters have {len(boundaries) - 1} rows in all, too few to "
                                   f"split over {servers} servers (each needs at least one row)")
    cuts = [0]
    for index in range(1, servers):
        target = total * index / servers
        at = bisect.bisect_left(boundaries, target)
        nearest = min((i for i in (at - 1, at) if 0 <= i < len(boundaries)),
                      key=lambda i: abs(boundaries[i] - target))
        # Each server keeps at least one row, and leaves one to each server after it.
        lowest = boundaries.index(cuts[-1]) + 1
        highest = len(boundaries) - 1 - (servers - index)
        cuts.append(boundaries[min(max(nearest, lowest), highest)])
    cuts.append(total)
    return list(zip(cuts[:-1], cuts[1:]))


def fingerprint(shapes, ranges) -> int:
    """A number that differs (almost surely) between two layouts: what ranks compare to agree."""
    return zlib.crc32(repr((tuple(tuple(s) for s in shapes), tuple(ranges))).encode()) & 0x7FFFFFFF


def optimizer_like(optimizer, groups) -> torch.optim.Optimizer:
    """An optimizer of `optimizer`'s class over other parameters: `groups` is [(one of its
    param_groups, the parameters in its place)], each new group with that group's settings."""
    return type(optimizer)([dict(group, params=params) for group, params in groups])


def assemble_state(optimizers: list, pieces: list) -> None:
    """Load into `optimizers` (the user's) each parameter's state made from the `pieces` of it
    every server sent (OwnedRange.state_pieces): the flat spans pasted into whole tensors, the
    other values taken from the first piece."""
    by_parameter = {}
    for index, position, span, part in pieces:
        by_parameter.setdefault((index, position), []).append((span, part))
    for index, optimizer in enumerate(optimizers):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        saved = optimizer.state_dict()
        for position, parts in sorted((p, parts) for (i, p), parts in by_parameter.items() if i == index):
            state = {}
            for name, (spread, value) in parts[0][1].items():
                if spread:
                    value = torch.zeros(params[position].numel(), dtype=value.dtype)
                    for (low, high), part in parts:
                        value[low:high] = part[name][1].reshape(-1)
                    value = value.view(params[position].shape)
                state[name] = value
            saved["state"][position] = state
        optimizer.load_state_dict(saved)  # which moves each value where torch keeps it


class OwnedRange:
    """A server's range [start, end) of the flat dense parameters `params`, held apart from the
    module: one flat buffer, and for each parameter the range covers, its rows there as a leaf
    tensor viewing the buffer (the buffer is thus always the range's current weights, what
    replies copy). `tables`: [(a sparse table's weight, (first, last + 1) of its rows this
    server holds)], each such rows a leaf tensor viewing the weight itself (stepping them steps
    the module's table). `optimizers` are the user's optimizers remade over these rows, with
    each group's settings and state restricted to the rows; a user's optimizer that holds none
    of this server's parameters is left out. Elementwise optimizers then give the owned rows
    exactly what they would give the whole tensors, and keep state of the owned rows only."""

    def __init__(self, params: list, span: tuple, optimizers: list, tables=()):
        start, end = span
        device = params[0].device if params else torch.device("cpu")
        dtype = params[0].dtype if params else torch.get_default_dtype()
        self.flat = torch.empty(end - start, dtype=dtype, device=device)
        self.pieces = []  # (the module's parameter, its rows here, their flat span within the parameter)
        offset = 0
        for param in params:
            low, high = max(start, offset), min(end, offset + param.numel())
            if low < high:
                rows = self.flat[low - start:high - start]
                rows.copy_(param.detach().reshape(-1)[low - offset:high - offset])
                shape = param.shape if high - low == param.numel() else (-1, *param.shape[1:])
                self.pieces.append((param, rows.view(shape).requires_grad_(True), (low - offset, high - offset)))
            offset += param.numel()
        self.table_rows = {}  # id of a table's weight -> (its rows here, the first of them)
        held = list(self.pieces)
        for weight, (first, last) in tables:
            rows = weight.detach()[first:last].requires_grad_(True)
            self.table_rows[id(weight)] = (rows, first)
            held.append((weight, rows, (first * weight[0].numel(), last * weight[0].numel())))
        self._held = held  # (parameter, its rows here, their flat span within it), dense and tables
        self._pairs = []  # (user's group, remade group), for the settings a scheduler may change
        # id of a remade optimizer's parameter -> (its user optimizer's index, the user parameter's
        # index there, the flat span of it held here), for checkpoints
        self._origins = {}
        self.optimizers = [remade for remade in (self._remake(index, optimizer, params)
                                                 for index, optimizer in enumerate(optimizers)) if remade is not None]

    def _remake(self, index: int, optimizer, params: list):
        owned = {id(param): (rows, span) for param, rows, span in self._held}
        groups = []
        for group in optimizer.param_groups:
            mine = [owned[id(p)][0] for p in group["params"] if id(p) in owned]
            if mine:
                groups.append((group, mine))
        user_params = [p for group in optimizer.param_groups for p in group["params"]]
        for position, param in enumerate(user_params):
            if id(param) in owned:
                rows, span = owned[id(param)]
                self._origins[id(rows)] = (index, position, span)
        if not groups:
            return None
        remade = optimizer_like(optimizer, groups)
        self._pairs += list(zip((group for group, _ in groups), remade.param_groups))
        for param, state in optimizer.state.items():  # a resumed optimizer's state, cut to the rows
            if id(param) in owned:
                rows, (low, high) = owned[id(param)]
                remade.state[rows] = {key: value.reshape(-1)[low:high].view_as(rows).clone()
                                      if torch.is_tensor(value) and value.shape == param.shape else value
                                      for key, value in state.items()}
        return remade

    def state_pieces(self) -> list:
        """This range's part of the optimizers' state, as [(the user optimizer's index, the
        parameter's index in it, (low, high), {name: (True, the state of the flat span [low,
        high) of the parameter) or (False, a value of the whole parameter)})], copies; a sparse
        state tensor comes dense."""
        pieces = []
        for optimizer in self.optimizers:
            for rows, state in optimizer.state.items():
                index, position, span = self._origins[id(rows)]
                part = {}
                for name, value in state.items():
                    if torch.is_tensor(value):
                        value = (value.to_dense() if value.is_sparse else value).detach().to("cpu", copy=True)
                    part[name] = (torch.is_tensor(value) and value.shape == rows.shape, value)
                pieces.append((index, position, span, part))
        return pieces

    def set_gradients(self, gradient: torch.Tensor) -> None:
        """The range's mean gradient (flat, the range's length) as the rows' gradients."""
        gradient = gradient.to(self.flat.device)
        at = 0
        for _, rows, (low, high) in self.pieces:
            rows.grad = gradient[at:at + high - low].view_as(rows)
            at += high - low

    def set_table_gradient(self, weight, gradient: torch.Tensor) -> None:
        """A table's sparse gradient (of the whole table, in this server's rows) as its rows'."""
        rows, first = self.table_rows[id(weight)]
        rows.grad = torch.sparse_coo_tensor(gradient._indices() - first, gradient._values(), rows.shape,
                                            check_invariants=False)

    def step(self, lr_scale: float) -> None:
        """One update of the rows: the user's current settings (a scheduler may have changed
        them), the learning rate times lr_scale for this update alone."""
        for user, remade in self._pairs:
            remade.update({key: value for key, value in user.items() if key != "params"})
            remade["lr"] = user["lr"] * lr_scale
        for optimizer in self.optimizers:
            optimizer.step()
        for _, rows, _ in self._held:
            rows.grad = None

    def weights(self) -> torch.Tensor:
        """A CPU copy of the range's current weights (pending sends read it while the rows move on)."""
        return self.flat.detach().to("cpu", copy=True)

    def to_module(self) -> None:
        """Copy the rows into the module's parameters."""
        with torch.no_grad():
            for param, rows, (low, high) in self.pieces:
                param.view(-1)[low:high] = rows.reshape(-1)
