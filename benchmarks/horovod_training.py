"""What Horovod's tensor fusion gives a training loop: Horovod's synthetic benchmark
(examples/horovod/pytorch_synthetic_benchmark.py, its deeper convnet) run as users run it, with
hvd.DistributedOptimizer at the default HOROVOD_FUSION_THRESHOLD, with fusion off
(HOROVOD_FUSION_THRESHOLD=0: an all-reduce per gradient), and with md.DataParallel instead.

    python benchmarks/horovod_training.py [--ranks 2,3] [--rounds 3] [--blocks 12] [--out PREFIX]

Each round launches the example once per candidate, in turn, so the noise of a shared machine
falls on all of them alike; the table holds the median over rounds of the example's own
"Total img/sec" line. Results go to PREFIX.json and PREFIX.md (default
benchmarks/results/horovod-training-cpu) with the machine and the commands.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from machine import cpu_model  # benchmarks/machine.py, beside this script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "horovod", "pytorch_synthetic_benchmark.py")
CANDIDATES = {
    "hvd.DistributedOptimizer, fused (default threshold)": ({}, []),
    "hvd.DistributedOptimizer, HOROVOD_FUSION_THRESHOLD=0": ({"HOROVOD_FUSION_THRESHOLD": "0"}, []),
    "md.DataParallel": ({}, ["--data-parallel"]),
}
# The launcher of the MPI library this Python's mpi4py loads: the one beside it in a venv.
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
MPIRUN = MPIRUN if os.path.exists(MPIRUN) else "mpirun"
TOTAL = re.compile(r"Total img/sec on \d+ CPU\(s\): ([\d.]+) \+-")


def launch(ranks: int, args, changes: dict, more: list) -> tuple:
    """(command, total img/sec) of one run of the example."""
    command = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", str(ranks), sys.executable, EXAMPLE,
               "--model", "convnet", "--no-cuda", "--blocks", str(args.blocks), "--batch-size", str(args.batch_size),
               "--image-size", str(args.image_size), "--num-classes", "10", "--num-warmup-batches", "3",
               "--num-batches-per-iter", "5", "--num-iters", "5", *more]
    env = dict(os.environ, **changes, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    found = TOTAL.search(result.stdout)
    if result.returncode != 0 or not found:
        raise SystemExit(f"{' '.join(command)} failed (exit {result.returncode}):\n{result.stdout}{result.stderr}")
    shown = [f"{key}={value}" for key, value in changes.items()]
    shown += ["mpirun", *command[1:6], "python", os.path.relpath(EXAMPLE, REPO), *command[8:]]
    return " ".join(shown), float(found.group(1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "horovod-training-cpu"))
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rows, commands = [], {}
    for ranks in (int(r) for r in args.ranks.split(",")):
        rates = {name: [] for name in CANDIDATES}
        for _ in range(args.rounds):
            for name, (changes, more) in CANDIDATES.items():
                commands[name], rate = launch(ranks, args, changes, more)
                rates[name].append(rate)
        fused = statistics.median(rates[next(iter(CANDIDATES))])
        for name, measured in rates.items():
            rows.append({"ranks": ranks, "candidate": name, "img_per_s": statistics.median(measured),
                         "img_per_s_all": measured, "vs_fused": statistics.median(measured) / fused})
            print(f"{ranks} ranks  {name:<55} {statistics.median(measured):8.1f} img/s", flush=True)
    machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "load_average_before": load_before,
               "load_average_after": os.getloadavg(), "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with open(args.out + ".json", "w") as handle:
        json.dump({"machine": machine, "commands": commands, "rows": rows}, handle, indent=1)
    with open(args.out + ".md", "w") as handle:
        handle.write(f"# Horovod's synthetic benchmark: fusion on and off, and md.DataParallel "
                     f"(`benchmarks/horovod_training.py`)\n\nMachine: {machine['cpu']}, {machine['cores']} cores; "
                     f"load average {load_before[0]:.1f} before, {machine['load_average_after'][0]:.1f} after "
                     f"({machine['finished']}). Command: `python benchmarks/horovod_training.py "
                     f"{' '.join(argv if argv is not None else sys.argv[1:])}`; each candidate ran as:\n\n")
        for name, command in commands.items():
            handle.write(f"- {name}: `{command}`\n")
        handle.write("\n| ranks | candidate | img/s (median of rounds) | each round | vs fused |\n|---|---|---|---|---|\n")
        for row in rows:
            each = ", ".join(f"{rate:.1f}" for rate in row["img_per_s_all"])
            handle.write(f"| {row['ranks']} | {row['candidate']} | {row['img_per_s']:.1f} | {each} | "
                         f"{row['vs_fused']:.2f} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
