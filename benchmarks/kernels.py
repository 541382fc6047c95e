"""Bandwidth of the fused reduction kernels against the NumPy/torch route and a plain copy.

    python benchmarks/kernels.py --json results/kernels-cpu.json --plot results/kernels-cpu.png

Each row is {"kernel", "dtype", "bytes", "gbs", "library_gbs", "copy_gbs", "vs_library",
"vs_library_low", "vs_library_high"}: `bytes` is the size of one buffer; gbs counts every byte the
kernel reads and writes (reduce: two reads and a write of `bytes`) per second; library_gbs is the
best NumPy or torch route for the same result with the same byte count; copy_gbs is a plain copy
of `bytes` (np.copyto or torch copy_, the faster), counted as read + write, measured in the same
run. vs_library is the median over rounds of the library route's time divided by ours in the
same round (> 1: ours is faster), against the library route with the better median;
vs_library_low/high bound a 95% confidence interval of that median (see paired_ratio): where
both routes run at the memory's speed, the ratio is 1 and the interval says how closely the
run could tell. The kernels are timed through the
pointer-level entry points the collectives use (reduce_ptr, ..., and mpidist._C for
pack/unpack/cast), so per-call Python overhead is the hot path's.

The routes of a row (ours and each library route; for copy_gbs, the two copies) are timed in
alternation, one sample of each in turn, and each gets the median of its samples: drift in memory
bandwidth, clock changes and other processes then hit every route alike instead of whichever ran
while they lasted. Threaded routes share one OpenMP runtime (torch's libgomp and ours have the
same soname, so a process maps one) and so the same worker threads; see Timer for how a sample
starts with them awake.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

import numpy as np
import torch

from mpidist import _C, kernels
from mpidist.cli.bench import parse_size

DTYPES = ("float32", "bfloat16", "float16", "float64", "int32", "int64", "uint8", "int8")
FLOATS = ("float32", "bfloat16", "float16", "float64")
MANY = 4  # sources of the reduce_many rows
PACK_PARTS = 64  # tensors per pack/unpack row
DEFAULT_SIZES = [4 << (2 * i) << 10 for i in range(9)]  # 4 KiB .. 256 MiB
QUICK_SIZES = [4 << 10, 256 << 10, 4 << 20, 64 << 20]


class Timer:
    """Median seconds per call of several routes, sampled in alternation.

    Each round takes one sample of every route, in a fresh random order, so that no route always
    follows the same one. A sample is a batch of calls lasting about 2 ms, preceded by one untimed
    call: a single-threaded route (NumPy) leaves the shared OpenMP workers idle long enough to fall
    asleep, and waking them costs the next threaded call up to a few hundred microseconds; the
    untimed call absorbs that, so every route is timed with its threads running.
    """

    def __init__(self, device: str, reps: int, seed: int = 0):
        self.cuda = device == "cuda"
        self.reps = reps
        self.order = random.Random(seed)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def batch(self, fn) -> int:
        fn()
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        once = max(time.perf_counter() - start, 1e-7)
        return int(min(10_000, max(1, 2e-3 / once)))

    def sample(self, fn, inner: int) -> float:
        fn()
        self.sync()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        self.sync()
        return (time.perf_counter() - start) / inner

    def __call__(self, *routes) -> list:
        """Seconds per call of each route: a list of samples per route, one per round."""
        inners = [self.batch(fn) for fn in routes]
        samples = [[] for _ in routes]
        for _ in range(self.reps):
            for i in self.order.sample(range(len(routes)), len(routes)):
                samples[i].append(self.sample(routes[i], inners[i]))
        return samples


def paired_ratio(theirs, ours):
    """Median over rounds of theirs[i] / ours[i] (samples of the same round), with a 95%
    distribution-free confidence interval of that median: the order statistics whose ranks a
    binomial(n, 1/2) count reaches with 2.5% and 97.5% probability."""
    ratios = sorted(t / o for t, o in zip(theirs, ours))
    n = len(ratios)
    half = 1.96 * math.sqrt(n) / 2
    low, high = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half) - 1)
    return statistics.median(ratios), ratios[low], ratios[high]


def filled(dtype: str, n: int, device: str, seed: int):
    t = torch.empty(n, dtype=getattr(torch, dtype), device=device)
    if dtype in FLOATS:
        t.uniform_(0.5, 1.5, generator=None)
    else:
        t.fill_(1 + seed)
    return t


def numpy_view(t):
    return t.numpy() if t.device.type == "cpu" and t.dtype != torch.bfloat16 else None


TORCH_OPS = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum, "prod": torch.mul}
NUMPY_OPS = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


def bench_size(nbytes: int, device: str, dtypes, timer, rows, op: str):
    prefix = "cuda_" if device == "cuda" else ""
    cast, pack, unpack = (getattr(_C, prefix + name) for name in ("cast", "pack", "unpack"))

    def row(kernel, dtype, moved, ours, library):
        """Times `ours` against the library routes (a callable or a list), in alternation."""
        library = library if isinstance(library, list) else [library]
        samples = timer(ours, *library)
        times = [statistics.median(s) for s in samples]
        best = min(range(1, len(times)), key=times.__getitem__)
        ratio, low, high = paired_ratio(samples[best], samples[0])
        rows.append({"kernel": kernel, "dtype": dtype, "isa": kernels.cpu_isa() if device == "cpu" else None,
                     "bytes": nbytes, "gbs": moved / times[0] / 1e9,
                     "library_gbs": moved / times[best] / 1e9, "copy_gbs": copy_gbs,
                     "vs_library": ratio, "vs_library_low": low, "vs_library_high": high})
        print(f"{kernel:<16}{dtype:<20}{nbytes:>12}{rows[-1]['gbs']:>10.1f}{rows[-1]['library_gbs']:>10.1f}"
              f"{copy_gbs:>10.1f}{rows[-1]['gbs'] / copy_gbs:>8.2f}{ratio:>8.2f} [{low:.2f}, {high:.2f}]", flush=True)

    copy_gbs = copy_bandwidth(nbytes, device, timer)
    for dtype in dtypes:
        bench_dtype(dtype, nbytes, device, op, row)
    bench_casts(nbytes, device, cast, row)
    bench_pack(nbytes, device, pack, unpack, row)


def copy_bandwidth(nbytes: int, device: str, timer) -> float:
    """GB/s (read + written) of the faster plain copy of `nbytes`: torch's copy_ or np.copyto."""
    raw_a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    raw_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copies = [lambda: raw_b.copy_(raw_a)]
    if device == "cpu":
        na, nb = raw_a.numpy(), raw_b.numpy()
        copies.append(lambda: np.copyto(nb, na))
    return 2 * nbytes / min(statistics.median(s) for s in timer(*copies)) / 1e9


