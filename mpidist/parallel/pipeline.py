"""Layer-wise model parallelism: a torch.nn.Sequential cut into stages, one stage per rank, fed
with micro-batches (GPipe's pipeline; the 1F1B schedule of PipeDream-Flush).

Rank s runs layers [start_s, end_s) of the model. A training step splits the batch into
micro-batches; each stage receives a micro-batch's activation from the previous rank, runs its
layers and sends the result on; the last stage computes the loss. Backward runs the other way:
each stage receives the gradient of its output, back-propagates through its layers (its
parameters accumulate their gradients) and sends the gradient of its input back.

Schedules (the same gradients, bit for bit; they differ in how many micro-batches' activations
a stage keeps alive and how long ranks sit idle):
- "gpipe": every micro-batch forward, then every micro-batch backward. A stage holds the
  activations of all micro-batches.
- "1f1b": stage s runs (stages - s - 1) forwards ahead, then alternates one forward and one
  backward, then finishes the backwards. A stage holds at most (stages - s) micro-batches'
  activations, whatever the number of micro-batches.

Messages are typed buffers on a communicator of their own (runtime/wire.py: a small header with
the dtype and shape, then the tensor), never pickled. Sends are non-blocking and every wait ends
after MPIDIST_TIMEOUT seconds with a DeadlineError naming the stage that went silent, so a rank
that stops does not leave the others hanging forever.
"""
from __future__ import annotations

import numpy as np
import torch

from ..comm import Communicator, init
from ..errors import InvalidArgumentError, MismatchError
from ..runtime import wire
from ..runtime.deadlines import wait_for_collective
from .model_state import broadcast_module_state
from .reducer import GradientBuckets, check_not_synchronized, register_gradient_hooks, trainable_parameters

SCHEDULES = ("gpipe", "1f1b")
# Tags of micro-batch i: 4i + FORWARD_HEADER (the activation's message: header, then its data
# with the next tag) and 4i + BACKWARD_HEADER (the gradient's message).
FORWARD_HEADER, BACKWARD_HEADER = 0, 2


