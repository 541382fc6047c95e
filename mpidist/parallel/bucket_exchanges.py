"""The compressed exchanges of the reducer's gradient buckets, one class per compressor that
exchanges its buckets itself (compressors.py gives each bucket its own: Compressor.bucket_exchange):
PowerSGD's two all-reduces of factors, int8's all-to-all of parts and allgather of sums, top-k's
allgather of (index, value) pairs; each with this rank's error-feedback state of the bucket.
The casts and no compression need none: the reducer's own all-reduce carries their buckets. How
each exchange works in full: compressors.py's docstring and docs/compression.md.
"""
from __future__ import annotations

import math
import time

import torch

from ..collectives.common import split_counts
from ..errors import InvalidArgumentError
from . import topk_codec
from .int8_parts import Int8Parts

REDUCE_OPS = ("sum", "avg")


class Exchange:
    """A bucket's exchange under way: wait() finishes it (once). `started` and `finished` are
    perf_counter times, as the reducer's trace and timeline read from a collective's handle."""

    def __init__(self, finish):
        self._finish = finish
        self.started = time.perf_counter()
        self.finished = None

    def wait(self):
        if self.finished is None:
            self._finish()
            self.finished = time.perf_counter()


class BucketExchange:
    """One bucket's compressed exchange and its error-feedback state, on this rank: start(flat, op)
    compresses the bucket's flat gradient and launches the exchange; the returned Exchange's wait()
    finishes it and leaves the reduced gradient in `flat`."""

    def __init__(self, settings, params, comm, algorithm):
        self.settings = settings
        self.comm = comm
        self.algorithm = algorithm
        self.numel = sum(p.numel() for p in params)
        first = params[0]
        self.residual = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        self.steps = 0

    def start(self, flat, op: str) -> Exchange:
        if op not in REDUCE_OPS:
            raise InvalidArgumentError(f"compression={str(self.settings)!r} reduces with sum or average, not {op!r}")
        return self._start(flat, op)

    def _start(self, flat, op) -> Exchange:
        raise NotImplementedError

    def _finish_step(self, flat, op) -> None:
        if op == "avg":
            flat.div_(self.comm.size)
        self.steps += 1

    def state_dict(self) -> dict:
        """This rank's state of the bucket (tensors), for a checkpoint."""
        return {"residual": self.residual.clone(), "steps": torch.tensor(self.steps, dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, self.state_dict(), str(self.settings), "this bucket's")
        self.residual.copy_(state["residual"])
        self.steps = int(state["steps"])


def check_state(state: dict, expected: dict, keeper: str, whose: str) -> None:
    """Refuse a compression state whose entries or shapes are not those of `expected` (what
    `keeper` keeps; `whose` names its owner in the message)."""
    if set(state) != set(expected):
        raise InvalidArgumentError(f"compression state with entries {sorted(state)}; {keeper} keeps {sorted(expected)}")
    for key, value in state.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise InvalidArgumentError(f"compression state {key!r} of shape {list(value.shape)}; {whose} "
                                       f"is {list(expected[key].shape)}")


def orthogonalize(matrix, epsilon: float = 0.0) -> None:
    """Gram-Schmidt on the columns of `matrix` (n x r), in place, as torch's PowerSGD does (each
    column divided by its norm + epsilon); an all-zero column stays zero."""
    for i in range(matrix.shape[1]):
        column = matrix[:, i:i + 1]
        norm = float(torch.linalg.vector_norm(column)) + epsilon
        if norm > 0:
            column.div_(norm)
        else:
            column.zero_()
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest.sub_((column * rest).sum(dim=0, keepdim=True) * column)


class PowerSGDBucket(BucketExchange):
    """PowerSGD of one bucket: which of its gradients go as factors and where each lies."""

    def __init__(self, settings, params, comm, algorithm):
        super().__init__(settings, params, comm, algorithm)
        self.matrices, self.whole = [], []  # (offset, n, m, r) and (offset, numel)
        offset = p_size = q_size = 0
        for param in params:
            numel = param.numel()
            if param.dim() >= 2:
                n, m = param.shape[0], numel // param.shape[0]
                r = min(n, m, settings.rank)
                if (n + m) * r * settings.min_compression_rate < n * m:
                    self.matrices.append((offset, n, m, r, p_size, q_size))
                    p_size += n * r
                    q_size += m * r
                    offset += numel
                    continue
            self.whole.append((offset, numel))
            offset += numel
        self.whole_size = sum(numel for _, numel in self.whole)
        first = params[0]
        self.q = torch.zeros(q_size, dtype=first.dtype, device=first.device)
        self.has_q = False
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.sent = torch.empty(self.whole_size + p_size, dtype=first.dtype, device=first.device)

    def _views(self, flat, p):
        for offset, n, m, r, p_at, q_at in self.matrices:
            yield (offset, flat[offset:offset + n * m].view(n, m), p[p_at:p_at + n * r].view(n, r),
                   self.q[q_at:q_at + m * r].view(m, r))

    def _new_q(self) -> None:
        random = torch.randn(self.q.numel(), generator=self.generator, dtype=torch.float32)
        self.q.copy_(random)

    def _start(self, flat, op):
        settings = self.settings
        if self.steps < settings.start_iter or not self.matrices:
            handle = self.comm.allreduce_async(flat, op=op, algorithm=self.algorithm)

            def plain():
                handle.wait()
                self.steps += 1
            return Exchange(plain)
        if settings.error_feedback:
            flat.add_(self.residual)
        if not (settings.warm_start and self.has_q):
            self._new_q()
        self.has_q = True
        at = 0
        for offset, numel in self.whole:
            self.sent[at:at + numel] = flat[offset:offset + numel]
            at += numel
        p = self.sent[self.whole_size:]
        for offset, matrix, p_part, q_part in self._views(flat, p):
            orthogonalize(q_part, settings.epsilon)
            torch.matmul(matrix, q_part, out=p_part)
        handle = self.comm.allreduce_async(self.sent, op="sum", algorithm=self.algorithm)

        def finish():
            handle.wait()
            # Averaged, as torch's hook does, in what is small: the whole gradients and Q (also the
            # next warm start), so that P Q^T needs no division after.
            if op == "avg":
                self.sent[:self.whole_size].div_(self.comm.size)
            at = 0
            for offset, numel in self.whole:
                flat[offset:offset + numel] = self.sent[at:at + numel]
                self.residual[offset:offset + numel] = 0
                at += numel
            for offset, matrix, p_part, q_part in self._views(flat, p):
                orthogonalize(p_part, settings.epsilon)
                torch.matmul(matrix.t(), p_part, out=q_part)
                if settings.error_feedback:  # what this rank meant to send, less its share P Q_rank^T
                    # in one pass over the matrix, with no temporary of its size
                    torch.addmm(matrix, p_part, q_part.t(), alpha=-1,
                                out=self.residual[offset:offset + matrix.numel()].view(matrix.shape))
            self.comm.allreduce(self.q, op=op, algorithm=self.algorithm)
            for offset, matrix, p_part, q_part in self._views(flat, p):
                torch.matmul(p_part, q_part.t(), out=matrix)
            self._finish_step(flat, "sum")  # averaged already
        return Exchange(finish)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["q"] = self.q.clone()
        state["has_q"] = torch.tensor(int(self.has_q), dtype=torch.int64)
        state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.q.copy_(state["q"])
        self.has_q = bool(int(state["has_q"]))
        self.generator.set_state(state["generator"])


class Int8Bucket(BucketExchange):
    """Int8 of one bucket. On several nodes of several ranks each, the bucket is first summed
    within each node, uncompressed (reduce-scatter over the node: each rank gets a slice), each
    slice goes through int8 between the ranks holding it on the other nodes, and an allgather
    within the node gives back the whole bucket: so only the links between nodes carry int8.
    Each rank's residual is then that of its slice (the rest of it stays zero)."""

    def __init__(self, settings, params, comm, algorithm):
        super().__init__(settings, params, comm, algorithm)
        self.node, self.across = comm.node_and_lane()
        first = params[0]
        self.over = comm if self.node is None else self.across
        if self.node is None:
            self.offset, count = 0, self.numel
        else:  # this rank's slice, as reduce_scatter cuts the bucket over the node
            self.offset, count = split_counts(self.numel, self.node.size)[self.node.rank]
        self.parts = Int8Parts(count, self.over.size, self.over.rank, settings.chunk, first.dtype, first.device)

    def _start(self, flat, op):
        parts = self.parts

        def exchange(_):
            values = flat if self.node is None else self.node.reduce_scatter(flat)
            residual = self.residual[self.offset:self.offset + parts.numel]
            received, _ = self.over.alltoall(parts.quantize(values, residual))
            parts.dequantize_into(values, self.over.allgather(parts.sum_own(received, residual)).view(parts.size, -1))
            return values if self.node is None else self.node.allgather(values)
        # On the communicator's engine, in the order of the other buckets' exchanges, while the
        # backward pass goes on (the communicator's collectives called there run there at once).
        handle = self.comm.async_engine().submit("int8 exchange", exchange)

        def finish():
            result = handle.wait()
            if result is not flat:
                flat.copy_(result)
            self._finish_step(flat, op)
        return Exchange(finish)


class TopKBucket(BucketExchange):
    """Top-k of one bucket: how many elements each rank sends."""

    def __init__(self, settings, params, comm, algorithm):
        super().__init__(settings, params, comm, algorithm)
        self.k = max(1, math.ceil(settings.fraction * self.numel))

    def _start(self, flat, op):
        flat.add_(self.residual)
        handle = self.comm.allgather_async(topk_codec.encode(flat, self.residual, self.k))

        def finish():
            gathered = handle.wait().view(self.comm.size, -1)
            flat.zero_()
            for row in gathered:  # in rank order
                topk_codec.add_decoded(flat, row, self.k)
            self._finish_step(flat, op)
        return Exchange(finish)
