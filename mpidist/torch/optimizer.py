"""Horovod's DistributedOptimizer: wraps a torch optimizer so that gradients are all-reduced in
buckets during backward (mpidist's reducer, parallel/reducer.py) and waited for in step(); with
op=hvd.Adasum, each rank steps on its own gradients and the parameters' changes are combined by
Adasum in step(); on a rank outside its process_set, it steps on the rank's own gradients alone
(as Horovod's). local_step steps any of them without exchanging anything.
"""
from __future__ import annotations

import contextlib
import functools
import time
import warnings

import torch

from ..errors import InvalidArgumentError, MpidistError
from ..parallel.flat import tensors_by_kind
from ..parallel.reducer import (
    COMPRESSION_DTYPES,
    GradientBuckets,
    check_not_synchronized,
    register_gradient_hooks,
    trainable_parameters,
)
from ..runtime import config
from .basics import Adasum, Average, resolve_op
from .compression import Compression, cast_only
from .join import register_adasum_optimizer, register_optimizer
from .process_sets import ProcessSet, comm_of
from .reductions import pack_group
from .timeline import current as current_timeline


class _DistributedOptimizer:
    """Mixed into the wrapped optimizer's class: gradients are all-reduced in buckets during
    backward (after `backward_passes_per_step` passes) and waited for in step()/synchronize()."""

    def _setup_distributed(self, compression, backward_passes_per_step, op, gradient_predivide_factor, groups,
                           comm):
        params = [p for group in self.param_groups for p in group["params"]]
        labels = {id(p): name for p, name in self._parameter_names.items()}  # for the timeline
        op = resolve_op(op)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise InvalidArgumentError("gradient_predivide_factor needs op=hvd.Average")
        trainable = trainable_parameters(params)
        check_not_synchronized(trainable, "DistributedOptimizer")
        self._trainable = trainable
        self._new_buckets = functools.partial(GradientBuckets, trainable, bucket_mb=_fusion_bucket_mb(),
                                              compression=getattr(compression, "wire", None), op=op,
                                              predivide=gradient_predivide_factor,
                                              passes_per_step=backward_passes_per_step,
                                              groups=_explicit_groups(groups, params, trainable))
        self._connect(comm)
        # The timeline's row of each bucket: "allreduce.<its parameters' names>".
        self._bucket_rows = ["allreduce." + "+".join(labels[id(p)] for p in bucket.params)
                             for bucket in self._buckets.buckets]

    def _connect(self, comm):
        self._buckets = self._new_buckets(comm)
        self._skip_sync = self._synchronized = False
        self._remove_hooks = register_gradient_hooks(self._buckets, "gradient_ready", self._trainable,
                                                     "DistributedOptimizer")
        register_optimizer(self._buckets)

    def reconnect(self, comm):
        """Go on on `comm`, the survivors' communicator after a rank died (hvd.elastic.run does
        this): new gradient buckets and hooks on it; the old ones are dropped (their hooks go
        at once, not when the collector finds them). Collective over `comm`."""
        self._remove_hooks()
        self._buckets = None
        self._connect(comm)

    def synchronize(self):
        """Wait for the gradients' all-reduces (call before clipping gradients, then step()
        inside skip_synchronize())."""
        self._synchronized = True
        timeline = current_timeline()
        if timeline is None:
            self._buckets.wait()
        else:
            # On the timeline: each bucket's all-reduce on its row (written by the buckets), and
            # the wait here on a row of its own.
            self._buckets.timeline_rows = self._bucket_rows
            start = time.perf_counter()
            self._buckets.wait()
            timeline.span("DistributedOptimizer", "SYNCHRONIZE", start, time.perf_counter())
        self._restore_sparse_gradients()

    def _restore_sparse_gradients(self):
        """A gradient backward made sparse (nn.Embedding(sparse=True)) is averaged as a dense
        tensor (with sparse_as_dense True or False alike) and handed back sparse, in its rows
        that are not all zero, as Horovod hands it back, so that torch.optim.SparseAdam takes it."""
        for param, sparse_dim in self._buckets.sparse_gradients.values():
            param.grad = param.grad.to_sparse(sparse_dim)
        self._buckets.sparse_gradients.clear()

    @contextlib.contextmanager
    def skip_synchronize(self):
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure=None):
        if not self._skip_sync:
            if self._synchronized:
                # Horovod warns here too: step() after an explicit synchronize() synchronizes again.
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", UserWarning, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._buckets.active:
            raise MpidistError("zero_grad() called while gradients are being all-reduced; call "
                               "step() or synchronize() first")
        return super().zero_grad(set_to_none=set_to_none)


