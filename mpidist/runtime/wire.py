"""The dtype table of the whole package, and typed messages between ranks: an int64 header (the
payload's dtype code and shape, and a few numbers of the sender's choosing), then the payload's
bytes. Nothing is pickled: a receiver only ever reads numbers and raw array memory.

ITEMSIZE is the one table of element types: name -> item size, in code order (a dtype's code
is its index in DTYPES). The first eight are the types the collectives and kernels reduce (COLLECTIVE_DTYPES:
their codes are part of the cross-rank call check); messages carry those and the rest.

Messages go over an mpi4py communicator given by the caller (this module never loads MPI). A
message uses two tags, `tag` (header) and `tag + 1` (payload); every wait has the deadline of
deadlines.py and names the peer it waits for. allgather_texts gives every rank each rank's text (or
none), as lengths then UTF-8 bytes.
"""
from __future__ import annotations

import sys

import numpy as np

from ..errors import InvalidArgumentError, UnsupportedDtypeError
from . import deadlines

ITEMSIZE = {
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "uint8": 1, "int8": 1,
    "int16": 2, "bool": 1,
}
DTYPES = tuple(ITEMSIZE)
COLLECTIVE_DTYPES = DTYPES[:8]
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES = ("float16", "bfloat16")

MAX_DIMS = 8
MAX_FIELDS = 4
# [dtype code, number of dimensions, MAX_DIMS dimensions, number of fields, MAX_FIELDS fields]
HEADER_LENGTH = 2 + MAX_DIMS + 1 + MAX_FIELDS


def code_of(name: str) -> int:
    return DTYPES.index(name)


def name_of(dtype) -> str:
    """The table's name of a torch or NumPy dtype (or of a name), or UnsupportedDtypeError."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise UnsupportedDtypeError(f"dtype {name} is not one mpidist sends; supported: {', '.join(DTYPES)}")
    return name


def torch_dtype(name: str):
    import torch  # only torch payloads need it, and importing torch takes seconds
    return getattr(torch, name)


# ---- messages ------------------------------------------------------------------------------

def header_of(tensor, fields=()) -> np.ndarray:
    """The header of a CPU torch tensor sent with `fields` (at most MAX_FIELDS integers)."""
    if tensor.dim() > MAX_DIMS:
        raise InvalidArgumentError(f"a message carries tensors of at most {MAX_DIMS} dimensions, got {tensor.dim()}")
    if len(fields) > MAX_FIELDS:
        raise InvalidArgumentError(f"a message header carries at most {MAX_FIELDS} numbers, got {len(fields)}")
    header = np.zeros(HEADER_LENGTH, dtype=np.int64)
    header[0], header[1] = code_of(name_of(tensor.dtype)), tensor.dim()
    header[2:2 + tensor.dim()] = tensor.shape
    header[2 + MAX_DIMS] = len(fields)
    header[3 + MAX_DIMS:3 + MAX_DIMS + len(fields)] = fields
    return header


def fields_of(header: np.ndarray) -> tuple:
    count = int(header[2 + MAX_DIMS])
    return tuple(int(v) for v in header[3 + MAX_DIMS:3 + MAX_DIMS + count])


def empty_from(header: np.ndarray):
    """An uninitialized CPU torch tensor of the dtype and shape a header describes."""
    import torch  # only torch payloads need it, and importing torch takes seconds
    shape = tuple(int(d) for d in header[2:2 + int(header[1])])
    return torch.empty(shape, dtype=torch_dtype(DTYPES[int(header[0])]))


def byte_view(tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as bytes (what MPI sends and receives)."""
    torch = sys.modules["torch"]
    return tensor.view(-1).view(torch.uint8).numpy() if tensor.numel() else np.empty(0, np.uint8)


