"""ParameterAveraging: hard-synchronous model averaging, the weights averaged over the ranks every
k local steps (one packed all-reduce per kind of tensor).
"""
from __future__ import annotations

import torch

from ..comm import init
from ..errors import InvalidArgumentError
from .flat import pack_tensors, shaped_like, tensors_by_kind, unpack_tensors
from .model_state import broadcast_module_state


class ParameterAveraging:
    """Hard-synchronous model averaging: call step() after each optimizer step; every `every`
    calls the parameters are averaged over ranks (one packed all-reduce)."""

    def __init__(self, module: torch.nn.Module, every: int = 1, comm=None, algorithm: str = "auto"):
        if every < 1:
            raise InvalidArgumentError(f"every must be >= 1, got {every}")
        self.module = module
        self.every = every
        self.comm = comm if comm is not None else init()
        self.algorithm = algorithm
        self.steps = 0
        params = list(module.parameters())
        if not params:
            raise InvalidArgumentError("ParameterAveraging: the module has no parameters to average")
        broadcast_module_state(module, self.comm)
        self._groups = []
        for members in tensors_by_kind(params):
            flat = torch.empty(sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device)
            self._groups.append((members, flat, shaped_like(members, flat)))

    def step(self) -> bool:
        """Count a local step; returns True when this step averaged the parameters."""
        self.steps += 1
        if self.steps % self.every:
            return False
        with torch.no_grad():
            for members, flat, parts in self._groups:
                pack_tensors(flat, parts, [p.data for p in members])
                self.comm.allreduce(flat, op="avg", algorithm=self.algorithm)
                unpack_tensors(flat, parts, [p.data for p in members])
        return True
