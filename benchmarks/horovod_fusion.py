"""What Horovod's tensor fusion gives mpidist.torch: many small named allreduce_async per step,
fused (HOROVOD_FUSION_THRESHOLD at its default) or not (0), beside one all-reduce per tensor
called directly (md.allreduce, no negotiation) and the tensors packed by hand into one buffer.

    mpirun --oversubscribe -np 2 python benchmarks/horovod_fusion.py \
        [--tensors 64] [--elements 256] [--steps 20] [--rounds 9] [--json FILE]

A step submits `--tensors` float32 tensors of `--elements` each under their own names, in an
order shuffled per rank and step (the negotiation matches them by name), then synchronizes them
all. Every round times `--steps` steps of each candidate in turn, so the noise of a shared
machine falls on all of them alike; the table holds the median over rounds of the time per step
on rank 0, in milliseconds. The threshold is changed between rounds on every rank before an MPI
barrier, while no operation is pending. After the timing, each candidate's result of one step is
checked against the sum of every rank's input; the command exits 1 if one differs.
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
from machine import cpu_model  # benchmarks/machine.py, beside this script
from mpi4py import MPI

import mpidist as md
import mpidist.torch as hvd

FUSED_DEFAULT = str(25 * 2 ** 20)


def step_inputs(rank, tensors, elements, step):
    return [torch.full((elements,), float((rank + 1) * (k + 1) + step)) for k in range(tensors)]


def negotiated_step(inputs, rank, step):
    order = np.random.default_rng(1000 * step + rank).permutation(len(inputs))
    handles = {k: hvd.allreduce_async(inputs[k], name=f"gradient.{k}", op=hvd.Sum) for k in order}
    return [hvd.synchronize(handles[k]) for k in range(len(inputs))]


def direct_step(inputs, rank, step):
    return [md.allreduce(tensor.clone(), op="sum") for tensor in inputs]


def packed_step(inputs, rank, step):
    flat = md.allreduce(torch.cat(inputs), op="sum")
    return list(flat.split([tensor.numel() for tensor in inputs]))


CANDIDATES = {
    "hvd allreduce_async, fused": (negotiated_step, FUSED_DEFAULT),
    "hvd allreduce_async, HOROVOD_FUSION_THRESHOLD=0": (negotiated_step, "0"),
    "md.allreduce per tensor": (direct_step, None),
    "md.allreduce of one packed buffer": (packed_step, None),
}


def run(candidate, args, world, step_offset):
    call, threshold = CANDIDATES[candidate]
    if threshold is not None:
        os.environ["HOROVOD_FUSION_THRESHOLD"] = threshold
    world.Barrier()
    rank = world.Get_rank()
    inputs = [step_inputs(rank, args.tensors, args.elements, step) for step in range(args.steps)]
    start = time.perf_counter()
    for step in range(args.steps):
        call(inputs[step], rank, step_offset + step)
    return (time.perf_counter() - start) / args.steps * 1e3


def wrong_results(candidate, args, world) -> int:
    call, threshold = CANDIDATES[candidate]
    if threshold is not None:
        os.environ["HOROVOD_FUSION_THRESHOLD"] = threshold
    world.Barrier()
    size = world.Get_size()
    results = call(step_inputs(world.Get_rank(), args.tensors, args.elements, 0), world.Get_rank(), 0)
    expected = [sum(step_inputs(r, args.tensors, args.elements, 0)[k] for r in range(size)) for k in range(args.tensors)]
    return sum(int((result != reference).sum()) for result, reference in zip(results, expected))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--elements", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", help="write the rows to this file (rank 0)")
    args = parser.parse_args(argv)
    hvd.init()
    world = MPI.COMM_WORLD
    times = {candidate: [] for candidate in CANDIDATES}
    for round_index in range(args.rounds):
        for candidate in CANDIDATES:
            times[candidate].append(run(candidate, args, world, round_index * args.steps))
    wrong = {candidate: world.allreduce(wrong_results(candidate, args, world)) for candidate in CANDIDATES}
    if world.Get_rank() == 0:
        rows = [{"candidate": candidate, "ranks": world.Get_size(), "tensors": args.tensors,
                 "bytes_per_tensor": 4 * args.elements, "ms_per_step": statistics.median(measured),
                 "ms_per_step_min": min(measured), "wrong": wrong[candidate]} for candidate, measured in times.items()]
        print(f"{world.Get_size()} ranks, {args.tensors} tensors x {4 * args.elements} B per step, median of "
              f"{args.rounds} rounds x {args.steps} steps (rank 0); load average {os.getloadavg()[0]:.1f}")
        for row in rows:
            print(f"  {row['candidate']:<50} {row['ms_per_step']:8.2f} ms/step (min {row['ms_per_step_min']:.2f})"
                  f"  wrong {row['wrong']}")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"cpu": cpu_model(), "cores": os.cpu_count(), "load_average": os.getloadavg(),
                           "command": f"mpirun -np {world.Get_size()} python " + " ".join(sys.argv), "rows": rows},
                          handle, indent=1)
    return 1 if any(wrong.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
