"""Optimizer state sharding: DataParallel with md.ZeroRedundancyOptimizer(Adam) against
DataParallel with a plain Adam, on the same model, batches and ranks, in one run.

    mpirun --oversubscribe --bind-to none -np 2 python benchmarks/zero.py \
        [--params 3M] [--batch 64] [--steps 20] [--rounds 5] [--warmup 5] [--json FILE]

The model, data and threads are benchmarks/training.py's (an MLP of about --params parameters,
fixed random batches, one thread per rank). Every round runs --steps steps of each candidate in
turn (the order alternating), so a shared machine's noise falls on both alike.

Columns: samples/s (global, the slowest rank's time per round; median over rounds), step and
optimizer milliseconds (median per step, mean over ranks; the optimizer's time includes ZeRO's
broadcast of the updated parameters), and the optimizer state bytes each rank holds (the tensors
in its optimizer's state: Adam's two moments and step counters), largest over ranks. Correctness:
after the measured steps both candidates' parameters must agree (max |a - b| / max |b| <=
--tolerance) and every rank must hold the same; the command exits 1 otherwise.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")  # as benchmarks/training.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from training import (  # noqa: E402
    build_model,
    layer_sizes,
    make_pool,
    parse_count,
    report,
    rounds_range,
    start_one_thread_per_rank,
    throughput,
)

LR = 1e-3


class Candidate:
    def __init__(self, name, sizes, seed, comm, zero: bool):
        import mpidist as md
        self.name = name
        torch.manual_seed(seed)
        self.model = build_model(sizes)
        self.wrapped = md.DataParallel(self.model, comm=comm)
        if zero:
            self.optimizer = md.ZeroRedundancyOptimizer(self.wrapped.parameters(), torch.optim.Adam, comm=comm, lr=LR)
            self.state_holder = self.optimizer.optim
        else:
            self.optimizer = torch.optim.Adam(self.wrapped.parameters(), lr=LR)
            self.state_holder = self.optimizer
        self.loss = torch.nn.CrossEntropyLoss()
        self.step_s, self.optimizer_s = [], []

    def train_step(self, x, y, record: bool) -> None:
        start = time.perf_counter()
        loss = self.loss(self.wrapped(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        before_step = time.perf_counter()
        self.optimizer.step()
        end = time.perf_counter()
        if record:
            self.step_s.append(end - start)
            self.optimizer_s.append(end - before_step)

    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for state in self.state_holder.state.values()
                   for v in state.values() if isinstance(v, torch.Tensor))


def measure(comm, args) -> list[dict]:
    sizes = layer_sizes(parse_count(args.params), args.depth)
    candidates = [Candidate("adam", sizes, args.seed, comm, zero=False),
                  Candidate("zero adam", sizes, args.seed, comm, zero=True)]
    pool = make_pool(sizes, args.batch, args.seed, comm.rank)
    for candidate in candidates:
        for index in range(args.warmup):
            candidate.train_step(*pool[index % len(pool)], record=False)
    rounds = np.full((args.rounds, len(candidates)), np.nan)
    for round_index in range(args.rounds):
        order = range(len(candidates)) if round_index % 2 == 0 else reversed(range(len(candidates)))
        for index in order:
            comm.mpi.Barrier()
            start = time.perf_counter()
            for step in range(args.steps):
                candidates[index].train_step(*pool[(args.warmup + step) % len(pool)], record=True)
            rounds[round_index, index] = comm.mpi.allreduce(time.perf_counter() - start, op=max_op())
    samples = comm.size * args.batch * args.steps
    plain, zero = candidates
    worst = max(((a.detach() - b.detach()).abs().max() / (b.detach().abs().max() or 1.0)).item()
                for a, b in zip(zero.model.parameters(), plain.model.parameters()))
    agree = all(ranks_hold_the_same(comm, c) for c in candidates)
    rows = []
    for index, candidate in enumerate(candidates):
        rows.append({
            "candidate": candidate.name, "ranks": comm.size, "params": sum(p.numel() for p in candidate.model.parameters()),
            "batch_per_rank": args.batch, "steps": args.steps, "rounds": args.rounds,
            **throughput(samples, rounds[:, index]),
            "step_ms": mean_over_ranks(comm, statistics.median(candidate.step_s) * 1e3),
            "optimizer_ms": mean_over_ranks(comm, statistics.median(candidate.optimizer_s) * 1e3),
            "state_bytes_per_rank": int(comm.mpi.allreduce(candidate.state_bytes(), op=max_op())),
            "max_rel_diff_vs_adam": worst if candidate is zero else 0.0,
            "correct": bool(agree and worst <= args.tolerance),
        })
    plain_rate = rows[0]["samples_per_s"]
    plain_state = rows[0]["state_bytes_per_rank"]
    for row in rows:
        row["vs_adam"] = row["samples_per_s"] / plain_rate
        row["state_vs_adam"] = row["state_bytes_per_rank"] / plain_state
    return rows


def max_op():
    from mpi4py import MPI
    return MPI.MAX


def mean_over_ranks(comm, value: float) -> float:
    return comm.mpi.allreduce(value) / comm.size


def ranks_hold_the_same(comm, candidate) -> bool:
    from mpi4py import MPI
    flat = torch.cat([p.detach().reshape(-1) for p in candidate.model.parameters()]).double().numpy()
    low, high = np.empty_like(flat), np.empty_like(flat)
    comm.mpi.Allreduce(flat, low, op=MPI.MIN)
    comm.mpi.Allreduce(flat, high, op=MPI.MAX)
    return bool((low == high).all())


def markdown_table(rows) -> str:
    lines = [f"# {rows[0]['ranks']} ranks, {rows[0]['params']:,} parameters, batch {rows[0]['batch_per_rank']} "
             f"per rank, {rows[0]['rounds']} rounds x {rows[0]['steps']} steps",
             "| candidate | samples/s (median) | rounds min-max | vs adam | step ms | optimizer ms | "
             "state MB per rank | state vs adam | max rel diff vs adam | correct |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['candidate']} | {row['samples_per_s']:.0f} | {rounds_range(row)} | "
                     f"{row['vs_adam']:.2f} | {row['step_ms']:.2f} | {row['optimizer_ms']:.2f} | "
                     f"{row['state_bytes_per_rank'] / 1e6:.1f} | {row['state_vs_adam']:.2f} | "
                     f"{row['max_rel_diff_vs_adam']:.1e} | {'yes' if row['correct'] else 'NO'} |")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="3M")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    comm = start_one_thread_per_rank(check_calls=False)
    rows = measure(comm, args)
    if comm.rank == 0:
        report(markdown_table(rows), rows, args.json)
    return 0 if all(row["correct"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
