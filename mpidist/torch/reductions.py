"""hvd's all-reduces: allreduce with its in-place (`_`), asynchronous (`_async`) and grouped
forms, and Horovod's rules for reducing a torch tensor, which reducescatter (mpi_ops) follows
too: the op a reduction runs (an integer average is a scaled sum), the scale factors, the dtype
the tensor is reduced in, and what the reductions refuse, on every rank at once.

Every all-reduce here is negotiated by name (negotiation.py), op=hvd.Adasum included: an
operation one rank calls with arguments it refuses, or with another op than the others, raises
on every rank instead of leaving the others waiting for it.
"""
from __future__ import annotations

import torch

from .. import buffers
from .. import comm as _comm
from ..collectives.adasum import ADASUM_DTYPES
from ..collectives.callcheck import check_op
from ..errors import InvalidArgumentError, MpidistError, NotOfferedError, UnsupportedDtypeError
from ..parallel.flat import tensors_by_kind
from .arguments import share_refusal
from .basics import Adasum, Average, Sum, resolve_op
from .compression import Compression, dtype_on_wire
from .handles import GroupHandle, Handle
from .join import check_joinable_allreduce
from .negotiation import negotiator_of, submit
from .negotiation_rules import dtype_name, group_member, signature_of
from .process_sets import comm_of
from .timeline import traced


def contiguous_copy(tensor):
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def scaled(tensor, factor):
    """Horovod's scaling: a floating-point tensor in its own dtype, an integer one in float64 with
    the product truncated toward zero into the tensor's dtype (its ScaleBuffer's C++ conversion)."""
    if factor != 1.0:
        if tensor.is_floating_point():
            tensor.mul_(factor)
        else:
            tensor.copy_(tensor.double().mul_(factor))


def reduction(tensor, op, postscale_factor, comm):
    """(op to run, postscale factor) of a reduction of `tensor`. Horovod averages as a sum scaled
    by postscale_factor / size; the collectives average floating-point tensors themselves, and
    integer ones are summed and scaled so, as Horovod's (the quotient truncated toward zero)."""
    if op == Average and not tensor.is_floating_point():
        return Sum, postscale_factor / comm.size
    return op, postscale_factor


def wire_dtype(tensor, compression):
    """The dtype `tensor` is reduced in, or None for its own: the compression's, or int32 for
    int16, which the kernels do not reduce (cast back after, it wraps as int16 arithmetic)."""
    if tensor.dtype == torch.int16:
        return torch.int32
    return dtype_on_wire(tensor, compression)


def reducible_dtype(tensor):
    """The name of the dtype `tensor` is reduced in, refused where the reductions take none."""
    name = str(wire_dtype(tensor, Compression.none) or tensor.dtype).removeprefix("torch.")
    if name not in buffers.DTYPES:
        raise UnsupportedDtypeError(f"the reductions take int16 and {', '.join(buffers.DTYPES)} tensors, "
                                    f"not {tensor.dtype}")
    return name


def resolved_op(op, average, comm, name, adasum_in=None, group=False):
    """basics.resolve_op's op for an operation negotiated on `comm` under `name` (None: the next
    unnamed one's); where this rank refuses it (an unknown op, average= with op=, Adasum where it
    is not offered), the other ranks are told under that name (an all-reduce `group`'s: as a
    whole), so that they raise at once too instead of waiting for this rank."""
    try:
        return resolve_op(op, average, adasum_in)
    except (ValueError, MpidistError):
        share_refusal(comm, negotiated=True, name=name, group=group)
        raise


def _check_reducible(tensor, op, comm, name):
    """Refuse an all-reduce of `tensor` the reductions cannot run (its dtype, or `op`, the op to
    run, on it), under `name` (None: the next unnamed operation's) on every rank."""
    try:
        check_op(op, reducible_dtype(tensor))
    except MpidistError:
        share_refusal(comm, negotiated=True, name=name)
        raise


