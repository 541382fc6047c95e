"""Parameter server against all-reduce: samples/s and bytes per step of a dense MLP and of an
embedding-heavy click model, every configuration in one run on the same ranks.

    mpirun --oversubscribe --bind-to none -np 4 python benchmarks/ps.py [--params 3M] [--depth 4] \
        [--rows 1M] [--server-bound-rows 256K] [--dim 64] [--bag 8] [--batch 64] [--steps 5] [--warmup 2] \
        [--server-bound-batch 8] [--rounds 3] [--models mlp,embedding,server-bound,server-bound-mlp] \
        [--configs ...] [--json FILE]

Ranks: exactly 4. Ranks 2 and 3 are the two workers of every configuration (the same ranks,
the same batches), so samples/s compare; ranks 0 and 1 serve or sleep:

- `allreduce`: md.DataParallel over the two workers (its gradients all-reduced each step);
  ranks 0 and 1 sleep in a polled barrier.
- `ps-1`: md.ParameterServer, mode="sync", one server (rank 0; rank 1 sleeps), dense: each step
  every worker pushes its whole gradient and pulls the whole weights.
- `ps-2`: the same with two servers (ranks 0 and 1), each holding half of the flat parameters.
- `sparse-ps`, `sparse-ps-2` (the embedding model only): the same as ps-1 and ps-2 with the table
  an nn.EmbeddingBag(sparse=True): a worker pulls the rows of its batch before the forward pass
  and pushes only their gradients.

Models (scenarios):
- `mlp`: benchmarks/training.py's MLP (`--params`, `--depth`; 3M: 1024-1024-1024-1024-10),
  random inputs and labels, plain SGD (lr 0.01).
- `embedding`: mpidist.cli.sparse_workload.ClickModel, a `--rows` x `--dim` table summed over bags of `--bag`
  ids drawn with Zipf probabilities (exponent 1.05, popular ids spread over the table), then
  Linear(dim, 64), ReLU, Linear(64, 2); random labels; Adagrad (lr 0.01), whose sparse form
  updates only the touched rows.
- `server-bound`: the same click model with a `--server-bound-rows` x `--dim` table, dense
  (all-reduce, ps-1 and ps-2 only), trained with Adam (amsgrad=True, lr 0.01): every step the
  server receives and averages the workers' whole gradients, runs an optimizer that makes about
  a dozen passes over every parameter and sends the weights back, while a worker's own work is a
  cheap embedding backward and a few copies of the parameters: the server is the bottleneck
  (the rows' CPU times show it), the case where a second server should pay. The table is one
  tensor: two servers each hold half of its rows.
- `server-bound-mlp`: the MLP of `mlp` with batches of `--server-bound-batch` samples and Adam
  (amsgrad=True, lr 0.01): the same server-heavy step on a model of several tensors, which two
  servers divide between them mostly whole.

Every round runs each configuration in turn (the order rotating from round to round), each
from fresh weights (the same seed): warm-up steps, then `--steps` timed steps on the workers,
then the workers close. samples_per_s = 2 workers x batch x steps / the slower worker's time,
median over rounds. bytes_per_step, per worker: for the parameter server the worker's counters
(ParameterServer.bytes_pushed + bytes_pulled) over the timed steps; for all-reduce the bytes a
bandwidth-optimal all-reduce sends from each rank, 2 (p - 1) / p x the gradient's bytes (p = 2
workers; on one node mpidist's all-reduce goes through shared memory, each rank copying its
gradient in and the sum out). CPU time per step, from the processes' CPU clocks (not the wall
clock, which other jobs on a shared machine stretch): worker_cpu_ms over the timed steps (mean
over workers), server_cpu_ms over serve() per update (mean over servers). Where a server's
exceeds a worker's, the server is the bottleneck of the synchronous steps.

Correctness: every configuration runs synchronous steps from the same weights on the same
batches, so after the last round every one must end with all-reduce's weights, on every worker:
max over tensors of max|a - b| / max|b| <= --tolerance (1e-5). The command exits 1 otherwise.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Waiting ranks yield the core, as Open MPI advises for oversubscribed nodes (see training.py).
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from training import (  # noqa: E402
    build_model,
    layer_sizes,
    parse_count,
    report,
    rounds_range,
    sleeping_barrier,
    start_one_thread_per_rank,
    throughput,
)

RANKS = 4
WORKERS = (2, 3)
ROW_KEYS = ("scenario", "config", "servers", "workers", "sparse", "batch_per_worker", "params", "steps", "rounds",
            "samples_per_s", "samples_per_s_rounds", "bytes_per_step", "bytes_per_step_rounds", "worker_cpu_ms",
            "server_cpu_ms",
            "max_rel_diff", "correct")
CONFIGS = {  # name: (servers, the table by rows); servers 0: all-reduce
    "allreduce": (0, False), "ps-1": (1, False), "ps-2": (2, False), "sparse-ps": (1, True), "sparse-ps-2": (2, True)}
MODELS = ("mlp", "embedding", "server-bound", "server-bound-mlp")
LR = 0.01


class Scenario:
    """A model, its optimizer and each worker's pool of batches."""

    def __init__(self, name: str, args, rank: int):
        self.name, self.args = name, args
        generator = np.random.default_rng(args.seed * 1000 + rank + 1)
        self.rows = parse_count(args.server_bound_rows if name == "server-bound" else args.rows)
        self.batch = args.server_bound_batch if name == "server-bound-mlp" else args.batch
        if name in ("mlp", "server-bound-mlp"):
            self.sizes = layer_sizes(parse_count(args.params), args.depth)
            self.pool = [(torch.from_numpy(generator.standard_normal((self.batch, self.sizes[0]), dtype=np.float32)),
                          torch.from_numpy(generator.integers(0, self.sizes[-1], self.batch)))
                         for _ in range(args.batches)]
        else:
            from mpidist.cli.sparse_workload import ZipfSampler
            ids = ZipfSampler(self.rows, seed=args.seed)
            self.pool = [(torch.from_numpy(ids.draw((self.batch, args.bag), generator)),
                          torch.from_numpy(generator.integers(0, 2, self.batch))) for _ in range(args.batches)]
        self.configs = [name for name, (_, by_rows) in CONFIGS.items()
                        if name in args.configs and (not by_rows or self.name == "embedding")]
        self.updates = args.warmup + args.steps  # per configuration and round

    def build(self, sparse: bool) -> torch.nn.Module:
        torch.manual_seed(self.args.seed)
        if self.name in ("mlp", "server-bound-mlp"):
            return build_model(self.sizes)
        from mpidist.cli.sparse_workload import ClickModel
        return ClickModel(self.rows, self.args.dim, hidden=64, sparse=sparse)

    def optimizer(self, params):
        if self.name == "mlp":
            return torch.optim.SGD(params, lr=LR)
        if self.name in ("server-bound", "server-bound-mlp"):
            return torch.optim.Adam(params, lr=LR, amsgrad=True)
        return torch.optim.Adagrad(params, lr=LR)


