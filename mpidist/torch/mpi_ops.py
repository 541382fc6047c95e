"""hvd's collective operations on torch tensors but the all-reduces (reductions.py), as Horovod's
mpi_ops: allgather, broadcast, alltoall and reducescatter with their in-place (`_`),
asynchronous (`_async`) and grouped forms, sparse_allreduce_async, barrier, and poll()/
synchronize() for the asynchronous operations' handles. The differentiable forms are autograd
functions here; the operations run on mpidist's collectives.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import buffers
from ..collectives.callcheck import check_root
from ..errors import InvalidArgumentError, MismatchError, MpidistError
from .arguments import release, share_refusal
from .basics import Average, Sum, resolve_op
from .compression import Compression
from .handles import DoneHandle, GroupHandle, Handle
from .join import collective_comm
from .negotiation import submit
from .negotiation_rules import group_member, signature_of
from .process_sets import root_in
from .reductions import (
    allreduce_into,
    check_group,
    contiguous_copy,
    no_gradient,
    reducible_dtype,
    reduction,
    scaled,
    wire_dtype,
)
from .timeline import end_traced, traced

_COLLECTIVE_DTYPES = frozenset(getattr(torch, name) for name in buffers.DTYPES)


@traced("BARRIER")
def barrier(process_set=None):
    """Wait until every rank has called barrier()."""
    submit(collective_comm(process_set), None, signature_of("barrier"), lambda private: private.barrier()).wait()


# ---- collectives -----------------------------------------------------------------------------
# allgather, broadcast and alltoall are differentiable, as Horovod's (its HorovodAllgather,
# HorovodBroadcast and HorovodAlltoall autograd functions); the in-place and asynchronous
# variants are not, as in Horovod.

# Horovod (since v0.22, PR #2687) averages the output gradients of allgather and broadcast over
# the ranks: every rank's loss counts 1/size, as in DistributedOptimizer's averaged gradients.
_GATHER_GRADIENT_OP = Average


def _combined_gradient(grad, comm):
    return allreduce_into(contiguous_copy(grad), _GATHER_GRADIENT_OP, Compression.none, 1.0, 1.0, comm)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, comm):
        ctx.shape, ctx.comm = tensor.shape, comm
        source = tensor.detach().contiguous()
        return _restored(comm.allgather(_movable(source)), source)

    @staticmethod
    def backward(ctx, grad):
        world = ctx.comm
        combined = _combined_gradient(grad, world)
        rows = ctx.shape[0] if len(ctx.shape) else 1  # a 0-d tensor is gathered as one row
        all_rows = world.allgather(np.array([rows], dtype=np.int64))
        offset = int(all_rows[:world.rank].sum())
        return combined.narrow(0, offset, rows).reshape(ctx.shape), None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, comm):
        ctx.root, ctx.comm = root, comm
        result = contiguous_copy(tensor)
        comm.broadcast(_movable(result), root=root)
        return result

    @staticmethod
    def backward(ctx, grad):
        # Every rank's output is the root's input: the root's gradient combines all ranks'
        # output gradients; the other ranks' inputs were not used (zero gradient, as Horovod).
        combined = _combined_gradient(grad, ctx.comm)
        if ctx.comm.rank != ctx.root:
            combined.zero_()
        return combined, None, None


def poll(handle) -> bool:
    return handle.handle.done()


def synchronize(handle):
    """Wait for an asynchronous operation; returns its result tensor (the same one on every call)."""
    if not handle.finished:
        try:
            outcome = handle.handle.wait()
        finally:
            release(handle)  # a failed operation is over too: its name may be used again
        if handle.result is None:  # the operation made it (see Handle)
            handle.result = outcome
        if handle.finish is not None:
            handle.result = handle.finish(handle.result)
        handle.finished = True
        end_traced(handle)
    return handle.result


@traced("BROADCAST")
def broadcast_(tensor, root_rank, name=None, process_set=None):
    _start_broadcast(tensor, root_rank, name, process_set).wait()
    return tensor


@traced("BROADCAST")
def broadcast(tensor, root_rank, name=None, process_set=None):
    """A new tensor holding `root_rank`'s `tensor`. Differentiable when `tensor` requires grad."""
    comm = collective_comm(process_set)
    return _Broadcast.apply(tensor, root_in(process_set, root_rank), comm)


