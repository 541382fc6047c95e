"""What the rank tests of tests/gpu/ share about arrays: the kinds of array on the launch's device,
every rank's inputs (known on every rank), the check that a result is the same bits on every
rank, and the check of the route a collective's buffer took (a count of host stagings)."""
from __future__ import annotations

import zlib

import numpy as np
import torch
from tolerances import assert_reduced

# The kinds of array checked on each device, and their dtypes (NumPy and CuPy have no bfloat16).
KINDS = {"cuda": ("torch", "cupy"), "cpu": ("numpy", "torch")}
DTYPES = {"torch": ("float32", "bfloat16", "float16"), "cupy": ("float32", "float16"),
          "numpy": ("float32", "float16")}
# One element; a count that is no multiple of a vector width; one past reduce_bcast's 4 MiB blocks
# and many of the 256 KiB segments the ring and halving algorithms pipeline.
COUNTS = {"cuda": (1, 4099, (1 << 21) + 7), "cpu": (1, 4099, 70_001)}
COUNT = 4099  # the count of the checks that run at one size


class Arrays:
    """Makes arrays of one kind ("torch", "cupy", "numpy") on one device from float64 values, and
    reads them back as float64."""

    def __init__(self, kind: str, device: str):
        self.kind, self.device = kind, device
        self.on_gpu = device.startswith("cuda")

    def make(self, values: np.ndarray, dtype: str):
        if self.kind == "torch":
            return torch.from_numpy(np.ascontiguousarray(values)).to(getattr(torch, dtype)).to(self.device)
        if self.kind == "cupy":
            import cupy
            with cupy.cuda.Device(torch.device(self.device).index or 0):
                return cupy.asarray(values.astype(dtype))
        return values.astype(dtype)

    def float64(self, array) -> np.ndarray:
        if self.kind == "torch":
            return array.detach().to("cpu", torch.float64).numpy()
        if self.kind == "cupy":
            import cupy
            return cupy.asnumpy(array).astype(np.float64)
        return np.asarray(array, dtype=np.float64)


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded to `dtype` (and back): what an array of that dtype holds exactly."""
    return torch.from_numpy(values).to(getattr(torch, dtype)).double().numpy()


class Inputs:
    """Every rank's input of a collective, known on every rank: float64 values that `dtype` holds
    exactly. The last set made is kept (the large ones are big), so tests of one dtype and count
    in a row make it once."""

    def __init__(self, size: int):
        self.size = size
        self._last = (None, None)

    def get(self, dtype: str, count: int, seed: int = 0) -> list:
        key = (dtype, count, seed)
        if self._last[0] != key:
            per_rank = [rounded(np.random.default_rng([seed, rank, count]).standard_normal(count), dtype)
                        for rank in range(self.size)]
            self._last = (key, per_rank)
        return self._last[1]


def assert_reduced_values(got: np.ndarray, per_rank: list, op: str, dtype: str) -> None:
    """`got` (float64) is the reduction `op` of every rank's input within tests/tolerances.py's
    bound for `dtype`, and of the inputs' shape (the bound alone would let a shorter result
    broadcast)."""
    assert got.shape == per_rank[0].shape, f"shape {got.shape}, expected {per_rank[0].shape}"
    assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} of {got.size} elements are not finite"
    assert_reduced(got, per_rank, op, dtype=dtype)


def disagreement(comm, values: np.ndarray) -> str:
    """"" where every rank holds these exact values, else what differs. A collective: call it
    on every rank before any assertion, so that a rank that fails one does not leave the others
    waiting in it."""
    from mpi4py import MPI
    mine = np.array([zlib.crc32(np.ascontiguousarray(values).tobytes())], dtype=np.int64)
    every = np.empty(comm.size, dtype=np.int64)
    comm.mpi.Allgather([mine, MPI.INT64_T], [every, MPI.INT64_T])
    return f"the ranks' results differ (checksums {every.tolist()})" if (every != every[0]).any() else ""


class StagingCounter:
    """Counts the communicator's host stagings, to check the route a GPU buffer took."""

    def __init__(self, comm):
        self.count = 0
        staging = comm.staging
        original = staging.stage_in

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        staging.stage_in = counted

    def route_problem(self, before: int, on_gpu: bool, host_only: bool, cuda_aware: bool,
                      windowed: bool = False) -> str:
        """"" where a collective that ran between `before` and now took its expected route, else
        what it did instead: a CPU buffer is never staged; with `windowed` a GPU buffer goes
        through the node window in GPU memory; otherwise it is staged through host memory
        exactly when the algorithm works there (`host_only`) or the MPI library is not
        CUDA-aware."""
        staged = self.count > before
        if not on_gpu:
            return "a CPU buffer was staged" if staged else ""
        if windowed:
            return "the GPU buffer was staged instead of going through the device window" if staged else ""
        if staged != (host_only or not cuda_aware):
            return (f"the GPU buffer {'was' if staged else 'was not'} staged through host memory, but the MPI "
                    f"library is {'' if cuda_aware else 'not '}CUDA-aware"
                    f"{' and the algorithm works in host memory' if host_only else ''}")
        return ""
