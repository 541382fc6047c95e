"""Synchronous data parallelism: DataParallel (gradient buckets overlapped with backward, like
PyTorch DDP) and ParameterAveraging (average the weights every k local steps).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import weakref

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import kernels
from ..comm import init
from ..errors import InvalidArgumentError, MpidistError, NotOfferedError
from ..memory import keep_freed_memory
from .sync_batchnorm import SyncBatchNorm

FIRST_BUCKET_BYTES = 1024 * 1024
# Largest bucket exchanged through the shared slots on one node. There no message cost is saved
# by bigger buckets, and a smaller one starts its exchange earlier in backward, while the
# gradients it copies are still in cache: 4 MB buckets ran 0.01-0.09x single faster than 25 MB
# in every run of benchmarks/results/training-cpu.md (runs G-M).
SHARED_SLOTS_BUCKET_BYTES = 4 * 1024 * 1024
COMPRESSION_DTYPES = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def broadcast_in_place(comm, tensor: torch.Tensor, root: int = 0) -> None:
    """Give every rank `root`'s values of `tensor`, in place, whatever its strides."""
    if tensor.is_contiguous():
        comm.broadcast(tensor, root=root)
        return
    staging = tensor.contiguous()  # channels_last weights, for example
    comm.broadcast(staging, root=root)
    tensor.copy_(staging)


def broadcast_module_state(module: torch.nn.Module, comm, root: int = 0) -> None:
    """Give every rank `root`'s parameters and buffers (in place)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            broadcast_in_place(comm, tensor.data, root)


class _Bucket:
    """Gradients of several parameters all-reduced together.

    A bucket of one parameter without compression all-reduces that gradient in place; larger
    buckets pack their gradients into one flat buffer (made on first use) and unpack after.
    """

    def __init__(self, params, compression):
        self.params = params
        first = params[0]
        self.wire_dtype = compression if compression is not None and compression != first.dtype else None
        self._flat = None
        self._flat_parts = None
        self._wire = None
        self.packed = True
        self.pending = set()
        self.handle = None
        self.sources = None  # the arrays an all-reduce through the shared slots reads or writes
        self.views = None  # with gradient_as_bucket_view: each parameter's gradient inside the bucket

    @property
    def flat(self):
        if self._flat is None:
            first = self.params[0]
            self._flat = torch.empty(sum(p.numel() for p in self.params), dtype=first.dtype, device=first.device)
        return self._flat

    @property
    def wire(self):
        if self.wire_dtype is None:
            return None
        if self._wire is None:
            self._wire = torch.empty_like(self.flat, dtype=self.wire_dtype)
        return self._wire

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer this bucket all-reduces (its gradient, flat buffer or wire buffer)."""
        return sum(p.numel() for p in self.params) * (self.wire_dtype or self.params[0].dtype).itemsize

    def reset(self):
        self.pending = {id(p) for p in self.params}
        self.handle = None
        self.sources = None

    @property
    def flat_parts(self):
        """The flat buffer as one contiguous view per parameter (made once)."""
        if self._flat_parts is None:
            self._flat_parts = shaped_like(self.params, self.flat)
        return self._flat_parts

    def pack(self, grads) -> None:
        pack_tensors(self.flat, self.flat_parts, grads)

    def unpack(self, grads) -> None:
        unpack_tensors(self.flat, self.flat_parts, grads)

    def use_views(self) -> None:
        """Make each gradient its view: the result is already there, nothing to copy."""
        for param, view in zip(self.params, self.views):
            if param.grad is not view:
                param.grad = view


def tensors_by_kind(tensors) -> list:
    """`tensors` in lists of one dtype and device, in order of first appearance (a flat buffer
    holds one kind of element)."""
    kinds = {}
    for tensor in tensors:
        kinds.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    return list(kinds.values())


def shaped_like(params, flat: torch.Tensor):
    """Views of `flat` shaped like `params` (contiguous), laid end to end."""
    parts = flat.split([p.numel() for p in params])
    return [part.view(p.shape) for part, p in zip(parts, params)]


