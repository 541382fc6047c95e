"""The torch.distributed backend "mpidist": `dist.init_process_group("mpidist")` runs torch's
DDP, FSDP, DTensor, pipelining and checkpointing on mpidist's collectives.

registration.py names the backend to torch; rendezvous.py takes rank and size from MPI and
sets up torch's store; backend.py is the process group itself, its sends and receives
point_to_point.py's; outside_compile.py keeps torch.compile out of both. Importing this
package imports neither torch nor MPI: `import mpidist` calls register_when_torch_loads(), which
registers the backend at once when torch.distributed is already imported, else as soon as the
program imports it.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TORCH_DISTRIBUTED = "torch.distributed"


def register_when_torch_loads() -> None:
    """Register the backend with torch.distributed now if it is loaded, else right after the
    program imports it (torch costs seconds to import: `import mpidist` does not pay them)."""
    if sys.modules.get(TORCH_DISTRIBUTED) is not None:
        _register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def _register() -> None:
    from .registration import register
    register()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds torch.distributed through the other finders and registers the backend once that
    module has run."""

    def find_spec(self, name, path, target=None):
        if name != TORCH_DISTRIBUTED:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec
