"""The multi-rank part of benchmarks/gpu_check.py: what every rank of one mpirun launch runs.

    mpirun -np 4 python benchmarks/gpu_check_ranks.py --device cuda --out DIR

It runs mpidist's collectives (every all-reduce algorithm, broadcast, allgather, reduce_scatter;
float32/bfloat16/float16; torch and CuPy arrays on `--device cuda`, NumPy and torch CPU arrays
on `--device cpu`), its torch.distributed backend (the c10d collectives, point-to-point and torch's
DDP on torch tensors on that device) and its training modes (DataParallel, Pipeline,
ParameterServer on a module on that device), Horovod's behaviours on that device (mpidist.torch as
Horovod's tests check it: asynchronous and fused all-reduces, CPU and GPU tensors mixed in one
call refused, alltoall with splits, hvd.join, SyncBatchNorm, a model split over two devices), and
compares each result with an independent
reference: float64 NumPy sums of every rank's inputs for the collectives, one-process float64 CPU
training for the training modes. For a GPU buffer it also checks the route the data took:
through the node window in GPU memory (CUDA IPC) for the hierarchical all-reduce, broadcast,
allgather and reduce_scatter with --device-window yes; otherwise through pinned host memory when
the MPI library is not CUDA-aware (MPIDIST_CUDA_AWARE=0 forces this), straight from GPU memory
when it is. With --nccl it also runs algorithm="nccl" as a peer: its checks are named "peer nccl
...", and NCCL's version goes into the rank's JSON ("nccl_version"); gpu_check.py records whether
NCCL ran without counting its refusal (NCCL before 2.30 refuses two ranks on one GPU) as ours.

Each rank writes DIR/rank<r>.json after every check ({"rank", "size", "device", "cuda_aware",
"mpi_library", "checks": [{"name", "ok", "detail"}]}), so a launch that dies still leaves the
checks it finished; gpu_check.py counts a check as passed only where every rank passed it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import zlib

import numpy as np
import torch

import mpidist as md
from mpidist import kernels

ALGORITHMS = ("auto", "ring", "tree", "recursive_halving", "recursive_doubling", "reduce_bcast", "hierarchical",
              "mpi")
# Algorithms that reduce in host memory whatever the MPI library can do (mpidist.collectives.api).
HOST_MEMORY_ALGORITHMS = ("hierarchical",)
DTYPES = {"torch": ("float32", "bfloat16", "float16"), "cupy": ("float32", "float16"),
          "numpy": ("float32", "float16")}  # NumPy and CuPy have no bfloat16
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}
# One element; a count that is no multiple of a vector width; one past reduce_bcast's 4 MiB blocks
# and many of the 256 KiB segments the ring and halving algorithms pipeline.
COUNTS = {"cuda": (1, 4099, (1 << 21) + 7), "cpu": (1, 4099, 70_001)}


# ---- arrays ------------------------------------------------------------------------------------

class Arrays:
    """Makes arrays of one kind ("torch", "cupy", "numpy") on one device from float64 values, and
    reads them back as float64."""

    def __init__(self, kind: str, device: str):
        self.kind, self.device = kind, device

    def make(self, values: np.ndarray, dtype: str):
        if self.kind == "torch":
            return torch.from_numpy(values).to(getattr(torch, dtype)).to(self.device)
        if self.kind == "cupy":
            import cupy
            with cupy.cuda.Device(torch.device(self.device).index or 0):
                return cupy.asarray(values.astype(dtype))
        return values.astype(dtype)

    def float64(self, array) -> np.ndarray:
        if self.kind == "torch":
            return array.detach().to("cpu", torch.float64).numpy()
        if self.kind == "cupy":
            import cupy
            return cupy.asnumpy(array).astype(np.float64)
        return np.asarray(array, dtype=np.float64)

    def label(self) -> str:
        return f"{self.kind}({self.device})"


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded to `dtype` (and back): what an array of that dtype holds exactly."""
    return torch.from_numpy(values).to(getattr(torch, dtype)).double().numpy()


