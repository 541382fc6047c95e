"""Collective micro-benchmarks in the style of nccl-tests and the OSU micro-benchmarks.

Every algorithm runs on the same torch CPU tensors, so the peers (the MPI library's own
collective through mpi4py, and torch.distributed's gloo backend) see exactly what ours see.

Timing follows OSU: each iteration resets the buffer, meets the other ranks at a barrier, and
times only the collective call. Algorithms take turns iteration by iteration, so the noise of a
shared machine falls on all of them alike and their ratios stay meaningful. Every result is
compared with an exact reference (inputs are small integers, so sums are exact in every float
dtype) and the wrong elements are counted over all iterations and ranks.

With --device cuda (all-reduce only) the buffers are on each rank's GPU and the rows name the
route (docs/gpu-training.md): "hierarchical" through the node window in GPU memory, "staged:<algorithm>"
through pinned host memory, "cuda-aware:<algorithm>" handed to a CUDA-aware MPI, "nccl" where
NCCL runs; each route on a Communicator of its own. The row "bound" (all-reduce on one node, on
the CPU and on CUDA) is no measurement but a model of the least time the node window's
all-reduce needs: the bytes it reads and writes at the copy rate measured in the same run
(bench_bound.py); where its reads hit cache, the all-reduce can beat it.

Bandwidths follow nccl-tests: algbw = bytes / time, and busbw = algbw * factor, where the factor
is 2(p-1)/p for all-reduce, (p-1)/p for allgather and reduce-scatter (whose size is the
total, gathered or unreduced, buffer) and 1 for broadcast. time_us in the JSON rows is the mean
over ranks of each rank's mean time per iteration.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time

import numpy as np

from ..runtime import COLLECTIVE_DTYPES, ITEMSIZE
from . import bench_bound, bench_device
from .bench_gloo import Gloo

# torch and mpi4py's MPI are imported in the functions that use them (matplotlib in bench_plot.py):
# the `mpidist` command builds its parser from this module without torch, and importing mpi4py's
# MPI initializes MPI.

OUR_ALLREDUCE = ("ring", "tree", "recursive_halving", "recursive_doubling", "reduce_bcast",
                 "hierarchical", "auto")
PEERS = ("mpi", "gloo")
# broadcast, allgather and reduce-scatter have one implementation each in mpidist.
OURS = {"allreduce": OUR_ALLREDUCE, "broadcast": ("mpidist",), "allgather": ("mpidist",),
        "reduce_scatter": ("mpidist",)}
COLLECTIVES = tuple(OURS)
DEFAULT_SIZES = "8,64,512,4K,32K,256K,1M,4M,16M"
ROW_KEYS = ("collective", "algorithm", "dtype", "bytes", "count", "ranks", "time_us", "algbw_gbs",
            "busbw_gbs", "wrong")
SUFFIXES = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024 ** 2, "MB": 1024 ** 2,
            "MIB": 1024 ** 2, "G": 1024 ** 3, "GB": 1024 ** 3, "GIB": 1024 ** 3}


def parse_size(text: str) -> int:
    """'8' -> 8, '4K' -> 4096, '1M' -> 1048576 (binary multiples, as nccl-tests)."""
    stripped = text.strip().upper()
    digits = stripped.rstrip("KMGIB")
    suffix = stripped[len(digits):]
    try:
        return int(float(digits) * SUFFIXES[suffix])
    except (ValueError, KeyError):
        raise ValueError(f"cannot read size {text!r}: use a number with an optional K, M or G suffix") from None


def parse_sizes(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part.strip()]


def busbw_factor(collective: str, ranks: int) -> float:
    if collective == "allreduce":
        return 2 * (ranks - 1) / ranks
    if collective in ("allgather", "reduce_scatter"):
        return (ranks - 1) / ranks
    return 1.0


def default_iterations(nbytes: int) -> int:
    # As OSU's micro-benchmarks: many iterations for small messages, whose mean a single
    # scheduler hiccup of a millisecond would otherwise move by microseconds.
    if nbytes <= 8 * 1024:
        return 1000
    if nbytes <= 64 * 1024:
        return 200
    if nbytes <= 1024 * 1024:
        return 50
    return 20


def pattern(count: int, rank: int, dtype):
    """Rank `rank`'s input: small integers in [-2, 2], exact in every dtype, as are their sums."""
    import torch
    return ((torch.arange(count, dtype=torch.int64) + 3 * rank) % 5 - 2).to(dtype)