def pack_tensors(flat: torch.Tensor, parts, tensors) -> None:
    """Gather `tensors` into `flat` (`parts`: shaped_like views of it): in one kernel call when
    they are contiguous and none is already its part; torch copies the others, whatever their
    strides (the kernel takes contiguous memory only)."""
    if all(t.is_contiguous() and t is not part for t, part in zip(tensors, parts)):
        kernels.pack(flat, tensors)
        return
    for tensor, part in zip(tensors, parts):
        if tensor is not part:
            part.copy_(tensor)


def unpack_tensors(flat: torch.Tensor, parts, tensors) -> None:
    """Scatter `flat` back into `tensors` (the inverse of pack_tensors)."""
    if all(t.is_contiguous() for t in tensors):
        kernels.unpack(flat, tensors)
        return
    for tensor, part in zip(tensors, parts):
        tensor.copy_(part)


def tensor_at(address: int, numel: int, dtype: torch.dtype, owner) -> torch.Tensor:
    """A CPU tensor over memory this process does not own through torch (a shared window).

    The tensor, and every view of it, keeps `owner` (what frees the memory) alive: a gradient
    that is a view of a shared slot stays valid after its DataParallel is gone."""
    memory = (ctypes.c_char * (numel * dtype.itemsize)).from_address(address)
    memory.owner = owner  # torch.frombuffer keeps `memory` alive for as long as the storage
    return torch.frombuffer(memory, dtype=dtype, count=numel)


# parameter -> (what, weak reference): the live DataParallel or DistributedOptimizer whose hooks
# all-reduce that parameter's gradient.
_SYNCHRONIZED_BY = WeakIdKeyDictionary()


def check_not_synchronized(params, what: str) -> None:
    """Refuse parameters whose gradients a live DataParallel or DistributedOptimizer already
    all-reduces: two sets of hooks would exchange the same gradients concurrently (on one node,
    through the same memory), leaving wrong averages. Called before any communication, so every
    rank running the same program raises here."""
    def taken():
        found = []
        for index, param in enumerate(params):
            owner_what, reference = _SYNCHRONIZED_BY.get(param, (None, lambda: None))
            if reference() is not None:
                found.append((index, owner_what))
        return found

    conflicts = taken()
    if conflicts:
        gc.collect()  # a wrapper the program dropped may only wait for the cycle collector
        conflicts = taken()
    if conflicts:
        index, owner_what = conflicts[0]
        raise InvalidArgumentError(
            f"{what}: parameter {index} (and {len(conflicts) - 1} more) already has its gradient all-reduced by "
            f"a {owner_what} that is still alive; drop that one first (del it) or use only one")


def register_gradient_hooks(owner, method: str, params, what: str) -> None:
    """Call `owner.<method>(param)` each time backward has accumulated a gradient of `params`, for
    as long as `owner` lives. The hooks refer to it weakly and are removed once it is collected,
    as PyTorch DDP removes its hooks when it is destroyed: a DataParallel or DistributedOptimizer
    that the program drops stops all-reducing the gradients (wrapping the model again does not
    exchange them twice) and its shared memory is given back. `what` names the owner in
    check_not_synchronized's error."""
    reference = weakref.ref(owner)

    def hook(param):
        alive = reference()
        if alive is not None:
            getattr(alive, method)(param)

    handles = [param.register_post_accumulate_grad_hook(hook) for param in params]
    weakref.finalize(owner, remove_hooks, handles)
    for param in params:
        _SYNCHRONIZED_BY[param] = (what, reference)


def remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


