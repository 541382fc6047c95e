"""Gradient compressors for the reducer's buckets: PowerSGD, int8 with a scale per chunk, top-k,
and the float16 / bfloat16 casts; the spelling `mpidist train --compression` takes.

A compressor is a small immutable settings object. For each gradient bucket the reducer asks it
for a BucketCompressor, which keeps that bucket's state on this rank and exchanges the bucket:
start(flat, op) compresses the bucket's flat gradient and launches the first exchange; the
returned Exchange's wait() finishes it and leaves the reduced gradient ("sum" or "avg") in
`flat`. The exchanges are mpidist's own collectives on the bucket's communicator.

Error feedback (PowerSGD, int8, top-k): before compressing, a bucket adds to its gradient the
residual of the step before, and keeps as the new residual what it meant to send minus what its
share of the result is. So nothing is lost, only delayed: over any number of steps, the sum of
the results plus every rank's residual is the sum of every rank's gradients. Every rank gets the
same bits: each reduces the same exchanged data in rank order, and PowerSGD orthogonalizes the
same all-reduced matrix on every rank.

Each one's exchange in full: docs/compression.md, "How they exchange". In short: PowerSGD
(Vogels et al., as torch's powerSGD_hook defines it) sends each weight matrix M as P = M Q and
Q = M^T P (two all-reduces), its residual M - P Q_rank^T; int8 sends one int8 part per rank
(all-to-all), each owner sums its part in float32 in rank order and requantizes it, and every
rank gathers the sums (allgather), on nodes of several ranks after a sum within each node, so
that only the node sums travel between nodes; top-k allgathers each rank's (index, value)
pairs; fp16 / bf16 are the reducer's casts, without error feedback.
"""
from __future__ import annotations

import dataclasses
import math
import time
import weakref

import torch

from ..comm import Communicator
from ..errors import InvalidArgumentError
from .int8_parts import Int8Parts, bytes_as

CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
REDUCE_OPS = ("sum", "avg")


class Compressor:
    """The settings of a gradient compression. `wire_dtype`: the dtype a cast sends the bucket in
    (None for the others, which make a BucketCompressor per bucket)."""

    name = "none"
    wire_dtype = None

    def check(self, params) -> None:
        """Refuse parameters this compression cannot send (it compresses floating point)."""
        for index, param in enumerate(params):
            if not param.dtype.is_floating_point:
                raise InvalidArgumentError(f"compression={str(self)!r} compresses floating-point gradients; "
                                           f"parameter {index} is {param.dtype}")

    def for_bucket(self, params, comm, algorithm) -> BucketCompressor:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class NoCompression(Compressor):
    """Gradients go as they are."""

    name = "none"

    def check(self, params) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Cast(Compressor):
    """The bucket travels in float16 or bfloat16 and comes back in the gradients' dtype."""

    dtype_name: str = "fp16"

    def __post_init__(self):
        if self.dtype_name not in CAST_DTYPES:
            raise InvalidArgumentError(f"compression cast {self.dtype_name!r}: choose 'fp16' or 'bf16'")

    @property
    def name(self) -> str:
        return self.dtype_name

    @property
    def wire_dtype(self):
        return CAST_DTYPES[self.dtype_name]


@dataclasses.dataclass(frozen=True)
class PowerSGD(Compressor):
    """Rank-`rank` PowerSGD with error feedback (module docstring); the arguments mean what
    torch's PowerSGDState's matrix_approximation_rank, start_powerSGD_iter,
    min_compression_rate, use_error_feedback, warm_start, orthogonalization_epsilon and
    random_seed mean."""

    rank: int = 1
    start_iter: int = 10
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    epsilon: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise InvalidArgumentError(f"PowerSGD rank={self.rank!r}: give a whole number >= 1")
        if not isinstance(self.start_iter, int) or self.start_iter < 0:
            raise InvalidArgumentError(f"PowerSGD start_iter={self.start_iter!r}: give a whole number >= 0")
        if not self.min_compression_rate > 0:
            raise InvalidArgumentError(f"PowerSGD min_compression_rate={self.min_compression_rate!r}: give a "
                                       "number > 0")
        if not self.epsilon >= 0:
            raise InvalidArgumentError(f"PowerSGD epsilon={self.epsilon!r}: give a number >= 0")

    @property
    def name(self) -> str:
        return f"powersgd:{self.rank}"

    def for_bucket(self, params, comm, algorithm):
        return PowerSGDBucket(self, params, comm, algorithm)


@dataclasses.dataclass(frozen=True)
class Int8(Compressor):
    """Int8 values with one float32 scale per `chunk` elements, summed in float32."""

    chunk: int = 1024

    def __post_init__(self):
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise InvalidArgumentError(f"int8 chunk={self.chunk!r}: give a whole number >= 1")

    name = "int8"

    def for_bucket(self, params, comm, algorithm):
        return Int8Bucket(self, params, comm, algorithm)


@dataclasses.dataclass(frozen=True)
class TopK(Compressor):
    """The `fraction` of each bucket's elements largest in magnitude, as (index, value) pairs."""

    fraction: float = 0.01

    def __post_init__(self):
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) \
                or not 0 < self.fraction <= 1:
            raise InvalidArgumentError(f"top-k fraction={self.fraction!r}: give a number in (0, 1]")

    @property
    def name(self) -> str:
        return f"topk:{self.fraction:g}"

    def for_bucket(self, params, comm, algorithm):
        return TopKBucket(self, params, comm, algorithm)


SPELLINGS = "none, fp16, bf16, int8, powersgd:<rank>, topk:<fraction>"


