"""hvd's collective operations on torch tensors, as Horovod's mpi_ops: allreduce, allgather,
broadcast, alltoall and reducescatter with their in-place (`_`), asynchronous (`_async`) and
grouped forms, barrier, and poll()/synchronize() for the asynchronous ones' handles. The
differentiable forms are autograd functions here; the operations run on mpidist's collectives.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import buffers
from ..errors import InvalidArgumentError, MismatchError, MpidistError, NotOfferedError, UnsupportedDtypeError
from ..parallel.flat import tensors_by_kind
from .arguments import release, share_refusal
from .basics import Adasum, Average, Sum, resolve_op
from .compression import Compression, dtype_on_wire
from .handles import DoneHandle, GroupHandle, Handle
from .join import check_joinable_allreduce, collective_comm
from .negotiation import member_name, negotiator_of
from .process_sets import comm_of, root_in
from .timeline import end_traced, traced

_COLLECTIVE_DTYPES = frozenset(getattr(torch, name) for name in buffers.DTYPES)


@traced("BARRIER")
def barrier(process_set=None):
    """Wait until every rank has called barrier()."""
    _negotiated(collective_comm(process_set), None, ["barrier", "", 0, "", "", [], 0, []],
                lambda private: private.barrier()).wait()


def _negotiated(comm, name, signature, run, buffer=None):
    """The handle of an operation submitted to `comm`'s negotiation (negotiation.py) under `name`,
    or under the next unnamed one's, which runs once every rank has submitted it."""
    negotiator = negotiator_of(comm)
    return negotiator.submit(negotiator.name_of(name), signature, run, buffer)


def _dtype_name(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


# ---- collectives -----------------------------------------------------------------------------
# allreduce, allgather, broadcast and alltoall are differentiable, as Horovod's (its
# HorovodAllreduce, HorovodAllgather, HorovodBroadcast and HorovodAlltoall autograd functions);
# the in-place and asynchronous variants are not, as in Horovod.

def _scaled(tensor, factor):
    """Horovod's scaling: a floating-point tensor in its own dtype, an integer one in float64 with
    the product truncated toward zero into the tensor's dtype (its ScaleBuffer's C++ conversion)."""
    if factor != 1.0:
        if tensor.is_floating_point():
            tensor.mul_(factor)
        else:
            tensor.copy_(tensor.double().mul_(factor))


def _reduction(tensor, op, postscale_factor, comm):
    """(op to run, postscale factor) of a reduction of `tensor`. Horovod averages as a sum scaled
    by postscale_factor / size; the collectives average floating-point tensors themselves, and
    integer ones are summed and scaled so, as Horovod's (the quotient truncated toward zero)."""
    if op == Average and not tensor.is_floating_point():
        return Sum, postscale_factor / comm.size
    return op, postscale_factor


def _wire_dtype(tensor, compression):
    """The dtype `tensor` is reduced in, or None for its own: the compression's, or int32 for
    int16, which the kernels do not reduce (cast back after, it wraps as int16 arithmetic)."""
    if tensor.dtype == torch.int16:
        return torch.int32
    return dtype_on_wire(tensor, compression)


def _group_shape(members):
    return [list(member.shape) for member in members]


def _start_allreduce(tensor, name, op, compression, prescale_factor, postscale_factor, comm, shape=None):
    """(handle, finishing step) of the all-reduce of `tensor` in place, negotiated under `name`;
    `shape` (default: the tensor's) is what the ranks' must match. Adasum runs at once. A dtype
    the reductions do not take is refused before anything changes the tensor, under `name` on
    every rank (an all-reduce group's members were checked as a whole before: _allreduce_group)."""
    if op != Adasum:  # Adasum checks its dtypes itself
        _check_reducible(tensor, op, comm, name)
    wire_dtype = _wire_dtype(tensor, compression)
    op, postscale_factor = _reduction(tensor, op, postscale_factor, comm)
    check_joinable_allreduce(comm, tensor, op, wire_dtype)  # Adasum always, while ranks wait in join()
    _scaled(tensor, prescale_factor)
    wire = tensor.to(wire_dtype) if wire_dtype is not None else tensor

    def finish(result):
        if wire is not result:
            result.copy_(wire)
        _scaled(result, postscale_factor)
        return result

    if op == Adasum:
        comm.adasum_allreduce(wire)
        return DoneHandle(tensor), finish
    signature = ["allreduce", _dtype_name(wire), wire.numel(), op, wire.device.type,
                 list(tensor.shape) if shape is None else shape, 0, [prescale_factor, postscale_factor]]
    return _negotiated(comm, name, signature, lambda private: private.allreduce(wire, op=op), buffer=wire), finish


def _allreduce_into(tensor, op, compression, prescale_factor, postscale_factor, comm, shape=None, name=None):
    """`tensor` reduced in place; `shape` (default: the tensor's) is what the ranks' must match."""
    handle, finish = _start_allreduce(tensor, name, op, compression, prescale_factor, postscale_factor, comm, shape)
    handle.wait()
    return finish(tensor)


def _contiguous_copy(tensor):
    return tensor.detach().clone(memory_format=torch.contiguous_format)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, compression, prescale_factor, postscale_factor, comm, name):
        ctx.settings = (op, compression, prescale_factor, postscale_factor, comm)
        return _allreduce_into(_contiguous_copy(tensor), *ctx.settings, name=name)

    @staticmethod
    def backward(ctx, grad):
        op = ctx.settings[0]
        if op not in (Average, Sum):
            raise NotOfferedError(f"hvd.allreduce with op={op!r} has no gradient; only Average and Sum "
                                  "are differentiable (as in Horovod)")
        # Each rank's input enters every rank's output through the same linear map, so its
        # gradient is the same reduction (op and scale factors) of all ranks' output gradients.
        # Unnamed, as Horovod's (HorovodAllreduce.backward): the ranks' backward passes meet in
        # the order they run, as unnamed operations do, whatever the forward's name=.
        return _allreduce_into(_contiguous_copy(grad), *ctx.settings), None, None, None, None, None, None


