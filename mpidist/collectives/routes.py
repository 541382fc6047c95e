"""The routes a collective's buffer takes to the algorithms, by memory kind and algorithm name.

A route is a table of entry points (Route): its GPU check, which api.py runs before the call
check so that a refusal reaches every rank there (callcheck.share_refusal), and one entry point
per collective, which runs it once the ranks have agreed on the call. api.py resolves the route
(route_for), checks the buffer's GPU, checks the call across ranks, then runs the route.

- "staged" (staging.py): the algorithm on the buffer where it can read it, else on a pinned host
  copy. Every CPU buffer, and the CUDA buffers of the all-reduce algorithms but those below.
- "device" (device_route.py): CUDA buffers in GPU memory, inside a node through the node window
  in GPU memory, between nodes through the GPU lane; staged where neither can be used. The CUDA
  buffers of all-reduce's "hierarchical" and "auto" (which callcheck.resolve_algorithm keeps for
  the route to decide) and of broadcast, allgather and reduce-scatter.

A new route is one file beside the others and one line here.
"""
from __future__ import annotations

import typing

from ..buffers import BufferInfo
from . import device_route, staging


class Route(typing.NamedTuple):
    """A route's entry points. Each takes the channel the collective runs on first."""

    check_gpu: typing.Callable  # (channel, info, collective): raises where the buffer is on the wrong GPU
    allreduce: typing.Callable  # (channel, array, info, op, algorithm): in place
    broadcast: typing.Callable  # (channel, array, info, root): in place
    allgather: typing.Callable  # (channel, array, info, out, chunks): every rank's chunk into out
    reduce_scatter: typing.Callable  # (channel, array, info, out, chunks, op): this rank's chunk into out


def any_gpu(channel, info: BufferInfo, collective: str) -> None:
    """The staged route takes a buffer on any GPU: it keeps no memory on one."""


ROUTES = {
    "staged": Route(any_gpu, staging.allreduce, staging.broadcast, staging.allgather, staging.reduce_scatter),
    "device": Route(device_route.check_gpu, device_route.allreduce, device_route.broadcast, device_route.allgather,
                    device_route.reduce_scatter),
}
# The route of a CUDA buffer by all-reduce algorithm (None: broadcast, allgather, reduce-scatter,
# which have one implementation each); any other algorithm's is "staged", as is every CPU buffer's.
CUDA_ROUTES = {"hierarchical": "device", "auto": "device", None: "device"}


def route_for(info: BufferInfo, algorithm: str | None = None) -> Route:
    """The route of buffer `info` to all-reduce algorithm `algorithm` (as resolve_algorithm gives
    it), or with None to the other collectives."""
    if not info.is_cuda:
        return ROUTES["staged"]
    return ROUTES[CUDA_ROUTES.get(algorithm, "staged")]