class _OutsideProcessSetOptimizer(_DistributedOptimizer):
    """Mixed into the wrapped optimizer's class on a rank outside the DistributedOptimizer's
    process_set, as Horovod does there: no gradient is exchanged, and step() is the wrapped
    optimizer's own step on this rank's gradients (synchronize() has nothing to wait for)."""

    def _setup_outside(self):
        self._skip_sync = self._synchronized = False

    def synchronize(self):
        self._synchronized = True

    def zero_grad(self, set_to_none: bool = True):
        return super(_DistributedOptimizer, self).zero_grad(set_to_none=set_to_none)


class _DistributedAdasumOptimizer:
    """Mixed into the wrapped optimizer's class with op=hvd.Adasum (Horovod's
    _DistributedAdasumOptimizer): each rank steps the wrapped optimizer on its own gradients, so
    its state (momentum, Adam's moments) stays its own, and the parameters become the step's
    starting point plus the Adasum over the ranks of their changes, tensor by tensor. Gradients
    are not exchanged during backward; everything happens in step()."""

    def _setup_adasum(self, compression, comm):
        if comm.size & (comm.size - 1):
            raise InvalidArgumentError(
                f"DistributedOptimizer(op=hvd.Adasum) needs a power-of-two number of ranks (its pairs "
                f"form a binary tree); there are {comm.size}")
        params = trainable_parameters([p for group in self.param_groups for p in group["params"]])
        check_not_synchronized(params, "DistributedOptimizer")
        self._adasum_params = params
        self._adasum_comm = comm
        self._wire = COMPRESSION_DTYPES.get(cast_only(compression, "DistributedOptimizer(op=hvd.Adasum)"))
        register_adasum_optimizer(self)

    def synchronize(self):
        pass  # as in Horovod: the changes are combined in step()

    def skip_synchronize(self):
        raise InvalidArgumentError("skip_synchronize() has no use with op=hvd.Adasum: the parameters' "
                                   "changes are combined in step(), after the local step")

    def step(self, closure=None):
        params = self._adasum_params
        start = {id(p): p.detach().clone() for p in params}
        result = super().step(closure)
        if self._adasum_comm.size == 1:
            return result
        began = time.perf_counter()
        self._combine_changes(params, start)
        timeline = current_timeline()
        if timeline is not None:
            timeline.span("DistributedOptimizer", "ADASUM", began, time.perf_counter())
        return result

    def _combine_changes(self, params, start):
        with torch.no_grad():
            for members in tensors_by_kind(params):
                change = pack_group([p - start[id(p)] for p in members])
                wire = change.to(self._wire) if self._wire is not None and change.is_floating_point() else change
                self._adasum_comm.adasum_allreduce(wire, sizes=[p.numel() for p in members])
                if wire is not change:
                    change.copy_(wire)
                for param, part in zip(members, change.split([p.numel() for p in members])):
                    param.copy_(start[id(param)] + part.view_as(param))


def local_step(optimizer) -> None:
    """A step of `optimizer` (a torch optimizer, or one DistributedOptimizer wraps) on this rank's
    gradients alone: a DistributedOptimizer's exchanges need every rank to step."""
    for mixin in (_DistributedOptimizer, _DistributedAdasumOptimizer):
        if isinstance(optimizer, mixin):
            super(mixin, optimizer).step()
            return
    optimizer.step()


def _fusion_bucket_mb() -> float:
    """Horovod's HOROVOD_FUSION_THRESHOLD (bytes) as the buckets' size in MB: unset, DataParallel's
    25; 0 (Horovod: no fusion), a bucket per gradient."""
    threshold = config.value("HOROVOD_FUSION_THRESHOLD")
    return max(threshold, 1) / 2 ** 20  # a 1-byte bucket holds one gradient, however small