class Inputs:
    """Every rank's input of a collective, known on every rank, and their float64 sums."""

    def __init__(self, size: int):
        self.size = size
        self._cache = {}

    def get(self, dtype: str, count: int, seed: int = 0):
        key = (dtype, count, seed)
        if key not in self._cache:
            per_rank = [rounded(np.random.default_rng([seed, rank, count]).standard_normal(count), dtype)
                        for rank in range(self.size)]
            total = np.sum(per_rank, axis=0)
            magnitude = np.sum(np.abs(per_rank), axis=0)
            self._cache = {key: (per_rank, total, magnitude)}  # one entry: the large ones are big
        return self._cache[key]


def within(got: np.ndarray, want: np.ndarray, bound: np.ndarray):
    """(ok, detail): every element finite and |got - want| <= bound."""
    if got.shape != want.shape:
        return False, f"shape {got.shape}, expected {want.shape}"
    got, want, bound = got.ravel(), want.ravel(), np.broadcast_to(bound, want.shape).ravel()
    if not np.isfinite(got).all():
        return False, f"{int((~np.isfinite(got)).sum())} elements are not finite"
    excess = np.abs(got - want) - bound
    worst = int(np.argmax(excess)) if excess.size else 0
    if excess.size and excess[worst] > 0:
        return False, (f"{int((excess > 0).sum())} of {got.size} elements off; worst at {worst}: got {got[worst]!r}, "
                       f"expected {want[worst]!r} within {bound[worst]:.3g}")
    return True, ""


def sum_bound(dtype: str, size: int, magnitude: np.ndarray) -> np.ndarray:
    """Error allowed for a sum of `size` values of `dtype` combined pairwise in any order (each
    step rounded once), plus one more rounding for a scale: (size + 1) u sum|x_i|, and the
    smallest subnormal for results that underflow."""
    return (size + 1) * UNIT_ROUNDOFF[dtype] * magnitude + 2.0 ** -133


# ---- results -----------------------------------------------------------------------------------

