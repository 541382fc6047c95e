"""Small all-reduce latency: mpidist's path for small CPU messages against calling mpi4py yourself.

    MPIDIST_CHECK=0 mpirun --oversubscribe -np 2 python benchmarks/small_allreduce.py \
        [--counts 1,256] [--calls 2000] [--rounds 15] [--candidates "mpi4py sum,mpidist sum"] [--json FILE]

Every round times `--calls` back-to-back calls of each candidate in turn (after a barrier), so
the noise of a shared machine falls on all of them alike; the table holds the median over
rounds of the time per call, in microseconds, on rank 0. Candidates, float32:

- `mpi4py sum`: `comm.Allreduce(array, out)` (the peer: mpi4py's own buffer call);
- `mpi4py sum + divide`: the same, then `out /= size` in NumPy (what an average costs by hand);
- `mpidist sum` / `mpidist avg`: `mpidist.allreduce(array, op=...)` on a NumPy array;
- `mpidist torch sum` / `mpidist torch avg`: the same on a torch tensor;
- `mpidist node sum` / `mpidist node torch sum`: `algorithm="hierarchical"` on one node, which the
  fast path hands straight to the node protocol (one call into the extension; `auto` takes it
  where the table gives small messages to the hierarchical all-reduce);
- `hvd torch sum`: `mpidist.torch.allreduce_(tensor, op=hvd.Sum)`, Horovod's call, which meets the
  other ranks' through the negotiation of hvd's operations (its thread and HOROVOD_CYCLE_TIME).

`--candidates` runs only those named (in the order above): leaving the node candidates out keeps the
hierarchical all-reduce from making the node window, as in a program that has no message large
enough for it.

The timed calls reduce zeros (an in-place sum of zeros stays zero); after them, each mpidist
candidate reduces ones once and is checked against what that must give (the rank count for a
sum, one for an average); the command exits 1 if one differs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import mpidist as md
import mpidist.torch as hvd


def candidates(world, array, out, tensor):
    """name -> (call, what its result should be when every rank's input is ones, or None)."""
    size = world.Get_size() if world is not None else 0

    def mpi4py_sum():
        world.Allreduce(array, out)

    def mpi4py_sum_divide():
        world.Allreduce(array, out)
        np.divide(out, size, out=out)

    return {
        "mpi4py sum": (mpi4py_sum, None),
        "mpi4py sum + divide": (mpi4py_sum_divide, None),
        "mpidist sum": (lambda: md.allreduce(array, op="sum"), size),
        "mpidist avg": (lambda: md.allreduce(array, op="avg"), 1),
        "mpidist torch sum": (lambda: md.allreduce(tensor, op="sum"), size),
        "mpidist torch avg": (lambda: md.allreduce(tensor, op="avg"), 1),
        "mpidist node sum": (lambda: md.allreduce(array, op="sum", algorithm="hierarchical"), size),
        "mpidist node torch sum": (lambda: md.allreduce(tensor, op="sum", algorithm="hierarchical"), size),
        "hvd torch sum": (lambda: hvd.allreduce_(tensor, op=hvd.Sum), size),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1,256", help="comma-separated element counts")
    parser.add_argument("--calls", type=int, default=2000, help="calls per candidate per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--candidates", help="comma-separated candidates to run, of those above (default: all)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    known = list(candidates(None, None, None, None))
    chosen = args.candidates.split(",") if args.candidates else known
    unknown = [name for name in chosen if name not in known]
    if unknown:
        parser.error(f"unknown candidates {unknown}; choose from {known}")
    md.init()
    if "hvd torch sum" in chosen:
        hvd.init()  # only then: its negotiation's thread would share the cores with the other candidates
    world = MPI.COMM_WORLD
    rows, wrong = [], []
    for count in [int(c) for c in args.counts.split(",")]:
        array, out, tensor = np.ones(count, np.float32), np.empty(count, np.float32), torch.ones(count)
        table = {name: call for name, call in candidates(world, array, out, tensor).items() if name in chosen}
        times = {name: [] for name in table}
        for _ in range(args.rounds):
            for name, (call, expected) in table.items():
                # Timed on zeros: in-place sums of zeros stay zero, call after call.
                array.fill(0)
                tensor.zero_()
                world.Barrier()
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
                if expected is not None:  # then one call on ones, checked
                    array.fill(1)
                    tensor.fill_(1)
                    call()
                    result = tensor.numpy() if "torch" in name else array
                    if not np.array_equal(result, np.full(count, expected, np.float32)):
                        wrong.append(f"{name}, {count} elements: {result[:4]} instead of {expected}")
        for name, samples in times.items():
            rows.append({"candidate": name, "count": count, "ranks": world.Get_size(),
                         "mpidist_check": os.environ.get("MPIDIST_CHECK", "1"),
                         "time_us": statistics.median(samples), "time_us_rounds": samples})
    wrong = [w for ws in world.allgather(wrong) for w in ws]
    if world.Get_rank() == 0:
        print(f"# {world.Get_size()} ranks, {args.rounds} rounds x {args.calls} calls, median us per call")
        print("| candidate | " + " | ".join(f"{c} elements" for c in args.counts.split(",")) + " |")
        print("|---|" + "---|" * len(args.counts.split(",")))
        for name in times:
            cells = [f"{r['time_us']:.2f}" for r in rows if r["candidate"] == name]
            print(f"| {name} | " + " | ".join(cells) + " |")
        for problem in wrong:
            print("WRONG:", problem)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(rows, handle, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
