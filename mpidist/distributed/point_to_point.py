"""The point-to-point operations of ProcessGroupMpidist (backend.py): a send or receive of one
tensor is a nonblocking MPI message on the group's communicator for them (a duplicate of its own,
so a user's tag never matches a collective's), and its Work waits for the request under the
deadline (MPIDIST_TIMEOUT), naming the peer. A CUDA tensor travels through a CPU copy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from mpi4py import MPI

from ..errors import InvalidArgumentError
from ..runtime.deadlines import wait_for_request
from .outside_compile import run_outside_compile


def send(mpi, tensor, dst_rank: int, tag: int) -> PointToPointWork:
    """Start sending `tensor` to `dst_rank` of `mpi` with `tag`."""
    host = tensor.detach().cpu().contiguous() if tensor.is_cuda else contiguous(tensor, "send")
    request = mpi.Isend(message(host), dest=dst_rank, tag=tag)
    return PointToPointWork(request, f"send to rank {dst_rank} (tag {tag})", dst_rank, mpi)


def receive(mpi, tensor, source: int, tag: int) -> PointToPointWork:
    """Start receiving into `tensor` from `source` of `mpi` (MPI.ANY_SOURCE: any rank) with `tag`."""
    target = torch.empty_like(tensor, device="cpu") if tensor.is_cuda else contiguous(tensor, "recv")
    request = mpi.Irecv(message(target), source=source, tag=tag)
    finish = (lambda: tensor.copy_(target)) if tensor.is_cuda else None
    who = "any rank" if source == MPI.ANY_SOURCE else f"rank {source}"
    return PointToPointWork(request, f"receive from {who} (tag {tag})", source, mpi, finish)


@run_outside_compile
class PointToPointWork(dist.Work):
    """A send's or receive's Work: the nonblocking MPI request, waited with the deadline."""

    def __init__(self, request, what: str, peer, mpi, finish=None):
        super().__init__()
        self._request, self._what, self._peer, self._mpi = request, what, peer, mpi
        self._finish = finish  # after a receive: copy a staged message into the tensor
        self._status = MPI.Status()
        self._done = False

    def wait(self, timeout=None):
        if not self._done:
            peer = "any rank" if self._peer == MPI.ANY_SOURCE else f"rank {self._peer}"
            wait_for_request(_StatusTest(self._request, self._status), f"rank {self._mpi.Get_rank()}", self._what,
                             peer, peers=() if self._peer == MPI.ANY_SOURCE else (self._peer,))
            self._complete()
        return True

    def _complete(self):
        self._done = True
        if self._finish is not None:
            self._finish()

    def is_completed(self):
        if not self._done and self._request.Test(self._status):
            self._complete()
        return self._done

    def _source_rank(self):
        self.wait()
        return self._status.Get_source()

    source_rank = _source_rank


class _StatusTest:
    """A request whose Test() fills a status (the source of a receive from any rank)."""

    def __init__(self, request, status):
        self.request, self.status = request, status

    def Test(self):
        return self.request.Test(self.status)


def contiguous(tensor, what: str):
    if not tensor.is_contiguous():
        raise InvalidArgumentError(f"{what}: the tensor must be contiguous")
    return tensor


def message(tensor):
    """An MPI buffer of the tensor's bytes (typed by size only: both sides pass the same dtype)."""
    return [tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else bytearray(), MPI.BYTE]
