"""Collectives raced back to back without the call check (MPIDIST_CHECK=0), as users run them
for speed: no barrier and no check between calls, so a fast rank starts its next call, of
another algorithm, size, dtype or op, while a slow one is still in the last.

Hypothesis draws a sequence of calls, the same on every rank (derandomized, as in
test_collectives.py); each rank sleeps at random points of its own (between calls, and inside
the algorithms' steps), seeded by its rank. Only after the whole sequence has run is each result
compared with its float64 NumPy reference within the bounds of tolerances.py, and the all-reduce
results across ranks bit for bit. The verdict is shared by all ranks (an allgather after the
sequence), so every rank fails the same examples and they stay in step.

The sizes reach past the size thresholds of the algorithms: auto's bounds for MPI's own and the
small-message fast path (8, 32 and 128 KiB), the segments of the pipelined transfers (256 KiB)
and broadcast's scatter + allgather (512 KiB). The two thresholds of a MiB and more, the
aggregator's blocks of reduce + broadcast (4 MiB) and the hierarchical all-reduce's ring across
nodes (1 MiB), are lowered here to 64 and 128 KiB: the same code runs at sizes the 2-core CI
affords for every rank of every call. Two communicators take the calls: one node, and emulated
nodes of two ranks (MPIDIST_RANKS_PER_NODE=2), whose hierarchical all-reduce and auto choice
differ. The asynchronous forms run the same way: several handles in flight, blocking calls in
between, each rank waiting for its handles in an order of its own.
"""
import hashlib
import time

import numpy as np
import pytest
import torch
from conftest import make_array, raw_bytes, to_float64
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from node_steps import stepwise
from test_collectives import FLOAT_DTYPES, INT_DTYPES, OPS, rank_values
from tolerances import reduction_bound, reduction_reference

import mpidist as md
from mpidist import _C
from mpidist.collectives import common, hierarchical, reduce_bcast

pytestmark = pytest.mark.mpi_shared_launch

ALGORITHMS = ["ring", "tree", "recursive_halving", "recursive_doubling", "reduce_bcast", "hierarchical", "mpi",
              "auto"]
DTYPES = FLOAT_DTYPES + INT_DTYPES
KiB = 1024
# Message sizes in bytes around the thresholds named in the module notes.
BYTE_RANGES = [(0, 0), (1, 64), (64, 8 * KiB), (8 * KiB, 32 * KiB), (32 * KiB, 160 * KiB), (250 * KiB, 600 * KiB)]
COLUMNS = 3  # the row length of allgather's and reduce_scatter's arrays
# Shrinking replays a failing example many times, each a new draw of a race: left out. The
# failure names the call that went wrong.
SETTINGS = settings(derandomize=True, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck))


@st.composite
def calls(draw, collectives, algorithms, communicators):
    """One call: (collective, algorithm, dtype, op, count, kind, in place, root, communicator)."""
    collective = draw(st.sampled_from(collectives))
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from(OPS))
    if op == "avg" and dtype in INT_DTYPES:
        op = "sum"
    low, high = draw(st.sampled_from(BYTE_RANGES))
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    count = draw(st.integers(low, high)) // itemsize
    kind = "torch" if dtype == "bfloat16" else draw(st.sampled_from(["numpy", "torch"]))
    return (collective, draw(st.sampled_from(algorithms)), dtype, op, count, kind, draw(st.booleans()),
            draw(st.integers(0, 4)), draw(st.sampled_from(communicators)))


