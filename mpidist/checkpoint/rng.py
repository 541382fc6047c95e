"""Every rank's random number generators in a checkpoint: torch's (CPU and CUDA), NumPy's and
Python's states, gathered on rank 0 as typed bytes (no pickle), written to HDF5, read back and
checked, and restored.
"""
from __future__ import annotations

import json
import random

import numpy as np

from ..runtime.deadlines import wait_for_collective


def snapshot_of_this_rank() -> dict:
    import torch
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [state.numpy() for state in torch.cuda.get_rng_state_all()]
    return {
        "torch_cpu": torch.get_rng_state().numpy(),
        "torch_cuda": cuda,
        "numpy": {"bit_generator": name, "keys": [int(k) for k in keys], "pos": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }


def _pack_rng(snapshot) -> np.ndarray:
    """One rank's RNG snapshot as bytes, to be gathered with a typed buffer (no pickle)."""
    header = {"numpy": snapshot["numpy"], "python": snapshot["python"],
              "torch_cpu": len(snapshot["torch_cpu"]), "torch_cuda": [len(s) for s in snapshot["torch_cuda"]]}
    head = np.frombuffer(json.dumps(header).encode() + b"\n", dtype=np.uint8)
    return np.concatenate([head, snapshot["torch_cpu"], *snapshot["torch_cuda"]]).astype(np.uint8)


def _unpack_rng(blob: np.ndarray) -> dict:
    raw = blob.tobytes()
    end = raw.index(b"\n")
    header = json.loads(raw[:end])
    offset = end + 1
    pieces = []
    for length in [header["torch_cpu"], *header["torch_cuda"]]:
        pieces.append(np.frombuffer(raw, dtype=np.uint8, count=length, offset=offset).copy())
        offset += length
    return {"numpy": header["numpy"], "python": header["python"], "torch_cpu": pieces[0], "torch_cuda": pieces[1:]}


def gather(mpi):
    """Every rank's RNG snapshot on rank 0 (a list by rank), None elsewhere."""
    snapshot = snapshot_of_this_rank()
    if mpi is None:
        return [snapshot]
    from mpi4py import MPI  # here, not at import: importing mpi4py's MPI initializes MPI
    blob = _pack_rng(snapshot)
    lengths = np.zeros(mpi.Get_size(), dtype=np.int64)
    # The first exchange of save_checkpoint: a rank that calls it alone (rank 0 only, as some
    # Horovod scripts save) gets an error after MPIDIST_TIMEOUT instead of waiting forever. An
    # allgather, not a gather: every rank waits here, with the stall report, until all have come.
    wait_for_collective(mpi.Iallgather(np.array([blob.size], dtype=np.int64), lengths), mpi,
                       "gather of save_checkpoint (every rank must call it when comm is given; with "
                       "comm=None a rank saves alone)")
    if mpi.Get_rank() != 0:
        mpi.Gatherv(blob, None, root=0)
        return None
    received = np.empty(int(lengths.sum()), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    mpi.Gatherv(blob, [received, lengths.tolist(), offsets.tolist(), MPI.BYTE], root=0)
    return [_unpack_rng(received[start:start + length]) for start, length in zip(offsets, lengths)]


def write(group, snapshot):
    group.create_dataset("torch_cpu", data=snapshot["torch_cpu"])
    for device, state in enumerate(snapshot["torch_cuda"]):
        group.create_dataset(f"torch_cuda/{device}", data=state)
    group.attrs["numpy"] = json.dumps(snapshot["numpy"])
    group.attrs["python"] = json.dumps(snapshot["python"])


def read(group) -> dict:
    """The RNG states of ``group``, each first set into a generator of its own, so that a state
    of the wrong size or kind raises here (ValueError, TypeError, RuntimeError) before any of
    this process's generators changes."""
    import torch
    torch_cpu = torch.from_numpy(np.asarray(group["torch_cpu"][()], dtype=np.uint8))
    torch.Generator().set_state(torch_cpu)
    torch_cuda = []
    if "torch_cuda" in group and torch.cuda.is_available():
        torch_cuda = [torch.from_numpy(group["torch_cuda"][str(d)][()]) for d in range(len(group["torch_cuda"]))]
    state = json.loads(group.attrs["numpy"])
    numpy_state = (state["bit_generator"], np.array(state["keys"], dtype=np.uint32), state["pos"],
                   state["has_gauss"], state["cached_gaussian"])
    if not 0 <= int(state["pos"]) <= len(numpy_state[1]):  # NumPy takes any position without a word
        raise ValueError(f"NumPy's MT19937 position {state['pos']} is outside its {len(numpy_state[1])} keys")
    np.random.RandomState().set_state(numpy_state)
    state = json.loads(group.attrs["python"])
    python_state = (state["version"], tuple(state["state"]), state["gauss_next"])
    random.Random().setstate(python_state)
    return {"torch_cpu": torch_cpu, "torch_cuda": torch_cuda, "numpy": numpy_state, "python": python_state}


def restore(states: dict) -> None:
    """Set this process's generators to ``states`` (from ``read``)."""
    import torch
    torch.set_rng_state(states["torch_cpu"])
    if states["torch_cuda"] and len(states["torch_cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["torch_cuda"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
