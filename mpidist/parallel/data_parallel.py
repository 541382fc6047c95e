"""DataParallel: synchronous data parallelism with PyTorch DDP's semantics, a facade over the
reducer (reducer.py: gradient buckets overlapped with backward), with DDP's join() for uneven
inputs (uneven_inputs.py) and its built-in communication hooks.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from ..comm import init
from ..errors import InvalidArgumentError, MpidistError, NotOfferedError
from .compressors import PowerSGD, resolve_compression
from .model_state import broadcast_coalesced, broadcast_module_state
from .reducer import GradientBuckets, check_not_synchronized, register_gradient_hooks, trainable_parameters
from .sync_batchnorm import SyncBatchNorm
from .uneven_inputs import Join, Joinable, last_joiner


def _ddp_bucket_size(bucket_mb, bucket_cap_mb):
    if bucket_cap_mb is None:
        return bucket_mb
    if bucket_mb != 25 and bucket_mb != bucket_cap_mb:
        raise InvalidArgumentError(f"bucket_mb={bucket_mb} and bucket_cap_mb={bucket_cap_mb} disagree; "
                                   "bucket_cap_mb is DDP's name for bucket_mb, give one of them")
    return bucket_cap_mb


def _powersgd_of(state):
    """The compressors.PowerSGD of torch's PowerSGDState: its settings mean the same."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
    if not isinstance(state, PowerSGDState):
        raise InvalidArgumentError(f"register_comm_hook(powerSGD_hook) takes a PowerSGDState, not {type(state).__name__}")
    if state.process_group is not None:
        raise InvalidArgumentError("register_comm_hook(powerSGD_hook): give PowerSGDState(process_group=None) (the "
                                   "hook runs on this DataParallel's comm), or compression="
                                   f"\"powersgd:{state.matrix_approximation_rank}\" to DataParallel")
    return PowerSGD(rank=state.matrix_approximation_rank, start_iter=state.start_powerSGD_iter,
                    min_compression_rate=state.min_compression_rate, error_feedback=state.use_error_feedback,
                    warm_start=state.warm_start, epsilon=state.orthogonalization_epsilon,
                    # torch draws its first Q's seed from the state's generator too
                    seed=int(state.rng.randint(1_000_000_000)))


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


