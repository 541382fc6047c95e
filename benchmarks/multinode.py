"""All-reduce bus bandwidth across emulated nodes: every algorithm of mpidist and the MPI library's
own ("mpi"), at 2 x 1, 2 x 2 and 4 x 1 ranks (nodes x ranks per node) over a shaped link, in one run.

    sudo python benchmarks/multinode.py [--rate 10gbit] [--delay 25us] [--sizes 4K,...,64M] [--layouts 2x1,2x2,4x1]

Each layout brings up tests/multinode/cluster.sh (nodes in network, hostname and mount namespaces,
their veth links shaped by tc), runs `mpidist bench allreduce` under mpirun from node 1, and takes
the cluster down again. Writes benchmarks/results/multinode-cpu.json (the rows of every layout,
with the link's settings) and multinode-cpu.md (the tables, the machine's CPU). Needs root.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from mpidist.cli.bench import parse_size

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CLUSTER = os.path.join(REPO, "tests", "multinode", "cluster.sh")
LAYOUTS = "2x1,2x2,4x1"  # nodes x ranks per node
SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
# Sizes above this run LARGE_ITERS timed iterations (after one warm-up): over a link of a few
# Gbit/s the defaults (20) would keep a 64 MiB case of 8 algorithms running for minutes.
LARGE = 1 << 20
LARGE_ITERS = 5
ALGORITHMS = "ring,tree,recursive_halving,recursive_doubling,reduce_bcast,hierarchical,auto,mpi"


def run_layout(nodes: int, per_node: int, args) -> tuple[list[dict], str]:
    """The bench rows of `nodes` x `per_node` ranks, and the link as cluster.sh reports it."""
    sizes = args.sizes.split(",")
    small = [s for s in sizes if parse_size(s) <= LARGE]
    large = [s for s in sizes if parse_size(s) > LARGE]
    rows, link = [], ""
    for group, iters in ((small, args.iters), (large, args.iters or LARGE_ITERS)):
        if group:
            group_rows, link = run_bench(nodes, per_node, ",".join(group), iters, args)
            rows += group_rows
    return rows, link


def run_bench(nodes: int, per_node: int, sizes: str, iters: int, args) -> tuple[list[dict], str]:
    """One `mpidist bench allreduce` of `sizes` in a cluster of its own."""
    with tempfile.TemporaryDirectory() as directory:
        rows_path = os.path.join(directory, "rows.json")
        env = dict(os.environ, MPIDIST_MN_NODES=str(nodes), MPIDIST_MN_SLOTS=str(per_node),
                   MPIDIST_MN_RATE=args.rate, MPIDIST_MN_DELAY=args.delay,
                   # the built-in `auto` table, not a tuning file of this machine
                   MPIDIST_TUNING_FILE=os.path.join(directory, "none.json"))
        command = ["bash", CLUSTER, "run", "mpirun", "--bind-to", "none", "-np", str(nodes * per_node),
                   sys.executable, "-m", "mpidist.cli", "bench", "allreduce", "--sizes", sizes,
                   "--algorithms", args.algorithms, "--json", rows_path]
        if iters:
            command += ["--iters", str(iters), "--warmup", "1" if iters <= LARGE_ITERS else str(max(2, iters // 10))]
        result = subprocess.run(command, env=env, cwd=REPO, text=True, stderr=subprocess.PIPE)
        sys.stderr.write(result.stderr)
        if result.returncode:
            raise SystemExit(f"multinode: the {nodes} x {per_node} run failed (exit status {result.returncode})")
        link = next(line.split("link: ", 1)[1] for line in result.stderr.splitlines() if "link: " in line)
        with open(rows_path) as rows:
            return json.load(rows), link


def table(rows: list[dict]) -> str:
    """busbw (GB/s) per size and algorithm, then our best and auto against mpi, and auto against
    the best of all (MPI's own included)."""
    algorithms = [a for a in ALGORITHMS.split(",") if any(r["algorithm"] == a for r in rows)]
    sizes = sorted({r["bytes"] for r in rows})
    busbw = {(r["algorithm"], r["bytes"]): r["busbw_gbs"] for r in rows}
    lines = ["| bytes | " + " | ".join(algorithms) + " | best (ours) | best/mpi | auto/mpi | auto/best | hierarchical/ring |",
             "|---:|" + "---:|" * len(algorithms) + "---|---:|---:|---:|---:|"]
    for size in sizes:
        ours = {a: busbw[(a, size)] for a in algorithms if a not in ("mpi", "auto") and (a, size) in busbw}
        best = max(ours, key=ours.get)
        mpi = busbw.get(("mpi", size))
        auto = busbw.get(("auto", size))
        hierarchical, ring = ours.get("hierarchical"), ours.get("ring")
        cells = [f"{busbw[(a, size)]:.3f}" if (a, size) in busbw else "-" for a in algorithms]
        lines.append(f"| {size} | " + " | ".join(cells) + f" | {best} | "
                     + (f"{ours[best] / mpi:.2f}" if mpi else "-") + " | "
                     + (f"{auto / mpi:.2f}" if mpi and auto else "-") + " | "
                     + (f"{auto / max(ours[best], mpi or 0):.2f}" if auto else "-") + " | "
                     + (f"{hierarchical / ring:.2f}" if hierarchical and ring else "-") + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="10gbit", help="every node's link rate (tc units)")
    parser.add_argument("--delay", default="25us", help="every node's one-way delay (netem, where the kernel has it)")
    parser.add_argument("--sizes", default=SIZES)
    parser.add_argument("--algorithms", default=ALGORITHMS)
    parser.add_argument("--layouts", default=LAYOUTS, help="comma-separated NODESxRANKS_PER_NODE")
    parser.add_argument("--iters", type=int, default=0,
                        help=f"timed iterations per case (default: mpidist bench's up to 1 MiB, {LARGE_ITERS} above)")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "multinode-cpu"),
                        help="path of the .json and .md results, without the suffix")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root, for the emulated nodes (tests/multinode/cluster.sh)")
    results = []
    load_before = os.getloadavg()
    for layout in args.layouts.split(","):
        nodes, per_node = (int(n) for n in layout.lower().split("x"))
        rows, link = run_layout(nodes, per_node, args)
        results.append({"nodes": nodes, "ranks_per_node": per_node, "link": link, "rows": rows})
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    # Other work on the machine slows everything alike but MPI's progress and ours unalike.
    load = f"load average {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    with open(args.output + ".json", "w") as out:
        json.dump({"rate": args.rate, "delay": args.delay, "load": load, "cpu": cpu, "layouts": results}, out, indent=1)
    sections = [f"## {r['nodes']} nodes x {r['ranks_per_node']} rank(s) per node\n\nLink: {r['link']}.\n\n"
                f"busbw in GB/s (nccl-tests' definition), float32:\n\n{table(r['rows'])}\n" for r in results]
    with open(args.output + ".md", "w") as out:
        out.write("# All-reduce across emulated nodes (benchmarks/multinode.py)\n\n"
                  f"Command: `python benchmarks/multinode.py --rate {args.rate} --delay {args.delay} "
                  f"--sizes {args.sizes} --layouts {args.layouts} --algorithms {args.algorithms}` ({load})\n\n"
                  + "\n".join(sections) + f"\nMachine:\n\n```\n{cpu}```\n")
    print(f"multinode: wrote {args.output}.json and {args.output}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
