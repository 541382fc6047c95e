"""The reduce-divide-publish step of the one-node hierarchical all-reduce, in three forms.

Each rank reduces its slice of the buffer, divides it (op="avg") and publishes it in its shared
slot; the gradient buckets' one-node path runs the same step. This times the whole all-reduce
with the step done
  - "fused": one reduce_many_to kernel call, block by block while each block is in L1 (the
    default, common.reduce_and_publish);
  - "pieces": reduce_many, scale and a copy per piece of 256 KiB, while the piece is in L2 (the
    form before the fused kernel);
  - "whole": the same three calls, each over the whole slice,
in a shuffled order every iteration (same seed on every rank), on a buffer reused every call
("hot": in cache) and on buffers taken in turn from a pool larger than the last-level cache
("cold", like gradients). Prints a Markdown table of median times in microseconds, and the median
over iterations of each form's time divided by the fused form's in the same iteration.

    mpirun --oversubscribe --bind-to none -np 2 python benchmarks/publish.py
"""
import argparse
import ctypes
import time

import numpy as np

import mpidist as md
from mpidist.cli.bench import parse_sizes

PIECE_BYTES = 256 * 1024


def in_passes(piece_bytes: int):
    """The step as separate reduce, scale and copy calls over pieces of `piece_bytes`."""
    from mpidist import kernels
    from mpidist.buffers import ITEMSIZE

    def reduce_and_publish(dst, sources, nbytes, dtype, op, scale, publish):
        itemsize = ITEMSIZE[dtype]
        step = max(itemsize, piece_bytes // itemsize * itemsize)
        for low in range(0, nbytes, step):
            size = min(step, nbytes - low)
            count = size // itemsize
            kernels.reduce_many_ptr(dst + low, [source + low for source in sources], count, dtype, op)
            if scale != 1.0:
                kernels.scale_ptr(dst + low, count, dtype, scale)
            for address in publish:
                ctypes.memmove(address + low, dst + low, size)

    return reduce_and_publish


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,4M,12M,16M", help="buffer sizes (K/M suffixes)")
    parser.add_argument("--iterations", type=int, default=40)
    args = parser.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    comm = md.init()
    from mpidist.collectives import common, hierarchical  # after init: importing the collectives starts MPI
    forms = {"fused": common.reduce_and_publish, "pieces": in_passes(PIECE_BYTES), "whole": in_passes(1 << 40)}
    names = list(forms)
    rng = np.random.default_rng(0)
    if comm.rank == 0:
        print(f"# {comm.size} ranks, op=avg, float32, kernel threads {md.kernels.get_num_threads()}, "
              f"median us of {args.iterations}; x fused: median per-iteration time ratio to fused")
        print("| bytes | buffer | " + " | ".join(names) + " | " + " | ".join(f"{n} x fused" for n in names[1:]) + " |")
        print("|---:|---|" + "---:|" * (2 * len(names) - 1))
    try:
        for nbytes in sizes:
            count = nbytes // 4
            pool = [np.ones(count, np.float32) for _ in range(max(2, (96 << 20) // nbytes))]
            times = {}
            for iteration in range(args.iterations):
                for name in rng.permutation(names):
                    hierarchical.reduce_and_publish = forms[name]
                    for kind in ("hot", "cold"):
                        buffer = pool[0] if kind == "hot" else pool[1 + iteration % (len(pool) - 1)]
                        comm.mpi.Barrier()
                        start = time.perf_counter()
                        comm.allreduce(buffer, op="avg", algorithm="hierarchical")
                        times.setdefault((kind, name), []).append(time.perf_counter() - start)
                        buffer.fill(1)
            if comm.rank == 0:
                for kind in ("hot", "cold"):
                    fused = np.array(times[(kind, "fused")])
                    cells = [f"{np.median(times[(kind, n)]) * 1e6:.0f}" for n in names]
                    ratios = [f"{np.median(np.array(times[(kind, n)]) / fused):.2f}" for n in names[1:]]
                    print(f"| {nbytes} | {kind} | " + " | ".join(cells + ratios) + " |", flush=True)
    finally:
        hierarchical.reduce_and_publish = forms["fused"]


if __name__ == "__main__":
    main()