class Report:
    """This rank's checks, rewritten to its JSON file after each one."""

    def __init__(self, out: str, comm, device: str):
        from mpi4py import MPI
        self.path = os.path.join(out, f"rank{comm.rank}.json")
        self.data = {"rank": comm.rank, "size": comm.size, "device": device,
                     "cuda_aware": comm.is_cuda_aware(),
                     "mpi_library": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
                     "checks": []}
        self.write()

    def add(self, name: str, ok: bool, detail: str = "", seconds: float = 0.0) -> None:
        self.data["checks"].append({"name": name, "ok": bool(ok), "detail": detail, "seconds": round(seconds, 3)})
        self.write()

    def write(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(self.path + ".tmp", self.path)

    def run(self, name: str, check) -> None:
        """Run check() -> (ok, detail); an exception fails the check with its traceback's end."""
        start = time.perf_counter()
        try:
            ok, detail = check()
        except Exception as error:  # reported, and the launch goes on with the next check
            ok, detail = False, f"{type(error).__name__}: {error} | {traceback.format_exc(limit=-3)}"
        self.add(name, ok, detail, time.perf_counter() - start)


def same_on_every_rank(comm, array_f64: np.ndarray):
    """(ok, detail): every rank holds these exact values."""
    from mpi4py import MPI
    mine = np.array([zlib.crc32(np.ascontiguousarray(array_f64).tobytes())], dtype=np.int64)
    every = np.empty(comm.size, dtype=np.int64)
    comm.mpi.Allgather([mine, MPI.INT64_T], [every, MPI.INT64_T])
    if (every != every[0]).any():
        return False, f"the ranks' results differ (checksums {every.tolist()})"
    return True, ""


class StagingCounter:
    """Counts the communicator's host stagings, to check the route a GPU buffer took."""

    def __init__(self, comm):
        self.count = 0
        staging = comm.staging
        original = staging.stage_in

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        staging.stage_in = counted

    def route_check(self, before: int, is_cuda: bool, host_only: bool, cuda_aware: bool, windowed: bool = False):
        """(ok, detail) for a collective that ran between `before` and now; `windowed`: it should
        have gone through the node window in GPU memory."""
        staged = self.count > before
        if not is_cuda:
            return (not staged), ("a CPU buffer was staged" if staged else "")
        if windowed:
            return (not staged), ("the GPU buffer was staged instead of going through the device window"
                                  if staged else "")
        expected = host_only or not cuda_aware
        if staged != expected:
            return False, (f"the GPU buffer {'was' if staged else 'was not'} staged through host memory, but the MPI "
                           f"library is {'' if cuda_aware else 'not '}CUDA-aware"
                           f"{' and the algorithm works in host memory' if host_only else ''}")
        return True, ""


def both(*results):
    """Joins (ok, detail) pairs: ok if all are."""
    failed = [detail for ok, detail in results if not ok]
    return (not failed), "; ".join(failed)


# ---- collectives -------------------------------------------------------------------------------

def check_collectives(comm, report: Report, arrays: Arrays, counts, staging: StagingCounter,
                      window: bool = False) -> None:
    """`window`: GPU buffers of the hierarchical all-reduce, broadcast, allgather and reduce_scatter
    must go through the node window in GPU memory."""
    size, rank = comm.size, comm.rank
    inputs = Inputs(size)
    aware = comm.is_cuda_aware()
    is_cuda = arrays.device.startswith("cuda")
    windowed = window and is_cuda
    for dtype in DTYPES[arrays.kind]:
        where = f"{arrays.label()} {dtype}"
        for count in counts:
            per_rank, total, magnitude = inputs.get(dtype, count)
            for algorithm in ALGORITHMS:
                for op in ("sum", "avg"):
                    def allreduce(algorithm=algorithm, op=op):
                        buf = arrays.make(per_rank[rank], dtype)
                        before = staging.count
                        out = md.allreduce(buf, op=op, algorithm=algorithm)
                        scale = 1.0 / size if op == "avg" else 1.0
                        got = arrays.float64(out)
                        route = (True, "") if algorithm == "auto" else staging.route_check(
                            before, is_cuda, algorithm in HOST_MEMORY_ALGORITHMS, aware,
                            windowed and algorithm == "hierarchical")
                        return both((out is buf, "the result is not the input array (in place)"),
                                    within(got, total * scale, sum_bound(dtype, size, magnitude) * scale),
                                    same_on_every_rank(comm, got), route)
                    report.run(f"allreduce {algorithm} {op} {where} n={count}", allreduce)

        count = counts[1]
        per_rank, total, magnitude = inputs.get(dtype, count)

        def allreduce_max_out():
            source = arrays.make(per_rank[rank], dtype)
            out = arrays.make(np.zeros(count), dtype)
            md.allreduce(source, op="max", out=out)
            return both(within(arrays.float64(out), np.max(per_rank, axis=0), np.zeros(count)),
                        within(arrays.float64(source), per_rank[rank], np.zeros(count)))
        report.run(f"allreduce max out= {where} n={count}", allreduce_max_out)

        def broadcast():
            root = size - 1
            buf = arrays.make(per_rank[rank], dtype)
            before = staging.count
            md.broadcast(buf, root=root)
            got = arrays.float64(buf)
            return both(within(got, per_rank[root], np.zeros(count)),
                        staging.route_check(before, is_cuda, False, aware, windowed))
        report.run(f"broadcast {where} n={count}", broadcast)

        def allgather():
            # Ranks give different numbers of rows, as Horovod allows.
            rows = [rounded(np.random.default_rng([7, r]).standard_normal((r + 1, 3)), dtype) for r in range(size)]
            before = staging.count
            got = arrays.float64(md.allgather(arrays.make(rows[rank], dtype)))
            return both(within(got, np.concatenate(rows), np.zeros((sum(len(r) for r in rows), 3))),
                        staging.route_check(before, is_cuda, False, aware, windowed))
        report.run(f"allgather {where}", allgather)

        for op in ("sum", "avg"):
            def reduce_scatter(op=op):
                rows = 2 * size + 1  # blocks of unequal size
                parts = [rounded(np.random.default_rng([9, r]).standard_normal((rows, 5)), dtype) for r in range(size)]
                scale = 1.0 / size if op == "avg" else 1.0
                start = sum(len(block) for block in np.array_split(np.arange(rows), size)[:rank])
                mine = len(np.array_split(np.arange(rows), size)[rank])
                want = (np.sum(parts, axis=0) * scale)[start:start + mine]
                bound = (sum_bound(dtype, size, np.sum(np.abs(parts), axis=0)) * scale)[start:start + mine]
                source = arrays.make(parts[rank], dtype)
                before = staging.count
                got = arrays.float64(md.reduce_scatter(source, op=op))
                return both(within(got, want, bound),
                            within(arrays.float64(source), parts[rank], np.zeros_like(parts[rank])),
                            staging.route_check(before, is_cuda, False, aware, windowed))
            report.run(f"reduce_scatter {op} {where}", reduce_scatter)


def check_device_window(comm, report: Report) -> None:
    """The node window in GPU memory was opened (after the collectives that open it)."""
    windows = comm.device_window
    opened = windows is not None and windows.window is not None
    report.add("device window: opened on every rank", opened,
               "" if opened else f"not opened: {windows.refusal if windows is not None else 'never asked for'}")


def check_nccl(comm, report: Report, arrays: Arrays, count: int) -> None:
    """algorithm="nccl" as a peer: its results against the same references, or the reason NCCL did
    not run (one failed "peer nccl: runs" check, and no more)."""
    from mpidist.collectives import nccl
    report.data["nccl_version"] = nccl.version()
    size, rank = comm.size, comm.rank
    inputs = Inputs(size)
    for dtype in DTYPES[arrays.kind]:
        per_rank, total, magnitude = inputs.get(dtype, count)
        for op in ("sum", "avg"):
            def allreduce(op=op):
                out = md.allreduce(arrays.make(per_rank[rank], dtype), op=op, algorithm="nccl")
                scale = 1.0 / size if op == "avg" else 1.0
                got = arrays.float64(out)
                return both(within(got, total * scale, sum_bound(dtype, size, magnitude) * scale),
                            same_on_every_rank(comm, got))
            name = f"peer nccl allreduce {op} {arrays.label()} {dtype} n={count}"
            report.run(name, allreduce)
            if not report.data["checks"][-1]["ok"]:  # NCCL refused, or reduced wrongly: no more tries
                report.add("peer nccl: runs", False, report.data["checks"][-1]["detail"])
                return
    report.add("peer nccl: runs", True, f"NCCL {report.data['nccl_version']}")


def check_async(comm, report: Report, arrays: Arrays, count: int) -> None:
    """allreduce_async. Run after the blocking checks: from the first asynchronous call on, every
    collective of the communicator runs on its background engine, whose host staging is its own."""
    inputs = Inputs(comm.size)
    for dtype in DTYPES[arrays.kind]:
        per_rank, total, magnitude = inputs.get(dtype, count)

        def allreduce_async(dtype=dtype, per_rank=per_rank, total=total, magnitude=magnitude):
            handles = [md.allreduce_async(arrays.make(per_rank[comm.rank], dtype), op=op) for op in ("sum", "avg")]
            results = [arrays.float64(handle.wait()) for handle in handles]
            bound = sum_bound(dtype, comm.size, magnitude)
            return both(within(results[0], total, bound), within(results[1], total / comm.size, bound / comm.size))
        report.run(f"allreduce_async sum and avg {arrays.label()} {dtype} n={count}", allreduce_async)


# ---- training modes ----------------------------------------------------------------------------

def mlp(seed: int, sizes=(10, 16, 16, 3)) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).double()