def sum_of_patterns(count: int, ranks: int, dtype):
    import torch
    total = torch.zeros(count, dtype=torch.int64)
    for rank in range(ranks):
        total += (torch.arange(count, dtype=torch.int64) + 3 * rank) % 5 - 2
    return total.to(dtype)


# ---- the peers (gloo: bench_gloo.py) -------------------------------------------------------

def mpi_datatype(torch_dtype):
    import torch
    from mpi4py import MPI
    return {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int32: MPI.INT32_T,
            torch.int64: MPI.INT64_T}.get(torch_dtype)


def mpi_memory(tensor):
    from mpi4py import MPI
    return MPI.buffer.fromaddress(tensor.data_ptr(), tensor.numel() * tensor.element_size())


# ---- one workload per collective: reset, call one algorithm, count the wrong elements -----------

class Workload:
    """Buffers and exact reference of one (collective, dtype, count) on this rank."""

    def __init__(self, comm, dtype, count, gloo):
        self.comm, self.dtype, self.count, self.gloo = comm, dtype, count, gloo
        self.p, self.r = comm.size, comm.rank

    def reset(self):
        pass

    def wrong(self, result) -> int:
        return int((result != self.expected).sum()) if result.numel() == self.expected.numel() \
            else max(result.numel(), self.expected.numel())


class AllreduceWorkload(Workload):
    """On `device`; `routes` are the Communicators of the routes of --device cuda (bench_device.ROUTES)."""

    def __init__(self, comm, dtype, count, gloo, device="cpu", routes=None):
        super().__init__(comm, dtype, count, gloo)
        self.pristine = pattern(count, self.r, dtype).to(device)
        self.buffer = self.pristine.clone()
        self.expected = sum_of_patterns(count, self.p, dtype).to(device)
        self.mpi_type = mpi_datatype(dtype)
        self.routes = routes or {}

    def reset(self):
        self.buffer.copy_(self.pristine)

    def call(self, algorithm):
        route, _, name = algorithm.rpartition(":")
        if route:
            self.routes[route].allreduce(self.buffer, op="sum", algorithm=name)
        elif algorithm == "gloo":
            self.gloo.dist.all_reduce(self.buffer)
        elif algorithm == "mpi" and self.mpi_type is not None:
            from mpi4py import MPI
            self.comm.mpi.Allreduce(MPI.IN_PLACE, [mpi_memory(self.buffer), self.count, self.mpi_type], MPI.SUM)
        else:
            # "mpi" for half types: mpidist's user route (upcast, MPI_Allreduce, round back).
            self.comm.allreduce(self.buffer, op="sum", algorithm=algorithm)
        return self.buffer


class BroadcastWorkload(Workload):
    def __init__(self, comm, dtype, count, gloo):
        super().__init__(comm, dtype, count, gloo)
        self.expected = pattern(count, 0, dtype)
        self.pristine = self.expected if self.r == 0 else self.expected.new_zeros(count)
        self.buffer = self.pristine.clone()

    def reset(self):
        self.buffer.copy_(self.pristine)

    def call(self, algorithm):
        if algorithm == "gloo":
            self.gloo.dist.broadcast(self.buffer, src=0)
        elif algorithm == "mpi":
            from mpi4py import MPI
            self.comm.mpi.Bcast([mpi_memory(self.buffer), MPI.BYTE], root=0)
        else:
            self.comm.broadcast(self.buffer, root=0)
        return self.buffer


class AllgatherWorkload(Workload):
    """`count` is the gathered total; each rank contributes count / p elements."""

    def __init__(self, comm, dtype, count, gloo):
        super().__init__(comm, dtype, count, gloo)
        self.block = count // self.p
        self.mine = pattern(self.block, self.r, dtype)
        self.expected = __import__("torch").cat([pattern(self.block, k, dtype) for k in range(self.p)])
        self.gathered = self.expected.new_empty(self.block * self.p)

    def call(self, algorithm):
        if algorithm == "gloo":
            self.gloo.dist.all_gather_into_tensor(self.gathered, self.mine)
            return self.gathered
        if algorithm == "mpi":
            from mpi4py import MPI
            self.comm.mpi.Allgather([mpi_memory(self.mine), MPI.BYTE], [mpi_memory(self.gathered), MPI.BYTE])
            return self.gathered
        return self.comm.allgather(self.mine)