class GradientBuckets:
    """Packs gradients into buckets as backward produces them and all-reduces each full bucket
    in the background; wait() puts the reduced gradients back. Shared by DataParallel and the
    Horovod-style DistributedOptimizer.

    Buckets hold parameters in reverse registration order (the order backward produces their
    gradients) and are launched strictly in bucket order on every rank, so all ranks issue the
    same collectives in the same order. A parameter that got no gradient counts as zero.

    When every rank runs on one node and the buckets are on the CPU, each bucket has slots in a
    shared window and its all-reduce is advanced by polling from the gradient hooks on the
    caller's thread (collectives/polled.py); otherwise each bucket is handed to the
    communicator's asynchronous engine. `trace`, when set to a list, receives (start, finish)
    perf_counter times of each bucket's all-reduce.

    For CPU parameters it makes glibc's malloc keep freed memory for reuse, process-wide
    (mpidist/memory.py; MPIDIST_KEEP_FREED_MEMORY=0 turns that off).

    With `gradient_as_bucket_view` (PyTorch DDP's option of that name), after the first step each
    gradient is a view of its bucket's memory (the shared slot or the flat buffer) where the
    all-reduce leaves its result, so the results are not copied back (see DataParallel).

    Each exchange also sums one number over the ranks, launched with the first bucket: 1 from a
    rank that brings gradients, 0 from a rank that has run out of data and only takes part
    (shadow(), for DataParallel.join and hvd.join). `active_ranks` is that sum for the last
    exchange, so every rank learns in the same exchange when others have joined, at the cost of
    a four-byte all-reduce per step.

    `groups` (Horovod's explicit grouping) is a list of lists of parameters: each group is
    all-reduced as one bucket of its own (one per dtype and device in it) once all its gradients
    are ready, whatever its size; the parameters in no group are bucketed as above.
    """

    def __init__(self, params, comm, bucket_mb=25, compression=None, algorithm="auto", op="avg",
                 predivide=1.0, passes_per_step=1, gradient_as_bucket_view=False, groups=()):
        if compression not in COMPRESSION_DTYPES:
            raise InvalidArgumentError(f"compression={compression!r}; choose None, 'fp16' or 'bf16'")
        if bucket_mb <= 0:
            raise InvalidArgumentError(f"bucket_mb must be positive, got {bucket_mb}")
        if passes_per_step < 1:
            raise InvalidArgumentError(f"backward passes per step must be >= 1, got {passes_per_step}")
        from ..collectives.api import check_algorithm  # imported here: it initializes MPI
        check_algorithm(algorithm)
        self.comm = comm
        self.algorithm = algorithm
        self.op = op
        self.predivide = float(predivide)
        self.passes_per_step = passes_per_step
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        if any(p.device.type == "cpu" for p in params):
            # Each step frees and reallocates the gradients: reuse the memory rather than fault
            # it in afresh every step (mpidist/memory.py).
            keep_freed_memory()
        polled = self._polled(params)
        limit = int(bucket_mb * 1024 * 1024)
        if polled:
            limit = min(limit, SHARED_SLOTS_BUCKET_BYTES)
        self.buckets = self._make_buckets(params, limit, COMPRESSION_DTYPES[compression], groups)
        self._bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self._passes = {id(p): 0 for bucket in self.buckets for p in bucket.params}
        self._next_to_launch = 0
        self.active_ranks = comm.size  # ranks that brought gradients to the last exchange
        self.exchanges_with_gradients = 0  # exchanges this rank brought gradients to
        self._contribution = 1.0  # 0.0 while shadow() takes part without gradients
        self._count = torch.ones(1, dtype=torch.float32)  # this rank's contribution, summed in place
        self._count_sum = self._count
        self._count_handle = None
        # Called with these buckets before each exchange this rank brings gradients to. A plain
        # function, not a bound method: buckets must not keep themselves alive (gradient hooks of a
        # dropped optimizer stop when its buckets are freed).
        self.before_exchange = None
        self.slots = None
        if polled:
            # Imported here: the collectives package initializes MPI when imported, and
            # `import mpidist.torch` must not (mpidist sets MPI's options first, see comm.load_mpi).
            from ..collectives.polled import NodeSlots
            # The slots keep the results when the gradients are views of them; a compressed or
            # predivided bucket goes through its flat buffer instead (and its views are there).
            in_slots = (self.gradient_as_bucket_view and self.predivide == 1.0
                        and all(b.wire is None for b in self.buckets))
            sizes = [b.nbytes for b in self.buckets] + [self._count.element_size()]
            self.slots = NodeSlots(comm.node_comm, sizes, results_in_slots=in_slots)
            if in_slots:
                for index, bucket in enumerate(self.buckets):
                    first = bucket.params[0]
                    numel = sum(p.numel() for p in bucket.params)
                    slot = tensor_at(self.slots.address(index), numel, first.dtype, owner=self.slots)
                    bucket.views = shaped_like(bucket.params, slot)
                # The count's sum stays in its slot too.
                self._count_sum = tensor_at(self.slots.address(len(self.buckets)), 1, torch.float32,
                                              owner=self.slots)
        self.trace = None
        self.reset()

    def _polled(self, params) -> bool:
        """Whether the buckets are all-reduced through shared slots polled from the hooks."""
        comm = self.comm
        return (comm.size > 1 and comm.local_size == comm.size and self.algorithm in ("auto", "hierarchical")
                and comm.forced_algorithm in (None, "hierarchical")
                and all(p.device.type == "cpu" for p in params))

    @staticmethod
    def _make_buckets(params, limit, compression, groups=()):
        """Buckets of at most `limit` bytes (a bigger gradient gets a bucket of its own). Like
        DDP, the first bucket (the last layers, whose gradients backward produces first) is kept
        small, so its all-reduce starts early and overlaps the rest of backward. Each of `groups`
        makes buckets of its own."""
        grouped = {id(p) for group in groups for p in group}
        buckets = GradientBuckets._automatic_buckets([p for p in params if id(p) not in grouped], limit,
                                                     compression)
        if not groups:
            return buckets
        position = {id(p): i for i, p in enumerate(params)}
        for group in groups:
            members = sorted(group, key=lambda p: -position[id(p)])  # backward's order
            buckets += [_Bucket(kind, compression) for kind in tensors_by_kind(members)]
        # Buckets launch in order, so order them by when backward completes each: at the gradient
        # of its first-registered parameter (backward produces gradients in reverse order).
        return sorted(buckets, key=lambda bucket: -min(position[id(p)] for p in bucket.params))

    @staticmethod
    def _automatic_buckets(params, limit, compression):
        first_limit = min(limit, FIRST_BUCKET_BYTES)
        buckets, current, size = [], [], 0
        for param in reversed(params):
            nbytes = param.numel() * param.element_size()
            cap = first_limit if not buckets else limit
            if current and (size + nbytes > cap or (param.dtype, param.device) != (current[0].dtype, current[0].device)):
                buckets.append(_Bucket(current, compression))
                current, size = [], 0
            current.append(param)
            size += nbytes
        if current:
            buckets.append(_Bucket(current, compression))
        return buckets

    @property
    def active(self) -> bool:
        return self._next_to_launch > 0 or any(len(b.pending) < len(b.params) for b in self.buckets)

    def gradient_ready(self, param) -> None:
        key = id(param)
        self._passes[key] += 1
        if self._passes[key] < self.passes_per_step:
            return
        bucket = self._bucket_of[key]
        bucket.pending.discard(key)
        while self._next_to_launch < len(self.buckets) and not self.buckets[self._next_to_launch].pending:
            self._launch(self._next_to_launch)
            self._next_to_launch += 1
        if self.slots is not None:
            if self._count_handle is not None:
                self._count_handle.progress()
            for bucket in self.buckets[:self._next_to_launch]:
                bucket.handle.progress()

    def _launch_count(self) -> None:
        """Start summing over the ranks how many bring gradients to this exchange."""
        if self._contribution and self.before_exchange is not None:
            self.before_exchange(self)
        self._count.fill_(self._contribution)
        if self.slots is not None:
            self._count_handle = self.slots.start(len(self.buckets), [self._count], "sum")
        else:
            self._count_handle = self.comm.allreduce_async(self._count, op="sum")

    def _launch(self, index: int) -> None:
        if index == 0:
            self._launch_count()
        bucket = self.buckets[index]
        for param in bucket.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            elif param.grad.is_sparse:  # nn.Embedding(sparse=True): averaged as a dense tensor
                param.grad = param.grad.to_dense()
        grads = [param.grad for param in bucket.params]
        op = self.op
        if self.slots is not None and self.slots.results_in_slots:
            # The slots read the gradients (views of the slot already, or fresh ones) and keep
            # the result.
            bucket.packed = False
            # Kept until the all-reduce ends: it reads them through their addresses.
            bucket.sources = [g.contiguous() for g in grads]
            bucket.handle = self.slots.start(index, bucket.sources, op)
            return
        if self.slots is not None and bucket.wire is None and self.predivide == 1.0 \
                and all(g.is_contiguous() for g in grads):
            # The shared slots reduce the gradients where they lie: nothing to pack.
            bucket.packed = False
            bucket.sources = grads  # kept until the all-reduce ends: it writes them through their addresses
            bucket.handle = self.slots.start(index, grads, op)
            return
        # One contiguous gradient needs no packing: it is all-reduced where it lies.
        bucket.packed = len(grads) > 1 or bucket.wire_dtype is not None or not grads[0].is_contiguous()
        buffer = bucket.flat if bucket.packed else grads[0]
        if bucket.packed:
            if self.gradient_as_bucket_view:
                bucket.views = bucket.flat_parts
            bucket.pack(grads)
        if self.predivide != 1.0:
            kernels.scale(buffer, 1.0 / self.predivide)
            op = "sum"
        if bucket.wire is not None:
            kernels.cast(bucket.wire, buffer)
            buffer = bucket.wire
        if self.slots is not None:
            bucket.handle = self.slots.start(index, [buffer], op)
        else:
            bucket.handle = self.comm.allreduce_async(buffer, op=op, algorithm=self.algorithm)

    def wait(self) -> None:
        """Launch what is left, wait for every bucket and write the results into .grad."""
        try:
            while self._next_to_launch < len(self.buckets):
                self._launch(self._next_to_launch)
                self._next_to_launch += 1
            if self._count_handle is None:  # no buckets at all
                self._launch_count()
            for bucket in self.buckets:
                bucket.handle.wait()
                if self.trace is not None:
                    self.trace.append((bucket.handle.started, bucket.handle.finished))
                result = bucket.flat if bucket.packed else bucket.params[0].grad
                if bucket.wire is not None:
                    kernels.cast(result, bucket.wire)
                if self.predivide != 1.0:
                    post = self.predivide / self.comm.size if self.op == "avg" else self.predivide
                    kernels.scale(result, post)
                if bucket.views is not None:  # the result is in them (shared slot or flat buffer)
                    bucket.use_views()
                elif bucket.packed:
                    bucket.unpack([param.grad for param in bucket.params])
            # Waited for last, so that a rank missing from the exchange is reported by bucket.
            self._count_handle.wait()
            self.active_ranks = round(self._count_sum.item())
            if self._contribution:
                self.exchanges_with_gradients += 1
        finally:
            self.reset()

    def check_idle(self) -> None:
        """Refuse to join in the middle of a step."""
        if self.active:
            raise MpidistError("join: the gradients of a step are still being all-reduced on this rank; "
                               "finish the step (optimizer.step() or synchronize()) before joining")

    def shadow(self) -> int:
        """Take part in the next exchange with zero gradients, as a rank that has run out of data
        does (it adds nothing to the sums; an average still divides by every rank). Returns how
        many ranks brought gradients to it: 0 once every rank takes part this way."""
        self.check_idle()
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad = None  # all-reduced as zeros
        self._contribution = 0.0
        try:
            self.wait()
        finally:
            self._contribution = 1.0
        return self.active_ranks

    def reset(self) -> None:
        self._count_handle = None
        for bucket in self.buckets:
            bucket.reset()
        for key in self._passes:
            self._passes[key] = 0
        self._next_to_launch = 0


