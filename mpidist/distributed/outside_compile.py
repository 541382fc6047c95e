"""Keeps torch.compile out of the backend's Python: the methods torch's C++ calls back into
(ProcessGroup's collectives, Work's wait and future) run with TorchDynamo off.

torch's C++ enters a Python backend's overrides wherever a collective runs, also from eager code
that a compiled function calls at a graph break (DDP rebuilding its buckets, the in-place
collectives of a traced function) while Dynamo's frame hook is still set. Dynamo would then
trace the override as a function of its own; it treats ProcessGroup and Work as opaque objects
and refuses every Python attribute of a subclass, and a collective is communication, nothing a
graph could hold. gloo's and NCCL's collectives are C++ throughout, so Dynamo never sees them;
torch.compiler.disable gives ours the same: the override and everything it calls run eagerly.
"""
from __future__ import annotations

import torch

from .after_import import after_import

# torch.compile imports Dynamo, and nothing traces a frame before; importing it costs seconds,
# which a program that never compiles does not pay for us.
DYNAMO = "torch._dynamo"


def run_outside_compile(cls: type) -> type:
    """`cls`, whose methods that override one of its torch base class's run outside Dynamo from
    the moment Dynamo is imported."""
    after_import(DYNAMO, lambda: _disable_overrides(cls))
    return cls


def _disable_overrides(cls: type) -> None:
    for name, member in list(vars(cls).items()):
        if callable(member) and not name.startswith("__") and hasattr(cls.__base__, name):
            setattr(cls, name, torch.compiler.disable(member))
