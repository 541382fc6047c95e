"""The Python in front of the node protocol: what one all-reduce of the fast path costs besides the
protocol's own work, measured without the noise of the other ranks.

    mpirun --oversubscribe -np 2 python benchmarks/fast_path_python.py [--sizes 4K,1M] [--calls 100000] [--json FILE]

The node window is made and every candidate runs once for real; then the extension's node steps
(`_C.node_one_shot`, `_C.node_allreduce`) are replaced by a function that returns at once, so each
rank times only the Python of its own calls: `comm.allreduce(x)` on a NumPy array and on a torch
tensor, with the call check off and on (its round in the node window is the same stubbed call),
and for comparison the stub alone. The table holds the fastest of 7 loops of `--calls` calls, in
nanoseconds per call, on rank 0. Sizes up to the one-shot bound take the one-shot, larger ones
the sliced all-reduce; the stub does no work, so the size matters only through that choice. The
command exits 1 if a candidate's call did not go through the fast path.
"""
from __future__ import annotations

import argparse
import json
import sys
import timeit
import types

import numpy as np
import torch

import mpidist as md
from mpidist import _C, collectives
from mpidist.cli.bench import parse_sizes
from mpidist.collectives import node_window

STUBBED = ("node_one_shot", "node_allreduce")
ELEVEN = tuple(range(11))  # as many arguments as a one-shot call passes


def returns_at_once(*args) -> int:
    return -1  # the extension's "the result is in place"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,1M", help="comma-separated message sizes in bytes, K/M suffixes")
    parser.add_argument("--calls", type=int, default=100000, help="calls per timed loop")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    comm = md.init()
    if comm.size < 2 or comm.num_nodes != 1:
        print("fast_path_python.py needs 2 or more ranks on one node (the node window)", file=sys.stderr)
        return 2
    arrays = {}
    for nbytes in parse_sizes(args.sizes):
        arrays[nbytes] = (np.zeros(nbytes // 4, dtype=np.float32), torch.zeros(nbytes // 4))
        for array in arrays[nbytes]:
            for check_calls in (False, True):
                comm.check_calls = check_calls
                for _ in range(3):  # the first call makes the window, the next ones the plans
                    comm.allreduce(array)
    comm.mpi.Barrier()
    extension = {name: getattr(_C, name) for name in dir(_C) if not name.startswith("__")}
    node_window._C = types.SimpleNamespace(**{**extension, **{name: returns_at_once for name in STUBBED}})

    def fastest(call) -> float:
        return min(timeit.repeat(call, number=args.calls, repeat=7)) / args.calls * 1e9

    fast = collectives.fast_cpu_allreduce
    taken = []
    collectives.fast_cpu_allreduce = lambda *call: taken.append(fast(*call)) or taken[-1]
    for array, tensor in arrays.values():  # every candidate goes through the fast path, or the table would lie
        for check_calls in (False, True):
            comm.check_calls = check_calls
            comm.allreduce(array)
            comm.allreduce(tensor)
    collectives.fast_cpu_allreduce = fast
    if taken != [True] * (4 * len(arrays)):
        print(f"rank {comm.rank}: a candidate left the fast path ({taken})", file=sys.stderr)
        return 1
    rows = [{"candidate": "the stub alone", "bytes": 0, "ns_per_call": fastest(lambda: returns_at_once(*ELEVEN))}]
    for nbytes, (array, tensor) in arrays.items():
        for check_calls in (False, True):
            comm.check_calls = check_calls
            for kind, buffer in (("numpy", array), ("torch", tensor)):
                rows.append({"candidate": f"comm.allreduce, {kind}, check {'on' if check_calls else 'off'}",
                             "bytes": nbytes, "ns_per_call": fastest(lambda buffer=buffer: comm.allreduce(buffer))})
    if comm.rank == 0:
        print(f"# {comm.size} ranks, the node steps stubbed, fastest of 7 x {args.calls} calls, ns per call")
        print("| candidate | bytes | ns per call |\n|---|---:|---:|")
        for row in rows:
            print(f"| {row['candidate']} | {row['bytes']} | {row['ns_per_call']:.0f} |")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
