"""The torch.distributed backend "mpidist": `dist.init_process_group("mpidist")` runs torch's
DDP, FSDP, DTensor, pipelining and checkpointing on mpidist's collectives.

registration.py names the backend to torch; rendezvous.py takes rank and size from MPI and
sets up torch's store; backend.py is the process group itself, its sends and receives
point_to_point.py's; outside_compile.py keeps torch.compile out of both, and
keep_compile_out_of_mpidist out of mpidist's own collectives. Importing this
package imports neither torch nor MPI: `import mpidist` calls register_when_torch_loads(), which
registers the backend at once when torch.distributed is already imported, else as soon as the
program imports it (after_import.py, which outside_compile.py uses too).
"""
from __future__ import annotations

from .after_import import after_import

TORCH_DISTRIBUTED = "torch.distributed"
DYNAMO = "torch._dynamo"


def register_when_torch_loads() -> None:
    """Register the backend with torch.distributed now if it is loaded, else right after the
    program imports it (torch costs seconds to import: `import mpidist` does not pay them)."""
    after_import(TORCH_DISTRIBUTED, _register)


def keep_compile_out_of_mpidist() -> None:
    """Once the program imports Dynamo (torch.compile does), have it skip mpidist's files: a
    compiled function that calls mpidist's own collectives (md.allreduce, a Communicator's)
    breaks its graph there and runs them eagerly, as it runs an extension's C functions, instead
    of tracing into mpidist's Python, which it cannot (a rank's stall report, mpi4py's buffers)."""
    after_import(DYNAMO, _skip_mpidist)


def _skip_mpidist() -> None:
    from torch._dynamo import trace_rules
    trace_rules.add("mpidist")


def _register() -> None:
    from .registration import register
    register()