def subcommunicator(world, ranks):
    """A Communicator of `ranks` of the world (None on the other ranks); every rank calls it."""
    from mpi4py import MPI

    import mpidist as md
    mpi = world.mpi.Split(0 if world.rank in ranks else MPI.UNDEFINED, world.rank)
    return md.Communicator(mpi) if world.rank in ranks else None


def train(model, scenario, apply, first: int, count: int, pull=None) -> None:
    for index in range(first, first + count):
        x, y = scenario.pool[index % len(scenario.pool)]
        if pull is not None:
            pull(x)
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        apply()


def run_config(config: str, scenario: Scenario, world, comms: dict, args):
    """One round of one configuration on this rank: (elapsed s, bytes per step and CPU ms per
    step on a worker, else NaN; CPU ms per update on a server, else NaN; the model)."""
    import mpidist as md
    servers, by_rows = CONFIGS[config]
    elapsed = sent = worker_cpu = server_cpu = float("nan")
    model = None
    if servers == 0:
        if world.rank in WORKERS:
            model = scenario.build(sparse=False)
            ddp = md.DataParallel(model, comm=comms["workers"])
            optimizer = scenario.optimizer(ddp.parameters())

            def step():
                optimizer.step()

            train(ddp, scenario, step, 0, args.warmup)
            comms["workers"].mpi.Barrier()
            start, process = time.perf_counter(), time.process_time()
            train(ddp, scenario, step, args.warmup, args.steps)
            elapsed, worker_cpu = time.perf_counter() - start, (time.process_time() - process) * 1e3 / args.steps
            gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            sent = 2 * (len(WORKERS) - 1) / len(WORKERS) * gradient_bytes
    else:
        comm = comms[servers]
        if comm is not None:
            model = scenario.build(sparse=by_rows)
            optimizer = scenario.optimizer(model.parameters()) if comm.rank < servers else None
            ps = md.ParameterServer(model, optimizer, comm=comm, mode="sync", servers=servers)
            if ps.is_server:
                process = time.process_time()
                updates = len(ps.serve())
                server_cpu = (time.process_time() - process) * 1e3 / updates
            else:
                pull = (lambda ids: ps.pull_rows(model.embedding, ids)) if by_rows else None
                train(model, scenario, ps.step, 0, args.warmup, pull)
                comms["workers"].mpi.Barrier()
                moved = ps.bytes_pushed + ps.bytes_pulled
                start, process = time.perf_counter(), time.process_time()
                train(model, scenario, ps.step, args.warmup, args.steps, pull)
                elapsed, worker_cpu = time.perf_counter() - start, (time.process_time() - process) * 1e3 / args.steps
                sent = (ps.bytes_pushed + ps.bytes_pulled - moved) / args.steps
                ps.close()
    sleeping_barrier(world)  # the ranks that sat out wait here without taking a core
    return elapsed, sent, worker_cpu, server_cpu, model