def split_layers(layers: int, stages: int, balance=None) -> list:
    """[start, end) of each stage's layers: `balance` gives the layer counts; without it the
    layers are shared out evenly, the first (layers % stages) stages taking one more."""
    if balance is None:
        if layers < stages:
            raise InvalidArgumentError(f"a pipeline of {stages} stages needs at least {stages} layers; the model has "
                                       f"{layers} (use fewer ranks, or a model with more layers)")
        balance = [layers // stages + (s < layers % stages) for s in range(stages)]
    balance = [int(b) for b in balance]
    if len(balance) != stages or any(b < 1 for b in balance) or sum(balance) != layers:
        raise InvalidArgumentError(f"balance={balance} must give one layer count >= 1 per stage ({stages} ranks) "
                                   f"summing to the model's {layers} layers")
    bounds = np.cumsum([0] + balance).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def check_sendable(tensor, stage: int) -> None:
    """Refuse, naming the stage, a tensor that no message can carry."""
    if str(tensor.dtype).removeprefix("torch.") not in wire.ITEMSIZE or tensor.dim() > wire.MAX_DIMS:
        raise InvalidArgumentError(f"stage {stage} produced a {tensor.dtype} tensor of {tensor.dim()} "
                                   "dimensions, which cannot be sent between stages")


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list:
    """The 1F1B order of ("forward" | "backward", micro-batch) for one stage."""
    ahead = min(stages - stage - 1, micro_batches)
    order = [("forward", i) for i in range(ahead)]
    for i in range(ahead, micro_batches):
        order += [("forward", i), ("backward", i - ahead)]
    order += [("backward", i) for i in range(micro_batches - ahead, micro_batches)]
    return order


def gpipe(micro_batches: int) -> list:
    return [("forward", i) for i in range(micro_batches)] + [("backward", i) for i in range(micro_batches)]


class Pipeline(torch.nn.Module):
    """A torch.nn.Sequential trained as a pipeline of stages, one per rank of `comm`, or with
    `replicas=k` as k pipelines side by side that average their gradients (pipeline x data
    parallelism).

    Every rank builds the same model (all of it: each keeps its stage's layers, `self.stage`);
    `parameters()` are the stage's, for this rank's optimizer. `balance` gives the number of
    layers per stage (default: as even as possible). `loss_fn(output, target)` must return the
    mean loss of the samples it is given (torch's losses do by default): train_step() weights
    each micro-batch's loss by its share of the batch, so the gradients are those of the whole
    batch's mean loss.

    With replicas, consecutive ranks form one pipeline (`comm.size // replicas` stages; rank
    r is stage r % stages of replica r // stages), each replica trains on its own batches, and
    each stage's gradients are averaged with the same stage's in the other replicas through
    gradient buckets (as DataParallel's), launched as the last micro-batch's backward produces
    each gradient. At construction each stage's parameters and buffers are broadcast from
    replica 0, so every replica starts from the same weights.
    """

    def __init__(self, model: torch.nn.Sequential, loss_fn, comm=None, chunks: int = 4, balance=None,
                 schedule: str = "1f1b", replicas: int = 1):
        if not isinstance(model, torch.nn.Sequential):
            raise InvalidArgumentError(f"Pipeline takes a torch.nn.Sequential (its layers are cut into stages); "
                                       f"got {type(model).__name__}")
        if schedule not in SCHEDULES:
            raise InvalidArgumentError(f"schedule={schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if not isinstance(chunks, int) or chunks < 1:
            raise InvalidArgumentError(f"chunks (micro-batches per step) must be a positive integer, got {chunks!r}")
        super().__init__()
        self.comm = comm if comm is not None else init()
        if not isinstance(replicas, int) or replicas < 1 or self.comm.size % replicas:
            raise InvalidArgumentError(f"replicas={replicas!r} must be a positive integer that divides the "
                                       f"{self.comm.size} ranks (each replica is a pipeline of equally many stages)")
        self.replicas = replicas
        self.stages = self.comm.size // replicas
        self.replica, self.index = divmod(self.comm.rank, self.stages)
        self.bounds = split_layers(len(model), self.stages, balance)
        start, end = self.bounds[self.index]
        self.stage = model[start:end]
        self.loss_fn = loss_fn
        self.chunks = chunks
        self.schedule = schedule
        self.first = self.index == 0
        self.last = self.index == self.stages - 1
        # The replica's stages: point-to-point traffic of their own, apart from collectives.
        self.mpi = self.comm.mpi.Split(self.replica, self.index)
        self.same_stage = None  # with replicas: this stage in every replica
        self.gradients = None  # and its gradient buckets
        if replicas > 1:
            params = trainable_parameters(self.stage)
            check_not_synchronized(params, "Pipeline")
            split = self.comm.mpi.Split(self.index, self.replica)
            self.same_stage = Communicator(split)  # a duplicate of it
            split.Free()
            broadcast_module_state(self.stage, self.same_stage)  # every replica starts from replica 0's
            if params:
                # A gradient is complete once every micro-batch's backward has added to it.
                self.gradients = GradientBuckets(params, self.same_stage, passes_per_step=chunks)
                register_gradient_hooks(self.gradients, "gradient_ready", params, "Pipeline")

    def forward(self, inputs=None):
        """Run `inputs` (needed on the first stage; ignored elsewhere) through every stage in
        one piece; returns the model's output on every rank."""
        self._agree(inputs, None, need_targets=False)
        with torch.no_grad():
            x = inputs if self.first else self._receive(0, FORWARD_HEADER, self.index - 1)
            y = self.stage(x)
            if not self.last:
                self._wait_all([self._send(y, self.index + 1, 0, FORWARD_HEADER)])
        return self._from_last(y if self.last else None)

    def train_step(self, inputs=None, targets=None) -> float:
        """Forward and backward of one batch in micro-batches: `inputs` on the first stage,
        `targets` on the last (each may be None on the other ranks). The stage's parameters
        accumulate the gradients of the batch's mean loss, as loss.backward() would. Returns that
        loss on every rank."""
        batch = self._agree(inputs, targets, need_targets=True)
        sizes = [len(part) for part in np.array_split(np.arange(batch), self.chunks)]
        if self.first:
            micro_inputs = torch.split(inputs, sizes)
        if self.last:
            micro_targets = torch.split(targets, sizes)
        order = one_f_one_b(self.index, self.stages, self.chunks) if self.schedule == "1f1b" else gpipe(self.chunks)
        received, outputs, sends = {}, {}, []
        # On the stage's device: adding a CUDA loss into a CPU tensor is an error in torch.
        loss = torch.zeros((), dtype=torch.float64, device=self._device())
        for kind, i in order:
            if kind == "forward":
                x = micro_inputs[i] if self.first else self._receive(i, FORWARD_HEADER, self.index - 1)
                if not self.first and x.is_floating_point():
                    x.requires_grad_()
                received[i] = x
                y = self.stage(x)
                if self.last:
                    y = self.loss_fn(y, micro_targets[i]) * (sizes[i] / batch)
                    loss += y.detach().double()
                else:
                    sends.append(self._send(y.detach(), self.index + 1, i, FORWARD_HEADER))
                outputs[i] = y
            else:
                x, y = received.pop(i), outputs.pop(i)
                if self.last:
                    y.backward()
                elif y.is_floating_point():  # the next stage sends back a gradient of floats only
                    grad = self._receive(i, BACKWARD_HEADER, self.index + 1)
                    if y.requires_grad:
                        torch.autograd.backward(y, grad)
                if not self.first and x.is_floating_point():
                    grad_x = x.grad if x.grad is not None else torch.zeros_like(x)
                    sends.append(self._send(grad_x, self.index - 1, i, BACKWARD_HEADER))
        self._wait_all(sends)
        if self.gradients is not None:
            self.gradients.wait()  # the stage's gradients, averaged over the replicas
        return float(self._from_last(loss if self.last else None))

    def free(self) -> None:
        """Release the pipeline's communicators and, with replicas, its buckets' shared memory
        (collective over its ranks; optional: MPI_Finalize releases them too). The pipeline
        cannot run afterwards."""
        if self.mpi is None:
            return
        self.mpi.Free()
        self.mpi = None
        if self.gradients is not None:
            if self.gradients.slots is not None:
                self.gradients.slots.free()
            self.gradients = None  # its gradient hooks go with it
        if self.same_stage is not None:
            self.same_stage.free()
            self.same_stage = None

    # ---- agreement and messages ------------------------------------------------------------

    def _agree(self, inputs, targets, need_targets: bool):
        """Every rank learns the batch size from the first stage and checks the last stage's
        targets against it, so bad input raises the same error on every rank before any
        micro-batch moves."""
        if self.mpi is None:
            raise InvalidArgumentError("this Pipeline was freed (Pipeline.free()); build a new one")
        mine = np.array([-1, -1], dtype=np.int64)  # first stage: batch size; last: targets' size
        if self.first:
            mine[0] = len(inputs) if isinstance(inputs, torch.Tensor) and inputs.dim() > 0 else -2
        if self.last and need_targets:
            mine[1] = len(targets) if isinstance(targets, torch.Tensor) and targets.dim() > 0 else -2
        table = np.empty((self.stages, 2), dtype=np.int64)
        wait_for_collective(self.mpi.Iallgather(mine, table), self.mpi, "pipeline's agreement on the batch size")
        batch, target_rows = int(table[0, 0]), int(table[-1, 1])
        first_rank = self.replica * self.stages
        if batch == -2:
            raise InvalidArgumentError(f"the first stage (rank {first_rank}) was given no input tensor with a batch "
                                       "dimension")
        if need_targets and target_rows == -2:
            raise InvalidArgumentError(f"the last stage (rank {first_rank + self.stages - 1}) was given no target "
                                       "tensor with a batch dimension")
        if need_targets and target_rows != batch:
            raise MismatchError(f"the first stage's inputs hold {batch} samples but the last stage's targets "
                                f"{target_rows}")
        if need_targets and batch < self.chunks:
            raise InvalidArgumentError(f"a batch of {batch} samples cannot be cut into chunks={self.chunks} "
                                       "micro-batches; use a larger batch or fewer chunks")
        return batch

    def _stage(self, index: int) -> str:
        """Stage `index` of this replica, with its rank in the communicator the user gave."""
        return f"stage {index} (rank {self.replica * self.stages + index})"

    def _send(self, tensor, dest: int, micro_batch: int, header_tag: int) -> wire.Outgoing:
        """Start sending `tensor` to stage `dest`; returns what must be waited for."""
        check_sendable(tensor, self.index)
        return wire.send(self.mpi, tensor, dest, tag=4 * micro_batch + header_tag)

    def _receive(self, micro_batch: int, header_tag: int, source: int) -> torch.Tensor:
        tensor, _ = wire.receive(self.mpi, source, 4 * micro_batch + header_tag, self._stage(self.index),
                                 f"the pipeline receive from stage {source}", self._stage(source))
        return tensor.to(self._device())

    def _wait_all(self, sends) -> None:
        for outgoing in sends:
            outgoing.wait(self._stage(self.index), f"the pipeline send to stage {outgoing.dest}",
                          self._stage(outgoing.dest))

    def _from_last(self, tensor):
        """The last stage's tensor on every rank."""
        if self.last:
            check_sendable(tensor, self.index)
        root = self.stages - 1
        tensor = wire.broadcast(self.mpi, tensor, root, self._stage(self.index), "the broadcast of the pipeline's "
                                "result", self._stage(root) if not self.last else "the other stages")
        return tensor.to(self._device())

    def _device(self):
        for param in self.stage.parameters():
            return param.device
        return torch.device("cpu")
