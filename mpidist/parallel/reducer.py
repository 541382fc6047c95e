"""The reducer under every synchronous training mode: gradient buckets filled in backward's order
and all-reduced as each fills (GradientBuckets, as PyTorch DDP's reducer), and the gradient hooks
that feed them, with the registry that keeps two reducers off the same parameters.
"""
from __future__ import annotations

import contextlib
import gc
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import kernels
from ..collectives.callcheck import check_algorithm
from ..collectives.node_buckets import NodeSlots
from ..errors import InvalidArgumentError, MpidistError
from ..memory import keep_freed_memory
from ..runtime import tracing
from ..runtime.mpi import fault_tolerant
from .compressors import CAST_DTYPES, resolve_compression
from .flat import pack_tensors, shaped_like, tensor_at, tensors_by_kind, unpack_tensors

FIRST_BUCKET_BYTES = 1024 * 1024
# Largest bucket exchanged through the shared slots on one node. There no message cost is saved
# by bigger buckets, and a smaller one starts its exchange earlier in backward, while the
# gradients it copies are still in cache: 4 MB buckets were faster than 25 MB in every run of
# benchmarks/results/training-cpu.md (runs G-M).
SHARED_SLOTS_BUCKET_BYTES = 4 * 1024 * 1024
COMPRESSION_DTYPES = {None: None, "none": None, **CAST_DTYPES}  # the casts' names and dtypes


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
        self.compressor = None  # the BucketExchange of a compression that exchanges its buckets itself

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
    check_not_synchronized's error. Returns the finalizer, which removes the hooks at once when
    called."""
    reference = weakref.ref(owner)

    def hook(param):
        alive = reference()
        if alive is not None:
            getattr(alive, method)(param)

    handles = [param.register_post_accumulate_grad_hook(hook) for param in params]
    for param in params:
        _SYNCHRONIZED_BY[param] = (what, reference)
    return weakref.finalize(owner, remove_hooks, handles)


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
    caller's thread (collectives/node_buckets.py); otherwise each bucket is handed to the
    communicator's asynchronous engine. `trace`, when set to a list, receives (start, finish)
    perf_counter times of each bucket's all-reduce. Each bucket's wait is an event in a torch
    profiler's trace, and each all-reduce, from its launch to its completion, a span on the
    timeline (runtime/tracing.py), on the row `timeline_rows[index]` ("gradient bucket <index>"
    unless the owner names them).

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

    `compression` is None, a spelling or a Compressor (compressors.py): a cast sends each bucket
    in float16 / bfloat16; the others give each bucket a compressor of its own, which keeps its
    error feedback (compression_state_dict) and exchanges it through the communicator's engine.
    """

    def __init__(self, params, comm, bucket_mb=25, compression=None, algorithm="auto", op="avg",
                 predivide=1.0, passes_per_step=1, gradient_as_bucket_view=False, groups=()):
        compressor = resolve_compression(compression)
        compressor.check(params)
        if bucket_mb <= 0:
            raise InvalidArgumentError(f"bucket_mb must be positive, got {bucket_mb}")
        if passes_per_step < 1:
            raise InvalidArgumentError(f"backward passes per step must be >= 1, got {passes_per_step}")
        check_algorithm(algorithm)
        self.comm = comm
        self.algorithm = algorithm
        self.op = op
        self.predivide = float(predivide)
        self.passes_per_step = passes_per_step
        # id(param) -> (param, sparse_dim): the gradients backward made sparse since the owner last
        # took them (the DistributedOptimizer hands them back sparse, as Horovod does).
        self.sparse_gradients = {}
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        if any(p.device.type == "cpu" for p in params):
            # Each step frees and reallocates the gradients: reuse the memory rather than fault
            # it in afresh every step (mpidist/memory.py).
            keep_freed_memory()
        self.compressor = compressor
        polled = self._polled(params)
        limit = int(bucket_mb * 1024 * 1024)
        if polled:
            limit = min(limit, SHARED_SLOTS_BUCKET_BYTES)
        self.buckets = self._make_buckets(params, limit, compressor.wire_dtype, groups)
        for bucket in self.buckets:
            bucket.compressor = compressor.bucket_exchange(bucket.params, comm, algorithm)
        self._bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self._passes = {id(p): 0 for bucket in self.buckets for p in bucket.params}
        self._next_to_launch = 0
        self._active_ranks = comm.size
        self._exchanges_with_gradients = 0
        self._contribution = 1.0  # 0.0 while shadow() takes part without gradients
        self._count = torch.ones(1, dtype=torch.float32)  # this rank's contribution, summed in place
        self._count_sum = self._count
        self._count_handle = None
        # Called with these buckets before each exchange this rank brings gradients to. A plain
        # function, not a bound method: buckets must not keep themselves alive (gradient hooks of a
        # dropped optimizer stop when its buckets are freed).
        self.before_exchange = None
        self.slots = self._node_slots() if polled else None
        self.trace = None
        self.timeline_rows = None
        self.reset()

    def _node_slots(self):
        """The buckets' and the count's slots in a shared window (with the results kept there when
        the gradients are views of them)."""
        # A compressed or predivided bucket goes through its flat buffer instead (its views are there).
        in_slots = self.gradient_as_bucket_view and self.predivide == 1.0 and all(b.wire is None for b in self.buckets)
        sizes = [b.nbytes for b in self.buckets] + [self._count.element_size()]
        slots = NodeSlots(self.comm.node_comm, sizes, results_in_slots=in_slots)
        if in_slots:
            for index, bucket in enumerate(self.buckets):
                numel = sum(p.numel() for p in bucket.params)
                slot = tensor_at(slots.address(index), numel, bucket.params[0].dtype, owner=slots)
                bucket.views = shaped_like(bucket.params, slot)
            # The count's sum stays in its slot too.
            self._count_sum = tensor_at(slots.address(len(self.buckets)), 1, torch.float32, owner=slots)
        return slots

    def _polled(self, params) -> bool:
        """Whether the buckets are all-reduced through shared slots polled from the hooks."""
        comm = self.comm
        return (comm.size > 1 and comm.local_size == comm.size and self.algorithm in ("auto", "hierarchical")
                and not fault_tolerant()  # no shared-memory windows then (runtime/mpi.py)
                and comm.forced_algorithm in (None, "hierarchical")
                # a compressor that exchanges its buckets itself does so with collectives of its own
                and self.compressor.bucket_exchange_class is None
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
    def active_ranks(self) -> int:
        """How many ranks brought gradients to the last exchange."""
        return self._active_ranks

    @property
    def exchanges_with_gradients(self) -> int:
        """How many exchanges this rank brought gradients to (see restart_exchange_count)."""
        return self._exchanges_with_gradients

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
                self.sparse_gradients[id(param)] = (param, param.grad.sparse_dim())
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
        bucket.packed = (len(grads) > 1 or bucket.wire_dtype is not None or bucket.compressor is not None
                         or not grads[0].is_contiguous())
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
        if bucket.compressor is not None:
            bucket.handle = bucket.compressor.start(buffer, op)
        elif self.slots is not None:
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
            recording = tracing.recording()
            for index, bucket in enumerate(self.buckets):
                with tracing.span(f"mpidist.gradient_bucket.{index}", "ALLREDUCE", on_timeline=False) \
                        if recording else contextlib.nullcontext():
                    bucket.handle.wait()
                if self.trace is not None:
                    self.trace.append((bucket.handle.started, bucket.handle.finished))
                timeline = tracing.current()
                if timeline is not None:
                    row = self.timeline_rows[index] if self.timeline_rows else f"gradient bucket {index}"
                    timeline.span(row, "ALLREDUCE", bucket.handle.started, bucket.handle.finished)
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
            self._active_ranks = round(self._count_sum.item())
            if self._contribution:
                self._exchanges_with_gradients += 1
        finally:
            self.reset()

    def compression_state_dict(self) -> dict:
        """This rank's error-feedback state (compressors.py), "bucket<index>.<name>" -> tensor;
        empty without such a compression. Ranks differ: each keeps its own."""
        return {f"bucket{index}.{name}": value for index, bucket in enumerate(self.buckets)
                if bucket.compressor is not None for name, value in bucket.compressor.state_dict().items()}

    def load_compression_state_dict(self, state: dict) -> None:
        """Restore what compression_state_dict gave (on the same rank of the same layout)."""
        expected = self.compression_state_dict()
        if set(state) != set(expected):
            missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            raise InvalidArgumentError(f"compression state for {self.compressor}: missing {missing[:3]}, "
                                       f"unexpected {unexpected[:3]} (another compression or bucket layout?)")
        for index, bucket in enumerate(self.buckets):
            if bucket.compressor is not None:
                prefix = f"bucket{index}."
                bucket.compressor.load_state_dict({name[len(prefix):]: value for name, value in state.items()
                                                   if name.startswith(prefix)})

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

    def restart_exchange_count(self) -> int:
        """How many exchanges this rank brought gradients to since the count last restarted (at
        construction, or by the join that last called this), and restart it from 0: a join counts
        the exchanges of its own round."""
        exchanges, self._exchanges_with_gradients = self._exchanges_with_gradients, 0
        return exchanges

    def end_join(self) -> None:
        """Every rank has left the join: count all of them as bringing gradients again, until an
        exchange shows otherwise."""
        self._active_ranks = self.comm.size

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
