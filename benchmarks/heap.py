"""Step time of a plain training script, with and without keeping freed memory (mpidist/memory.py).

    python benchmarks/heap.py [--ranks 2] [--rounds 5] [--steps 100] [--warmup 10] [--json FILE]

benchmarks/training.py runs every candidate in one process, where several models share one heap
and glibc happens to keep the gradients' memory from step to step. A user's script holds one
model per process, and there glibc returns the freed gradients to the kernel at each
zero_grad(set_to_none=True) and the next backward faults them in again. This benchmark runs such
scripts, one process per configuration, started afresh each round:

- `single`: one process, plain torch training (no mpidist, no MPI);
- `dataparallel`: `--ranks` processes under mpirun, the same loop with the model wrapped in
  mpidist.DataParallel;
- `ddp`: the same with torch's DistributedDataParallel (gloo, rendezvous through MPI);

each with MPIDIST_KEEP_FREED_MEMORY=1 (`kept`: the single and DDP scripts call
mpidist.memory.keep_freed_memory() themselves, DataParallel does it when constructed) and =0
(`returned`: glibc's defaults, what a DDP user gets). The configurations run in a shuffled
order each round, so the host's drift falls on all of them alike. Model, data and optimizer as benchmarks/training.py's
defaults (MLP 1024-1024-1024-1024-10, batch 64 per rank, SGD lr 0.01, one thread per process).

Per process: the time of `--steps` steps after `--warmup` steps, and the median over those steps
of the minor page faults per step (getrusage). samples/s is processes x batch x steps / the
slowest process's time; the table shows medians over rounds and each row against `single` and
`ddp` with the same setting, and against `single returned` (a plain script as users write it).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("single", "dataparallel", "ddp")
CONFIGS = [(mode, keep) for mode in MODES for keep in ("1", "0")]


def worker(args) -> None:
    """One process of one configuration: train, print one JSON line."""
    import resource

    import torch

    sys.path.insert(0, HERE)
    from training import LR, build_model, layer_sizes, make_pool, parse_count

    from mpidist.memory import keep_freed_memory

    torch.set_num_threads(1)
    rank, gloo = 0, None
    sizes = layer_sizes(parse_count("3M"), 4)
    model = build_model(sizes)
    if args.worker != "dataparallel":
        keep_freed_memory()  # as DataParallel does; MPIDIST_KEEP_FREED_MEMORY=0 makes it a no-op
    if args.worker != "single":
        import mpidist as md
        from mpidist import kernels
        kernels.set_num_threads(1)
        comm = md.init()
        comm.check_calls = False
        rank = comm.rank
        if args.worker == "dataparallel":
            model = md.DataParallel(model, comm=comm)
        else:
            from mpidist.cli.bench import Gloo
            gloo = Gloo(comm)
            model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    pool = make_pool(sizes, args.batch, 0, rank)

    def step(index):
        x, y = pool[index % len(pool)]
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    for index in range(args.warmup):
        step(index)
    faults = []
    start = time.perf_counter()
    for index in range(args.steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step(index)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    elapsed = time.perf_counter() - start
    if gloo is not None:
        gloo.close(comm)
    print(json.dumps({"rank": rank, "seconds": elapsed, "faults_per_step": statistics.median(faults)}), flush=True)


def run_config(mode: str, keep: str, args) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--batch", str(args.batch)]
    processes = 1
    if mode != "single":
        processes = args.ranks
        command = [args.mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(processes)] + command
    env = dict(os.environ, MPIDIST_KEEP_FREED_MEMORY=keep, OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or len(reports) != processes:
        raise SystemExit(f"{mode} (keep={keep}) failed:\n{result.stdout}\n{result.stderr}")
    slowest = max(report["seconds"] for report in reports)
    return {"samples_per_s": processes * args.batch * args.steps / slowest,
            "step_ms": slowest / args.steps * 1e3,
            "faults_per_step": max(report["faults_per_step"] for report in reports)}


def name(mode: str, keep: str) -> str:
    return f"{mode} {'kept' if keep == '1' else 'returned'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--mpirun", default="mpirun")
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    runs = {config: [] for config in CONFIGS}
    for round_index in range(args.rounds):
        order = list(CONFIGS)
        random.Random(round_index).shuffle(order)
        for config in order:
            runs[config].append(run_config(*config, args))
            print(f"round {round_index}: {name(*config)}: {runs[config][-1]}", flush=True)

    median = {config: {key: statistics.median(run[key] for run in rounds) for key in rounds[0]}
              for config, rounds in runs.items()}
    print(f"\n# plain training scripts, MLP 1024-1024-1024-1024-10, batch {args.batch} per process, "
          f"{args.rounds} rounds x {args.steps} steps (medians over rounds)")
    print("| configuration | processes | samples/s | rounds min-max | step ms | page faults per step | "
          "vs single, same setting | vs single returned | vs ddp, same setting |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    rows = []
    for mode, keep in CONFIGS:
        m = median[(mode, keep)]
        rates = [run["samples_per_s"] for run in runs[(mode, keep)]]
        same = m["samples_per_s"] / median[("single", keep)]["samples_per_s"]
        plain = m["samples_per_s"] / median[("single", "0")]["samples_per_s"]
        ddp = m["samples_per_s"] / median[("ddp", keep)]["samples_per_s"]
        processes = args.ranks if mode != "single" else 1
        print(f"| {name(mode, keep)} | {processes} | {m['samples_per_s']:.0f} | {min(rates):.0f}-{max(rates):.0f} | "
              f"{m['step_ms']:.2f} | {m['faults_per_step']:.0f} | {same:.2f} | {plain:.2f} | {ddp:.2f} |")
        rows.append({"configuration": name(mode, keep), "processes": processes, **m,
                     "vs_single_same_setting": same, "vs_single_returned": plain, "vs_ddp_same_setting": ddp,
                     "rounds": runs[(mode, keep)]})
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