@st.composite
def sequences(draw, collectives, max_size):
    """Calls of a few algorithms on one or both communicators (so that an algorithm often follows
    itself on one communicator, at another size)."""
    algorithms = draw(st.lists(st.sampled_from(ALGORITHMS), min_size=1, max_size=3, unique=True))
    communicators = draw(st.sampled_from([[0], [1], [0, 1]]))
    return draw(st.lists(calls(collectives, algorithms, communicators), min_size=max_size // 2, max_size=max_size))


class Jitter:
    """Random sleeps of this rank's own: up to a millisecond, at a fifth of the points asked."""

    def __init__(self, seed, rank):
        self.rng = np.random.default_rng([seed, rank])

    def __call__(self):
        if self.rng.random() < 0.2:
            time.sleep(self.rng.uniform(0, 1e-3))


@pytest.fixture
def lowered_thresholds(monkeypatch):
    """The thresholds of a MiB and more at sizes the test draws (module notes)."""
    monkeypatch.setattr(reduce_bcast, "BLOCK_BYTES", 64 * KiB)
    monkeypatch.setattr(hierarchical, "RING_ACROSS_NODES_BYTES", 128 * KiB)


@pytest.fixture
def unchecked_comms(monkeypatch, lowered_thresholds):
    """Two communicators over MPI's world made with MPIDIST_CHECK=0: one node, and emulated nodes
    of two ranks. Freed at the end."""
    monkeypatch.setenv("MPIDIST_CHECK", "0")
    monkeypatch.delenv("MPIDIST_RANKS_PER_NODE", raising=False)
    one_node = md.Communicator(MPI.COMM_WORLD)
    monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", "2")
    nodes_of_two = md.Communicator(MPI.COMM_WORLD)
    assert not one_node.check_calls and not nodes_of_two.check_calls
    yield one_node, nodes_of_two
    for comm in (one_node, nodes_of_two):
        comm.free()


@pytest.fixture
def jitter(monkeypatch):
    """A Jitter whose sleeps also come inside the algorithms: before and after every
    point-to-point step, reduction and node barrier. Reseed it with jitter.rng for each example."""
    jitter = Jitter(0, MPI.COMM_WORLD.Get_rank())

    def delayed(method):
        def run(*args, **kwargs):
            jitter()
            result = method(*args, **kwargs)
            jitter()
            return result
        return run

    for name in ("send", "recv", "sendrecv", "exchange_and_reduce", "reduce"):
        monkeypatch.setattr(common.Context, name, delayed(getattr(common.Context, name)))
    monkeypatch.setattr(hierarchical.NodeWindow, "sync", delayed(hierarchical.NodeWindow.sync))
    for name, function in stepwise(lambda step, last: jitter()).items():  # the extension's steps
        monkeypatch.setattr(_C, name, function)
    return jitter


class Call:
    """One drawn call on this rank: its inputs, how to start it, and how to check its result."""

    def __init__(self, seed, index, call, p, rank):
        (self.collective, self.algorithm, self.dtype, self.op, self.count, self.kind, self.in_place, root,
         self.comm_index) = call
        self.root = root % p
        self.seed, self.p, self.rank = seed * 1000 + index, p, rank
        arguments = {"allreduce": f"{self.algorithm} {self.op} {'in place' if self.in_place else 'out='}",
                     "broadcast": f"root {self.root}", "allgather": "", "reduce_scatter": self.op}[self.collective]
        self.where = (f"call {index}: {self.collective} {arguments} {self.dtype} n={self.count} {self.kind} "
                      f"on {('one node', 'nodes of two')[self.comm_index]}")
        if self.collective == "allgather":  # rows of the ranks' own numbers
            self.rows = [int(np.random.default_rng([self.seed, k]).integers(0, self.count // COLUMNS + 2))
                         for k in range(p)]
        else:
            self.rows = [self.count // COLUMNS] * p
        if self.collective in ("allgather", "reduce_scatter"):
            self.inputs = [rank_values(self.seed, k, rows * COLUMNS, self.dtype, self.op).reshape(rows, COLUMNS)
                           for k, rows in enumerate(self.rows)]
        else:
            self.inputs = [rank_values(self.seed, k, self.count, self.dtype, self.op) for k in range(p)]
        self.array = make_array(self.kind, self.inputs[rank], self.dtype)
        self.input_bytes = raw_bytes(self.array)
        self.out = make_array(self.kind, np.zeros(self.count), self.dtype) \
            if self.collective == "allreduce" and not self.in_place else None

    def start(self, comm, asynchronous=False):
        """Call the collective; returns its result, or with `asynchronous` its handle."""
        suffix = "_async" if asynchronous else ""
        if self.collective == "allreduce":
            return getattr(comm, "allreduce" + suffix)(self.array, op=self.op, algorithm=self.algorithm, out=self.out)
        if self.collective == "broadcast":
            return getattr(comm, "broadcast" + suffix)(self.array, root=self.root)
        if self.collective == "allgather":
            return getattr(comm, "allgather" + suffix)(self.array)
        return getattr(comm, "reduce_scatter" + suffix)(self.array, op=self.op)

    def errors(self, result) -> list:
        """What is wrong with `result` (empty when nothing is)."""
        if self.collective == "broadcast":
            expected = raw_bytes(make_array(self.kind, self.inputs[self.root], self.dtype))
            return [] if raw_bytes(result) == expected else [f"{self.where}: not root {self.root}'s data"]
        if self.collective == "allgather":
            expected = make_array(self.kind, np.concatenate(self.inputs), self.dtype)
            same = tuple(result.shape) == tuple(expected.shape) and raw_bytes(result) == raw_bytes(expected)
            return [] if same else [f"{self.where}: not the ranks' rows {self.rows} in rank order"]
        errors = []
        if self.collective == "allreduce":
            target = self.array if self.out is None else self.out
            if result is not target:
                errors.append(f"{self.where}: the result is not {'the array' if self.out is None else 'out='}")
            if self.out is not None and raw_bytes(self.array) != self.input_bytes:
                errors.append(f"{self.where}: out= changed the input")
        expected = reduction_reference(self.inputs, self.op)
        bound = np.broadcast_to(reduction_bound(self.inputs, self.op, self.dtype), expected.shape)
        if self.collective == "reduce_scatter":  # this rank's block of rows (the first rows % p get one more)
            expected, bound = np.array_split(expected, self.p)[self.rank], np.array_split(bound, self.p)[self.rank]
        got = to_float64(result)
        if got.shape != expected.shape:
            return errors + [f"{self.where}: shape {got.shape}, expected {expected.shape}"]
        error = np.abs(got - expected)
        if not (error <= bound).all():
            errors.append(f"{self.where}: error {error.max()} > bound at {np.argmax(error - bound)}")
        return errors

    def digest(self, result) -> str:
        """The result's bits, for the check that every rank has the same (all-reduces only)."""
        return hashlib.sha1(raw_bytes(result)).hexdigest() if self.collective == "allreduce" else ""


def verdict(comm, errors: list, digests: list) -> None:
    """Fail on every rank if any rank found errors or the ranks' all-reduce results differ."""
    everyone = comm.mpi.allgather((errors, digests))
    problems = [f"rank {rank}: {error}" for rank, (rank_errors, _) in enumerate(everyone) for error in rank_errors]
    problems += [f"call {index}: the ranks' results differ" for index, digest in enumerate(digests)
                 if any(other[1][index] != digest for other in everyone)]
    assert not problems, "\n".join(problems)


@settings(SETTINGS, max_examples=10)
@given(sequence=sequences(["allreduce"] * 5 + ["broadcast", "allgather", "reduce_scatter"], max_size=24),
       seed=st.integers(0, 2 ** 20))
def race_blocking(comms, jitter, sequence, seed):
    p, rank = comms[0].size, comms[0].rank
    jitter.rng = np.random.default_rng([seed, rank])
    drawn = [Call(seed, index, call, p, rank) for index, call in enumerate(sequence)]
    results = []
    for call in drawn:  # back to back: nothing between the calls but this rank's sleeps
        jitter()
        results.append(call.start(comms[call.comm_index]))
    errors = [error for call, result in zip(drawn, results) for error in call.errors(result)]
    verdict(comms[0], errors, [call.digest(result) for call, result in zip(drawn, results)])


@pytest.mark.mpi(ranks=[2, 3, 4, 5])
def test_blocking_calls_back_to_back(unchecked_comms, jitter):
    race_blocking(unchecked_comms, jitter)


@settings(SETTINGS, max_examples=10)
@given(sequence=sequences(["allreduce"] * 5 + ["broadcast", "allgather", "reduce_scatter"], max_size=16),
       blocking=st.lists(st.sampled_from([False, False, False, True]), min_size=16, max_size=16),
       seed=st.integers(0, 2 ** 20))
def race_asynchronous(comms, jitter, sequence, blocking, seed):
    p, rank = comms[0].size, comms[0].rank
    jitter.rng = np.random.default_rng([seed, rank])
    drawn = [Call(seed, index, call, p, rank) for index, call in enumerate(sequence)]
    handles, results = {}, {}
    for index, call in enumerate(drawn):
        jitter()
        if blocking[index]:  # behind the handles in flight on its communicator
            results[index] = call.start(comms[call.comm_index])
        else:
            handles[index] = call.start(comms[call.comm_index], asynchronous=True)
        if handles and jitter.rng.random() < 0.3:  # wait for a few, in an order of this rank's own
            for waited in jitter.rng.permutation(list(handles))[:jitter.rng.integers(1, len(handles) + 1)]:
                results[int(waited)] = handles.pop(int(waited)).wait()
    for waited in jitter.rng.permutation(list(handles)):
        results[int(waited)] = handles.pop(int(waited)).wait()
    results = [results[index] for index in range(len(drawn))]
    errors = [error for call, result in zip(drawn, results) for error in call.errors(result)]
    verdict(comms[0], errors, [call.digest(result) for call, result in zip(drawn, results)])


@pytest.mark.mpi(ranks=[2, 3, 4, 5])
def test_asynchronous_handles_waited_in_any_order(unchecked_comms, jitter):
    race_asynchronous(unchecked_comms, jitter)
