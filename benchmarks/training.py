"""Data-parallel training throughput: mpidist DataParallel against torch DDP (gloo) and one process.

    mpirun --oversubscribe --bind-to none -np 2 python benchmarks/training.py \
        [--params 3M] [--batch 64] [--steps 20] [--rounds 5] [--warmup 5] [--buckets 25,1] \
        [--views] [--json FILE] [--plot FILE]

Model: an MLP of `--depth` linear layers in all, `--depth` - 1 of width x width (ReLU after
each) and a last width x 10 one; the width is chosen so the model has about `--params`
parameters (3M: width 1024, 4 layers, 3,159,050 parameters). Data: fixed random batches
(inputs N(0, 1), labels uniform in 0..9), `--batch` samples per rank per step, a different pool
on every rank, the same pool for every candidate. Cross-entropy loss, plain SGD (lr 0.01). One
thread per rank: torch, the mpidist kernels and OMP_NUM_THREADS.

Candidates, all in the same run and interleaved: every round runs `--steps` steps of each
candidate in turn (the order rotates from round to round), so the noise of a shared machine
falls on all of them alike:

- `mpidist` DataParallel, one row per bucket size in `--buckets` (MB);
- `ddp`: torch.nn.parallel.DistributedDataParallel over gloo (default buckets);
- with `--views`, also `mpidist ... views` and `ddp views`: the same with
  gradient_as_bucket_view=True (their vs_ddp is against `ddp views`);
- `local`: every rank trains its own model on its batches, no communication: what the ranks
  reach together on this machine when nothing is shared, the ceiling for data parallelism;
- `lockstep` (all ranks on one node): `local` plus one synchronization of the ranks after each
  backward (a one-element all-reduce through the shared slots), no gradients exchanged: the
  ceiling for synchronous data parallelism, whose every step waits for the slowest rank;
- `single`: rank 0 trains alone (batch `--batch`), the other ranks sleep in a polled barrier.

samples_per_s is global: ranks x batch x steps / the slowest rank's time for the round (for
`single`: batch x steps / rank 0's time). Rows hold the median over rounds and every round.

Breakdown (mpidist rows; per step, median over measured steps, mean over ranks): forward (with
the loss), backward compute (backward minus the wait below), exposed wait (GradientBuckets.wait
in the callback that ends backward: launching the buckets still pending, waiting for every
all-reduce, unpacking), optimizer (step and zero_grad). comm_ms is the sum of the buckets'
all-reduce times, start to finish of each (GradientBuckets.trace: on one node from the copy-in
at launch to the copy-out, through the polled shared slots; otherwise on the async engine's
thread), comm_hidden_ms the part of it that ran before the exposed wait began, i.e. behind
backward. The wait's timestamps come from wrapping GradientBuckets.wait on the instances used
here; mpidist itself is unchanged by that.

Correctness: after the measured steps, every mpidist model's parameters are compared with DDP's
(same initial weights, same batches, same number of steps): max over tensors of
max|a - b| / max|b| must be <= --tolerance (1e-5). Also every rank must hold the same parameters.
The command exits 1 if a check fails.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Open MPI busy-polls while a request is pending. Where a rank has two busy threads (the
# training loop and mpidist's async engine, which serves the buckets unless all ranks share one
# node) on fewer cores, a rank waiting for its peer's bucket would steal the CPU the peer needs
# to produce it; yielding when idle avoids that (Open MPI's advice for
# oversubscribed nodes). Set before MPI starts; `OMPI_MCA_mpi_yield_when_idle=0` in the
# environment turns it off. Other MPI libraries ignore the variable.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling modules, however it is run

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from training_candidates import (  # noqa: E402
    Candidate,
    DDPCandidate,
    LocalCandidate,
    LockstepCandidate,
    MpidistCandidate,
    SingleCandidate,
)

ROW_KEYS = ("candidate", "bucket_mb", "gradient_as_bucket_view", "ranks", "batch_per_rank", "params", "layers",
            "steps", "rounds",
            "samples_per_s", "samples_per_s_rounds", "step_ms", "forward_ms", "backward_ms",
            "exposed_wait_ms", "optimizer_ms", "comm_ms", "comm_hidden_ms", "buckets",
            "vs_ddp", "vs_single", "vs_local", "max_rel_diff_vs_ddp", "correct",
            "mpi_yield_when_idle")
LR = 0.01
CLASSES = 10


def parse_count(text: str) -> int:
    """'3M' -> 3_000_000, '20K' -> 20_000 (decimal multiples: a parameter count)."""
    text = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:], None)
    return int(float(text[:-1]) * scale) if scale else int(text)


def layer_sizes(params: int, depth: int) -> list[int]:
    """[width] * depth + [10]: (depth - 1) width x width layers and a width x 10 one, width a
    multiple of 16 (of 64 above 256) chosen so the parameter count is closest to `params`."""
    width = math.sqrt(params / max(1, depth - 1))
    step = 64 if width > 256 else 16
    width = max(step, int(round(width / step)) * step)
    return [width] * depth + [CLASSES]


def build_model(sizes: list[int]) -> torch.nn.Module:
    layers = []
    for index, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if index < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def sleeping_barrier(comm) -> None:
    """A barrier that polls with short sleeps instead of spinning, so an idle rank leaves its
    core to the rank that works (MPI's blocking barrier busy-polls)."""
    request = comm.mpi.Ibarrier()
    while not request.Test():
        time.sleep(0.0005)


# ---- the measurement ----------------------------------------------------------------------------

def run_steps(candidate, comm, pool, first: int, count: int, record: bool) -> float:
    """`count` steps of one candidate on batches first, first+1, ... of the pool; returns this
    rank's elapsed seconds (NaN on the ranks that sit out the single-process candidate)."""
    works = candidate.name != "single" or comm.rank == 0
    comm.mpi.Barrier()
    start = time.perf_counter()
    if works:
        for index in range(first, first + count):
            x, y = pool[index % len(pool)]
            candidate.train_step(x, y, record)
    elapsed = time.perf_counter() - start
    if candidate.name == "single":
        sleeping_barrier(comm)
    return elapsed if works else float("nan")


def make_pool(sizes, batch, seed, rank, batches=8):
    generator = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    return [(torch.randn(batch, sizes[0], generator=generator),
             torch.randint(0, CLASSES, (batch,), generator=generator)) for _ in range(batches)]


def max_rel_diff(a: Candidate, b: Candidate) -> float:
    worst = 0.0
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        scale = pb.detach().abs().max().item() or 1.0
        worst = max(worst, (pa.detach() - pb.detach()).abs().max().item() / scale)
    return worst


def ranks_agree(comm, candidate) -> bool:
    from mpi4py import MPI
    flat = candidate.parameters_flat().numpy().astype(np.float64)
    low, high = np.empty_like(flat), np.empty_like(flat)
    comm.mpi.Allreduce(flat, low, op=MPI.MIN)
    comm.mpi.Allreduce(flat, high, op=MPI.MAX)
    return bool((low == high).all())


class Lineup:
    """The candidates of one run, in the order they are measured and reported: the mpidist ones,
    DDP (per gradient_as_bucket_view setting), then the references that exchange no gradients
    (local, lockstep where all ranks share one node, single)."""

    def __init__(self, sizes, comm, args):
        def model():  # the same initial weights for every candidate
            torch.manual_seed(args.seed)
            return build_model(sizes)

        settings = (False, True) if args.views else (False,)
        self.candidates = [MpidistCandidate(model(), LR, comm, mb, views) for views in settings for mb in args.buckets]
        self.ddps = {views: DDPCandidate(model(), LR, views) for views in settings}
        self.single = SingleCandidate(model(), LR)
        self.local = LocalCandidate(model(), LR)
        self.references = [self.local, self.single]
        if comm.local_size == comm.size:
            self.references.insert(1, LockstepCandidate(model(), LR, comm))
        self.candidates += list(self.ddps.values()) + self.references


def measure(comm, args) -> list[dict]:
    from mpidist.cli.bench_gloo import Gloo

    sizes = layer_sizes(parse_count(args.params), args.depth)
    gloo = Gloo(comm)
    try:
        lineup = Lineup(sizes, comm, args)
        params = sum(p.numel() for p in lineup.single.model.parameters())
        pool = make_pool(sizes, args.batch, args.seed, comm.rank)
        single_pool = make_pool(sizes, args.batch, args.seed, 0)
        if comm.rank == 0:
            print(f"# {comm.size} ranks, MLP {'-'.join(map(str, sizes))} ({params:,} parameters), "
                  f"batch {args.batch} per rank, {args.rounds} rounds x {args.steps} steps, "
                  f"warmup {args.warmup}", flush=True)
        slowest = time_rounds(lineup, comm, args, pool, single_pool)
        rows = [row_of(candidate, candidate is lineup.single, slowest[:, index], sizes, params, comm, args)
                for index, candidate in enumerate(lineup.candidates)]
        compare_rates(rows, lineup)
        check_correctness(rows, lineup, comm, args.tolerance)
        for candidate in lineup.candidates:
            candidate.close()
        return rows
    finally:
        gloo.close(comm)


def time_rounds(lineup: Lineup, comm, args, pool, single_pool) -> np.ndarray:
    """The warm-up steps of every candidate, then `args.rounds` rounds of `args.steps` steps of
    each, in an order that rotates from round to round; [round, candidate] the slowest rank's
    seconds."""
    from mpi4py import MPI

    candidates = lineup.candidates
    for candidate in candidates:
        run_steps(candidate, comm, single_pool if candidate is lineup.single else pool, 0, args.warmup, False)
    elapsed = np.full((args.rounds, len(candidates)), np.nan)
    for round_index in range(args.rounds):
        order = list(range(len(candidates)))
        shift = round_index % len(order)
        for index in order[shift:] + order[:shift]:
            candidate = candidates[index]
            first = args.warmup + round_index * args.steps
            elapsed[round_index, index] = run_steps(
                candidate, comm, single_pool if candidate is lineup.single else pool, first, args.steps, True)
    slowest = np.empty_like(elapsed)
    comm.mpi.Allreduce(np.nan_to_num(elapsed, nan=-1.0), slowest, op=MPI.MAX)
    return slowest


def row_of(candidate: Candidate, alone: bool, seconds, sizes, params: int, comm, args) -> dict:
    """A candidate's row, but for its comparisons: its samples/s from each round's `seconds`, and
    its step's breakdown, the mean over the ranks of each rank's medians (rank 0's `alone`)."""
    from mpi4py import MPI

    ranks = 1 if alone else comm.size
    phases = np.array(candidate.phases if candidate.phases else [[np.nan] * 6])
    medians = np.median(phases, axis=0) * 1e3
    summed = np.empty_like(medians)
    comm.mpi.Allreduce(np.nan_to_num(medians, nan=0.0), summed, op=MPI.SUM)
    mean = summed / (1 if alone else comm.size)
    step_ms = float(np.median(np.sum(phases[:, :4], axis=1))) * 1e3
    step_sum = np.empty(1)
    comm.mpi.Allreduce(np.array([0.0 if math.isnan(step_ms) else step_ms]), step_sum, op=MPI.SUM)
    is_mpidist = candidate.name == "mpidist"
    return {
        "candidate": candidate.name, "bucket_mb": candidate.bucket_mb,
        "gradient_as_bucket_view": candidate.views, "ranks": ranks,
        "batch_per_rank": args.batch, "params": params, "layers": sizes, "steps": args.steps,
        "rounds": args.rounds, **throughput(ranks * args.batch * args.steps, seconds),
        "step_ms": round(float(step_sum[0]) / (1 if alone else comm.size), 3),
        "forward_ms": round(float(mean[0]), 3), "backward_ms": round(float(mean[1]), 3),
        "exposed_wait_ms": round(float(mean[2]), 3) if is_mpidist or candidate.name == "lockstep" else None,
        "optimizer_ms": round(float(mean[3]), 3),
        "comm_ms": round(float(mean[4]), 3) if is_mpidist else None,
        "comm_hidden_ms": round(float(mean[5]), 3) if is_mpidist else None,
        "buckets": candidate.buckets,
        "mpi_yield_when_idle": os.environ.get("OMPI_MCA_mpi_yield_when_idle"),
    }


def compare_rates(rows: list[dict], lineup: Lineup) -> None:
    """Each row's samples/s against DDP's with the same gradient_as_bucket_view setting, single's
    and local's; the correctness columns left empty for check_correctness."""
    ddp_rates = {views: rows[lineup.candidates.index(c)]["samples_per_s"] for views, c in lineup.ddps.items()}
    single_rate = rows[lineup.candidates.index(lineup.single)]["samples_per_s"]
    local_rate = rows[lineup.candidates.index(lineup.local)]["samples_per_s"]
    for row in rows:
        row["vs_ddp"] = round(row["samples_per_s"] / ddp_rates[row["gradient_as_bucket_view"]], 3)
        row["vs_single"] = round(row["samples_per_s"] / single_rate, 3)
        row["vs_local"] = round(row["samples_per_s"] / local_rate, 3)
        row["max_rel_diff_vs_ddp"] = None
        row["correct"] = None


def check_correctness(rows: list[dict], lineup: Lineup, comm, tolerance: float) -> None:
    """DataParallel against DDP on every rank, and the ranks against each other, for every
    candidate but the references."""
    from mpi4py import MPI

    ddp = lineup.ddps[False]
    for index, candidate in enumerate(lineup.candidates):
        if candidate in lineup.references:
            continue
        agree = ranks_agree(comm, candidate)
        mine = max_rel_diff(candidate, ddp) if candidate is not ddp else 0.0
        worst = np.empty(1)
        comm.mpi.Allreduce(np.array([mine]), worst, op=MPI.MAX)
        rows[index]["max_rel_diff_vs_ddp"] = float(worst[0])
        rows[index]["correct"] = bool(agree and worst[0] <= tolerance)


# ---- outputs ------------------------------------------------------------------------------------

def label(row) -> str:
    name = f"mpidist {row['bucket_mb']:g} MB" if row["candidate"] == "mpidist" else row["candidate"]
    return name + " views" if row.get("gradient_as_bucket_view") else name


def markdown_table(rows) -> str:
    def fmt(value, digits=2):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| candidate | buckets | samples/s (median) | rounds min-max | vs ddp | vs single | vs local | step ms | "
             "forward ms | backward ms | exposed wait ms | optimizer ms | comm ms | comm hidden ms | "
             "max rel diff vs ddp | correct |",
             "|" + "---|" * 16]
    for row in rows:
        lines.append(
            f"| {label(row)} | {row['buckets'] if row['buckets'] is not None else '-'} | "
            f"{row['samples_per_s']:.0f} | {rounds_range(row)} | {row['vs_ddp']:.2f} | {row['vs_single']:.2f} | "
            f"{row['vs_local']:.2f} | "
            f"{fmt(row['step_ms'])} | {fmt(row['forward_ms'])} | {fmt(row['backward_ms'])} | "
            f"{fmt(row['exposed_wait_ms'])} | {fmt(row['optimizer_ms'])} | {fmt(row['comm_ms'])} | "
            f"{fmt(row['comm_hidden_ms'])} | "
            f"{'-' if row['max_rel_diff_vs_ddp'] is None else format(row['max_rel_diff_vs_ddp'], '.1e')} | "
            f"{'-' if row['correct'] is None else ('yes' if row['correct'] else 'NO')} |")
    return "\n".join(lines)


