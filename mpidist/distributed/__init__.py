"""The torch.distributed backend "mpidist": `dist.init_process_group("mpidist")` runs torch's
DDP, FSDP, DTensor, pipelining and checkpointing on mpidist's collectives.

registration.py names the backend to torch; rendezvous.py takes rank and size from MPI and
sets up torch's store; backend.py is the process group itself, its sends and receives
point_to_point.py's; outside_compile.py keeps torch.compile out of both. Importing this
package imports neither torch nor MPI: `import mpidist` calls register_when_torch_loads(), which
registers the backend at once when torch.distributed is already imported, else as soon as the
program imports it (after_import.py, which outside_compile.py uses too).
"""
from __future__ import annotations

from .after_import import after_import

TORCH_DISTRIBUTED = "torch.distributed"


def register_when_torch_loads() -> None:
    """Register the backend with torch.distributed now if it is loaded, else right after the
    program imports it (torch costs seconds to import: `import mpidist` does not pay them)."""
    after_import(TORCH_DISTRIBUTED, _register)


def _register() -> None:
    from .registration import register
    register()