# Horovod (since v0.22, PR #2687) averages the output gradients of allgather and broadcast over
# the ranks: every rank's loss counts 1/size, as in DistributedOptimizer's averaged gradients.
_GATHER_GRADIENT_OP = Average


def _combined_gradient(grad, comm):
    return _allreduce_into(_contiguous_copy(grad), _GATHER_GRADIENT_OP, Compression.none, 1.0, 1.0, comm)


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
        result = _contiguous_copy(tensor)
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


@traced("ALLREDUCE")
def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=None, compression=Compression.none):
    return _allreduce_into(tensor, resolve_op(op, average), compression, prescale_factor, postscale_factor,
                           comm_of(process_set), name=name)


@traced("ALLREDUCE")
def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """A new tensor holding the reduction of `tensor` over all ranks (average by default).
    Differentiable when `tensor` requires grad."""
    return _Allreduce.apply(tensor, resolve_op(op, average), compression, prescale_factor, postscale_factor,
                            comm_of(process_set), name)


@traced("ALLREDUCE")
def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None):
    handle, finish = _start_allreduce(tensor, name, resolve_op(op, average), Compression.none, prescale_factor,
                                      postscale_factor, comm_of(process_set))
    return Handle(handle, tensor, finish)


@traced("ALLREDUCE")
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None):
    return allreduce_async_(_contiguous_copy(tensor), average, name, op, prescale_factor,
                            postscale_factor, process_set)


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
    from ..collectives.callcheck import check_root  # imported here: the collectives initialize MPI
    comm = collective_comm(process_set)
    try:
        root = check_root(root_in(process_set, root_rank), comm.size)
    except MpidistError:
        share_refusal(comm, negotiated=True, name=name)
        raise
    moved = _movable(tensor)
    signature = ["broadcast", _dtype_name(tensor), tensor.numel(), "", tensor.device.type, list(tensor.shape), root, []]
    return _negotiated(comm, name, signature, lambda private: private.broadcast(moved, root=root))


@traced("BROADCAST")
def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    return Handle(_start_broadcast(tensor, root_rank, name, process_set), tensor)


