"""mpidist's own collective algorithms, one per file; api.py is the front door."""
from .api import ALGORITHMS, ALLREDUCE, OPS, Handle  # noqa: F401