class ReduceScatterWorkload(Workload):
    """`count` is the unreduced total; each rank ends with count / p reduced elements."""

    def __init__(self, comm, dtype, count, gloo):
        super().__init__(comm, dtype, count, gloo)
        self.block = count // self.p
        self.mine = pattern(self.block * self.p, self.r, dtype)
        total = sum_of_patterns(self.block * self.p, self.p, dtype)
        self.expected = total[self.r * self.block:(self.r + 1) * self.block].clone()
        self.out = self.expected.new_empty(self.block)
        self.mpi_type = mpi_datatype(dtype)

    def call(self, algorithm):
        import torch
        if algorithm == "gloo":
            self.gloo.dist.reduce_scatter_tensor(self.out, self.mine)
            return self.out
        if algorithm == "mpi":
            from mpi4py import MPI
            if self.mpi_type is not None:
                self.comm.mpi.Reduce_scatter_block([mpi_memory(self.mine), self.block, self.mpi_type],
                                                   [mpi_memory(self.out), self.block, self.mpi_type], MPI.SUM)
                return self.out
            # Half types: the user route, as for all-reduce (upcast, MPI, round back).
            wide_in, wide_out = self.mine.to(torch.float32), torch.empty(self.block, dtype=torch.float32)
            self.comm.mpi.Reduce_scatter_block([mpi_memory(wide_in), self.block, MPI.FLOAT],
                                               [mpi_memory(wide_out), self.block, MPI.FLOAT], MPI.SUM)
            self.out.copy_(wide_out)
            return self.out
        return self.comm.reduce_scatter(self.mine, op="sum")


WORKLOADS = {"allreduce": AllreduceWorkload, "broadcast": BroadcastWorkload,
             "allgather": AllgatherWorkload, "reduce_scatter": ReduceScatterWorkload}


# ---- the measurement --------------------------------------------------------------------------

@dataclasses.dataclass
class Options:
    collective: str = "allreduce"
    sizes: list = dataclasses.field(default_factory=lambda: parse_sizes(DEFAULT_SIZES))
    dtypes: list = dataclasses.field(default_factory=lambda: ["float32"])
    algorithms: list | None = None  # None: all of ours plus the peers
    iters: int | None = None  # None: by size (default_iterations)
    warmup: int | None = None
    check_calls: bool = False
    quiet: bool = False
    device: str = "cpu"  # or "cuda": all-reduce on each rank's GPU