def _start_allreduce(tensor, name, op, compression, prescale_factor, postscale_factor, comm, shape=None,
                     sizes=None):
    """(handle, finishing step) of the all-reduce of `tensor` in place, negotiated under `name`;
    `shape` (default: the tensor's) is what the ranks' must match. A dtype the reductions do not
    take is refused before anything changes the tensor, under `name` on every rank (an all-reduce
    group's members were checked as a whole before: _allreduce_group). Adasum checks its dtypes
    itself, in the negotiation's thread, where every rank runs it; it is never fused. `sizes`: the
    element counts of a group's members packed in `tensor`, which Adasum combines each with its
    own coefficients, as each member's own all-reduce would."""
    op, postscale_factor = reduction(tensor, op, postscale_factor, comm)
    if op != Adasum:
        _check_reducible(tensor, op, comm, name)
    reduced_in = wire_dtype(tensor, compression)
    check_joinable_allreduce(comm, tensor, op, reduced_in)  # Adasum always, while ranks wait in join()
    scaled(tensor, prescale_factor)
    wire = tensor.to(reduced_in) if reduced_in is not None else tensor

    def finish(result):
        if wire is not result:
            result.copy_(wire)
        scaled(result, postscale_factor)
        return result

    signature = signature_of("allreduce", wire, op, shape=tensor.shape if shape is None else shape,
                             scale_factors=(prescale_factor, postscale_factor))
    if op == Adasum:
        return submit(comm, name, signature, lambda private: private.adasum_allreduce(wire, sizes=sizes)), finish
    return submit(comm, name, signature, lambda private: private.allreduce(wire, op=op), buffer=wire), finish


def allreduce_into(tensor, op, compression, prescale_factor, postscale_factor, comm, shape=None, name=None,
                   sizes=None):
    """`tensor` reduced in place; `shape` (default: the tensor's) is what the ranks' must match;
    `sizes`: _start_allreduce's."""
    handle, finish = _start_allreduce(tensor, name, op, compression, prescale_factor, postscale_factor, comm, shape,
                                      sizes)
    handle.wait()
    return finish(tensor)


def no_gradient(operation, op):
    if op not in (Average, Sum):
        raise NotOfferedError(f"hvd.{operation} with op={op!r} has no gradient; only Average and Sum "
                              "are differentiable (as in Horovod)")


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, compression, prescale_factor, postscale_factor, comm, name):
        ctx.settings = (op, compression, prescale_factor, postscale_factor, comm)
        return allreduce_into(contiguous_copy(tensor), *ctx.settings, name=name)

    @staticmethod
    def backward(ctx, grad):
        no_gradient("allreduce", ctx.settings[0])
        # Each rank's input enters every rank's output through the same linear map, so its
        # gradient is the same reduction (op and scale factors) of all ranks' output gradients.
        # Unnamed, as Horovod's (HorovodAllreduce.backward): the ranks' backward passes meet in
        # the order they run, as unnamed operations do, whatever the forward's name=.
        return allreduce_into(contiguous_copy(grad), *ctx.settings), None, None, None, None, None, None


@traced("ALLREDUCE")
def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=None, compression=Compression.none):
    comm = comm_of(process_set)
    return allreduce_into(tensor, resolved_op(op, average, comm, name), compression, prescale_factor,
                          postscale_factor, comm, name=name)


@traced("ALLREDUCE")
def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """A new tensor holding the reduction of `tensor` over all ranks (average by default).
    Differentiable when `tensor` requires grad."""
    comm = comm_of(process_set)
    return _Allreduce.apply(tensor, resolved_op(op, average, comm, name), compression, prescale_factor,
                            postscale_factor, comm, name)


@traced("ALLREDUCE")
def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None):
    comm = comm_of(process_set)
    handle, finish = _start_allreduce(tensor, name, resolved_op(op, average, comm, name), Compression.none,
                                      prescale_factor, postscale_factor, comm)
    return Handle(handle, tensor, finish)


@traced("ALLREDUCE")
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None):
    return allreduce_async_(contiguous_copy(tensor), average, name, op, prescale_factor,
                            postscale_factor, process_set)


# ---- grouped all-reduces ---------------------------------------------------------------------
# Horovod's grouped_allreduce runs a list of tensors as one operation. Here it packs the tensors
# of each dtype and device into one buffer (one all-reduce per kind, in the order the kinds first
# appear, the same on every rank). Results, differentiability and handles are Horovod's.
#
# A group has one name on every rank (its name=, or the next unnamed operation's), and its kind
# k is negotiated as group_member(group, k). How many kinds there are, only a rank with the
# tensors can tell; a rank that refuses the group (its tensors, its op) refuses it as a whole
# (arguments.share_refusal), and the negotiation refuses every member the others submitted with it.
#
# With op=hvd.Adasum each tensor of the group gets the result of its own allreduce(op=Adasum):
# a kind's buffer is combined tensor by tensor (adasum_allreduce's sizes), each with its own dot
# product and norms, as Horovod's Adasum combines the entries of its fusion buffer. As in Horovod,
# only on the global process set.

# A group is packed with torch.cat, not with parallel/flat.py's kernel (kernels.pack): Horovod's
# ops take dtypes that the kernels do not describe (int16, test_horovod_ops.py).
def pack_group(members):
    return torch.cat([member.reshape(-1) for member in members])