def batch(step: int, worker: int, rows: int = 8, features: int = 10):
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return (torch.randn(rows, features, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (rows,), generator=generator))


def train_reference(seed: int, batches, sizes=(10, 16, 16, 3)):
    """One process on the CPU: SGD with momentum, each step on the mean loss of its batch."""
    model = mlp(seed, sizes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def close_parameters(got, want, what: str):
    """(ok, detail) for float64 parameters trained on a device against the CPU reference."""
    worst = 0.0
    for a, b in zip(got, want):
        a = a.detach().to("cpu")
        worst = max(worst, float((a - b.detach()).abs().max()))
    ok = worst <= 1e-9
    return ok, "" if ok else f"{what}: parameters differ from one-process CPU training by up to {worst:.3g}"


def train_data_parallel(wrap, device: str, rank: int, size: int, what: str, steps: int = 3,
                        wrap_optimizer=lambda optimizer, model: optimizer):
    """(ok, detail): a float64 MLP on `device`, wrapped by wrap(model) (a data-parallel wrapper
    whose construction gives every rank rank 0's weights) and its optimizer by
    wrap_optimizer(optimizer, model), trained on each rank's batches against one process on the
    CPU training on all of them."""
    model = mlp(seed=rank).to(device)
    wrapped = wrap(model)
    optimizer = wrap_optimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9), model)
    for step in range(steps):
        x, y = batch(step, rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(wrapped(x.to(device)), y.to(device)).backward()
        optimizer.step()
    union = [tuple(torch.cat(parts) for parts in zip(*[batch(step, r) for r in range(size)]))
             for step in range(steps)]
    reference, _ = train_reference(0, union)
    return close_parameters(list(model.parameters()), list(reference.parameters()), what)


def check_training(comm, report: Report, device: str) -> None:
    size, rank, steps = comm.size, comm.rank, 3

    def data_parallel(bucket_mb, as_view):
        def wrap(model):
            return md.DataParallel(model, bucket_mb=bucket_mb, gradient_as_bucket_view=as_view)
        return lambda: train_data_parallel(wrap, device, rank, size, "DataParallel", steps)

    report.run(f"DataParallel {device} float64 (one bucket)", data_parallel(25, False))

    def horovod():
        import mpidist.torch as hvd

        def wrap(model):
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            return model

        def wrap_optimizer(optimizer, model):
            return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        return train_data_parallel(wrap, device, rank, size, "hvd.DistributedOptimizer", steps, wrap_optimizer)
    report.run(f"hvd.DistributedOptimizer {device} float64", horovod)
    report.run(f"DataParallel {device} float64 (small buckets, gradient_as_bucket_view)",
               data_parallel(0.0005, True))

    def pipeline(replicas):
        def check():
            sizes = (10, 16, 16, 12, 3)  # 7 layers: enough for 4 stages
            stages = size // replicas
            model = mlp(seed=0, sizes=sizes).to(device)
            pipe = md.Pipeline(model, torch.nn.functional.cross_entropy, chunks=4, replicas=replicas)
            optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
            losses, rows = [], 8
            for step in range(steps):
                x, y = batch(step, 0, rows=rows * replicas)
                mine = slice(pipe.replica * rows, (pipe.replica + 1) * rows)
                pipe.zero_grad()
                losses.append(pipe.train_step(x[mine].to(device) if pipe.first else None,
                                              y[mine].to(device) if pipe.last else None))
                optimizer.step()
            reference, reference_losses = train_reference(0, [batch(step, 0, rows=rows * replicas)
                                                              for step in range(steps)], sizes)
            start, end = pipe.bounds[pipe.index]
            params = close_parameters(list(pipe.parameters()), list(reference[start:end].parameters()),
                                      f"Pipeline stage {pipe.index} of {stages}")
            pipe.free()
            if replicas == 1:  # with replicas each returns its own rows' loss
                worst = max(abs(a - b) for a, b in zip(losses, reference_losses))
                return both(params, (worst <= 1e-9, f"Pipeline losses differ by up to {worst:.3g}"))
            return params
        return check

    report.run(f"Pipeline {device} float64 ({size} stages)", pipeline(1))
    if size % 2 == 0 and size > 2:
        report.run(f"Pipeline {device} float64 ({size // 2} stages x 2 replicas)", pipeline(2))

    def parameter_server():
        server, workers = 0, list(range(1, size))
        model = mlp(seed=rank).to(device)  # the chief's weights win
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if rank == server else None
        ps = md.ParameterServer(model, optimizer, mode="sync", server=server)
        if ps.is_server:
            ps.serve()
        else:
            for step in range(steps):
                model.zero_grad()
                x, y = batch(step, rank)
                torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
                ps.step()
            ps.close()
        # Synchronous SGD: each update averages one gradient of every worker, which is the
        # gradient of the mean loss over the workers' batches together.
        union = [tuple(torch.cat(parts) for parts in zip(*[batch(step, w) for w in workers])) for step in range(steps)]
        reference, _ = train_reference(workers[0], union)
        return close_parameters(list(model.parameters()), list(reference.parameters()), "ParameterServer")

    report.run(f"ParameterServer sync {device} float64 ({size - 1} workers)", parameter_server)


# ---- Horovod's behaviours on the device --------------------------------------------------------

def check_horovod(comm, report: Report, device: str) -> None:
    """mpidist.torch on tensors on `device`, as Horovod's own tests for horovod.torch check them:
    asynchronous all-reduces of several dtypes, CPU and GPU tensors mixed in one call refused on
    every rank, alltoall with splits, hvd.join(device) with all-reduces on the other ranks,
    SyncBatchNorm against BatchNorm over every rank's batch, and a model split over two devices
    trained with the DistributedOptimizer. Before any DistributedOptimizer: join() refuses to run
    beside a live one."""
    import mpidist.torch as hvd
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    total = size * (size + 1) / 2  # the sum of the factors (rank + 1)

    def asynchronous():
        handles, wrong = [], []
        for dtype, op in ((torch.float32, hvd.Average), (torch.float16, hvd.Average), (torch.int32, hvd.Sum)):
            tensor = torch.arange(17, device=device).to(dtype) * (rank + 1)
            handles.append((dtype, op, hvd.allreduce_async(tensor, name=f"async {dtype}", op=op)))
        pair = [torch.full((5,), rank + 1.0, device=device), torch.full((3,), 2.0 * (rank + 1), device=device)]
        group = hvd.grouped_allreduce_async(pair, name="fused pair", op=hvd.Sum)
        for dtype, op, handle in handles:
            got = hvd.synchronize(handle)
            want = np.arange(17) * total / (size if op == hvd.Average else 1)
            if got.device.type != torch.device(device).type or got.dtype != dtype or \
                    not np.array_equal(got.cpu().double().numpy(), want):
                wrong.append(f"{dtype}: got {got.cpu().tolist()[:4]}... on {got.device}, want {want[:4].tolist()}...")
        first, second = hvd.synchronize(group)
        if not (torch.all(first.cpu() == total) and torch.all(second.cpu() == 2 * total)):
            wrong.append(f"fused pair: got {first.cpu().tolist()}, {second.cpu().tolist()}, want {total}, {2 * total}")
        return not wrong, "; ".join(wrong)
    report.run(f"hvd.allreduce_async {device}: float32 and float16 averaged, int32 and a fused pair summed",
               asynchronous)

    if torch.device(device).type == "cuda":
        def mixed():
            tensor = torch.ones(4, device=device if rank % 2 == 0 else "cpu")
            try:
                hvd.allreduce(tensor)
            except RuntimeError as error:  # Horovod raises a RuntimeError on every rank
                ok = "cpu" in str(error) and "cuda" in str(error)
                return ok, "" if ok else f"the error does not name both devices: {error}"
            return False, "an all-reduce of a CUDA tensor on even ranks and a CPU one on odd ranks ran"
        report.run("hvd.allreduce of CPU and GPU tensors mixed: refused on every rank", mixed)

    def alltoall_splits():
        # Rank r sends k + 1 rows holding 100 r + k to rank k.
        rows = [torch.full((k + 1, 3), 100.0 * rank + k, device=device) for k in range(size)]
        splits = torch.arange(1, size + 1, dtype=torch.int32)
        got, received = hvd.alltoall(torch.cat(rows), splits=splits)
        want = torch.cat([torch.full((rank + 1, 3), 100.0 * source + rank) for source in range(size)])
        ok = got.device.type == torch.device(device).type and torch.equal(got.cpu(), want) \
            and received.tolist() == [rank + 1] * size
        return ok, "" if ok else f"got {got.cpu().tolist()} on {got.device}, splits {received.tolist()}"
    report.run(f"hvd.alltoall {device} with splits", alltoall_splits)

    def join():
        # Rank 0 runs out of data at once; the others average two tensors, then join too.
        device_id = torch.device(device).index if torch.device(device).type == "cuda" else -1
        results = []
        if rank != 0:
            for step in range(2):
                results.append(hvd.allreduce(torch.full((6,), rank + 1.0 + step, device=device), name=f"join {step}"))
        last = hvd.join(-1 if device_id is None else device_id)
        wrong = [] if last == size - 1 else [f"join() returned {last}, want {size - 1} (the rank that joined last)"]
        for step, got in enumerate(results):  # rank 0 took part with zeros; the average counts it
            want = sum(r + 1.0 + step for r in range(1, size)) / size
            if got.device.type != torch.device(device).type or not torch.allclose(got.cpu(), torch.full((6,), want)):
                wrong.append(f"step {step}: got {got.cpu().tolist()} on {got.device}, want {want}")
        return not wrong, "; ".join(wrong)
    report.run(f"hvd.join(device) {device}, the other ranks averaging", join)

    def sync_batchnorm():
        generator = torch.Generator().manual_seed(7)
        full = torch.randn(4 * size, 3, 5, generator=generator, dtype=torch.float64)
        weights = torch.randn(full.shape, generator=generator, dtype=torch.float64)
        mine = slice(4 * rank, 4 * (rank + 1))
        layer = hvd.SyncBatchNorm(3).double().to(device)
        x = full[mine].to(device).requires_grad_()
        y = layer(x)
        (y * weights[mine].to(device)).sum().backward()
        reference = torch.nn.BatchNorm1d(3).double()
        x_all = full.clone().requires_grad_()
        y_all = reference(x_all)
        (y_all * weights).sum().backward()
        worst = max(float((a.detach().cpu() - b.detach()).abs().max()) for a, b in (
            (y, y_all[mine]), (x.grad, x_all.grad[mine]), (layer.running_mean, reference.running_mean),
            (layer.running_var, reference.running_var)))
        return worst <= 1e-10, f"differs from BatchNorm over every rank's batch by up to {worst:.3g}"
    report.run(f"hvd.SyncBatchNorm {device} float64 against BatchNorm over all ranks' rows", sync_batchnorm)

    def two_devices():
        # Horovod's model parallelism test, with the one GPU and the CPU as the two devices.
        other = "cpu"

        class Split(torch.nn.Module):
            def __init__(self, seed):
                super().__init__()
                torch.manual_seed(seed)
                self.first, self.second = torch.nn.Linear(10, 16).double(), torch.nn.Linear(16, 3).double()

            def forward(self, x):
                return self.second(torch.tanh(self.first(x.to(self.first.weight.device))).to(other))

        model = Split(seed=rank)
        model.first.to(device)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                             named_parameters=model.named_parameters())
        reference = Split(seed=0)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            x, y = batch(step, rank)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            x_all, y_all = (torch.cat(parts) for parts in zip(*[batch(step, r) for r in range(size)]))
            reference_optimizer.zero_grad()
            torch.nn.functional.cross_entropy(reference(x_all), y_all).backward()
            reference_optimizer.step()
        return close_parameters(list(model.parameters()), list(reference.parameters()),
                                f"a model on {device} and {other}")
    report.run(f"hvd.DistributedOptimizer over a model split between {device} and cpu", two_devices)


