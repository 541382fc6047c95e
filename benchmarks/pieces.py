"""Piece size of the hierarchical all-reduce's reduce-divide-publish step (one node).

Each rank reduces its slice of the buffer, divides it (op="avg") and publishes it in its shared
slot piece by piece (common.PIECE_BYTES_PER_THREAD per kernel thread), so that each piece
is still in cache for the second and third step. This measures the all-reduce time for several
piece sizes, in a shuffled order every iteration (same seed on every rank), on a buffer that is
reused every call ("hot": in cache) and on buffers taken in turn from a pool larger than the
last-level cache ("cold", like gradients). Prints a Markdown table of median times in
microseconds.

    mpirun --oversubscribe --bind-to none -np 2 python benchmarks/pieces.py
"""
import argparse
import time

import numpy as np

import mpidist as md
from mpidist.bench import parse_size, parse_sizes

WHOLE = 1 << 40  # larger than any slice: one piece


def piece_size(text: str) -> int:
    """'256K' -> 262144, '4M' -> 4194304 (mpidist bench's sizes), 'whole' -> one piece."""
    return WHOLE if text == "whole" else parse_size(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,4M,16M", help="buffer sizes (K/M suffixes)")
    parser.add_argument("--pieces", default="64K,256K,1M,whole", help="piece sizes per thread")
    parser.add_argument("--iterations", type=int, default=40)
    args = parser.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    pieces = [piece_size(p) for p in args.pieces.split(",")]
    comm = md.init()
    from mpidist.collectives import common  # after init: importing the collectives starts MPI
    rng = np.random.default_rng(0)
    if comm.rank == 0:
        print(f"# {comm.size} ranks, op=avg, float32, kernel threads {md.kernels.get_num_threads()}, median us of {args.iterations}")
        print("| bytes | buffer | " + " | ".join("whole" if p == WHOLE else f"{p >> 10} KiB" for p in pieces) + " |")
        print("|---:|---|" + "---:|" * len(pieces))
    for nbytes in sizes:
        count = nbytes // 4
        pool = [np.ones(count, np.float32) for _ in range(max(2, (96 << 20) // nbytes))]
        times = {}
        for iteration in range(args.iterations):
            for piece in rng.permutation(pieces):
                common.PIECE_BYTES_PER_THREAD = int(piece)
                for kind in ("hot", "cold"):
                    buffer = pool[0] if kind == "hot" else pool[1 + iteration % (len(pool) - 1)]
                    comm.mpi.Barrier()
                    start = time.perf_counter()
                    comm.allreduce(buffer, op="avg", algorithm="hierarchical")
                    times.setdefault((kind, int(piece)), []).append(time.perf_counter() - start)
                    buffer.fill(1)
        if comm.rank == 0:
            for kind in ("hot", "cold"):
                cells = " | ".join(f"{np.median(times[(kind, p)]) * 1e6:.0f}" for p in pieces)
                print(f"| {nbytes} | {kind} | {cells} |")


if __name__ == "__main__":
    main()