class Outgoing:
    """A message being sent: its requests, and the buffers they read (kept alive until done)."""

    def __init__(self, requests, buffers, dest: int):
        self.requests, self.buffers, self.dest = requests, buffers, dest

    def test(self) -> bool:
        return all(request.Test() for request in self.requests)

    def wait(self, who: str, what: str, silent: str) -> None:
        for request in self.requests:
            deadlines.wait_for_request(request, who, what, silent, peers=(self.dest,))


def send(mpi, tensor, dest: int, tag: int, fields=()) -> Outgoing:
    """Start sending a torch tensor (moved to host memory if needed) with `fields` to `dest`:
    the header with `tag`, the payload with `tag + 1` (none when the tensor is empty)."""
    tensor = tensor.detach().cpu().contiguous()
    header, data = header_of(tensor, fields), byte_view(tensor)
    requests = [mpi.Isend(header, dest=dest, tag=tag)]
    if data.size:
        requests.append(mpi.Isend(data, dest=dest, tag=tag + 1))
    return Outgoing(requests, (header, data, tensor), dest)


class Incoming:
    """A header being received; receive_payload() then takes the tensor it announces."""

    def __init__(self, mpi, source: int, tag: int):
        self.mpi, self.source, self.tag = mpi, source, tag
        self.header = np.empty(HEADER_LENGTH, dtype=np.int64)
        self.request = mpi.Irecv(self.header, source=source, tag=tag)

    @property
    def fields(self) -> tuple:
        return fields_of(self.header)

    def wait(self, who: str, what: str, silent: str) -> None:
        deadlines.wait_for_request(self.request, who, what, silent, peers=(self.source,))

    def receive_payload(self, who: str, what: str, silent: str):
        tensor = empty_from(self.header)
        if tensor.numel():
            request = self.mpi.Irecv(byte_view(tensor), source=self.source, tag=self.tag + 1)
            deadlines.wait_for_request(request, who, what, silent, peers=(self.source,))
        return tensor


def receive(mpi, source: int, tag: int, who: str, what: str, silent: str):
    """(tensor, fields) of the message from `source` with `tag` (as send() sent it)."""
    incoming = Incoming(mpi, source, tag)
    incoming.wait(who, what, silent)
    return incoming.receive_payload(who, what, silent), incoming.fields


def broadcast(mpi, tensor, root: int, who: str, what: str, silent: str):
    """`root`'s torch tensor (pass None elsewhere) on every rank of `mpi`, header then payload;
    `silent` names the root, or on the root the others."""
    if mpi.Get_rank() == root:
        tensor = tensor.detach().cpu().contiguous()
        header = header_of(tensor)
        peers = deadlines.other_ranks(mpi)
    else:
        header = np.zeros(HEADER_LENGTH, dtype=np.int64)
        peers = (root,)
    deadlines.wait_for_request(mpi.Ibcast(header, root=root), who, what, silent, peers)
    if mpi.Get_rank() != root:
        tensor = empty_from(header)
    if tensor.numel():
        deadlines.wait_for_request(mpi.Ibcast(byte_view(tensor), root=root), who, what, silent, peers)
    return tensor


# ---- texts ---------------------------------------------------------------------------------

def allgather_texts(mpi, text: str | None, what: str) -> list:
    """Every rank's `text` (or None) on every rank of `mpi`, in a list by rank: the lengths (-1
    for None), then, only where some rank has a text, the UTF-8 bytes of all."""
    data = np.frombuffer((text or "").encode(), dtype=np.uint8)
    lengths = np.empty(mpi.Get_size(), dtype=np.int64)
    length = np.array([-1 if text is None else data.size], dtype=np.int64)
    deadlines.wait_for_collective(mpi.Iallgather(length, lengths), mpi, what)
    if (lengths < 0).all():
        return [None] * len(lengths)
    counts = np.maximum(lengths, 0)
    gathered = np.empty(int(counts.sum()), dtype=np.uint8)
    deadlines.wait_for_collective(mpi.Iallgatherv(data, [gathered, counts]), mpi, what)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return [None if lengths[k] < 0 else gathered[offsets[k]:offsets[k + 1]].tobytes().decode()
            for k in range(len(lengths))]