@traced("BROADCAST")
def broadcast_async(tensor, root_rank, name=None, process_set=None):
    return broadcast_async_(_contiguous_copy(tensor), root_rank, name, process_set)


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
    source = _contiguous_copy(tensor)
    moved = _movable(source)
    # The first dimension may differ by rank: the ranks agree on the rest of the shape.
    signature = ["allgather", _dtype_name(source), 0, "", source.device.type, list(source.shape[1:]), 0, []]
    handle = _negotiated(comm, name, signature, lambda private: private.allgather(moved))
    return handle, None, lambda result: _restored(result, source)


def _member_name(name, index):
    """The name of member `index` of a grouped operation called `name` (None: unnamed)."""
    return None if name is None else member_name(name, index)


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


def _check_scattered(tensors, comm, names=None):
    """What reducescatter refuses: 0-d tensors (no rows to scatter, as Horovod) and dtypes the
    reductions do not take; all of a group's checked before the first is sent. A refusal is
    shared with the other ranks (arguments.share_refusal): in the call check, or, for negotiated
    operations, under each of the `names` the call would have submitted (a group's every member,
    so that none is left waiting for this rank and the ranks' unnamed operations still meet)."""
    try:
        for tensor in tensors:
            _reducible_dtype(tensor)
        if any(tensor.dim() == 0 for tensor in tensors):
            raise InvalidArgumentError("reducescatter scatters the first dimension's rows: give tensors of at "
                                       "least one dimension, not 0-d ones")
    except MpidistError:
        if names is None:
            share_refusal(comm, negotiated=False)
        for name in names or ():
            share_refusal(comm, negotiated=True, name=name)
        raise


def _reducescatter(tensor, op, compression, prescale_factor, postscale_factor, comm):
    """Rank r's block of rows of the reduction (the first rows % size ranks get one row more)."""
    _check_scattered([tensor], comm)
    source = _contiguous_copy(tensor)
    wire_dtype = _wire_dtype(source, compression)
    op, postscale_factor = _reduction(source, op, postscale_factor, comm)
    _scaled(source, prescale_factor)
    if wire_dtype is not None:
        result = comm.reduce_scatter(source.to(wire_dtype), op=op).to(tensor.dtype)
    else:
        result = comm.reduce_scatter(source, op=op)
    _scaled(result, postscale_factor)
    return result


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, compression, prescale_factor, postscale_factor, comm):
        ctx.op, ctx.scale, ctx.shape, ctx.comm = op, prescale_factor * postscale_factor, tensor.shape, comm
        return _reducescatter(tensor, op, compression, prescale_factor, postscale_factor, comm)

    @staticmethod
    def backward(ctx, grad):
        if ctx.op not in (Average, Sum):
            raise NotOfferedError(f"hvd.reducescatter with op={ctx.op!r} has no gradient; only Average and Sum "
                                  "are differentiable (as in Horovod)")
        # Horovod's gradient (HorovodReducescatter.backward): every rank's output gradient,
        # gathered back into the rows it came from and scaled by the prescale and postscale
        # factors, and for Sum by the set's size too. That is size times the gradient of the
        # sum of the ranks' losses, for Sum and Average alike.
        gathered = ctx.comm.allgather(grad.detach().contiguous())
        _scaled(gathered, ctx.scale * ctx.comm.size if ctx.op == Sum else ctx.scale)
        return gathered.reshape(ctx.shape), None, None, None, None, None


@traced("REDUCESCATTER")
def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=None,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce `tensor` over the ranks and give rank r its r-th block of rows (the first
    rows % size ranks get one row more, as Horovod splits). Differentiable when `tensor`
    requires grad (op Average or Sum)."""
    return _Reducescatter.apply(tensor, resolve_op(op, adasum_in="reducescatter"), compression, prescale_factor,
                                postscale_factor, collective_comm(process_set))


def _start_reducescatter(tensor, name, op, prescale_factor, postscale_factor, comm):
    """(the handle, the finishing step) of the negotiated reduce-scatter of a prescaled copy of
    `tensor` (the caller may change its tensor while the operation runs), as _reducescatter's."""
    source = _contiguous_copy(tensor)
    wire_dtype = _wire_dtype(source, Compression.none)
    op, postscale_factor = _reduction(source, op, postscale_factor, comm)
    _scaled(source, prescale_factor)
    wire = source.to(wire_dtype) if wire_dtype is not None else source
    signature = ["reducescatter", _dtype_name(wire), wire.numel(), op, wire.device.type, list(wire.shape), 0,
                 [prescale_factor, postscale_factor]]
    handle = _negotiated(comm, name, signature, lambda private: private.reduce_scatter(wire, op=op))

    def finish(result):
        result = result.to(tensor.dtype) if wire_dtype is not None else result
        _scaled(result, postscale_factor)
        return result

    return handle, finish


