"""The int8 compressor's compute on one rank: its steps run by mpidist._C's kernels
(csrc/quantize.cpp) against the same steps as torch operations, without the network.

    python benchmarks/int8_compute.py [--ranks 4] [--hidden 2560] [--chunk 1024] [--steps 15]
        [--rounds 3] [--threads 1] [--output PATH]

The buckets are benchmarks/compression.py's model's (an MLP 64 -> hidden -> hidden -> 10, one
bucket per layer's weight and bias), float32. Per step, rank 1 of `--ranks` does the local work
of an int8 exchange on every bucket: quantizes its gradient plus residual into one part per rank,
sums its own part over `--ranks` received payload rows and requantizes it, and dequantizes
`--ranks` gathered rows into the bucket (the all-to-all and allgather between are left out). A
row holds the CPU time per step (time.process_time: the median of `--steps` steps after one
warm-up), for `--rounds` rounds alternating between the two. torch and the kernels use
`--threads` threads (benchmarks/compression.py's nodes run one per rank). Prints a Markdown table
and writes PATH.json with --output.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from machine import cpu_model  # noqa: E402

from mpidist import kernels  # noqa: E402
from mpidist.parallel.compressors import Int8  # noqa: E402
from mpidist.parallel.int8_parts import Int8Parts  # noqa: E402


def step_seconds(args, fused):
    """CPU seconds of each step's local int8 work over every bucket."""
    generator = torch.Generator().manual_seed(0)
    work = []
    for rows, columns in [(args.hidden, 64), (args.hidden, args.hidden), (10, args.hidden)]:
        numel = rows * columns + rows
        parts = Int8Parts(numel, args.ranks, 1, args.chunk, torch.float32, "cpu")
        parts.fused = fused
        grad, residual = torch.randn(numel, generator=generator), torch.zeros(numel)
        received = torch.stack([parts.quantize(grad * (rank + 1), torch.zeros(numel))[rank % args.ranks]
                                for rank in range(args.ranks)])
        gathered = torch.cat([parts.sum_own(received, torch.zeros(numel))] * args.ranks)
        work.append((parts, grad, residual, received, gathered))
    times = []
    for _ in range(args.steps + 1):
        began = time.process_time()
        for parts, grad, residual, received, gathered in work:
            parts.quantize(grad, residual)
            parts.sum_own(received, residual)
            parts.dequantize_into(grad.clone(), gathered)
        times.append(time.process_time() - began)
    return statistics.median(times[1:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--chunk", type=int, default=Int8().chunk)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", help="PATH.json for the measurements")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels.set_num_threads(args.threads)
    rows = {"torch operations": [], "mpidist._C kernels": []}
    for _ in range(args.rounds):
        rows["torch operations"].append(step_seconds(args, fused=False))
        rows["mpidist._C kernels"].append(step_seconds(args, fused=True))
    base = statistics.median(rows["torch operations"])
    print(f"| int8, {args.ranks} ranks, hidden {args.hidden}, chunk {args.chunk}, {args.threads} thread(s) "
          "| CPU ms per step, each round | median | vs torch operations |")
    print("|---|---|---:|---:|")
    for name, seconds in rows.items():
        median = statistics.median(seconds)
        print(f"| {name} | {', '.join(f'{s * 1e3:.1f}' for s in seconds)} | {median * 1e3:.1f} | "
              f"{base / median:.2f}x |")
    if args.output:
        with open(args.output, "w") as out:
            json.dump({"command": " ".join(sys.argv), "cpu": cpu_model(), "machine": platform.machine(),
                       "isa": kernels.cpu_isa(), "settings": vars(args),
                       "cpu_seconds_per_step": rows}, out, indent=1)


if __name__ == "__main__":
    main()
