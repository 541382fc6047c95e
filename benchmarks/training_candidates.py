"""The candidates benchmarks/training.py times, each one way to train a model a step at a time
with the step's phases timed: mpidist DataParallel (with its exposed wait and its buckets'
all-reduces), torch DDP, and the references that exchange no gradients: every rank alone
(local), alone but in lockstep, and rank 0 alone (single)."""
from __future__ import annotations

import time

import numpy as np
import torch


class Candidate:
    """One way to train `model`: a step at a time, each step's phases timed."""
    name = ""
    bucket_mb = None
    views = False  # gradient_as_bucket_view

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.loss = torch.nn.CrossEntropyLoss()
        self.phases = []  # per measured step: (forward, backward, wait, optimizer, comm, hidden) s

    def train_step(self, x, y, record: bool) -> None:
        t0 = time.perf_counter()
        loss = self.loss(self.wrapped(x), y)
        t1 = time.perf_counter()
        self.backward(loss)
        t2 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        t3 = time.perf_counter()
        if record:
            self.phases.append(self.breakdown(t0, t1, t2, t3))

    def backward(self, loss) -> None:
        loss.backward()

    def breakdown(self, t0, t1, t2, t3):
        return (t1 - t0, t2 - t1, 0.0, t3 - t2, 0.0, 0.0)

    def parameters_flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])

    def close(self):
        pass


class MpidistCandidate(Candidate):
    def __init__(self, model, lr, comm, bucket_mb, views=False):
        super().__init__(model)
        import mpidist as md
        self.name, self.bucket_mb, self.views = "mpidist", bucket_mb, views
        self.wrapped = md.DataParallel(self.model, comm=comm, bucket_mb=bucket_mb, gradient_as_bucket_view=views)
        self.optimizer = torch.optim.SGD(self.wrapped.parameters(), lr=lr)
        self.buckets = len(self.wrapped.buckets.buckets)
        self.waits = []
        self._instrument()

    def _instrument(self):
        """Timestamps of GradientBuckets.wait (through an instance attribute; the class is
        untouched) and of each bucket's all-reduce (GradientBuckets.trace)."""
        buckets = self.wrapped.buckets
        plain_wait = buckets.wait

        def timed_wait():
            start = time.perf_counter()
            try:
                plain_wait()
            finally:
                self.waits.append((start, time.perf_counter()))

        buckets.wait = timed_wait
        self.spans = buckets.trace = []

    def train_step(self, x, y, record: bool) -> None:
        self.waits.clear()
        self.spans.clear()
        super().train_step(x, y, record)

    def breakdown(self, t0, t1, t2, t3):
        (wait_start, wait_end), = self.waits
        wait = wait_end - wait_start
        comm = sum(end - start for start, end in self.spans)
        hidden = sum(max(0.0, min(end, wait_start) - start) for start, end in self.spans)
        return (t1 - t0, t2 - t1 - wait, wait, t3 - t2, comm, hidden)


class DDPCandidate(Candidate):
    name = "ddp"

    def __init__(self, model, lr, views=False):
        super().__init__(model)
        self.views = views
        self.wrapped = torch.nn.parallel.DistributedDataParallel(self.model, gradient_as_bucket_view=views)
        self.optimizer = torch.optim.SGD(self.wrapped.parameters(), lr=lr)
        self.buckets = None


class LocalCandidate(Candidate):
    """Every rank trains its own copy on its own batches with no communication at all: the
    throughput the ranks reach together on this machine, the ceiling of any data parallelism."""
    name = "local"

    def __init__(self, model, lr):
        super().__init__(model)
        self.wrapped = self.model
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.buckets = None


class LockstepCandidate(LocalCandidate):
    """`local` plus one synchronization of the ranks after each backward, and no data moved:
    the ceiling of any synchronous data parallelism, which runs every step at the pace of the
    slowest rank. The ranks meet through a one-element all-reduce in the shared slots, polled
    and napping as DataParallel's buckets wait (all ranks on one node)."""
    name = "lockstep"

    def __init__(self, model, lr, comm):
        super().__init__(model, lr)
        from mpidist.collectives.node_buckets import NodeSlots
        self.flag = np.zeros(1, dtype=np.float32)
        self.slots = NodeSlots(comm.node_comm, [self.flag.nbytes])

    def backward(self, loss) -> None:
        loss.backward()
        start = time.perf_counter()
        self.slots.start(0, [self.flag], "sum").wait()
        self.wait = time.perf_counter() - start

    def breakdown(self, t0, t1, t2, t3):
        return (t1 - t0, t2 - t1 - self.wait, self.wait, t3 - t2, 0.0, 0.0)

    def close(self):
        self.slots.free()


class SingleCandidate(LocalCandidate):
    """The same plain training, run by rank 0 alone (training.py's run_steps lets the other ranks wait)."""
    name = "single"