def parse_compression(text: str) -> Compressor:
    """The compressor `text` names: "none", "fp16", "bf16", "int8", "powersgd:<rank>" (rank 1
    without it), "topk:<fraction>" (0.01 without it)."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"compression={text!r}: give one of {SPELLINGS}, or a compressor")
    name, _, setting = text.strip().lower().partition(":")
    try:
        if name in ("none", "fp16", "bf16", "int8") and setting:
            raise InvalidArgumentError(f"{name} takes no setting")
        if name == "none":
            return NoCompression()
        if name in CAST_DTYPES:
            return Cast(name)
        if name == "int8":
            return Int8()
        if name == "powersgd":
            return PowerSGD(rank=_number(setting, int, "rank") if setting else 1)
        if name == "topk":
            return TopK(fraction=_number(setting, float, "fraction") if setting else 0.01)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"compression {text!r}: {exc}") from None
    raise InvalidArgumentError(f"compression {text!r} is unknown; choose {SPELLINGS}")


def _number(text, kind, what):
    try:
        return kind(text)
    except ValueError:
        raise InvalidArgumentError(f"its {what} {text!r} is not a number") from None


def resolve_compression(compression) -> Compressor:
    """A Compressor for `compression`: None, a spelling (parse_compression) or a Compressor."""
    if compression is None:
        return NoCompression()
    if isinstance(compression, Compressor):
        return compression
    return parse_compression(compression)


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

    def progress(self) -> None:
        """Nothing to advance: the exchanges run on the communicator's engine."""


class BucketCompressor:
    """One bucket's compressed exchange and its error-feedback state, on this rank."""

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


class PowerSGDBucket(BucketCompressor):
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


class Int8Bucket(BucketCompressor):
    """Int8 of one bucket. On several nodes of several ranks each, the bucket is first summed
    within each node, uncompressed (reduce-scatter over the node: each rank gets a slice), each
    slice goes through int8 between the ranks holding it on the other nodes, and an allgather
    within the node gives back the whole bucket: so only the links between nodes carry int8.
    Each rank's residual is then that of its slice (the rest of it stays zero)."""

    def __init__(self, settings, params, comm, algorithm):
        super().__init__(settings, params, comm, algorithm)
        self.node, self.across = node_groups(comm)
        first = params[0]
        self.over = comm if self.node is None else self.across
        if self.node is None:
            self.offset, count = 0, self.numel
        else:  # this rank's slice, as reduce_scatter cuts the bucket over the node
            base, extra = divmod(self.numel, self.node.size)
            self.offset, count = self.node.rank * base + min(self.node.rank, extra), base + (self.node.rank < extra)
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


_NODE_GROUPS = weakref.WeakKeyDictionary()


def node_groups(comm):
    """(the ranks of this rank's node, the ranks of the same local rank on every node: its lane)
    as Communicators, where `comm` spans several nodes with the same number (more than one) of its
    ranks on each; (None, None) otherwise. Made once per communicator (collective on it, at its
    first int8 bucket: every rank makes its buckets in the same order), kept while it lives."""
    if comm not in _NODE_GROUPS:
        local_sizes = set(comm.allgather(torch.tensor([comm.local_size])).tolist()) if comm.num_nodes > 1 else {1}
        if local_sizes == {1} or len(local_sizes) > 1:
            _NODE_GROUPS[comm] = (None, None)
        else:
            _NODE_GROUPS[comm] = (Communicator(comm.node_comm), Communicator(comm.node_communicators().lane))
    return _NODE_GROUPS[comm]


DIRECT_TOPK_NUMEL = 1 << 16  # largest_magnitudes runs torch.topk over all of a bucket this small
SAMPLE_STRIDE = 61  # its sample's stride, which rarely divides a row: the sample follows no column


def largest_magnitudes(flat, k: int):
    """The indices (int64, in no order) of the k elements of `flat` largest in magnitude: the set
    torch.topk(flat.abs(), k) gives (up to ties), without its cost over millions of elements.
    topk runs over candidates: those at least a threshold that about 2k pass, read off a strided
    sample. The top k are at least the k-th largest, so if k or more pass they are all among
    them; if fewer pass (a sample unlike the rest), topk runs over every element."""
    magnitudes = flat.abs()
    if magnitudes.numel() > DIRECT_TOPK_NUMEL and 4 * k <= magnitudes.numel():
        sample = magnitudes[::SAMPLE_STRIDE]
        threshold = torch.kthvalue(sample, max(1, sample.numel() - 2 * k // SAMPLE_STRIDE)).values
        candidates = torch.nonzero(magnitudes >= threshold).squeeze(1)
        if candidates.numel() >= k:
            return candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]
    return torch.topk(magnitudes, k, sorted=False).indices


class TopKBucket(BucketCompressor):
    """Top-k of one bucket: how many elements each rank sends."""

    def __init__(self, settings, params, comm, algorithm):
        super().__init__(settings, params, comm, algorithm)
        self.k = max(1, math.ceil(settings.fraction * self.numel))

    def _start(self, flat, op):
        flat.add_(self.residual)
        indices = largest_magnitudes(flat, self.k)
        values = flat[indices]
        self.residual.copy_(flat)
        self.residual[indices] = 0
        indices = indices.to(torch.int32)
        payload = torch.cat([indices.view(torch.uint8), values.view(torch.uint8)])
        handle = self.comm.allgather_async(payload)

        def finish():
            gathered = handle.wait().view(self.comm.size, -1)
            flat.zero_()
            for row in gathered:  # in rank order
                rank_indices = bytes_as(row[:4 * self.k], torch.int32).long()
                flat.index_add_(0, rank_indices, bytes_as(row[4 * self.k:], flat.dtype))
            self._finish_step(flat, op)
        return Exchange(finish)
