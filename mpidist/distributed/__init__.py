"""The torch.distributed backend "mpidist": `dist.init_process_group("mpidist")` runs torch's
DDP, FSDP, DTensor, pipelining and checkpointing on mpidist's collectives.

registration.py names the backend to torch; rendezvous.py takes rank and size from MPI and
sets up torch's store; backend.py is the process group itself, its sends and receives
point_to_point.py's; outside_compile.py keeps torch.compile out of both. Importing this
package imports neither torch nor MPI: `import mpidist` calls register_when_torch_loads(), which
registers the backend at once when torch.distributed is already imported, else as soon as the
program imports it (after_import, which outside_compile.py uses too).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TORCH_DISTRIBUTED = "torch.distributed"


def register_when_torch_loads() -> None:
    """Register the backend with torch.distributed now if it is loaded, else right after the
    program imports it (torch costs seconds to import: `import mpidist` does not pay them)."""
    after_import(TORCH_DISTRIBUTED, _register)


def _register() -> None:
    from .registration import register
    register()


def after_import(name: str, action) -> None:
    """action() now if the module `name` is loaded, else once the program has imported it; an
    action already waiting for that module is not added twice."""
    if sys.modules.get(name) is not None:
        action()
    elif not any(isinstance(finder, _AfterImport) and (finder.name, finder.action) == (name, action)
                 for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, action))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the module `name` through the other finders and runs `action` once it has run."""

    def __init__(self, name: str, action):
        self.name, self.action = name, action

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            self.action()

        spec.loader.exec_module = exec_module
        return spec