def trainable_parameters(module_or_params):
    """Parameters that need gradients, each once, in registration order."""
    params = module_or_params.parameters() if isinstance(module_or_params, torch.nn.Module) else module_or_params
    seen, unique = set(), []
    for param in params:
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            unique.append(param)
    return unique


def _ddp_bucket_size(bucket_mb, bucket_cap_mb):
    if bucket_cap_mb is None:
        return bucket_mb
    if bucket_mb != 25 and bucket_mb != bucket_cap_mb:
        raise InvalidArgumentError(f"bucket_mb={bucket_mb} and bucket_cap_mb={bucket_cap_mb} disagree; "
                                   "bucket_cap_mb is DDP's name for bucket_mb, give one of them")
    return bucket_cap_mb


def _check_ddp_devices(module, device_ids, output_device) -> None:
    """DDP's rule: device_ids is None for a CPU module, and [the device] for a module on one GPU."""
    devices = {p.device for p in module.parameters()}
    if device_ids is None:
        if output_device is not None:
            raise InvalidArgumentError("output_device= needs device_ids= (as in DDP)")
        return
    wanted = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in device_ids]
    if len(wanted) != 1 or devices != {wanted[0]}:
        where = sorted(str(d) for d in devices) or ["no parameters"]
        raise InvalidArgumentError(
            f"device_ids={list(device_ids)}: the module's parameters are on {where}; as in DDP, give the one "
            "device of a single-device GPU module, or device_ids=None for a CPU module")
    if output_device is not None:
        out = torch.device("cuda", output_device) if isinstance(output_device, int) else torch.device(output_device)
        if out != wanted[0]:
            raise InvalidArgumentError(f"output_device={output_device} differs from device_ids={list(device_ids)}; "
                                       "the output stays where the module computes it")


