"""The all-reduce cost model (mpidist/collectives/cost_model.py) against measurement, and its
predictions for machines we do not have.

    sudo python benchmarks/cost_model.py [--local 2,3,4,5] [--layouts 2x1,2x2,4x1] [--rate 10gbit]
    python benchmarks/cost_model.py --measured benchmarks/results/cost-model-cpu-measured.json

Measures every algorithm (the MPI library's own included) with `mpidist bench allreduce` on one
node at each rank count of --local, and across emulated nodes (tests/multinode/cluster.sh, links
shaped to --rate; needs root) at each layout of --layouts; fits the model's parameters to all of
it; prints predicted against measured for every configuration, and the error when a
configuration is left out of the fit and predicted from the others (what `auto` does for a rank
count it has not measured). Then predicts 64, 256 and 1,024 ranks on a stated network and names
the fastest algorithm per size. Writes OUTPUT-measured.json (the rows) and OUTPUT.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

ALGORITHMS = "ring,tree,recursive_halving,recursive_doubling,reduce_bcast,hierarchical,mpi"
SIZES = "8,512,4K,32K,256K,1M,4M"


def measure_local(ranks: int, args) -> list[dict]:
    """The bench rows of `ranks` ranks on this machine (one node)."""
    with tempfile.TemporaryDirectory() as directory:
        rows_path = os.path.join(directory, "rows.json")
        env = dict(os.environ, MPIDIST_TUNING_FILE=os.path.join(directory, "none.json"))
        command = ["mpirun", "--bind-to", "none", "--map-by", ":OVERSUBSCRIBE", "-np", str(ranks),
                   sys.executable, "-m", "mpidist.cli", "bench", "allreduce", "--sizes", args.sizes,
                   "--algorithms", args.algorithms, "--json", rows_path]
        subprocess.run(command, env=env, cwd=REPO, check=True)
        with open(rows_path) as rows:
            return json.load(rows)


def measure(args) -> dict:
    import multinode

    configurations = []
    for ranks in (int(r) for r in args.local.split(",") if r):
        configurations.append({"nodes": 1, "ranks_per_node": ranks, "link": "shared memory",
                               "rows": measure_local(ranks, args)})
    for layout in (layout for layout in args.layouts.split(",") if layout):
        nodes, per_node = (int(n) for n in layout.lower().split("x"))
        rows, link = multinode.run_layout(nodes, per_node, args)
        configurations.append({"nodes": nodes, "ranks_per_node": per_node, "link": link, "rows": rows})
    return {"rate": args.rate, "load_start": os.getloadavg()[0], "configurations": configurations}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local", default="2,3,4,5", help="rank counts on one node")
    parser.add_argument("--layouts", default="2x1,2x2,4x1", help="NODESxRANKS_PER_NODE across emulated nodes")
    parser.add_argument("--rate", default="10gbit", help="the emulated nodes' link rate (tc units)")
    parser.add_argument("--delay", default="25us", help="one-way delay, where the kernel has netem")
    parser.add_argument("--sizes", default=SIZES)
    parser.add_argument("--algorithms", default=ALGORITHMS)
    parser.add_argument("--iters", type=int, default=0)
    parser.add_argument("--measured", default=None, help="reuse the rows of an earlier run instead of measuring")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "cost-model-cpu"))
    args = parser.parse_args(argv)
    if args.measured:
        with open(args.measured) as handle:
            measured = json.load(handle)
    else:
        if args.layouts and os.geteuid() != 0:
            parser.error("needs root for --layouts (tests/multinode/cluster.sh); give --layouts '' to measure one node")
        load_before = os.getloadavg()
        measured = measure(args)
        measured["load"] = f"load average {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
        measured["command"] = " ".join(["python", "benchmarks/cost_model.py"] + (argv or sys.argv[1:]))
        measured["cpu"] = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        with open(args.output + "-measured.json", "w") as out:
            json.dump(measured, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