def _explicit_groups(groups, params, trainable) -> list:
    """Horovod's `groups`: a number n (the trainable parameters in optimizer order, cut into n runs
    of nearly equal length, as Horovod's split_list cuts them) or a list of lists of parameters.
    Each group is all-reduced as one bucket (GradientBuckets); parameters in no group, and every
    parameter when groups is None, are bucketed automatically. Frozen parameters are left out."""
    if groups is None:
        return []
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups <= 0:
            raise InvalidArgumentError(f"groups={groups}: pass a positive number of groups or a list of "
                                       "lists of parameters")
        quotient, remainder = divmod(len(trainable), groups)
        runs = [trainable[k * quotient + min(k, remainder):(k + 1) * quotient + min(k + 1, remainder)]
                for k in range(groups)]
        return [run for run in runs if run]
    if not isinstance(groups, (list, tuple)):
        raise InvalidArgumentError(f"groups must be a positive number or a list of lists of parameters, "
                                   f"got {type(groups).__name__}")
    known, trainable_ids, seen, result = {id(p) for p in params}, {id(p) for p in trainable}, set(), []
    for k, group in enumerate(groups):
        if not isinstance(group, (list, tuple)):
            raise InvalidArgumentError(f"groups[{k}] is a {type(group).__name__}; each group must be a list "
                                       "of parameters")
        for member in group:
            if not isinstance(member, torch.Tensor):
                raise InvalidArgumentError(f"groups[{k}] holds a {type(member).__name__}; groups must consist "
                                           "of torch.Tensor parameters")
            if id(member) in seen:
                raise InvalidArgumentError(f"groups[{k}]: a parameter can only appear once in groups")
            if id(member) not in known:
                raise InvalidArgumentError(f"groups[{k}] holds a tensor that is not a parameter of the "
                                           "wrapped optimizer")
            seen.add(id(member))
        members = [p for p in group if id(p) in trainable_ids]
        if members:
            result.append(members)
    return result


def _parameter_names(optimizer, named_parameters) -> dict:
    """Horovod's optimizer._parameter_names, {parameter: name}: the names given, or
    allreduce.noname.<group>.<index in group>, unique and the same on every rank. Checked before
    anything else, as in Horovod (hvd.init() need not have run)."""
    if named_parameters is None:
        named = [(f"allreduce.noname.{g}.{i}", p) for g, group in enumerate(optimizer.param_groups)
                 for i, p in enumerate(group["params"])]
    else:
        named = list(named_parameters)
        if not all(isinstance(item, tuple) and len(item) == 2 for item in named):
            raise InvalidArgumentError("named_parameters should be a sequence of tuples (name, parameter), usually "
                                       "produced by model.named_parameters()")
    names = [name for name, _ in named]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise InvalidArgumentError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                                   f"{', '.join(duplicates)}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    known = {id(p) for _, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in known]
    if missing:
        raise InvalidArgumentError(f"named_parameters was specified, but one or more model parameters were not "
                                   f"named: optimizer parameters {missing}")
    return {p: name for name, p in named}


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None):
    """Wrap a torch optimizer the way horovod.torch.DistributedOptimizer does."""
    parameter_names = _parameter_names(optimizer, named_parameters)
    outside = (isinstance(process_set, ProcessSet) and process_set._registered().process_set_id != 0
               and not process_set.included())
    comm = None if outside else comm_of(process_set)
    adasum = resolve_op(op) == Adasum
    if adasum and gradient_predivide_factor != 1.0:
        raise InvalidArgumentError("gradient_predivide_factor needs op=hvd.Average")
    if num_groups:
        warnings.warn("DistributedOptimizer: num_groups is the older name of groups (as in Horovod)",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    mixin = _OutsideProcessSetOptimizer if outside else _DistributedAdasumOptimizer if adasum else _DistributedOptimizer
    cls = type(optimizer.__class__.__name__, (mixin, optimizer.__class__), {})
    distributed = cls.__new__(cls)
    distributed.__dict__.update(optimizer.__dict__)
    distributed._parameter_names = parameter_names
    if outside:
        distributed._setup_outside()
    elif adasum:
        distributed._setup_adasum(compression, comm)
    else:
        distributed._setup_distributed(compression, backward_passes_per_step, op, gradient_predivide_factor,
                                       groups, comm)
    return distributed