class DataParallel(torch.nn.Module):
    """Wrap a module for synchronous data-parallel training over MPI (PyTorch DDP semantics).

    On construction rank 0's parameters and buffers are broadcast. During backward the gradients
    are packed into buckets and each bucket's all-reduce starts in the background as soon as it
    is full, overlapping the rest of backward. When backward returns, every gradient holds the
    average over ranks.

    gradient_as_bucket_view=True (as in DDP): from the first step on, each parameter's .grad is a
    view of its bucket's memory, where the all-reduce leaves the average; the copy back into the
    gradients is saved (and, without compression on one node, the gradients live in the shared
    slots). Like DDP's option, a gradient tensor kept from an earlier step changes when a later
    step's all-reduce runs; zero_grad() with or without set_to_none works, and so do in-place
    changes to .grad (clipping).
    """

    def __init__(self, module: torch.nn.Module, comm=None, bucket_mb: float = 25,
                 compression: str | None = None, algorithm: str = "auto", broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = False, *, device_ids=None, output_device=None,
                 find_unused_parameters: bool = False, static_graph: bool = False, bucket_cap_mb=None,
                 process_group=None):
        # DDP's own arguments, so that `DistributedDataParallel(model, device_ids=[i], ...)` ports by
        # renaming the class: find_unused_parameters and static_graph change nothing here (a
        # parameter without a gradient is always all-reduced as zeros), bucket_cap_mb is bucket_mb.
        bucket_mb = _ddp_bucket_size(bucket_mb, bucket_cap_mb)
        _check_ddp_devices(module, device_ids, output_device)
        if process_group is not None:
            raise InvalidArgumentError("process_group= is torch.distributed's; pass comm= (an mpidist.Communicator, "
                                       "e.g. md.Communicator(mpi4py_subcommunicator)) instead")
        super().__init__()
        self.module = module
        self.comm = comm if comm is not None else init()
        self.broadcast_buffers = broadcast_buffers
        self._sync_enabled = True
        self._in_backward = False
        self._join_options = None  # inside join(): (divide_by_initial_world_size, throw_on_early_termination)
        params = trainable_parameters(module)
        check_not_synchronized(params, "DataParallel")
        broadcast_module_state(module, self.comm)
        # register_comm_hook may make the buckets again, with another compression.
        self._new_buckets = functools.partial(GradientBuckets, params, self.comm, bucket_mb, algorithm=algorithm,
                                              gradient_as_bucket_view=gradient_as_bucket_view)
        self._compression = compression
        self._comm_hook = None
        self.buckets = self._new_buckets(compression=compression)
        register_gradient_hooks(self, "_gradient_ready", params, "DataParallel")

    def register_comm_hook(self, state, hook) -> None:
        """DDP's register_comm_hook for its built-in hooks, which the buckets do themselves:
        allreduce_hook (the default average), fp16_compress_hook and bf16_compress_hook (each
        rank divides its gradients by the rank count, sends them in float16 / bfloat16 and the
        sum comes back in the gradients' dtype, as torch's hooks do). Other hooks take torch's
        GradBucket and futures of a torch.distributed process group: refused. As in DDP, call it
        once, on every rank (it is collective), before the first backward."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        wire = {default_hooks.allreduce_hook: None, default_hooks.fp16_compress_hook: "fp16",
                default_hooks.bf16_compress_hook: "bf16"}
        name = getattr(hook, "__qualname__", repr(hook))
        if hook not in wire:
            raise NotOfferedError(f"register_comm_hook({name}): mpidist runs DDP's allreduce_hook, fp16_compress_hook "
                                  "and bf16_compress_hook; other hooks need torch.distributed's GradBucket futures")
        if state is not None:
            raise InvalidArgumentError("register_comm_hook: state is a torch.distributed process group; pass None "
                                       "(the hook runs on this DataParallel's comm)")
        if self._comm_hook is not None:
            raise MpidistError(f"register_comm_hook can only be called once (already {self._comm_hook})")
        if self.buckets.exchanges_with_gradients or self.buckets.active:
            raise MpidistError("register_comm_hook must be called before the first backward pass, as in DDP")
        if self._compression is not None:
            raise InvalidArgumentError(f"register_comm_hook({name}) with compression={self._compression!r}: "
                                       "choose one")
        self._comm_hook = name
        if wire[hook] is not None:  # the default average needs no new buckets
            self.buckets = None  # the old buckets' shared memory can be given back first
            self.buckets = self._new_buckets(compression=wire[hook], predivide=self.comm.size)

    def forward(self, *args, **kwargs):
        if self.training and self._sync_enabled:
            self._broadcast_buffers()
        return self.module(*args, **kwargs)

    def _broadcast_buffers(self) -> None:
        # Once a rank has joined (its last exchange showed fewer ranks with gradients), the
        # buffers are no longer broadcast: join() ends by giving every rank the last joiner's.
        if self.broadcast_buffers and self.buckets.active_ranks == self.comm.size:
            with torch.no_grad():
                for buffer in self.module.buffers():
                    broadcast_in_place(self.comm, buffer.data)

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Train on uneven inputs (PyTorch DDP's `model.join()`): a rank that leaves this block
        early keeps taking part in the other ranks' gradient exchanges, with zeros, until every
        rank has left it; then every rank gets the parameters and buffers of the rank that
        trained longest (the highest such rank).

        While some ranks have joined, the average divides by the world size
        (`divide_by_initial_world_size=True`, DDP's default) or by the ranks still bringing
        gradients (False), and the buffers are not broadcast. With `throw_on_early_termination`
        every rank raises `MpidistError` as soon as one rank runs out of data. Inside the block,
        each training forward must be followed by its backward, and the ranks still training
        must run no other collective (as in DDP). A join() block costs nothing per step: the
        count of ranks with gradients travels with every exchange (GradientBuckets).
        """
        with Join([self], enable, throw_on_early_termination,
                  divide_by_initial_world_size=divide_by_initial_world_size):
            yield

    def _start_join(self, divide_by_initial_world_size: bool, throw_on_early_termination: bool) -> None:
        if self._join_options is not None:
            raise InvalidArgumentError("DataParallel.join() blocks cannot be nested")
        if any(isinstance(m, SyncBatchNorm) for m in self.module.modules()):
            # Its forward is a collective the joined ranks cannot take part in (as in DDP).
            raise InvalidArgumentError("DataParallel.join() with SyncBatchNorm layers is not possible: their "
                                       "statistics need every rank's forward")
        self._join_options = (bool(divide_by_initial_world_size), bool(throw_on_early_termination))
        self.buckets.exchanges_with_gradients = 0

    def _shadow_step(self) -> int:
        """Take part in the other ranks' next step as a rank without data: the buffer broadcast
        of their forward (while every rank was active) and their gradient exchange. Returns how
        many ranks brought gradients to it."""
        self._broadcast_buffers()
        return self.buckets.shadow()

    def _finish_join(self) -> None:
        """Once every rank has joined: everyone takes the model of the rank that took part in
        the most exchanges with gradients."""
        last = last_joiner(self.comm, self.buckets.exchanges_with_gradients)
        broadcast_module_state(self.module, self.comm, root=last)

    def _end_join(self) -> None:
        self._join_options = None
        self.buckets.active_ranks = self.comm.size

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally inside this block; the next synchronized backward
        all-reduces the accumulated sum."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _gradient_ready(self, param):
        if not self._sync_enabled:
            return
        if not self._in_backward:
            # Runs once autograd has finished this backward pass: wait for the buckets there,
            # so the gradients are averaged when backward() returns.
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self.buckets.gradient_ready(param)

    def _finish_backward(self):
        try:
            self.buckets.wait()
        finally:
            self._in_backward = False
        active, size = self.buckets.active_ranks, self.comm.size
        if active < size and self._join_options is not None:
            divide_by_initial_world_size, throw = self._join_options
            if throw:
                raise MpidistError(f"{size - active} rank(s) ran out of inputs "
                                   "(throw_on_early_termination=True)")
            if not divide_by_initial_world_size:  # average over the ranks that brought gradients
                with torch.no_grad():
                    for bucket in self.buckets.buckets:
                        for param in bucket.params:
                            param.grad.mul_(size / active)


