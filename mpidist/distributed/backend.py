"""ProcessGroupMpidist: torch.distributed's process group over an mpidist Communicator, every
c10d operation on mpidist's collectives (never another backend's).

A group owns a Communicator of its own (the world's, or a sub-communicator of the ranks torch
lists), so its messages never cross the program's own mpidist calls. Every collective keeps the
cross-rank call check and the deadlines (MPIDIST_TIMEOUT) of mpidist's collectives. A call with
async_op=False runs on the caller's thread (behind any queued asynchronous ones); async_op=True
queues it on the Communicator's asynchronous engine (collectives/engine.py), which progresses it
in the background, and returns a Work at once, except on CPU tensors in a group on one node
(MPIDIST_EAGER_ON_NODE), where it runs at once like a blocking call and its Work is complete when
returned. Point-to-point operations are point_to_point.py's: nonblocking MPI messages on a
duplicate communicator of the group's own, so a user's tag never matches a collective's.
Every method torch's C++ calls back into runs outside torch.compile (outside_compile.py).

How the c10d operations map onto the collectives: all_reduce (SUM, AVG, PRODUCT, MIN, MAX) is
allreduce; PREMUL_SUM scales, then sums; BAND/BOR/BXOR gather the ranks' tensors and fold them
here; reduce is an all-reduce kept by the root; all_gather[_into_tensor] is allgather;
reduce_scatter[_tensor] is reduce_scatter over the rows of the stacked inputs; all_to_all[_single],
gather and scatter are alltoall (gather and scatter send rows only to or from the root).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.futures import Future

from .. import collectives
from ..collectives.engine import in_order, on_engine_thread
from ..comm import Communicator, init
from ..errors import InvalidArgumentError, NotOfferedError
from ..runtime import config
from . import point_to_point
from .outside_compile import run_outside_compile
from .rendezvous import check_agrees_with_mpi

# c10d's reduce ops by their numbers (an enum as a dictionary key costs microseconds on every call).
RedOpType = dist.ReduceOp.RedOpType
NATIVE_OPS = {RedOpType.SUM.value: "sum", RedOpType.AVG.value: "avg", RedOpType.PRODUCT.value: "prod",
              RedOpType.MIN.value: "min", RedOpType.MAX.value: "max"}
BITWISE_OPS = {RedOpType.BAND.value: torch.bitwise_and, RedOpType.BOR.value: torch.bitwise_or,
               RedOpType.BXOR.value: torch.bitwise_xor}
PREMUL_SUM = RedOpType.PREMUL_SUM.value
BITWISE_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@run_outside_compile
class MpidistWork(dist.Work):
    """A collective's Work: wait() raises the collective's error, get_future() completes with
    the output tensors (as gloo's)."""

    # Class defaults, so that the Work of a collective that already ran (a blocking call's, on
    # every call) costs only the base Work and one attribute.
    _future = None  # made at once for a queued collective; on demand for one already run
    _handle = None  # None: the collective already ran

    def __init__(self, outputs, future: Future | None = None, handle=None):
        super().__init__()
        self._outputs = outputs
        if handle is not None:
            self._future, self._handle = future, handle

    def wait(self, timeout=None):
        if self._handle is not None:
            self._handle.wait()
        return True

    def is_completed(self):
        return self._handle is None or self._handle.done()

    def is_success(self):
        return self.is_completed() and self.exception() is None

    def exception(self):
        return self._handle._error if self._handle is not None else None

    def get_future(self):
        if self._future is None:
            self._future = Future()
            self._future.set_result(self._outputs)
        return self._future


@run_outside_compile
class ProcessGroupMpidist(dist.ProcessGroup):
    """torch.distributed's process group on an mpidist Communicator (see the module docstring)."""

    @classmethod
    def create(cls, group_rank: int, group_size: int, global_ranks: list, name: str, backend_name: str):
        """The world group (no `global_ranks`) or the group of `global_ranks`, collectively over
        those ranks (torch calls the creator on the group's ranks only); `name` is the group's,
        `backend_name` the one the backend is registered under."""
        world = init()
        if not global_ranks:
            check_agrees_with_mpi(world, (group_rank, f"rank {group_rank}"), (group_size, f"world size {group_size}"))
            return cls(Communicator(world.mpi), name, backend_name)
        group = world.mpi.Get_group().Incl(global_ranks)
        sub = world.mpi.Create_group(group)
        group.Free()
        try:
            return cls(Communicator(sub), name, backend_name)
        finally:
            sub.Free()

    def __init__(self, comm: Communicator, name: str, backend_name: str):
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self._backend_name = backend_name
        self._p2p = comm.mpi.Dup()
        self._group_name = name
        # On one node a collective is CPU work on either thread (copies and reductions through
        # shared memory, no network to wait for): a background thread only competes with the
        # ranks' computation for their cores (docs/distributed-backend.md#performance).
        self._eager = comm.num_nodes == 1 and config.value("MPIDIST_EAGER_ON_NODE")

    # ---- what torch asks of every process group --------------------------------------------

    def getBackendName(self):
        return self._backend_name

    def _get_backend_name(self):
        return self._backend_name

    def _set_group_name(self, name):
        self._group_name = name

    @property
    def group_name(self):
        return self._group_name

    def __repr__(self):
        return f"ProcessGroupMpidist(rank={self.rank()}, size={self.size()}, name={self._group_name!r})"

    def shutdown(self):
        """destroy_process_group's call, on every rank of the group: free the group's MPI
        communicators and its engine (collective over the group, as destroy_process_group is),
        rather than leave them to MPI_Finalize. The group cannot be used afterwards."""
        self.comm.free()
        if self._p2p is not None:
            self._p2p.Free()
            self._p2p = None

    # ---- running a collective ---------------------------------------------------------------

    def _run(self, description: str, run, outputs, opts) -> MpidistWork | None:
        """run(channel) now (behind the queued asynchronous collectives) or, with async_op=True,
        on the engine, unless the group runs its CPU collectives at once; the Work's future
        completes with `outputs`. A blocking call returns no Work: torch's blocking functions
        take None for a collective the backend has completed (a Work costs a microsecond).

        A collective asked for on the engine's own thread, by a callback of a future the engine
        completes (torch's PowerSGD hook chains its all-reduces so and waits on them inside the
        callbacks), runs there at once: queued, it would wait behind the very job whose
        completion runs the callback. Every rank still runs it right after that job and before
        what its caller submits next: where the job ended before the callback was attached, the
        callback runs on the caller's thread, which queues the collective at once."""
        asynchronous = getattr(opts, "asyncOp", True)
        if not asynchronous or self._eager and _on_cpu(outputs) or on_engine_thread(self.comm):
            in_order(self.comm, run)
            return MpidistWork(outputs) if asynchronous else None
        future = Future()

        def work(channel):
            try:
                run(channel)
            except BaseException as exc:
                future.set_exception(exc)
                raise
            future.set_result(outputs)

        return MpidistWork(outputs, future, self.comm.async_engine().submit(description, work))

    # ---- reductions --------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        tensor = _one(tensors, "all_reduce")
        opts = _option(opts, dist.AllreduceOptions)
        reduce_op = _reduce_op(opts.reduceOp, tensor.dtype, "all_reduce")
        # dist.all_reduce's usual call, a native reduction of a CPU tensor run at once on a
        # group with no engine, straight to the fast path: each layer of Python skipped
        # is a microsecond per call (the general route below does the same, and its refusals).
        if (not opts.asyncOp or self._eager) and reduce_op[0] in NATIVE_OPS \
                and collectives.fast_cpu_allreduce(self.comm, tensor, NATIVE_OPS[reduce_op[0]], "auto"):
            return MpidistWork([tensor]) if opts.asyncOp else None
        return self._run("all_reduce", lambda channel: self._allreduce(channel, tensor, reduce_op), [tensor], opts)

    def _allreduce(self, channel, tensor, reduce_op) -> None:
        """All-reduce `tensor` in place on `channel` with a reduction of any kind (_reduction)."""
        kind, factor = reduce_op
        if kind in BITWISE_OPS:
            gathered = collectives.allgather(channel, tensor.reshape(1, -1))
            folded = gathered[0]
            for row in gathered[1:]:
                folded = BITWISE_OPS[kind](folded, row)
            tensor.copy_(folded.view_as(tensor))
            return
        if kind == PREMUL_SUM:
            tensor.mul_(factor)
        op = NATIVE_OPS.get(kind, "sum")
        # The small-message path on either channel, the Communicator or its engine (engine.py)
        if not collectives.fast_cpu_allreduce(channel, tensor, op, "auto"):
            collectives.allreduce(channel, tensor, op=op)

    def allreduce_coalesced(self, tensors, opts=None):
        if not tensors:
            raise InvalidArgumentError("all_reduce_coalesced needs at least one tensor")
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise InvalidArgumentError(f"all_reduce_coalesced needs one dtype for all tensors, got {sorted(map(str, dtypes))}")
        reduce_op = _reduce_op(_option(opts, dist.AllreduceCoalescedOptions).reduceOp, tensors[0].dtype,
                               "all_reduce_coalesced")

        def run(channel):
            flat = torch.cat([t.reshape(-1) for t in tensors])
            self._allreduce(channel, flat, reduce_op)
            for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                tensor.copy_(part.view_as(tensor))

        return self._run("all_reduce_coalesced", run, list(tensors), opts)

    def reduce(self, tensors, opts=None):
        tensor = _one(tensors, "reduce")
        opts = _option(opts, dist.ReduceOptions)
        root = self._root(opts.rootRank, "reduce")
        reduce_op = _reduce_op(opts.reduceOp, tensor.dtype, "reduce")

        def run(channel):
            # Only the root's tensor receives the result; the others' stay as they were.
            self._allreduce(channel, tensor if self.rank() == root else tensor.clone(), reduce_op)

        return self._run("reduce", run, [tensor], opts)

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        output = _one(output_tensors, "reduce_scatter")
        inputs = _one(input_lists, "reduce_scatter")
        self._check_list(inputs, output, "reduce_scatter", "input_list")
        reduce_op = _reduce_op(_option(opts, dist.ReduceScatterOptions).reduceOp, output.dtype, "reduce_scatter")
        return self._run("reduce_scatter",
                         lambda channel: self._reduce_scatter_rows(
                             channel, torch.stack([t.reshape(-1) for t in inputs]), output, reduce_op),
                         [output], opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        if input.numel() != output.numel() * self.size():
            raise InvalidArgumentError(f"reduce_scatter_tensor: the input has {input.numel()} elements, it needs the "
                                       f"output's {output.numel()} times the group size {self.size()}")
        reduce_op = _reduce_op(_option(opts, dist.ReduceScatterOptions).reduceOp, output.dtype, "reduce_scatter_tensor")
        return self._run("reduce_scatter_tensor",
                         lambda channel: self._reduce_scatter_rows(channel, input.reshape(self.size(), -1), output,
                                                                   reduce_op),
                         [output], opts)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._reduce_scatter_base(output, input, opts) for output, input in zip(outputs, inputs)]
        return works[-1] if works else self._run("reduce_scatter_tensor_coalesced", lambda channel: None, [], opts)

    def _reduce_scatter_rows(self, channel, rows, output, reduce_op) -> None:
        """Reduce the (group size, n) `rows` across the ranks; rank r's row r into `output`."""
        if reduce_op[0] in NATIVE_OPS:
            mine = collectives.reduce_scatter(channel, rows, op=NATIVE_OPS[reduce_op[0]])
        else:  # bitwise and pre-multiplied sums: reduced whole, then the row kept
            rows = rows.clone()
            self._allreduce(channel, rows, reduce_op)
            mine = rows[self.rank()]
        output.copy_(mine.reshape(output.shape))

    # ---- broadcast and gathers ----------------------------------------------------------------

    def broadcast(self, tensors, opts=None):
        tensor = _one(tensors, "broadcast")
        opts = _option(opts, dist.BroadcastOptions)
        root = self._root(opts.rootRank, "broadcast")
        return self._run("broadcast", lambda channel: collectives.broadcast(channel, tensor, root=root), [tensor], opts)

    def allgather(self, output_lists, input_tensors, opts=None):
        outputs = _one(output_lists, "all_gather")
        tensor = _one(input_tensors, "all_gather")
        self._check_list(outputs, tensor, "all_gather", "tensor_list")

        def run(channel):
            gathered = collectives.allgather(channel, tensor.reshape(1, -1))
            for output, row in zip(outputs, gathered):
                output.copy_(row.view_as(output))

        return self._run("all_gather", run, [outputs], opts)

    def _allgather_base(self, output, input, opts=None):
        if output.numel() != input.numel() * self.size():
            raise InvalidArgumentError(f"all_gather_into_tensor: the output has {output.numel()} elements, it needs the "
                                       f"input's {input.numel()} times the group size {self.size()}")

        def run(channel):
            output.copy_(collectives.allgather(channel, input.reshape(1, -1)).view_as(output))

        return self._run("all_gather_into_tensor", run, [output], opts)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._allgather_base(output, input, opts) for output, input in zip(outputs, inputs)]
        return works[-1] if works else self._run("all_gather_into_tensor_coalesced", lambda channel: None, [], opts)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        works = [self.allgather([outputs], [tensor], opts) for outputs, tensor in zip(output_lists, input_tensors)]
        return works[-1] if works else self._run("all_gather_coalesced", lambda channel: None, [], opts)

    def gather(self, output_lists, input_tensors, opts=None):
        tensor = _one(input_tensors, "gather")
        opts = _option(opts, dist.GatherOptions)
        root = self._root(opts.rootRank, "gather")
        outputs = None
        if self.rank() == root:
            outputs = _one(output_lists, "gather")
            self._check_list(outputs, tensor, "gather", "gather_list")
        elif output_lists and any(output_lists):
            raise InvalidArgumentError(f"gather: only the destination (group rank {root}) passes a gather_list")
        splits = [0] * self.size()
        splits[root] = tensor.numel()

        def run(channel):
            received, _ = collectives.alltoall(channel, tensor.reshape(-1), splits)
            for output, part in zip(outputs or (), received.split(tensor.numel())):
                output.copy_(part.view_as(output))

        return self._run("gather", run, [outputs or []], opts)

    def scatter(self, output_tensors, input_lists, opts=None):
        output = _one(output_tensors, "scatter")
        opts = _option(opts, dist.ScatterOptions)
        root = self._root(opts.rootRank, "scatter")
        if self.rank() == root:
            inputs = _one(input_lists, "scatter")
            self._check_list(inputs, output, "scatter", "scatter_list")
            splits = [output.numel()] * self.size()
        else:
            if input_lists and any(input_lists):
                raise InvalidArgumentError(f"scatter: only the source (group rank {root}) passes a scatter_list")
            inputs, splits = None, [0] * self.size()

        def run(channel):
            sent = torch.cat([t.reshape(-1) for t in inputs]) if inputs else output.new_empty(0)
            received, _ = collectives.alltoall(channel, sent, splits)
            output.copy_(received.view_as(output))

        return self._run("scatter", run, [output], opts)

    # ---- all-to-all ---------------------------------------------------------------------------

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        size = self.size()
        if not input_split_sizes and input.shape[0] % size or not output_split_sizes and output.shape[0] % size:
            raise InvalidArgumentError(f"all_to_all_single without split sizes divides the first dimension evenly over "
                                       f"the {size} ranks: input has {input.shape[0]} rows, output {output.shape[0]}")
        expected = list(output_split_sizes) or [output.shape[0] // size] * size

        def run(channel):
            received, counts = collectives.alltoall(channel, input, list(input_split_sizes) or None)
            if counts.tolist() != expected:
                raise InvalidArgumentError(f"all_to_all_single: rank {self.rank()} expected rows {expected} from the "
                                           f"ranks (output_split_sizes), they sent {counts.tolist()}")
            output.copy_(received.view_as(output))

        return self._run("all_to_all_single", run, [output], opts)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        size = self.size()
        if len(output_tensors) != size or len(input_tensors) != size:
            raise InvalidArgumentError(f"all_to_all takes one tensor per rank ({size}) in each list, got "
                                       f"{len(output_tensors)} outputs and {len(input_tensors)} inputs")

        def run(channel):
            sent = torch.cat([t.reshape(-1) for t in input_tensors])
            received, counts = collectives.alltoall(channel, sent, [t.numel() for t in input_tensors])
            wanted = [t.numel() for t in output_tensors]
            if counts.tolist() != wanted:
                raise InvalidArgumentError(f"all_to_all: rank {self.rank()}'s output tensors hold {wanted} elements, "
                                           f"the ranks sent {counts.tolist()}")
            for output, part in zip(output_tensors, received.split(wanted)):
                output.copy_(part.view_as(output))

        return self._run("all_to_all", run, list(output_tensors), opts)

    # ---- barriers ----------------------------------------------------------------------------

    def barrier(self, opts=None):
        return self._run("barrier", collectives.barrier, [], opts)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """A barrier whose deadline (MPIDIST_TIMEOUT) names the ranks that did not enter it."""
        in_order(self.comm, collectives.barrier)

    # ---- point to point ----------------------------------------------------------------------

    def send(self, tensors, dst_rank, tag):
        self._check_peer(dst_rank, "send")
        return point_to_point.send(self._p2p, _one(tensors, "send"), dst_rank, tag)

    def recv(self, tensors, src_rank, tag):
        self._check_peer(src_rank, "recv")
        return point_to_point.receive(self._p2p, _one(tensors, "recv"), src_rank, tag)

    def recv_anysource(self, tensors, tag):
        return point_to_point.receive(self._p2p, _one(tensors, "recv"), MPI.ANY_SOURCE, tag)

    # ---- checks --------------------------------------------------------------------------------

    def _root(self, root, what: str) -> int:
        if not 0 <= root < self.size():
            raise InvalidArgumentError(f"{what}: root {root} is not a rank of this group (size {self.size()})")
        return root

    def _check_peer(self, peer, what: str) -> None:
        if not 0 <= peer < self.size():
            raise InvalidArgumentError(f"{what}: peer {peer} is not a rank of this group (size {self.size()})")

    def _check_list(self, tensors, like, what: str, name: str) -> None:
        """One tensor per rank, each of `like`'s element count and dtype (as gloo asks)."""
        if len(tensors) != self.size():
            raise InvalidArgumentError(f"{what}: {name} needs one tensor per rank ({self.size()}), got {len(tensors)}")
        for tensor in tensors:
            if tensor.numel() != like.numel() or tensor.dtype != like.dtype:
                raise InvalidArgumentError(
                    f"{what}: every tensor of {name} must have {like.numel()} x {like.dtype} (as the other tensor), "
                    f"got {tensor.numel()} x {tensor.dtype}")


def _one(tensors, what: str):
    """The single tensor of a per-rank list: torch's multi-device forms are not offered."""
    if len(tensors) != 1:
        raise NotOfferedError(f"{what}: the mpidist backend takes one tensor (or tensor list) per rank, got "
                              f"{len(tensors)}; the multi-device forms are not offered (gloo refuses them too)")
    return tensors[0]


def _on_cpu(outputs) -> bool:
    """Whether every tensor of `outputs` (tensors and lists of them) is a CPU tensor."""
    return all(_on_cpu(output) if isinstance(output, list) else output.is_cpu for output in outputs)


def _option(opts, kind):
    return kind() if opts is None else opts


def _reduce_op(reduce_op, dtype, what: str) -> tuple:
    """(kind, factor): the c10d ReduceOp's number and PREMUL_SUM's factor (else None), checked
    against the dtype as gloo checks it."""
    # A ReduceOp hashes to its RedOpType's number, as the enum does: reading .op.value instead
    # costs microseconds (two pybind11 objects made) on every call.
    kind = hash(reduce_op)
    if kind in NATIVE_OPS:
        return kind, None
    op_name = RedOpType(kind).name
    if kind in BITWISE_OPS and dtype not in BITWISE_DTYPES:
        raise InvalidArgumentError(f"{what}: {op_name} reduces integer or bool tensors, got {dtype}")
    if kind == PREMUL_SUM:
        factor = reduce_op.factor
        return kind, factor.item() if isinstance(factor, torch.Tensor) else factor
    if kind not in BITWISE_OPS:
        raise NotOfferedError(f"{what}: reduce op {op_name} is not offered by the mpidist backend")
    return kind, None