def bench_dtype(dtype: str, nbytes: int, device: str, op: str, row) -> None:
    """The reductions and scaling of one dtype (its buffers are freed on return)."""
    n = nbytes // torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    a, b = filled(dtype, n, device, 0), filled(dtype, n, device, 1)
    na, nb = numpy_view(a), numpy_view(b)
    top, nop = TORCH_OPS[op], NUMPY_OPS[op]

    pa, pb, dev = a.data_ptr(), b.data_ptr(), device
    library = [lambda: top(a, b, out=a)] + ([lambda: nop(na, nb, out=na)] if na is not None else [])
    row("reduce", dtype, 3 * nbytes, lambda: kernels.reduce_ptr(pa, pb, n, dtype, op, dev), library)

    if dtype in FLOATS:
        library = [lambda: top(a, b, out=a).mul_(0.5)]
        if na is not None:
            library.append(lambda: np.multiply(nop(na, nb, out=na), na.dtype.type(0.5), out=na))
        row("reduce_scale", dtype, 3 * nbytes,
            lambda: kernels.reduce_scale_ptr(pa, pb, n, dtype, op, 0.5, dev), library)

        library = [lambda: a.mul_(1.0)] + ([lambda: np.multiply(na, na.dtype.type(1.0), out=na)]
                                           if na is not None else [])
        row("scale", dtype, 2 * nbytes, lambda: kernels.scale_ptr(pa, n, dtype, 1.0, dev), library)

        # The one-node all-reduce's publish step on two ranks: a = b = (a op b) * 0.5 (the
        # result over both sources). Reads a and b, writes a and b.
        library = [lambda: b.copy_(top(a, b, out=a).mul_(0.5))]
        if na is not None:
            library.append(lambda: np.copyto(nb, np.multiply(nop(na, nb, out=na), na.dtype.type(0.5), out=na)))
        row("reduce_many_to", dtype, 4 * nbytes,
            lambda: kernels.reduce_many_to_ptr([pa, pb], [pa, pb], n, dtype, op, 0.5, dev), library)

    srcs = [a, b] + [filled(dtype, n, device, j) for j in range(2, MANY)]
    dst = torch.empty_like(a)
    nsrcs = [numpy_view(s) for s in srcs]
    ndst = numpy_view(dst)

    def torch_many():
        top(srcs[0], srcs[1], out=dst)
        for s in srcs[2:]:
            top(dst, s, out=dst)

    def numpy_many():
        nop(nsrcs[0], nsrcs[1], out=ndst)
        for s in nsrcs[2:]:
            nop(ndst, s, out=ndst)

    ptrs, pd = [s.data_ptr() for s in srcs], dst.data_ptr()
    row(f"reduce_many{MANY}", dtype, (MANY + 1) * nbytes,
        lambda: kernels.reduce_many_ptr(pd, ptrs, n, dtype, op, dev),
        [torch_many] + ([numpy_many] if ndst is not None else []))