def max_rel_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    worst = 0.0
    for pa, pb in zip(a.parameters(), b.parameters()):
        scale = pb.detach().abs().max().item() or 1.0
        worst = max(worst, (pa.detach() - pb.detach()).abs().max().item() / scale)
    return worst


def measure(world, scenario: Scenario, comms: dict, args) -> list[dict]:
    from mpi4py import MPI
    configs = scenario.configs
    results = np.full((args.rounds, len(configs), 4), np.nan)  # elapsed, bytes, worker CPU, server CPU
    finals = {}
    for round_index in range(args.rounds):
        shift = round_index % len(configs)
        for index in list(range(len(configs)))[shift:] + list(range(len(configs)))[:shift]:
            *outcome, model = run_config(configs[index], scenario, world, comms, args)
            results[round_index, index] = outcome
            if round_index == args.rounds - 1 and model is not None and world.rank in WORKERS:
                model.zero_grad(set_to_none=True)
                finals[configs[index]] = model
    table = np.empty((world.size, *results.shape))
    world.mpi.Allgather(np.ascontiguousarray(results), table)
    workers, servers = table[list(WORKERS)], table[:min(WORKERS)]
    with torch.device("meta"):  # the shapes alone
        params = sum(p.numel() for p in scenario.build(sparse=False).parameters())
    rows = []
    for index, config in enumerate(configs):
        slowest = workers[:, :, index, 0].max(axis=0)
        moved = workers[:, :, index, 1].mean(axis=0)
        worker_cpu = workers[:, :, index, 2].mean(axis=0)
        server_cpu = np.nanmean(servers[:, :, index, 3], axis=0) if CONFIGS[config][0] else None
        mine = max_rel_diff(finals[config], finals["allreduce"]) if world.rank in WORKERS else 0.0
        worst = np.empty(1)
        world.mpi.Allreduce(np.array([mine]), worst, op=MPI.MAX)
        rows.append({
            "scenario": scenario.name, "config": config, "servers": CONFIGS[config][0], "workers": len(WORKERS),
            "sparse": CONFIGS[config][1], "batch_per_worker": scenario.batch, "params": params, "steps": args.steps,
            "rounds": args.rounds, **throughput(len(WORKERS) * scenario.batch * args.steps, slowest),
            "bytes_per_step": int(statistics.median(moved)), "bytes_per_step_rounds": [int(b) for b in moved],
            "worker_cpu_ms": round(float(statistics.median(worker_cpu)), 2),
            "server_cpu_ms": None if server_cpu is None else round(float(statistics.median(server_cpu)), 2),
            "max_rel_diff": float(worst[0]), "correct": bool(worst[0] <= args.tolerance)})
    return rows


def checks(rows) -> list[str]:
    """The targets, each line saying what was measured and whether it is met."""
    by = {(row["scenario"], row["config"]): row for row in rows}
    lines = []

    def line(name, value, met):
        lines.append(f"{name}: {value} -> {'met' if met else 'NOT met'}")

    if ("embedding", "sparse-ps") in by:
        allreduce, sparse = by["embedding", "allreduce"], by["embedding", "sparse-ps"]
        fewer = allreduce["bytes_per_step"] / max(sparse["bytes_per_step"], 1)
        line("embedding model: sparse PS moves >= 20x fewer bytes per step per worker than all-reduce",
             f"{fewer:.0f}x ({sparse['bytes_per_step']:,} against {allreduce['bytes_per_step']:,} bytes)", fewer >= 20)
        faster = sparse["samples_per_s"] / allreduce["samples_per_s"]
        line("embedding model: sparse PS is faster than all-reduce", f"{faster:.2f}x all-reduce's samples/s",
             faster > 1)
    dense_ps = [by["mlp", config] for config in ("ps-1", "ps-2") if ("mlp", config) in by]
    if dense_ps:
        allreduce = by["mlp", "allreduce"]
        best = max(dense_ps, key=lambda row: row["samples_per_s"])
        ratio = allreduce["samples_per_s"] / best["samples_per_s"]
        line("dense MLP: all-reduce beats the parameter server", f"{ratio:.2f}x the best PS ({best['config']})",
             ratio > 1)
    for scenario in sorted({row["scenario"] for row in rows if (row["scenario"], "ps-2") in by}):
        one, two = by[scenario, "ps-1"], by[scenario, "ps-2"]
        ratio = two["samples_per_s"] / one["samples_per_s"]
        bound = one["server_cpu_ms"] > one["worker_cpu_ms"]
        cpu = f"1 server: {one['server_cpu_ms']:.0f} ms of server CPU per update, {one['worker_cpu_ms']:.0f} per worker step"
        if bound:
            line(f"{scenario}: 2 servers >= 1.6x the samples/s of 1 server where the server is the bottleneck ({cpu})",
                 f"{ratio:.2f}x", ratio >= 1.6)
        else:
            lines.append(f"{scenario}: 2 servers give {ratio:.2f}x the samples/s of 1 server; the server is not the "
                         f"bottleneck here ({cpu}), so the 1.6x target does not apply")
    return lines