def _start_broadcast(tensor, root_rank, name, process_set):
    """The negotiated handle of the broadcast of `tensor` in place from `root_rank`."""
    comm = collective_comm(process_set)
    try:
        root = check_root(root_in(process_set, root_rank), comm.size)
    except MpidistError:
        share_refusal(comm, negotiated=True, name=name)
        raise
    moved = _movable(tensor)
    signature = signature_of("broadcast", tensor, root=root)
    return submit(comm, name, signature, lambda private: private.broadcast(moved, root=root))


@traced("BROADCAST")
def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    return Handle(_start_broadcast(tensor, root_rank, name, process_set), tensor)


@traced("BROADCAST")
def broadcast_async(tensor, root_rank, name=None, process_set=None):
    return broadcast_async_(contiguous_copy(tensor), root_rank, name, process_set)


@traced("ALLGATHER")
def allgather(tensor, name=None, process_set=None):
    """Every rank's `tensor` concatenated along the first dimension (which may differ by rank).
    Differentiable when `tensor` requires grad."""
    return _Allgather.apply(tensor, collective_comm(process_set))


@traced("ALLGATHER")
def allgather_async(tensor, name=None, process_set=None):
    # Sends a copy, as allreduce_async: the caller may change its tensor while the operation runs.
    return Handle(*_start_allgather(tensor, name, collective_comm(process_set)))


def _start_allgather(tensor, name, comm):
    """(negotiated handle, None, finishing step) of the allgather of a copy of `tensor`."""
    source = contiguous_copy(tensor)
    moved = _movable(source)
    # The first dimension may differ by rank: the ranks agree on the rest of the shape.
    signature = signature_of("allgather", source, shape=source.shape[1:], count=0)
    handle = submit(comm, name, signature, lambda private: private.allgather(moved))
    return handle, None, lambda result: _restored(result, source)


def _member_name(name, index):
    """The name of member `index` of a grouped operation called `name` (None: unnamed)."""
    return None if name is None else group_member(name, index)


@traced("ALLREDUCE")
def sparse_allreduce_async(tensor, name=None, op=Average, process_set=None):
    """Horovod's all-reduce of a sparse COO tensor: every rank's indices and values gathered into
    one sparse tensor (duplicate indices left uncoalesced; they add up), the values divided by the
    rank count for op=Average. Returns a callable that gives the result, as Horovod's does."""
    op = resolve_op(op, adasum_in="sparse_allreduce_async")
    if op not in (Average, Sum):
        raise InvalidArgumentError(f"sparse_allreduce_async takes op=hvd.Average or hvd.Sum, got {op!r}")
    if not tensor.is_sparse:
        raise InvalidArgumentError(f"sparse_allreduce_async takes a sparse COO tensor, got layout {tensor.layout}")
    comm = collective_comm(process_set)
    shapes = comm.allgather(np.array([tensor.shape], dtype=np.int64))
    if (shapes != shapes[0]).any():
        raise MismatchError(f"sparse_allreduce_async: the ranks' tensors have different shapes "
                            f"{[tuple(row) for row in shapes.tolist()]} by rank")
    # allgather concatenates along the first dimension: the indices travel one row per element.
    indices = allgather(tensor._indices().t().contiguous(), name, process_set)
    values = allgather(tensor._values().contiguous(), name, process_set)
    if op == Average:
        values = values / comm.size
    result = torch.sparse_coo_tensor(indices.t(), values, tensor.shape)
    return lambda: result


def _movable(tensor):
    """`tensor` as the collectives move it: as it is, or, for the dtypes they do not reduce
    (int16, bool, ...), as uint8 bytes, a row of bytes per row (a 0-d tensor: one row). The byte
    view shares the tensor's memory; a non-contiguous tensor is left for the collective to refuse."""
    if tensor.dtype in _COLLECTIVE_DTYPES or not tensor.is_contiguous():
        return tensor
    rows = tensor.shape[0] if tensor.dim() else 1
    return tensor.reshape(rows, math.prod(tensor.shape[1:])).view(torch.uint8)