class Join:
    """PyTorch's `torch.distributed.algorithms.Join` for DataParallel models: `with
    md.Join([model_a, model_b]):` trains several models on uneven inputs, as each model's own
    join() does for one. A rank that leaves the block early shadows the others' steps of every
    model, in the order given (the order the training loop runs them), until every rank has left
    it. Keyword arguments (divide_by_initial_world_size) go to each model."""

    def __init__(self, joinables, enable: bool = True, throw_on_early_termination: bool = False, **kwargs):
        joinables = list(joinables)
        if not joinables or not all(isinstance(j, DataParallel) for j in joinables):
            raise InvalidArgumentError(f"Join takes a non-empty list of mpidist.DataParallel models, got "
                                       f"{[type(j).__name__ for j in joinables]}")
        unknown = set(kwargs) - {"divide_by_initial_world_size"}
        if unknown:
            raise InvalidArgumentError(f"Join got unknown keyword arguments {sorted(unknown)}")
        self.joinables = joinables
        self.enable = bool(enable)
        self.throw = bool(throw_on_early_termination)
        self.divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))

    def __enter__(self):
        if self.enable:
            started = []
            try:
                for joinable in self.joinables:
                    joinable._start_join(self.divide_by_initial_world_size, self.throw)
                    started.append(joinable)
            except BaseException:
                for joinable in started:
                    joinable._end_join()
                raise
        return self

    def __exit__(self, exc_type, exc, traceback):
        if not self.enable:
            return False
        try:
            if exc_type is None:
                self._join_the_others()
        finally:
            for joinable in self.joinables:
                joinable._end_join()
        return False

    def _join_the_others(self) -> None:
        while True:
            active = [joinable._shadow_step() for joinable in self.joinables]
            if not any(active):
                break
            if self.throw:
                raise MpidistError(f"rank {self.joinables[0].comm.rank} ran out of inputs before the others "
                                   "(throw_on_early_termination=True)")
        for joinable in self.joinables:
            joinable._finish_join()