def plot(rows, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [label(row) for row in rows]
    medians = [row["samples_per_s"] for row in rows]
    lows = [m - min(row["samples_per_s_rounds"]) for m, row in zip(medians, rows)]
    highs = [max(row["samples_per_s_rounds"]) - m for m, row in zip(medians, rows)]
    left.bar(names, medians, yerr=[lows, highs], capsize=4,
             color=["tab:blue" if row["candidate"] == "mpidist" else "tab:gray" for row in rows])
    left.set_ylabel("samples/s (global; median, bars: min-max over rounds)")
    left.set_title(f"{rows[0]['ranks']} ranks, MLP {'-'.join(map(str, rows[0]['layers']))}, "
                   f"batch {rows[0]['batch_per_rank']}/rank")
    left.grid(True, axis="y", alpha=0.3)

    parts = [("forward_ms", "forward"), ("backward_ms", "backward compute"),
             ("exposed_wait_ms", "exposed wait"), ("optimizer_ms", "optimizer")]
    bottom = np.zeros(len(rows))
    for key, name in parts:
        values = np.array([row[key] or 0.0 for row in rows])
        right.bar(names, values, bottom=bottom, label=name)
        bottom += values
    comm = [row["comm_ms"] for row in rows]
    hidden = [row["comm_hidden_ms"] for row in rows]
    xs = [i for i, c in enumerate(comm) if c is not None]
    right.scatter(xs, [comm[i] for i in xs], marker="_", s=600, color="black", label="all-reduce total (ms)")
    right.scatter(xs, [hidden[i] for i in xs], marker="_", s=600, color="red", label="all-reduce hidden (ms)")
    right.set_ylabel("ms per step (median)")
    right.set_title("per-step breakdown")
    right.legend(fontsize=8)
    right.grid(True, axis="y", alpha=0.3)
    for axes in (left, right):  # long candidate names: slanted so they do not overlap
        axes.tick_params(axis="x", labelrotation=30)
        for tick in axes.get_xticklabels():
            tick.set_horizontalalignment("right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="3M", help="about this many parameters (3M, 20K, ...)")
    parser.add_argument("--depth", type=int, default=4, help="linear layers in all, the last one width x 10 (default 4)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=20, help="steps per candidate per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5, help="steps per candidate before the rounds")
    parser.add_argument("--buckets", default="25,1", help="mpidist bucket sizes in MB, comma-separated")
    parser.add_argument("--views", action="store_true",
                        help="also measure each mpidist bucket size and DDP with gradient_as_bucket_view=True")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--check", action="store_true",
                        help="keep mpidist's per-call cross-rank check on (default off, as MPIDIST_CHECK=0)")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    args.buckets = [float(part) for part in args.buckets.split(",") if part.strip()]
    return args


def start_one_thread_per_rank(check_calls: bool):
    """torch and mpidist's kernels on one thread each, then MPI; returns the world communicator."""
    import mpidist as md
    from mpidist import kernels

    torch.set_num_threads(1)
    kernels.set_num_threads(1)
    comm = md.init()
    comm.check_calls = check_calls
    return comm


def throughput(samples: int, seconds) -> dict:
    """A row's samples/s over rounds, from each round's `seconds` for `samples` samples (the
    slowest rank's time): the median and every round's."""
    rates = [samples / float(round_seconds) for round_seconds in seconds]
    return {"samples_per_s": round(statistics.median(rates), 2), "samples_per_s_rounds": [round(r, 2) for r in rates]}


def rounds_range(row, digits: int = 0) -> str:
    """A row's lowest and highest samples/s over rounds, "min-max", for the tables."""
    rates = row["samples_per_s_rounds"]
    return f"{min(rates):.{digits}f}-{max(rates):.{digits}f}"


def report(table: str, rows, json_path) -> None:
    """Rank 0's output: the table on stdout and, if asked, the rows as JSON."""
    print(table, flush=True)
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(rows, handle, indent=1)
            handle.write("\n")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    comm = start_one_thread_per_rank(args.check)
    rows = measure(comm, args)
    if comm.rank == 0:
        report(markdown_table(rows), rows, args.json)
        if args.plot:
            plot(rows, args.plot)
    return 0 if all(row["correct"] is not False for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
