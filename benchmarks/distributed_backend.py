"""The torch.distributed backend "mpidist" against gloo and against mpidist's own API.

    MPIDIST_CHECK=0 mpirun --oversubscribe --bind-to none -np 2 python benchmarks/distributed_backend.py \
        [--params 3M] [--batch 64] [--bucket-mb 25] [--steps 10] [--rounds 5] [--warmup 3] \
        [--counts 1,1024,262144,4194304] [--calls 200] [--json FILE]

Two questions, in one run, every candidate interleaved round by round (the order rotates) so
the noise of a shared machine falls on all alike:

1. Training throughput on the MLP of benchmarks/training.py (3M: 1024-1024-1024-1024-10, batch
   `--batch` per rank, cross-entropy, SGD): torch DDP over "mpidist" (the default process
   group; `--bucket-mb` is DDP's bucket_cap_mb), torch DDP over "gloo" (a gloo group of the
   same processes, made with new_group on the store the mpidist rendezvous set up), mpidist's
   own DataParallel, and torch DDP over a second "mpidist" group made with
   MPIDIST_EAGER_ON_NODE=0 ("background thread": its asynchronous all-reduces queued on the
   group's engine, as across nodes). samples_per_s is global:
   ranks x batch x steps / the slowest rank's time for the round; the median over rounds.
   Correctness: after the steps, every candidate's parameters are compared with DDP over gloo's
   (same initial weights, same batches): max |a - b| / max |b| <= 1e-5, else the command exits 1.
2. All-reduce of float32 tensors of `--counts` elements, before the training and after it: dist.all_reduce over "mpidist", over
   "gloo", and mpidist.allreduce (our API) on a Communicator, `--calls` back-to-back calls per
   round; time per call (median over rounds), bus bandwidth as nccl-tests defines it
   (bytes / time x 2(p-1)/p), and the backend's overhead over our API (the difference of their
   times per call, in microseconds). Each candidate then sums ones once, checked. With the
   ranks on several nodes (or MPIDIST_EAGER_ON_NODE=0), DDP's asynchronous all-reduces start
   the default group's background engine, and a blocking call then runs on the engine's
   communicator (on the caller's thread when nothing is queued): the second pass measures that
   path. On one node DDP's all-reduces run at once and start no engine: the second pass then
   measures the first one's path again, after the training.
   benchmarks/distributed_backend_layers.py splits the cost per call into its layers.

One thread per rank (torch, mpidist's kernels). MPIDIST_CHECK=0 turns mpidist's cross-rank call
check off for all mpidist candidates alike (gloo has none).
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")  # as benchmarks/training.py: see there
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from training import LR, build_model, layer_sizes, make_pool, parse_count, throughput  # noqa: E402

import mpidist as md  # noqa: E402
from mpidist import kernels  # noqa: E402

TOLERANCE = 1e-5
SEED = 0


class Trainer:
    """One candidate: a wrapped copy of the model (same initial weights for all) and its SGD."""

    def __init__(self, name, sizes, wrap):
        torch.manual_seed(SEED)
        self.name, self.model = name, build_model(sizes)
        self.wrapped = wrap(self.model)
        self.optimizer = torch.optim.SGD(self.wrapped.parameters(), lr=LR)
        self.loss = torch.nn.CrossEntropyLoss()

    def steps(self, pool, first, count):
        for index in range(first, first + count):
            x, y = pool[index % len(pool)]
            self.loss(self.wrapped(x), y).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()


def max_rel_diff(a, b) -> float:
    return max((pa.detach() - pb.detach()).abs().max().item() / (pb.detach().abs().max().item() or 1.0)
               for pa, pb in zip(a.parameters(), b.parameters()))


def slowest(seconds: float) -> float:
    """The slowest rank's time."""
    value = torch.tensor([seconds], dtype=torch.float64)
    md.allreduce(value, op="max")
    return float(value[0])


def background_group():
    """An mpidist group of every rank that queues asynchronous collectives on its background
    thread even on one node (MPIDIST_EAGER_ON_NODE=0 while it is made)."""
    saved = os.environ.get("MPIDIST_EAGER_ON_NODE")
    os.environ["MPIDIST_EAGER_ON_NODE"] = "0"
    try:
        return dist.new_group(backend="mpidist")
    finally:
        if saved is None:
            del os.environ["MPIDIST_EAGER_ON_NODE"]
        else:
            os.environ["MPIDIST_EAGER_ON_NODE"] = saved