def element_count(collective: str, nbytes: int, itemsize: int, ranks: int) -> int:
    count = max(1, nbytes // itemsize)
    if collective in ("allgather", "reduce_scatter"):
        count = max(ranks, count - count % ranks)  # equal blocks per rank
    return count


def known_algorithms(collective: str, device: str) -> tuple:
    """The names --algorithms takes for `collective` on `device`: on CUDA buffers also NCCL, the
    bound and every route of an all-reduce algorithm ("staged:ring", bench_device.ROUTES); on
    the CPU the all-reduce's bound too."""
    if device != "cuda":
        return OURS[collective] + PEERS + (("bound",) if collective == "allreduce" else ())
    names = OUR_ALLREDUCE + ("mpi",)
    return names + ("gloo", "nccl", "bound") + tuple(f"{route}:{name}" for route in bench_device.ROUTES
                                                     for name in names)


def refusal(options: Options) -> str | None:
    """What makes `options` no measurement, named as a usage error, or None. It reads the options
    alone (no MPI, no torch), so that the `mpidist` command refuses them before MPI starts, as
    nccl-tests and the OSU benchmarks refuse theirs."""
    if options.collective not in WORKLOADS:
        return f"unknown collective {options.collective!r}; choose one of {', '.join(COLLECTIVES)}"
    if options.device == "cuda" and options.collective != "allreduce":
        return "argument --device: cuda measures allreduce only"
    unknown_dtypes = [name for name in options.dtypes if name not in COLLECTIVE_DTYPES]
    if unknown_dtypes or not options.dtypes:
        return (f"argument --dtype: unknown dtype {', '.join(unknown_dtypes) or '(none given)'}; "
                f"choose from {', '.join(COLLECTIVE_DTYPES)}")
    if not options.sizes:
        return "argument --sizes: names no size"
    not_positive = [size for size in options.sizes if size <= 0]
    if not_positive:
        return f"argument --sizes: must be positive numbers of bytes, got {', '.join(map(str, not_positive))}"
    for dtype in options.dtypes:
        uneven = [size for size in options.sizes if size % ITEMSIZE[dtype]]
        if uneven:
            return (f"argument --sizes: {', '.join(map(str, uneven))} is not a multiple of {ITEMSIZE[dtype]} bytes, "
                    f"the size of one {dtype} element")
    if options.iters is not None and options.iters < 1:
        return f"argument --iters: must be at least 1, got {options.iters}"
    if options.warmup is not None and options.warmup < 0:
        return f"argument --warmup: must be 0 or more, got {options.warmup}"
    if options.algorithms is not None:
        known = known_algorithms(options.collective, options.device)
        unknown = [name for name in options.algorithms if name not in known]
        if unknown or not options.algorithms:
            return (f"argument --algorithms: unknown algorithm {', '.join(map(repr, unknown)) or '(none given)'} "
                    f"for {options.collective}"
                    f"{' on cuda' if options.device == 'cuda' else ''}; choose from {', '.join(known)}")
    return None


def run(comm, options: Options, out=sys.stdout) -> list[dict]:
    """Measure every (dtype, size, algorithm) of one collective; returns the rows (on every rank)."""
    problem = refusal(options)
    if problem is not None:
        raise ValueError(problem)
    if options.device == "cuda":
        import torch
        torch.cuda.set_device(comm.local_rank % torch.cuda.device_count())
        algorithms = list(options.algorithms or bench_device.cuda_algorithms(comm))
    else:
        # every algorithm of ours and the peers; for an all-reduce on one node the bound too
        bound = ("bound",) if options.collective == "allreduce" and comm.num_nodes == 1 else ()
        algorithms = list(options.algorithms or (OURS[options.collective] + PEERS + bound))
    # The caller's communicator gets its call check back afterwards: a program that benchmarks
    # (or tunes) on its world communicator and then trains on it keeps its checks.
    check_calls, comm.check_calls = comm.check_calls, options.check_calls
    gloo = Gloo(comm) if "gloo" in algorithms else None
    routes = bench_device.route_communicators(comm, algorithms)
    printer = TablePrinter(out if comm.rank == 0 and not options.quiet else None, options.collective, comm.size)
    if "bound" in algorithms and options.device == "cpu" and comm.num_nodes > 1:
        algorithms.remove("bound")
        printer.note("bound left out: across nodes the link bounds an all-reduce, not the memory")
    try:
        return measure(comm, options, algorithms, gloo, printer, routes)
    finally:
        comm.check_calls = check_calls
        for route in routes.values():
            route.free()
        if gloo is not None:
            gloo.close(comm)


def timing_order(active: list, iterations: int) -> list:
    """(iteration, index into `active`) of every timed call, in order. A call measures differently
    depending on which collective ran just before it (identical code paths measured far apart at
    8 bytes in a fixed order), so each iteration runs the candidates in a shuffled order; the seed
    is the iteration, so every rank calls the same algorithm at the same time. gloo runs in a loop
    of its own, after the others: its threads go on running after each of its calls and slowed
    whatever was timed next (docs/benchmarks.md)."""
    order = []
    for group in ([name for name in active if name != "gloo"], [name for name in active if name == "gloo"]):
        for iteration in range(iterations):
            order += [(iteration, active.index(group[position]))
                      for position in np.random.default_rng(iteration).permutation(len(group))]
    return order


def measure(comm, options, algorithms, gloo, printer, routes=None) -> list[dict]:
    import torch
    from mpi4py import MPI

    p = comm.size
    rows = []
    for dtype_name in options.dtypes:
        dtype = getattr(torch, dtype_name)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        for nbytes in options.sizes:
            count = element_count(options.collective, nbytes, itemsize, p)
            if options.device == "cuda":
                workload = AllreduceWorkload(comm, dtype, count, gloo, "cuda", routes)
            else:
                workload = WORKLOADS[options.collective](comm, dtype, count, gloo)
            iters = options.iters or default_iterations(count * itemsize)
            warmup = options.warmup if options.warmup is not None else max(2, iters // 10)
            active = [a for a in algorithms if a != "bound" and supported(workload, a, printer)]
            elapsed = np.zeros(len(active))
            wrong = np.zeros(len(active), dtype=np.int64)
            for iteration, index in timing_order(active, warmup + iters):
                algorithm = active[index]
                workload.reset()
                comm.mpi.Barrier()
                start = time.perf_counter()
                result = workload.call(algorithm)
                if options.device == "cuda":
                    torch.cuda.synchronize()
                stop = time.perf_counter()
                if iteration >= warmup:
                    elapsed[index] += stop - start
                wrong[index] += workload.wrong(result)
            mean_us = elapsed / iters * 1e6
            stats = {name: np.empty_like(mean_us) for name in ("sum", "min", "max")}
            for name, op in (("sum", MPI.SUM), ("min", MPI.MIN), ("max", MPI.MAX)):
                comm.mpi.Allreduce(mean_us, stats[name], op=op)
            wrong_total = np.empty_like(wrong)
            comm.mpi.Allreduce(wrong, wrong_total, op=MPI.SUM)
            for index, algorithm in enumerate(active):
                row = make_row(options.collective, algorithm, dtype_name, count * itemsize, count, p,
                               stats["sum"][index] / p, int(wrong_total[index]))
                rows.append(with_device(row, options.device))
                printer.row(row, stats["min"][index], stats["max"][index])
            if "bound" in algorithms:
                bound = np.array([bench_bound.bound_us(comm, count * itemsize, options.device)])
                comm.mpi.Allreduce(MPI.IN_PLACE, bound, op=MPI.MAX)
                row = make_row(options.collective, "bound", dtype_name, count * itemsize, count, p, bound[0], 0)
                rows.append(with_device(row, options.device))
                printer.row(row, bound[0], bound[0])
    return rows


def with_device(row: dict, device: str) -> dict:
    """Rows of CUDA buffers say so (DESIGN: "device": "cuda")."""
    if device != "cpu":
        row["device"] = device
    return row


def supported(workload, algorithm, printer) -> bool:
    """Peers that cannot run this case are left out with a note (gloo's missing reduce-scatter,
    NCCL refusing two ranks on one GPU); every rank learns the same refusal, so all leave it out."""
    if algorithm not in ("gloo", "nccl"):
        return True
    try:
        workload.reset()
        workload.call(algorithm)
        return True
    except (RuntimeError, ValueError, AttributeError) as exc:
        printer.note(f"{algorithm} skipped for {workload.dtype} {type(workload).__name__}: {str(exc).splitlines()[0]}")
        return False


def make_row(collective, algorithm, dtype, nbytes, count, ranks, time_us, wrong) -> dict:
    algbw = nbytes / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0
    return {"collective": collective, "algorithm": algorithm, "dtype": dtype, "bytes": int(nbytes),
            "count": int(count), "ranks": int(ranks), "time_us": round(float(time_us), 3),
            "algbw_gbs": round(algbw, 4), "busbw_gbs": round(algbw * busbw_factor(collective, ranks), 4),
            "wrong": int(wrong)}


class TablePrinter:
    """nccl-tests-like table on rank 0, one line per measured row as soon as it is known."""

    COLUMNS = ("size(B)", "count", "dtype", "algorithm", "time_us", "min_us", "max_us", "algbw_gbs",
               "busbw_gbs", "#wrong")
    FORMAT = "{:>12} {:>11} {:>9} {:>19} {:>11} {:>11} {:>11} {:>10} {:>10} {:>7}"

    def __init__(self, out, collective, ranks):
        self.out = out
        self.header_done = False
        self.title = f"# mpidist bench {collective}: {ranks} ranks; time = mean over ranks of the " \
                     "per-iteration mean (min/max over ranks)"

    def _print(self, text):
        if self.out is not None:
            print(text, file=self.out, flush=True)

    def note(self, text):
        self._print(f"# {text}")

    def row(self, row, min_us, max_us):
        if not self.header_done:
            self._print(self.title)
            self._print(self.FORMAT.format(*self.COLUMNS))
            self.header_done = True
        self._print(self.FORMAT.format(row["bytes"], row["count"], row["dtype"], row["algorithm"],
                                       f"{row['time_us']:.1f}", f"{min_us:.1f}", f"{max_us:.1f}",
                                       f"{row['algbw_gbs']:.3f}", f"{row['busbw_gbs']:.3f}", row["wrong"]))


# ---- outputs ------------------------------------------------------------------------------------

def write_json(rows, path: str) -> None:
    with open(path, "w") as handle:
        json.dump(rows, handle, indent=1)
        handle.write("\n")
