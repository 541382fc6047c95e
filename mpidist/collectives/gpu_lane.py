"""The lane between nodes of CUDA buffers' all-reduce on the device route (device_route.py:
"hierarchical" and "auto"): which one (choose_lane, from every rank's facts; agreed_lane, the
same answer on every rank, once per channel) and the all-reduce that runs it (allreduce, with
check_gpu before the call check).

The lanes, in `auto`'s order:
- "nccl": NCCL between the nodes (runtime/nccl_library.py), one NCCL communicator per lane of
  hierarchical.py, bootstrapped over MPI as algorithm="nccl" is (nccl.communicator_over);
- "cuda-aware": MPI reading GPU memory, with hierarchical.py's algorithms between the nodes;
- "staged": the whole all-reduce on a pinned host copy (staging.py's route: hierarchical.py in
  host memory, or for "auto" the table's choice), which works everywhere.
With the first two, inside each node the ranks reduce through the device window's memory
(device_window.DeviceMemory, with hierarchical.py's result region), so the buffer never leaves
the GPUs; with one rank per node the lane runs on the buffer itself. `auto` takes the first lane
every rank can use; MPIDIST_GPU_LANE forces one, and a forced lane that some rank cannot use is an
error on every rank, naming those ranks and why.
"""
from __future__ import annotations

from .. import buffers, kernels
from ..buffers import BufferInfo
from ..errors import InvalidArgumentError
from ..runtime import config, nccl_library, wire
from ..runtime.together import raise_together
from . import device_window, nccl
from .common import TAGS, Context, kernel_op
from .hierarchical import HierarchicalWindow, across_nodes, reduce_across_nodes

LANES = ("nccl", "cuda-aware", "staged")
VARIABLE = "MPIDIST_GPU_LANE"


def by_ranks(reasons: dict) -> str:
    """{rank: reason} -> 'rank 1: ...; ranks 0, 2: ...' (ranks with equal reasons together)."""
    groups: dict = {}
    for rank, reason in sorted(reasons.items()):
        groups.setdefault(reason, []).append(rank)
    return "; ".join(f"rank {ranks[0]}: {reason}" if len(ranks) == 1 else
                     f"ranks {', '.join(map(str, ranks))}: {reason}" for reason, ranks in groups.items())


def choose_lane(forced: str | None, nccl_missing: dict, mpi_unaware: list, window_refusal: str | None) -> tuple:
    """(lane, why) for the facts of every rank: `forced` (MPIDIST_GPU_LANE; None for auto),
    `nccl_missing` ({rank: why} of the ranks without a usable NCCL), `mpi_unaware` (the ranks
    whose MPI library does not read GPU memory), `window_refusal` (why the device window cannot
    be used inside the nodes; None where it can or is not needed). A forced lane that cannot be
    taken raises InvalidArgumentError."""
    if forced is not None and forced not in LANES:
        raise InvalidArgumentError(f"{VARIABLE}={forced!r} is none of auto, {', '.join(LANES)}")
    blocked = {"nccl": f"no NCCL on {by_ranks(nccl_missing)}" if nccl_missing else None,
               "cuda-aware": (f"the MPI library does not read GPU memory on rank(s) {sorted(mpi_unaware)}"
                              if mpi_unaware else None),
               "staged": None}
    for lane in ("nccl", "cuda-aware"):
        if window_refusal and not blocked[lane]:
            blocked[lane] = f"the device window inside the nodes cannot be used ({window_refusal})"
    if forced is not None:
        if blocked[forced]:
            raise InvalidArgumentError(f"{VARIABLE}={forced} cannot be taken: {blocked[forced]}")
        return forced, f"forced by {VARIABLE}"
    lane = next(lane for lane in LANES if blocked[lane] is None)
    passed = [f"not {other}: {blocked[other]}" for other in LANES[:LANES.index(lane)]]
    return lane, "; ".join(["auto", *passed])


def gathered(mpi, text: str | None, what: str) -> dict:
    """{rank: text} of the ranks of `mpi` that passed a text (collective)."""
    return {rank: found for rank, found in enumerate(wire.allgather_texts(mpi, text, what)) if found is not None}