def last_joiner(comm, exchanges_with_gradients: int) -> int:
    """The rank that brought gradients to the most exchanges (the highest of several): the one
    that ran out of data last. Collective."""
    key = np.array([exchanges_with_gradients * comm.size + comm.rank], dtype=np.int64)
    comm.allreduce(key, op="max")
    return int(key[0] % comm.size)


class ParameterAveraging:
    """Hard-synchronous model averaging: call step() after each optimizer step; every `every`
    calls the parameters are averaged over ranks (one packed all-reduce)."""

    def __init__(self, module: torch.nn.Module, every: int = 1, comm=None, algorithm: str = "auto"):
        if every < 1:
            raise InvalidArgumentError(f"every must be >= 1, got {every}")
        self.module = module
        self.every = every
        self.comm = comm if comm is not None else init()
        self.algorithm = algorithm
        self.steps = 0
        params = list(module.parameters())
        if not params:
            raise InvalidArgumentError("ParameterAveraging: the module has no parameters to average")
        broadcast_module_state(module, self.comm)
        self._groups = []
        for members in tensors_by_kind(params):
            flat = torch.empty(sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device)
            self._groups.append((members, flat, shaped_like(members, flat)))

    def step(self) -> bool:
        """Count a local step; returns True when this step averaged the parameters."""
        self.steps += 1
        if self.steps % self.every:
            return False
        with torch.no_grad():
            for members, flat, parts in self._groups:
                pack_tensors(flat, parts, [p.data for p in members])
                self.comm.allreduce(flat, op="avg", algorithm=self.algorithm)
                unpack_tensors(flat, parts, [p.data for p in members])
        return True