@traced("REDUCESCATTER")
def reducescatter_async(tensor, name=None, op=Average, process_set=None, prescale_factor=1.0,
                        postscale_factor=1.0):
    op = resolve_op(op, adasum_in="reducescatter")
    comm = collective_comm(process_set)
    _check_scattered([tensor], comm, [name])
    handle, finish = _start_reducescatter(tensor, name, op, prescale_factor, postscale_factor, comm)
    return Handle(handle, finish=finish)


# ---- grouped collectives ---------------------------------------------------------------------
# Horovod's grouped_* operations run a list of tensors as one operation. Here an all-reduce of a
# group packs the tensors of each dtype and device into one buffer (one all-reduce per kind, in
# the order the kinds first appear, the same on every rank); allgather and reducescatter run per
# tensor. Results, differentiability and handles are Horovod's.
#
# An all-reduce group has one name on every rank (its name=, or the next unnamed operation's),
# and its kind k is negotiated as member_name(group, k). How many kinds there are, only a rank
# with the tensors can tell; a rank that refuses the group refuses it as a whole (arguments.
# share_refusal), and the negotiation refuses every member the others submitted with it.

def pack_group(members):
    return torch.cat([member.reshape(-1) for member in members])


def unpack_group(flat, members):
    offset = 0
    for member in members:
        member.copy_(flat[offset:offset + member.numel()].view(member.shape))
        offset += member.numel()


def _reducible_dtype(tensor):
    """The name of the dtype `tensor` is reduced in, refused where the reductions take none."""
    name = str(_wire_dtype(tensor, Compression.none) or tensor.dtype).removeprefix("torch.")
    if name not in buffers.DTYPES:
        raise UnsupportedDtypeError(f"the reductions take int16 and {', '.join(buffers.DTYPES)} tensors, "
                                    f"not {tensor.dtype}")
    return name


def _check_reducible(tensor, op, comm, name):
    """Refuse an all-reduce of `tensor` the reductions cannot run (its dtype, or op's on it),
    under `name` (None: the next unnamed operation's) on every rank."""
    from ..collectives.callcheck import check_op  # imported here: the collectives initialize MPI
    try:
        check_op(_reduction(tensor, op, 1.0, comm)[0], _reducible_dtype(tensor))
    except MpidistError:
        share_refusal(comm, negotiated=True, name=name)
        raise


def _allreduce_group(tensors, op, comm, name):
    """The name of the all-reduce group of `tensors` (see above). What the all-reduce of one kind
    would refuse is checked for all of them before the first is sent (an in-place group is then
    left as it was); a refusal is the whole group's, on every rank."""
    from ..collectives.callcheck import check_op  # imported here: the collectives initialize MPI
    try:
        if op != Adasum:  # Adasum checks its dtypes itself
            for tensor in tensors:
                check_op(_reduction(tensor, op, 1.0, comm)[0], _reducible_dtype(tensor))
    except MpidistError:
        share_refusal(comm, negotiated=True, name=name, group=True)
        raise
    return negotiator_of(comm).name_of(name)


