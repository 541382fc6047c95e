"""algorithm="nccl", a peer of mpidist's own algorithms as MPI and gloo are on the CPU: whether it
runs on each kind of GPU array (NCCL before 2.30 refuses two ranks on one GPU), then its results
against the same references as mpidist's. Run last (--nccl; conftest.py's MODULES): a peer that
fails or hangs in its own setup cannot cost mpidist's checks, and its failures are reported
without failing the launch. Where it did not run, its all-reduces are not tried."""
import numpy as np
import pytest
from device_arrays import COUNT, assert_reduced_values, disagreement

import mpidist as md

pytestmark = [pytest.mark.peer, pytest.mark.gpu_only]
DID_NOT_RUN = {}  # kind of array -> why NCCL did not run on it


def test_peer_nccl_runs(comm, kind, arrays, record_testsuite_property):
    """One all-reduce through NCCL; the ranks agree whether it ran, so that none goes on alone."""
    from mpi4py import MPI

    from mpidist.collectives import nccl
    record_testsuite_property("nccl_version", nccl.version())
    try:
        got = arrays.float64(md.allreduce(arrays.make(np.ones(COUNT), "float32"), algorithm="nccl"))
        problem = "" if (got == comm.size).all() else f"wrong sum: {got[:4].tolist()}..., want {comm.size}"
    except Exception as error:  # NCCL's refusal, whatever its type, is this check's result
        problem = f"{type(error).__name__}: {error}"
    ran = np.array([0 if problem else 1], dtype=np.int32)
    everywhere = np.empty(1, dtype=np.int32)
    comm.mpi.Allreduce([ran, MPI.INT32_T], [everywhere, MPI.INT32_T], op=MPI.MIN)
    if not everywhere[0]:
        DID_NOT_RUN[kind] = problem or "it failed on another rank"
    assert not problem, problem
    assert everywhere[0], "NCCL failed on another rank"


@pytest.mark.parametrize("op", ("sum", "avg"))
def test_peer_nccl_allreduce(comm, kind, arrays, dtype, op, inputs):
    if kind in DID_NOT_RUN:
        pytest.skip(f"not tried: NCCL did not run ({DID_NOT_RUN[kind]})")
    per_rank = inputs.get(dtype, COUNT)
    got = arrays.float64(md.allreduce(arrays.make(per_rank[comm.rank], dtype), op=op, algorithm="nccl"))
    differs = disagreement(comm, got)
    assert_reduced_values(got, per_rank, op, dtype)
    assert not differs, differs