def _restored(moved, like):
    """A collective's result on _movable(like) in `like`'s dtype and row shape."""
    if moved.dtype == like.dtype:
        return moved
    return moved.view(like.dtype).reshape((moved.shape[0],) + tuple(like.shape[1:]))


def _check_scattered(tensors, comm, op, names=None):
    """The op of a reducescatter of `tensors` (resolve_op's), checked with what reducescatter
    refuses: Adasum, 0-d tensors (no rows to scatter, as Horovod) and dtypes the reductions do
    not take; all of a group's checked before the first is sent. A refusal is
    shared with the other ranks (arguments.share_refusal): in the call check, or, for negotiated
    operations, under each of the `names` the call would have submitted (a group's every member,
    so that none is left waiting for this rank and the ranks' unnamed operations still meet)."""
    try:
        op = resolve_op(op, adasum_in="reducescatter")
        for tensor in tensors:
            reducible_dtype(tensor)
        if any(tensor.dim() == 0 for tensor in tensors):
            raise InvalidArgumentError("reducescatter scatters the first dimension's rows: give tensors of at "
                                       "least one dimension, not 0-d ones")
    except (ValueError, MpidistError):  # resolve_op's refusals include ValueError
        if names is None:
            share_refusal(comm, negotiated=False)
        for name in names or ():
            share_refusal(comm, negotiated=True, name=name)
        raise
    return op


def _reducescatter(tensor, op, compression, prescale_factor, postscale_factor, comm):
    """Rank r's block of rows of the reduction (the first rows % size ranks get one row more)."""
    source = contiguous_copy(tensor)
    reduced_in = wire_dtype(source, compression)
    op, postscale_factor = reduction(source, op, postscale_factor, comm)
    scaled(source, prescale_factor)
    if reduced_in is not None:
        result = comm.reduce_scatter(source.to(reduced_in), op=op).to(tensor.dtype)
    else:
        result = comm.reduce_scatter(source, op=op)
    scaled(result, postscale_factor)
    return result


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, compression, prescale_factor, postscale_factor, comm):
        ctx.op, ctx.scale, ctx.shape, ctx.comm = op, prescale_factor * postscale_factor, tensor.shape, comm
        return _reducescatter(tensor, op, compression, prescale_factor, postscale_factor, comm)

    @staticmethod
    def backward(ctx, grad):
        no_gradient("reducescatter", ctx.op)
        # Horovod's gradient (HorovodReducescatter.backward): every rank's output gradient,
        # gathered back into the rows it came from and scaled by the prescale and postscale
        # factors, and for Sum by the set's size too. That is size times the gradient of the
        # sum of the ranks' losses, for Sum and Average alike.
        gathered = ctx.comm.allgather(grad.detach().contiguous())
        scaled(gathered, ctx.scale * ctx.comm.size if ctx.op == Sum else ctx.scale)
        return gathered.reshape(ctx.shape), None, None, None, None, None


@traced("REDUCESCATTER")
def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=None,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce `tensor` over the ranks and give rank r its r-th block of rows (the first
    rows % size ranks get one row more, as Horovod splits). Differentiable when `tensor`
    requires grad (op Average or Sum)."""
    comm = collective_comm(process_set)
    op = _check_scattered([tensor], comm, op)
    return _Reducescatter.apply(tensor, op, compression, prescale_factor, postscale_factor, comm)


def _start_reducescatter(tensor, name, op, prescale_factor, postscale_factor, comm):
    """(the handle, the finishing step) of the negotiated reduce-scatter of a prescaled copy of
    `tensor` (the caller may change its tensor while the operation runs), as _reducescatter's."""
    source = contiguous_copy(tensor)
    reduced_in = wire_dtype(source, Compression.none)
    op, postscale_factor = reduction(source, op, postscale_factor, comm)
    scaled(source, prescale_factor)
    wire = source.to(reduced_in) if reduced_in is not None else source
    signature = signature_of("reducescatter", wire, op, scale_factors=(prescale_factor, postscale_factor))
    handle = submit(comm, name, signature, lambda private: private.reduce_scatter(wire, op=op))

    def finish(result):
        result = result.to(tensor.dtype) if reduced_in is not None else result
        scaled(result, postscale_factor)
        return result

    return handle, finish


