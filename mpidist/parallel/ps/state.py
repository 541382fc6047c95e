"""A parameter server's weights and optimizer state between its servers: each server's part
gathered on the coordinator for a checkpoint (gather_state), and every server's range shared
with the others at the end, so that every server ends with the whole model.
"""
from __future__ import annotations

import json

import torch

from ...runtime import wire
from . import shards
from .protocol import Tag, text, words
from .roles import ServerRole
from .server import receive_from_server, send_table_ranges


def share_final_weights(role: ServerRole) -> list:
    """Every server sends its range of the final weights to the others and takes theirs."""
    servers, model = role.settings.servers, role.model
    if len(servers) == 1:
        return []
    start, end = role.own_range
    weights = torch.empty(model.numel, dtype=model.dtype)
    weights[start:end] = role.owned.weights()
    others = [s for s in servers if s != role.endpoint.rank]
    sends = [wire.send(role.endpoint.mpi, weights[start:end], other, Tag.SHARE) for other in others]
    for other in others:
        sends += send_table_ranges(role, other, Tag.SHARE)
    for index, (other, (low, high)) in enumerate(zip(servers, role.settings.ranges)):
        if other != role.endpoint.rank:
            what = f"the final weights of server {other}"
            weights[low:high] = receive_from_server(role, other, Tag.SHARE, what)
            for table in model.tables:
                rows = receive_from_server(role, other, Tag.SHARE, what)
                with torch.no_grad():
                    table.weight[slice(*table.row_range(index))] = rows.to(table.weight.device)
    model.load(weights)
    return sends


def gather(role: ServerRole, weights: bool) -> list:
    """The optimizers' state (and, with `weights`, the weights) of every server on the
    coordinator: another server starts sending its part and returns the sends."""
    servers, ranges, model = role.settings.servers, role.settings.ranges, role.model
    if len(servers) == 1:
        return []
    if not role.coordinating:
        return send_part(role, weights)
    pieces = role.owned.state_pieces()
    flat = torch.empty(model.numel, dtype=model.dtype)
    if weights:
        flat[slice(*role.own_range)] = role.owned.weights()
    for other, (low, high) in zip(servers[1:], ranges[1:]):
        what = f"the state of server {other}"
        if weights:
            flat[low:high] = receive_from_server(role, other, Tag.STATE, what)
            for table in model.tables:
                rows = receive_from_server(role, other, Tag.STATE, what)
                with torch.no_grad():
                    table.weight[slice(*table.row_range(servers.index(other)))] = rows.to(table.weight.device)
        said = receive_from_server(role, other, Tag.STATE, what)
        contents = json.loads(text(said))
        count = sum(spread is not None for *_, named in contents for spread, _ in named.values())
        tensors = [receive_from_server(role, other, Tag.STATE, what) for _ in range(count)]
        pieces += [(optimizer, position, tuple(span),
                    {name: (bool(spread), value if spread is None else tensors[value])
                     for name, (spread, value) in named.items()})
                   for optimizer, position, span, named in contents]
    if weights:
        model.load(flat)
    shards.assemble_state(model.optimizers, pieces)
    return []


def send_part(role: ServerRole, weights: bool) -> list:
    """Start sending this server's part of the state to the coordinator: the weights of its
    range (with `weights`), a JSON list of its optimizers' state pieces, then their tensors."""
    owned = role.owned
    parts = [owned.weights()] + [table.weight.detach()[slice(*table.row_range(role.index))].clone()
                                 for table in role.model.tables] if weights else []
    contents, tensors = [], []
    for optimizer, position, span, state in owned.state_pieces():
        named = {}
        for name, (spread, value) in state.items():
            named[name] = [spread, len(tensors)] if torch.is_tensor(value) else [None, value]
            if torch.is_tensor(value):
                tensors.append(value)
        contents.append([optimizer, position, list(span), named])
    return [wire.send(role.endpoint.mpi, part, role.settings.coordinator, Tag.STATE)
            for part in [*parts, words(json.dumps(contents)), *tensors]]