# ---- the torch.distributed backend --------------------------------------------------------------

def check_distributed_backend(comm, report: Report, device: str, count: int, train: bool) -> None:
    """torch.distributed over "mpidist" on torch tensors on `device`: the c10d collectives and
    point-to-point against float64 references, then (with `train`) torch's own DDP against
    one-process training."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("mpidist")
    size, rank = comm.size, comm.rank
    arrays, inputs = Arrays("torch", device), Inputs(size)
    for dtype in ("float32", "bfloat16"):
        def collectives(dtype=dtype):
            per_rank, total, magnitude = inputs.get(dtype, count)
            bound = sum_bound(dtype, size, magnitude)
            blocking, queued = arrays.make(per_rank[rank], dtype), arrays.make(per_rank[rank], dtype)
            dist.all_reduce(blocking)
            dist.all_reduce(queued, async_op=True).wait()
            broadcast = arrays.make(per_rank[rank], dtype)
            dist.broadcast(broadcast, src=0)
            gathered = arrays.make(np.zeros(size * count), dtype)
            dist.all_gather_into_tensor(gathered, arrays.make(per_rank[rank], dtype))
            # reduce_scatter_tensor: rank r keeps the sum of every rank's r-th block of `rows`.
            rows = count // size * size
            scattered = arrays.make(np.zeros(rows // size), dtype)
            dist.reduce_scatter_tensor(scattered, arrays.make(per_rank[rank][:rows], dtype))
            block = slice(rank * rows // size, (rank + 1) * rows // size)
            received = arrays.make(np.zeros(count), dtype)
            works = [dist.isend(arrays.make(per_rank[rank], dtype), (rank + 1) % size),
                     dist.irecv(received, (rank - 1) % size)]
            for work in works:
                work.wait()
            return both(within(arrays.float64(blocking), total, bound),
                        within(arrays.float64(queued), total, bound),
                        within(arrays.float64(broadcast), per_rank[0], 0),
                        within(arrays.float64(gathered), np.concatenate(per_rank), 0),
                        within(arrays.float64(scattered), total[block], bound[block]),
                        within(arrays.float64(received), per_rank[(rank - 1) % size], 0))
        report.run(f"torch.distributed \"mpidist\": all_reduce (blocking, async), broadcast, "
                   f"all_gather_into_tensor, reduce_scatter_tensor, isend/irecv {arrays.label()} {dtype} n={count}",
                   collectives)

    if train:
        report.run(f"torch DDP over \"mpidist\" {device} float64",
                   lambda: train_data_parallel(torch.nn.parallel.DistributedDataParallel, device, rank, size,
                                               "DDP over mpidist"))


# ---- main --------------------------------------------------------------------------------------

def array_kinds(device: str, comm, report: Report):
    """The kinds of array to check on `device`; a kind that cannot be made is a failed check."""
    if device == "cpu":
        return [Arrays("numpy", "cpu"), Arrays("torch", "cpu")]
    if not torch.cuda.is_available():
        return []  # the "GPU visible" check has failed already
    gpu = f"cuda:{comm.local_rank % torch.cuda.device_count()}"
    torch.cuda.set_device(gpu)
    kinds = [Arrays("torch", gpu)]
    try:
        import cupy  # noqa: F401
        kinds.append(Arrays("cupy", gpu))
    except ImportError as error:
        report.add("CuPy arrays", False, f"CuPy cannot be imported: {error}")
    return kinds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--out", required=True, help="folder for rank<r>.json")
    parser.add_argument("--expect-ranks", type=int, required=True,
                        help="the launch's size: a launcher of another MPI starts singletons instead")
    parser.add_argument("--expect-cuda-aware", choices=("yes", "no"), help="the route GPU buffers must take")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--device-window", choices=("yes", "no"), default="no",
                        help="whether GPU buffers must go through the node window in GPU memory")
    parser.add_argument("--nccl", action="store_true", help='also run algorithm="nccl" as a peer')
    args = parser.parse_args(argv)
    comm = md.init()
    report = Report(args.out, comm, args.device)
    report.add("launch: world size", comm.size == args.expect_ranks,
               "" if comm.size == args.expect_ranks else
               f"this rank sees {comm.size} ranks, the launch asked for {args.expect_ranks}: mpirun and mpi4py's "
               "MPI library do not belong together")
    if comm.size != args.expect_ranks:
        return 1
    if args.expect_cuda_aware is not None:
        aware = comm.is_cuda_aware()
        report.add("launch: CUDA-aware MPI as expected", aware == (args.expect_cuda_aware == "yes"),
                   f"mpidist sees cuda_aware={aware}, expected {args.expect_cuda_aware}")
    if args.device == "cuda":
        report.add("launch: GPU visible", torch.cuda.is_available() and kernels.cuda_available(),
                   f"torch.cuda.is_available()={torch.cuda.is_available()}, "
                   f"mpidist.kernels.cuda_available()={kernels.cuda_available()}")
    staging = StagingCounter(comm)
    kinds = array_kinds(args.device, comm, report)
    window = args.device_window == "yes"
    for arrays in kinds:
        check_collectives(comm, report, arrays, COUNTS[args.device], staging, window)
    if window and kinds:
        check_device_window(comm, report)
    for arrays in kinds:
        check_async(comm, report, arrays, COUNTS[args.device][1])
    if kinds:
        check_distributed_backend(comm, report, kinds[0].device, COUNTS[args.device][1], not args.skip_training)
    if not args.skip_training:
        check_horovod(comm, report, kinds[0].device if kinds else args.device)
        check_training(comm, report, kinds[0].device if kinds else args.device)
    if args.nccl:  # last: a peer that fails or hangs in NCCL's own setup cannot cost our checks
        for arrays in kinds:
            check_nccl(comm, report, arrays, COUNTS[args.device][1])
    # A peer's failure (NCCL refusing two ranks on one GPU) is recorded, not ours.
    return 0 if all(check["ok"] or check["name"].startswith("peer ") for check in report.data["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