def markdown_table(rows) -> str:
    lines = ["| model | config | servers | samples/s (median) | rounds min-max | vs all-reduce | bytes/step/worker | "
             "vs all-reduce bytes | worker CPU ms/step | server CPU ms/update | max rel diff | correct |",
             "|" + "---|" * 12]
    for row in rows:
        base = next(r for r in rows if r["scenario"] == row["scenario"] and r["config"] == "allreduce")
        lines.append(
            f"| {row['scenario']} | {row['config']} | {row['servers']} | {row['samples_per_s']:.1f} | "
            f"{rounds_range(row, 1)} | "
            f"{row['samples_per_s'] / base['samples_per_s']:.2f} | {row['bytes_per_step']:,} | "
            f"{row['bytes_per_step'] / base['bytes_per_step']:.4f} | "
            f"{row['worker_cpu_ms']:.1f} | {'-' if row['server_cpu_ms'] is None else format(row['server_cpu_ms'], '.1f')} | "
            f"{row['max_rel_diff']:.1e} | "
            f"{'yes' if row['correct'] else 'NO'} |")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="scenarios, comma-separated (default all)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="configurations, comma-separated (default all; allreduce is always run, as the reference)")
    parser.add_argument("--params", default="3M", help="the MLP: about this many parameters (3M, 20K, ...)")
    parser.add_argument("--depth", type=int, default=4, help="the MLP: linear layers in all")
    parser.add_argument("--rows", default="1M", help="the embedding table's rows (1M, 1K, ...)")
    parser.add_argument("--server-bound-rows", default="256K", help="the server-bound model's table rows")
    parser.add_argument("--server-bound-batch", type=int, default=8, help="samples per worker per step of server-bound-mlp")
    parser.add_argument("--dim", type=int, default=64, help="the embedding table's columns")
    parser.add_argument("--bag", type=int, default=8, help="ids per sample")
    parser.add_argument("--batch", type=int, default=64, help="samples per worker per step")
    parser.add_argument("--batches", type=int, default=8, help="batches in each worker's pool")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.models = [name.strip() for name in args.models.split(",") if name.strip()]
    if set(args.models) - set(MODELS) or not args.models:
        parser.error(f"--models: choose among {', '.join(MODELS)}, got {args.models}")
    args.configs = ["allreduce"] + [name.strip() for name in args.configs.split(",") if name.strip() != "allreduce"]
    if set(args.configs) - set(CONFIGS):
        parser.error(f"--configs: choose among {', '.join(CONFIGS)}, got {args.configs[1:]}")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    world = start_one_thread_per_rank(check_calls=False)
    if world.size != RANKS:
        if world.rank == 0:
            print(f"benchmarks/ps.py runs on exactly {RANKS} ranks (2 servers, 2 workers), not {world.size}",
                  file=sys.stderr, flush=True)
        return 2
    comms = {"workers": subcommunicator(world, WORKERS), 1: subcommunicator(world, (0, *WORKERS)), 2: world}
    rows = []
    for name in args.models:
        scenario = Scenario(name, args, world.rank)
        if world.rank == 0:
            print(f"# {name}: {RANKS} ranks, workers {WORKERS}, batch {scenario.batch} per worker, {args.rounds} rounds "
                  f"x {args.steps} steps after {args.warmup} warm-up steps", flush=True)
        rows += measure(world, scenario, comms, args)
    if world.rank == 0:
        report("\n".join([markdown_table(rows), *checks(rows)]), rows, args.json)
    return 0 if all(row["correct"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