def unpack_group(flat, members):
    offset = 0
    for member in members:
        member.copy_(flat[offset:offset + member.numel()].view(member.shape))
        offset += member.numel()


def check_group(tensors, what):
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise InvalidArgumentError(f"hvd.{what} takes a non-empty list of tensors")
    return tensors


def _group_shape(members):
    return [list(member.shape) for member in members]


def _sizes(members):
    return [member.numel() for member in members]


def _allreduce_group(tensors, op, average, comm, name):
    """(the op, the name) of the all-reduce group of `tensors` (see above). What the all-reduce
    of one kind would refuse is checked for all of them before the first is sent (an in-place
    group is then left as it was); a refusal is the whole group's, on every rank."""
    op = resolved_op(op, average, comm, name, group=True)
    try:
        if op == Adasum:
            if comm is not _comm.world():
                raise NotOfferedError("hvd.grouped_allreduce with op=hvd.Adasum runs on the global process set "
                                      "only, as in Horovod (\"Adasum does not support non-global process sets\"); "
                                      "use allreduce(op=hvd.Adasum) on each tensor of a process set")
            for tensor in tensors:
                if dtype_name(tensor) not in ADASUM_DTYPES:
                    raise UnsupportedDtypeError(f"Adasum combines floating-point tensors of {', '.join(ADASUM_DTYPES)}; "
                                                f"the group holds a {dtype_name(tensor)} tensor")
        else:
            for tensor in tensors:
                check_op(reduction(tensor, op, 1.0, comm)[0], reducible_dtype(tensor))
    except MpidistError:
        share_refusal(comm, negotiated=True, name=name, group=True)
        raise
    return op, negotiator_of(comm).name_of(name)


def _grouped_allreduce_into(tensors, op, compression, prescale_factor, postscale_factor, comm, group):
    """`tensors` reduced in place, as the group named `group` (_allreduce_group's)."""
    for kind, members in enumerate(tensors_by_kind(tensors)):
        flat = pack_group(members)
        allreduce_into(flat, op, compression, prescale_factor, postscale_factor, comm, _group_shape(members),
                       group_member(group, kind), _sizes(members))
        unpack_group(flat, members)
    return list(tensors)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, settings, group, *tensors):
        ctx.settings = settings
        return tuple(_grouped_allreduce_into([contiguous_copy(t) for t in tensors], *settings, group))

    @staticmethod
    def backward(ctx, *grads):
        no_gradient("grouped_allreduce", ctx.settings[0])
        # Unnamed, as allreduce's backward: the next unnamed operation's name.
        group = negotiator_of(ctx.settings[-1]).name_of(None)
        return (None, None, *_grouped_allreduce_into([contiguous_copy(g) for g in grads], *ctx.settings, group))


@traced("ALLREDUCE")
def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """New tensors holding the reductions of `tensors` (one operation per dtype and device).
    Differentiable when the tensors require grad."""
    tensors = check_group(tensors, "grouped_allreduce")
    comm = comm_of(process_set)
    op, group = _allreduce_group(tensors, op, average, comm, name)
    settings = (op, compression, prescale_factor, postscale_factor, comm)
    return list(_GroupedAllreduce.apply(settings, group, *tensors))


@traced("ALLREDUCE")
def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=None):
    tensors = check_group(tensors, "grouped_allreduce_")
    comm = comm_of(process_set)
    op, group = _allreduce_group(tensors, op, average, comm, name)
    return _grouped_allreduce_into(tensors, op, Compression.none, prescale_factor, postscale_factor, comm, group)


@traced("ALLREDUCE")
def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None):
    comm = comm_of(process_set)
    tensors = check_group(tensors, "grouped_allreduce_async_")
    op, group = _allreduce_group(tensors, op, average, comm, name)
    handles, packed = [], []
    # Submitted last to first: once the negotiation holds a rank's member 0, it holds all of that
    # rank's members, which a refusal of the whole group relies on (Negotiator.refuse_group).
    for kind, members in reversed(list(enumerate(tensors_by_kind(tensors)))):
        flat = pack_group(members)
        handle, finish_flat = _start_allreduce(flat, group_member(group, kind), op, Compression.none, prescale_factor,
                                               postscale_factor, comm, _group_shape(members), _sizes(members))
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
    tensors = check_group(tensors, "grouped_allreduce_async")
    return grouped_allreduce_async_([contiguous_copy(t) for t in tensors], average, name, op, prescale_factor,
                                    postscale_factor, process_set)
