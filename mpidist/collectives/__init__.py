"""mpidist's own collective algorithms, one per file; api.py is the front door."""
from ..runtime.mpi import load_mpi

# The modules below import mpi4py's MPI, which initializes MPI: set mpidist's Open MPI options
# first, whichever module of the package a program imports before md.init().
load_mpi()

from .api import ALGORITHMS, ALLREDUCE, OPS, Handle  # noqa: E402,F401