@traced("REDUCESCATTER")
def reducescatter_async(tensor, name=None, op=Average, process_set=None, prescale_factor=1.0,
                        postscale_factor=1.0):
    comm = collective_comm(process_set)
    op = _check_scattered([tensor], comm, op, [name])
    handle, finish = _start_reducescatter(tensor, name, op, prescale_factor, postscale_factor, comm)
    return Handle(handle, finish=finish)


# ---- grouped collectives ---------------------------------------------------------------------
# Horovod's grouped_* operations run a list of tensors as one operation; here grouped allgather
# and reducescatter run one operation per tensor (the grouped all-reduces: reductions.py), with
# Horovod's results, differentiability and handles.

@traced("ALLGATHER")
def grouped_allgather(tensors, name=None, process_set=None):
    return [allgather(t, name, process_set) for t in check_group(tensors, "grouped_allgather")]


@traced("ALLGATHER")
def grouped_allgather_async(tensors, name=None, process_set=None):
    tensors = check_group(tensors, "grouped_allgather_async")
    comm = collective_comm(process_set)
    started = [_start_allgather(t, _member_name(name, k), comm) for k, t in enumerate(tensors)]
    return Handle(GroupHandle([handle for handle, _, _ in started]),
                  finish=lambda results: [finish(result) for result, (_, _, finish) in zip(results, started)])


@traced("REDUCESCATTER")
def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average, process_set=None,
                          prescale_factor=1.0, postscale_factor=1.0):
    tensors = check_group(tensors, "grouped_reducescatter")
    _check_scattered(tensors, collective_comm(process_set), op)
    return [reducescatter(t, name, compression, op, process_set, prescale_factor, postscale_factor)
            for t in tensors]


@traced("REDUCESCATTER")
def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=None, prescale_factor=1.0,
                                postscale_factor=1.0):
    tensors = check_group(tensors, "grouped_reducescatter_async")
    comm = collective_comm(process_set)
    op = _check_scattered(tensors, comm, op, [_member_name(name, k) for k in range(len(tensors))])
    started = [_start_reducescatter(t, _member_name(name, k), op, prescale_factor, postscale_factor, comm)
               for k, t in enumerate(tensors)]
    return Handle(GroupHandle([handle for handle, _ in started]),
                  finish=lambda results: [finish(result) for result, (_, finish) in zip(results, started)])


def _alltoall(tensor, splits, comm):
    """(received rows, received row counts by rank as an int32 tensor) for `tensor`'s
    first-dimension `splits` over `comm`, by mpidist's alltoall collective."""
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    source = tensor.detach().contiguous()
    # A 0-d tensor goes as it is, for the collective to refuse (it has no rows to split).
    output, received = comm.alltoall(source if source.dim() == 0 else _movable(source), splits)
    return _restored(output, source), torch.tensor(received.tolist(), dtype=torch.int32)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, comm):
        output, received = _alltoall(tensor, splits, comm)
        ctx.received, ctx.comm = received, comm
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _received_grad):
        # The gradient of the rows this rank sent comes back from the ranks that received them.
        grad_input, _ = _alltoall(grad.contiguous(), ctx.received, ctx.comm)
        return grad_input, None, None


@traced("ALLTOALL")
def alltoall(tensor, splits=None, name=None, process_set=None):
    """Send `splits[k]` rows of `tensor` (first dimension; equal parts without splits=) to rank k
    and return the rows received, in rank order. As in Horovod: with splits= the result is
    (tensor, received_splits), an int32 tensor of the row counts received from each rank.
    Differentiable when `tensor` requires grad."""
    output, received = _Alltoall.apply(tensor, splits, collective_comm(process_set))
    return output if splits is None else (output, received)


@traced("ALLTOALL")
def alltoall_async(tensor, splits=None, name=None, process_set=None):
    """As Horovod's: synchronize() returns (received rows, received splits), with or without splits=."""
    output, received = _alltoall(tensor.detach(), splits, collective_comm(process_set))
    result = (output, received)
    return Handle(DoneHandle(result), result)
