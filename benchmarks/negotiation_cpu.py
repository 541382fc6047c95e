"""What hvd's negotiation costs a training loop whose gradients go through the optimizer's
buckets: the CPU time of the negotiation's thread while hvd.DistributedOptimizer trains the
convnet of Horovod's synthetic benchmark (examples/horovod/pytorch_synthetic_benchmark.py), beside
the CPU time of the whole process.

    mpirun --oversubscribe --bind-to none -np 3 python benchmarks/negotiation_cpu.py \
        [--steps 300] [--blocks 12] [--json FILE]

The loop calls nothing hvd negotiates, so the thread's every cycle is overhead: its CPU time (from
/proc/self/task/<thread id>/stat) and its cycles are counted over `--steps` steps, after 5 warm-up
steps. Rank 0 prints one row per rank; --json writes them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from machine import cpu_model  # benchmarks/machine.py, beside this script
from torch import nn

import mpidist.torch as hvd
from mpidist.torch import negotiation


def convnet(blocks: int) -> nn.Module:
    """The synthetic benchmark's convnet: `blocks` convolutions with batch normalization."""
    channels = [3, 16, 32] + [64] * (blocks - 2)
    layers = []
    for index, (inputs, outputs) in enumerate(zip(channels[:-1], channels[1:])):
        layers += [nn.Conv2d(inputs, outputs, 3, stride=2 if index < 3 else 1, padding=1, bias=False),
                   nn.BatchNorm2d(outputs), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def thread_cpu_seconds(native_id: int) -> float:
    """User and system CPU time of one thread of this process."""
    with open(f"/proc/self/task/{native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    world = hvd.init()
    negotiator = negotiation.negotiator_of(world)
    cycles = []
    exchange = negotiator._exchange
    negotiator._exchange = lambda message: cycles.append(None) or exchange(message)
    torch.manual_seed(0)
    model = convnet(args.blocks)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    inputs, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

    def step():
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    for _ in range(5):
        step()
    thread = negotiator._thread.native_id
    cycles.clear()
    start, process_start, thread_start = time.perf_counter(), time.process_time(), thread_cpu_seconds(thread)
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - start
    row = {"rank": hvd.rank(), "ranks": hvd.size(), "steps": args.steps, "seconds": seconds,
           "steps_per_s": args.steps / seconds, "cycles": len(cycles),
           "thread_cpu_s": thread_cpu_seconds(thread) - thread_start,
           "process_cpu_s": time.process_time() - process_start}
    rows = world.mpi.gather(row)
    if hvd.rank() == 0:
        print(f"# {cpu_model()}, {hvd.size()} ranks, {args.steps} steps")
        print("| rank | steps/s | negotiation cycles | thread CPU s | process CPU s | thread share |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['rank']} | {r['steps_per_s']:.1f} | {r['cycles']} | {r['thread_cpu_s']:.2f} "
                  f"| {r['process_cpu_s']:.2f} | {r['thread_cpu_s'] / r['process_cpu_s']:.3f} |")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"cpu": cpu_model(), "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