def training(args, gloo, background, rank, size) -> list[dict]:
    sizes = layer_sizes(parse_count(args.params), 4)
    pool = make_pool(sizes, args.batch, SEED, rank)

    def ddp(model, process_group=None):
        return torch.nn.parallel.DistributedDataParallel(model, process_group=process_group,
                                                         bucket_cap_mb=args.bucket_mb)

    trainers = [Trainer("ddp mpidist", sizes, ddp),
                Trainer("ddp gloo", sizes, lambda m: ddp(m, process_group=gloo)),
                Trainer("mpidist DataParallel", sizes, md.DataParallel),
                Trainer("ddp mpidist, background thread", sizes, lambda m: ddp(m, process_group=background))]
    step = 0
    for trainer in trainers:
        trainer.steps(pool, step, args.warmup)
    step += args.warmup
    seconds = {trainer.name: [] for trainer in trainers}
    for round_index in range(args.rounds):
        order = trainers[round_index % len(trainers):] + trainers[:round_index % len(trainers)]
        for trainer in order:
            md.barrier()
            start = time.perf_counter()
            trainer.steps(pool, step, args.steps)
            seconds[trainer.name].append(slowest(time.perf_counter() - start))
        step += args.steps
    reference = trainers[1].model
    rows = []
    for trainer in trainers:
        diff = max_rel_diff(trainer.model, reference)
        rows.append({"question": "training", "candidate": trainer.name, "ranks": size, "batch_per_rank": args.batch,
                     "ddp_bucket_mb": args.bucket_mb,
                     "params": sum(p.numel() for p in trainer.model.parameters()), "steps": args.steps,
                     "rounds": args.rounds, **throughput(size * args.batch * args.steps, seconds[trainer.name]),
                     "max_rel_diff_vs_ddp_gloo": diff,
                     "correct": diff <= TOLERANCE})
    gloo_rate = rows[1]["samples_per_s"]
    for row in rows:
        row["vs_ddp_gloo"] = row["samples_per_s"] / gloo_rate
    return rows


def allreduce(args, gloo, comm, size, phase: str) -> list[dict]:
    rows = []
    for count in (int(c) for c in args.counts.split(",")):
        tensor = torch.zeros(count)
        candidates = {"dist.all_reduce mpidist": lambda t: dist.all_reduce(t),
                      "dist.all_reduce gloo": lambda t: dist.all_reduce(t, group=gloo),
                      "mpidist.allreduce": lambda t: comm.allreduce(t)}
        calls = max(3, args.calls if count <= 65536 else args.calls // 20)
        times = {name: [] for name in candidates}
        for round_index in range(args.rounds):
            names = list(candidates)
            names = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in names:
                tensor.zero_()  # timed on zeros: sums of zeros stay zero
                md.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    candidates[name](tensor)
                times[name].append(slowest(time.perf_counter() - start) / calls * 1e6)
        for name, call in candidates.items():
            ones = torch.ones(count)
            call(ones)
            time_us = statistics.median(times[name])
            rows.append({"question": "allreduce", "phase": phase, "candidate": name, "ranks": size, "count": count,
                         "bytes": 4 * count,
                         "calls": calls, "rounds": args.rounds, "time_us": time_us, "time_us_rounds": times[name],
                         "busbw_gbs": 4 * count / (time_us * 1e-6) * 2 * (size - 1) / size / 1e9,
                         "correct": bool((ones == size).all())})
        ours = rows[-1]["time_us"]
        for row in rows[-3:]:
            row["overhead_us_vs_mpidist_api"] = row["time_us"] - ours
    return rows


def markdown(rows) -> str:
    lines = ["| candidate | samples/s | vs DDP gloo | max rel diff vs DDP gloo |", "|---|---|---|---|"]
    for row in rows:
        if row["question"] == "training":
            lines.append(f"| {row['candidate']} | {row['samples_per_s']:.0f} | {row['vs_ddp_gloo']:.2f}x | "
                         f"{row['max_rel_diff_vs_ddp_gloo']:.1e} |")
    lines += ["", "| when | candidate | elements | time per call (us) | busbw (GB/s) | overhead vs mpidist.allreduce (us) |",
              "|---|---|---|---|---|---|"]
    for row in rows:
        if row["question"] == "allreduce":
            lines.append(f"| {row['phase']} | {row['candidate']} | {row['count']} | {row['time_us']:.1f} | "
                         f"{row['busbw_gbs']:.3f} | "
                         f"{row['overhead_us_vs_mpidist_api']:+.1f} |")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="3M")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--counts", default="1,1024,262144,4194304", help="all-reduce sizes, float32 elements")
    parser.add_argument("--calls", type=int, default=200, help="calls per round (a twentieth above 64K elements)")
    parser.add_argument("--json", metavar="FILE")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    kernels.set_num_threads(1)
    comm = md.init()
    dist.init_process_group("mpidist")
    gloo = dist.new_group(backend="gloo")
    background = background_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    rows = allreduce(args, gloo, comm, size, "before any async_op") \
        + training(args, gloo, background, rank, size) + allreduce(args, gloo, comm, size, "after DDP (async_op)")
    for row in rows:
        row["mpidist_check"] = os.environ.get("MPIDIST_CHECK", "1")
    failed = [row for row in rows if not row["correct"]]
    if rank == 0:
        print(markdown(rows), flush=True)
        for row in failed:
            print(f"WRONG: {row['candidate']} ({row['question']})")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(rows, handle, indent=1)
                handle.write("\n")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