def bench_casts(nbytes: int, device: str, cast, row) -> None:
    """Conversions: bytes moved are n * (source itemsize + destination itemsize)."""
    n = nbytes // 4
    f32 = filled("float32", n, device, 0)
    for half in ("bfloat16", "float16"):
        h = torch.empty(n, dtype=getattr(torch, half), device=device)
        ph, pf = h.data_ptr(), f32.data_ptr()
        row("cast", f"float32->{half}", 6 * n, lambda: cast(ph, half, pf, "float32", n), lambda: h.copy_(f32))
        row("cast", f"{half}->float32", 6 * n, lambda: cast(pf, "float32", ph, half, n), lambda: f32.copy_(h))


def bench_pack(nbytes: int, device: str, pack, unpack, row) -> None:
    """pack/unpack: PACK_PARTS float32 tensors of uneven sizes adding up to `nbytes`."""
    count = nbytes // 4
    cuts = np.linspace(0, count, PACK_PARTS + 1).astype(np.int64) if count >= PACK_PARTS else np.array([0, count])
    cuts[1:-1] += (np.arange(1, len(cuts) - 1) % 3) - 1  # uneven, misaligned parts
    parts = [filled("float32", int(hi - lo), device, 0) for lo, hi in zip(cuts[:-1], cuts[1:])]
    flat = torch.empty(count, dtype=torch.float32, device=device)
    part_ptrs, part_bytes, pflat = [p.data_ptr() for p in parts], [p.numel() * 4 for p in parts], flat.data_ptr()
    row("pack", "float32", 2 * nbytes, lambda: pack(pflat, part_ptrs, part_bytes),
        lambda: torch.cat(parts, out=flat))
    views = list(torch.split(flat, [p.numel() for p in parts]))

    def torch_unpack():
        for p, v in zip(parts, views):
            p.copy_(v)

    row("unpack", "float32", 2 * nbytes, lambda: unpack(pflat, part_ptrs, part_bytes), torch_unpack)


def plot(rows, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["kernel"] for r in rows}, key=lambda k: [r["kernel"] for r in rows].index(k))
    fig, axes = plt.subplots(2, (len(names) + 1) // 2, figsize=(5 * ((len(names) + 1) // 2), 8), squeeze=False)
    for ax, name in zip(axes.flat, names):
        mine = [r for r in rows if r["kernel"] == name]
        for i, dtype in enumerate(dict.fromkeys(r["dtype"] for r in mine)):
            sel = sorted((r for r in mine if r["dtype"] == dtype), key=lambda r: r["bytes"])
            x = [r["bytes"] for r in sel]
            line, = ax.plot(x, [r["gbs"] for r in sel], marker="o", ms=3, label=f"{dtype}")
            ax.plot(x, [r["library_gbs"] for r in sel], ls="--", color=line.get_color(), lw=0.8)
        copy = sorted({(r["bytes"], r["copy_gbs"]) for r in mine})
        ax.plot([c[0] for c in copy], [c[1] for c in copy], color="black", lw=1.5, label="copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{name} (solid: mpidist, dashed: numpy/torch)", fontsize=9)
        ax.set_xlabel("bytes per buffer")
        ax.set_ylabel("GB/s (read + write)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the rows here")
    parser.add_argument("--plot", help="save a PNG of bandwidth against size here")
    parser.add_argument("--sizes", nargs="+", type=parse_size, help="buffer sizes, e.g. 4K 1M 64M")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--isa", choices=("avx512", "avx2", "baseline"),
                        help="CPU loops to run (default: the widest this CPU has), e.g. avx2 on an AVX-512 machine")
    parser.add_argument("--op", choices=kernels.OPS, default="sum")
    parser.add_argument("--reps", type=int, default=40, help="timed samples (rounds) per route and row")
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES} and float32/bfloat16 only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not kernels.cuda_available():
        sys.exit("--device cuda: mpidist._C has no CUDA support or there is no GPU")
    if args.isa:
        kernels.set_cpu_isa(args.isa)
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    dtypes = ["float32", "bfloat16"] if args.quick and args.dtypes == list(DTYPES) else args.dtypes

    print(f"mpidist kernels on {args.device}: {kernels.cpu_isa()} loops, {kernels.get_num_threads()} threads, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}")
    print(f"{'kernel':<16}{'dtype':<20}{'bytes':>12}{'GB/s':>10}{'library':>10}{'copy':>10}{'/copy':>8}"
          f"{'/library':>9} [95% CI]")
    timer = Timer(args.device, args.reps)
    rows = []
    for nbytes in sizes:
        bench_size(nbytes, args.device, dtypes, timer, rows, args.op)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