def _grouped_allreduce_into(tensors, op, compression, prescale_factor, postscale_factor, comm, name=None):
    group = _allreduce_group(tensors, op, comm, name)
    for kind, members in enumerate(tensors_by_kind(tensors)):
        flat = pack_group(members)
        _allreduce_into(flat, op, compression, prescale_factor, postscale_factor, comm, _group_shape(members),
                        member_name(group, kind))
        unpack_group(flat, members)
    return list(tensors)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, settings, name, *tensors):
        ctx.settings = settings
        return tuple(_grouped_allreduce_into([_contiguous_copy(t) for t in tensors], *settings, name=name))

    @staticmethod
    def backward(ctx, *grads):
        op = ctx.settings[0]
        if op not in (Average, Sum):
            raise NotOfferedError(f"hvd.grouped_allreduce with op={op!r} has no gradient; only Average and Sum "
                                  "are differentiable (as in Horovod)")
        return (None, None, *_grouped_allreduce_into([_contiguous_copy(g) for g in grads], *ctx.settings))


def _check_group(tensors, what):
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise InvalidArgumentError(f"hvd.{what} takes a non-empty list of tensors")
    return tensors


@traced("ALLREDUCE")
def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """New tensors holding the reductions of `tensors` (one operation per dtype and device).
    Differentiable when the tensors require grad."""
    tensors = _check_group(tensors, "grouped_allreduce")
    settings = (resolve_op(op, average, "grouped_allreduce"), compression, prescale_factor, postscale_factor,
                comm_of(process_set))
    return list(_GroupedAllreduce.apply(settings, name, *tensors))


@traced("ALLREDUCE")
def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=None):
    tensors = _check_group(tensors, "grouped_allreduce_")
    return _grouped_allreduce_into(tensors, resolve_op(op, average, "grouped_allreduce"), Compression.none,
                                   prescale_factor, postscale_factor, comm_of(process_set), name)


@traced("ALLREDUCE")
def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None):
    comm = comm_of(process_set)
    tensors = _check_group(tensors, "grouped_allreduce_async_")
    op = resolve_op(op, average, "grouped_allreduce")
    group = _allreduce_group(tensors, op, comm, name)
    handles, packed = [], []
    # Submitted last to first: once the negotiation holds a rank's member 0, it holds all of that
    # rank's members, which a refusal of the whole group relies on (Negotiator.refuse_group).
    for kind, members in reversed(list(enumerate(tensors_by_kind(tensors)))):
        flat = pack_group(members)
        handle, finish_flat = _start_allreduce(flat, member_name(group, kind), op, Compression.none, prescale_factor,
                                               postscale_factor, comm, _group_shape(members))
        handles.insert(0, handle)
        packed.insert(0, (flat, finish_flat, members))

    def finish(_result):
        for flat, finish_flat, members in packed:
            unpack_group(finish_flat(flat), members)
        return tensors

    return Handle(GroupHandle(handles), tensors, finish)


@traced("ALLREDUCE")
def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None):
    tensors = _check_group(tensors, "grouped_allreduce_async")
    return grouped_allreduce_async_([_contiguous_copy(t) for t in tensors], average, name, op, prescale_factor,
                                    postscale_factor, process_set)


@traced("ALLGATHER")
def grouped_allgather(tensors, name=None, process_set=None):
    return [allgather(t, name, process_set) for t in _check_group(tensors, "grouped_allgather")]


@traced("ALLGATHER")
def grouped_allgather_async(tensors, name=None, process_set=None):
    tensors = _check_group(tensors, "grouped_allgather_async")
    comm = collective_comm(process_set)
    started = [_start_allgather(t, _member_name(name, k), comm) for k, t in enumerate(tensors)]
    return Handle(GroupHandle([handle for handle, _, _ in started]),
                  finish=lambda results: [finish(result) for result, (_, _, finish) in zip(results, started)])


@traced("REDUCESCATTER")
def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average, process_set=None,
                          prescale_factor=1.0, postscale_factor=1.0):
    tensors = _check_group(tensors, "grouped_reducescatter")
    _check_scattered(tensors, collective_comm(process_set))
    return [reducescatter(t, name, compression, op, process_set, prescale_factor, postscale_factor)
            for t in tensors]


@traced("REDUCESCATTER")
def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=None, prescale_factor=1.0,
                                postscale_factor=1.0):
    tensors = _check_group(tensors, "grouped_reducescatter_async")
    op = resolve_op(op, adasum_in="reducescatter")
    comm = collective_comm(process_set)
    _check_scattered(tensors, comm, [_member_name(name, k) for k in range(len(tensors))])
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