class DataParallel(torch.nn.Module, Joinable):
    """Wrap a module for synchronous data-parallel training over MPI (PyTorch DDP semantics).

    On construction rank 0's parameters and buffers are broadcast, and in training mode its
    buffers again before each forward (broadcast_buffers, coalesced). During backward the gradients
    are packed into buckets and each bucket's all-reduce starts in the background as soon as it
    is full, overlapping the rest of backward. When backward returns, every gradient holds the
    average over ranks.

    gradient_as_bucket_view=True (as in DDP): from the first step on, each parameter's .grad is a
    view of its bucket's memory, where the all-reduce leaves the average; the copy back into the
    gradients is saved (and, without compression on one node, the gradients live in the shared
    slots). Like DDP's option, a gradient tensor kept from an earlier step changes when a later
    step's all-reduce runs; zero_grad() with or without set_to_none works, and so do in-place
    changes to .grad (clipping).

    compression: None, "fp16", "bf16", "int8", "powersgd:<rank>", "topk:<fraction>" or a
    compressor object (mpidist.parallel.compressors: PowerSGD, Int8, TopK, Cast). The casts send
    the gradients in half precision; the others keep each rank's error feedback, which
    compression_state_dict() gives for a checkpoint (each rank its own) and
    load_compression_state_dict() restores.
    """

    def __init__(self, module: torch.nn.Module, comm=None, bucket_mb: float = 25,
                 compression=None, algorithm: str = "auto", broadcast_buffers: bool = True,
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
        # register_comm_hook and reconnect make the buckets again (another compression, another
        # communicator).
        self._bucket_options = functools.partial(GradientBuckets, params, bucket_mb=bucket_mb, algorithm=algorithm,
                                                 gradient_as_bucket_view=gradient_as_bucket_view)
        resolve_compression(compression)  # a bad spelling is refused before any exchange
        self._compression = compression
        self._comm_hook = None
        self._hook_compression = None
        self.buckets = self._new_buckets(compression=compression)
        register_gradient_hooks(self, "_gradient_ready", params, "DataParallel")

    def register_comm_hook(self, state, hook) -> None:
        """DDP's register_comm_hook for its built-in hooks, which the buckets do themselves:
        allreduce_hook (the default average), fp16_compress_hook and bf16_compress_hook (each
        rank divides its gradients by the rank count, sends them in float16 / bfloat16 and the
        sum comes back in the gradients' dtype, as torch's hooks do), and powerSGD_hook with its
        PowerSGDState, whose settings become a compressors.PowerSGD (as compression= gives it).
        batched_powerSGD_hook is refused, naming compression="powersgd:<rank>"; other hooks
        (your own) take torch's GradBucket and futures of a torch.distributed process group:
        refused, naming where they run, torch's DistributedDataParallel over the "mpidist"
        backend. As in DDP, call it once, on every rank (it is collective), before the first
        backward."""
        # imported here: torch.distributed is needed only by this call, and is slow to import
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        wire = {default_hooks.allreduce_hook: None, default_hooks.fp16_compress_hook: "fp16",
                default_hooks.bf16_compress_hook: "bf16"}
        name = getattr(hook, "__qualname__", repr(hook))
        if hook is powerSGD_hook.batched_powerSGD_hook:
            raise NotOfferedError(
                f"register_comm_hook({name}): md.DataParallel runs PowerSGD layer by layer, as powerSGD_hook does "
                "(torch recommends it over the batched form): pass powerSGD_hook, or "
                f"compression=\"powersgd:{getattr(state, 'matrix_approximation_rank', 1)}\"")
        if hook is powerSGD_hook.powerSGD_hook:
            compression = _powersgd_of(state)
        elif hook in wire:
            if state is not None:
                raise InvalidArgumentError("register_comm_hook: state is a torch.distributed process group; pass "
                                           "None (the hook runs on this DataParallel's comm)")
            compression = wire[hook]
        else:
            raise NotOfferedError(
                f"register_comm_hook({name}): md.DataParallel runs DDP's allreduce_hook, fp16_compress_hook, "
                "bf16_compress_hook and powerSGD_hook itself; other hooks (your own) work on torch's GradBucket and "
                "futures: use torch.nn.parallel.DistributedDataParallel over the mpidist backend "
                "(dist.init_process_group(\"mpidist\")), where every comm hook runs (docs/data-parallel.md)")
        if self._comm_hook is not None:
            raise MpidistError(f"register_comm_hook can only be called once (already {self._comm_hook})")
        if self.buckets.exchanges_with_gradients or self.buckets.active:
            raise MpidistError("register_comm_hook must be called before the first backward pass, as in DDP")
        if self._compression is not None:
            raise InvalidArgumentError(f"register_comm_hook({name}) with compression={self._compression!r}: "
                                       "choose one")
        self._comm_hook = name
        self._hook_compression = compression
        if compression is not None:  # the default average needs no new buckets
            self.buckets = None  # the old buckets' shared memory can be given back first
            self.buckets = self._new_buckets()

    def _new_buckets(self, compression=None):
        if isinstance(self._hook_compression, PowerSGD):
            return self._bucket_options(self.comm, compression=self._hook_compression)
        if self._hook_compression is not None:  # a compress hook: each rank divides by the rank count first
            return self._bucket_options(self.comm, compression=self._hook_compression, predivide=self.comm.size)
        return self._bucket_options(self.comm, compression=compression)

    def compression_state_dict(self) -> dict:
        """This rank's error-feedback state of the compression (name -> tensor; empty without
        one): its residuals, PowerSGD's warm-start Q and random generator, its step count.
        Each rank keeps its own, so each checkpoints its own."""
        return self.buckets.compression_state_dict()

    def load_compression_state_dict(self, state: dict) -> None:
        """Restore this rank's compression_state_dict() (same compression, same model)."""
        self.buckets.load_compression_state_dict(state)

    def reconnect(self, comm) -> None:
        """Go on on `comm`, the survivors' communicator after a rank died (md.elastic.run does
        this): new gradient buckets on it; the old ones, on a communicator that lost a rank, are
        dropped unfreed. Collective over `comm`; the parameters are left as they are (the elastic
        state restores and synchronizes them)."""
        self.buckets = None
        self.comm = comm
        self.buckets = self._new_buckets(compression=self._compression)

    def forward(self, *args, **kwargs):
        if self.training and self._sync_enabled:
            self._broadcast_buffers()
        return self.module(*args, **kwargs)

    def _broadcast_buffers(self) -> None:
        # Once a rank has joined (its last exchange showed fewer ranks with gradients), the
        # buffers are no longer broadcast: join() ends by giving every rank the last joiner's.
        if self.broadcast_buffers and self.buckets.active_ranks == self.comm.size:
            with torch.no_grad():
                broadcast_coalesced(self.comm, [buffer.data for buffer in self.module.buffers()])

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
        self.buckets.restart_exchange_count()

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
        self.buckets.end_join()

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