def agreed_lane(channel, device_index: int) -> tuple:
    """(lane, why) for CUDA buffers on `channel`, which spans nodes: every rank's facts gathered,
    then choose_lane on every rank alike (collective over the channel; kept on it)."""
    if getattr(channel, "gpu_lane", None) is not None:
        return channel.gpu_lane
    mpi, forced, problem = channel.mpi, None, None
    try:
        forced = config.value(VARIABLE)
    except InvalidArgumentError as error:
        problem = error
    raise_together(mpi, problem, f"reading {VARIABLE}", InvalidArgumentError)
    differing = gathered(mpi, forced or "auto", f"{VARIABLE} of every rank")
    if len(set(differing.values())) > 1:
        raise InvalidArgumentError(f"{VARIABLE} differs between ranks: {by_ranks(differing)}")
    nccl_missing = gathered(mpi, nccl_library.problem(), "NCCL on every rank")
    unaware = gathered(mpi, None if channel.is_cuda_aware() else "unaware", "CUDA-aware MPI on every rank")
    node = channel.node_communicators().node
    refusal = device_window.can_open(node, device_index) if node.Get_size() > 1 else None
    refusals = gathered(mpi, refusal, "the device window on every node")
    channel.gpu_lane = choose_lane(forced, nccl_missing, list(unaware), by_ranks(refusals) or None)
    return channel.gpu_lane


def describe_lane(channel, device_index: int) -> str:
    """For `mpidist info` (collective over the channel): the lane CUDA buffers' hierarchical
    all-reduce would take between nodes, and why, or why none can."""
    try:
        lane, why = agreed_lane(channel, device_index)
    except InvalidArgumentError as error:
        return f"none: {error}"
    return f"{lane} ({why}){'' if channel.num_nodes > 1 else '; one node here: only the device window is used'}"


class LaneWindow(HierarchicalWindow):
    """hierarchical.py's window across nodes in GPU memory, with the lane between nodes it runs
    (and, for the NCCL lane, the lane's NCCL communicator, made at its first use)."""

    def __init__(self, channel, lane: str, device_index: int):
        groups = channel.node_communicators()
        memory = device_window.DeviceMemory(groups.node, device_index)
        super().__init__(groups, spans_nodes=True, one_shot_bytes=0, memory=memory)
        self.lane, self.device_index, self.nccl_comm = lane, device_index, None

    def across(self, ctx: Context, info: BufferInfo) -> None:
        if self.lane == "cuda-aware":
            across_nodes(ctx, self.lane_comm, info)
            return
        if self.nccl_comm is None:
            self.nccl_comm = nccl.communicator_over(self.lane_comm, self.device_index, "the NCCL lane between nodes")
        nccl.reduce_with(self.nccl_comm, info, ctx.op)
        kernels.synchronize(info.device)

    def free(self) -> None:
        if self.nccl_comm is not None:
            self.nccl_comm.destroy()
            self.nccl_comm = None
        super().free()


def check_gpu(channel, info: BufferInfo) -> None:
    """Refuse CUDA buffer `info` where it lies on another GPU than `channel`'s lane window (made on
    this rank's GPU at its first all-reduce across nodes), as device_window.check_gpu does for the
    node window, and before the call check for the same reason: the other ranks would otherwise
    wait for this one in the window or the lane until MPIDIST_TIMEOUT."""
    window = channel.lane_window
    if info.is_cuda and window is not None and info.device_index != window.device_index:
        raise InvalidArgumentError(
            f"rank {channel.rank}'s buffer is on {info.device}, this communicator's GPU lane window on that rank on "
            f"cuda:{window.device_index}: a rank's GPU buffers must all be on one GPU")


def allreduce(channel, array, info: BufferInfo, op: str) -> bool:
    """CUDA buffer `info` all-reduced through the device window inside each node and the agreed
    lane between them (with one rank per node, the lane alone, on the buffer itself); False,
    having done nothing, where the buffer takes the staged route (one node, or the staged lane).
    check_gpu has passed."""
    if channel.num_nodes == 1 or channel.size == 1:
        return False
    lane, _ = agreed_lane(channel, info.device_index)
    if lane == "staged":
        return False
    if channel.lane_window is None:
        channel.lane_window = LaneWindow(channel, lane, info.device_index)
    window = channel.lane_window
    buffers.synchronize(array, info)
    ctx = Context(channel, channel.mpi, info, op=kernel_op(op), tag=TAGS["allreduce"])
    if window.local_size == 1:
        window.across(ctx, info)  # nothing to share inside the node: no window memory, no CuPy
    else:
        reduce_across_nodes(ctx, window)
    if op == "avg":
        kernels.scale_ptr(info.ptr, info.count, info.dtype, 1.0 / channel.size, device=info.device)
    kernels.synchronize(info.device)
    return True
