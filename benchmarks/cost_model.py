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
import statistics
import subprocess
import sys
import tempfile

from mpidist.collectives import cost_model
from mpidist.collectives.common import SEGMENT_BYTES
from mpidist.collectives.cost_model import Layout
from mpidist.collectives.select import choose_allreduce, layout_table

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

ALGORITHMS = "ring,tree,recursive_halving,recursive_doubling,reduce_bcast,hierarchical,mpi"
SIZES = "8,512,4K,32K,256K,1M,4M"
# The stated network of the predicted tables (the question's example): 8 ranks per node,
# 100 Gbit/s links, 2 us latency per message.
STATED = {"ranks_per_node": 8, "gbit_per_s": 100.0, "alpha_s": 2e-6}
PREDICTED_RANKS = (64, 256, 1024)
PREDICTED_SIZES = [8 * 4 ** k for k in range(14)]  # 8 B .. 512 MiB


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
    return {"rate": args.rate, "configurations": configurations}


def rows_of(configuration, cores: int) -> list[dict]:
    """The rows with their layout; every rank, emulated node or not, shares this machine's cores."""
    return [dict(row, ranks_per_node=configuration["ranks_per_node"], ranks_per_core=row["ranks"] / cores)
            for row in configuration["rows"] if not row["wrong"] and row["algorithm"] in cost_model.MODELLED]


def name(configuration) -> str:
    if configuration["nodes"] == 1:
        return f"1 node x {configuration['ranks_per_node']}"
    return f"{configuration['nodes']} nodes x {configuration['ranks_per_node']}"


def errors(parameters, rows) -> list[float]:
    """predicted / measured - 1 for every row."""
    return [cost_model.predict(parameters, row["algorithm"], row["bytes"], cost_model.row_layout(row),
                               SEGMENT_BYTES) / (row["time_us"] * 1e-6) - 1 for row in rows]


def choice_cost(parameters, rows) -> list[tuple]:
    """Per size: (bytes, measured fastest, predicted fastest, its measured time over the fastest's,
    the built-in table's choice, its measured time over the fastest's)."""
    result = []
    for nbytes in sorted({row["bytes"] for row in rows}):
        times = {row["algorithm"]: row["time_us"] for row in rows if row["bytes"] == nbytes}
        best = min(times, key=times.get)
        layout = cost_model.row_layout(rows[0])
        chosen = cost_model.fastest(parameters, nbytes, layout, SEGMENT_BYTES, tuple(times))
        builtin = choose_allreduce(nbytes, layout.ranks, layout_table(layout.ranks, layout.nodes))
        result.append((nbytes, best, chosen, times[chosen] / times[best], builtin, times[builtin] / times[best]))
    return result


def summary(values) -> str:
    """Of predicted/measured - 1 per row: the median factor apart, the range, the share within 2x."""
    ratios = [1 + v for v in values]
    factors = sorted(max(r, 1 / r) for r in ratios)
    within = sum(f <= 2 for f in factors) / len(factors)
    return (f"median {statistics.median(factors):.2f}x apart, predicted/measured {min(ratios):.2f} .. {max(ratios):.2f}, "
            f"{within:.0%} of rows within 2x")


def configuration_section(configuration, rows, fitted, held_out) -> str:
    algorithms = [a for a in cost_model.MODELLED if any(r["algorithm"] == a for r in rows)]
    lines = [f"### {name(configuration)} ({configuration['link']})", "",
             "Measured us / predicted us (fit to every configuration):", "",
             "| bytes | " + " | ".join(algorithms) + " | fastest measured | chosen by the model left out of it "
             "(its measured time / the fastest's) | built-in table's choice (same) |",
             "|---:|" + "---:|" * len(algorithms) + "---|---|---|"]
    measured = {(r["algorithm"], r["bytes"]): r for r in rows}
    layout = cost_model.row_layout(rows[0])
    choices = {nbytes: rest for nbytes, *rest in choice_cost(held_out, rows)}
    for nbytes in sorted({r["bytes"] for r in rows}):
        cells = []
        for algorithm in algorithms:
            row = measured.get((algorithm, nbytes))
            predicted = cost_model.predict(fitted, algorithm, nbytes, layout, SEGMENT_BYTES)
            cells.append(f"{row['time_us']:.0f} / {predicted * 1e6:.0f}" if row else "-")
        best, chosen, ratio, builtin, builtin_ratio = choices[nbytes]
        lines.append(f"| {nbytes} | " + " | ".join(cells) + f" | {best} | {chosen} ({ratio:.2f}) | "
                     f"{builtin} ({builtin_ratio:.2f}) |")
    lines += ["", f"Error of the fit to everything: {summary(errors(fitted, rows))}.",
              f"Error predicted from the other configurations alone: {summary(errors(held_out, rows))}.", ""]
    return "\n".join(lines)


def predicted_section(on_node: dict) -> str:
    parameters = cost_model.with_network(on_node, STATED["alpha_s"], STATED["gbit_per_s"])
    lines = [f"Parameters: {STATED['ranks_per_node']} ranks per node, {STATED['gbit_per_s']:g} Gbit/s and "
             f"{STATED['alpha_s'] * 1e6:g} us per message between nodes (plus the software cost per message "
             "fitted here), this machine's fitted on-node parameters otherwise:", "", "```",
             json.dumps({k: float(f"{v:.4g}") for k, v in parameters.items()}, indent=1), "```", ""]
    for ranks in PREDICTED_RANKS:
        layout = Layout(ranks, STATED["ranks_per_node"])
        lines += [f"### {ranks} ranks ({layout.nodes} nodes x {layout.per_node})", "",
                  "Predicted time in us:", "",
                  "| bytes | " + " | ".join(cost_model.MODELLED) + " | fastest | next (x slower) |",
                  "|---:|" + "---:|" * len(cost_model.MODELLED) + "---|---|"]
        for nbytes in PREDICTED_SIZES:
            times = {a: cost_model.predict(parameters, a, nbytes, layout, SEGMENT_BYTES) for a in cost_model.MODELLED}
            ranked = sorted(times, key=times.get)
            lines.append(f"| {nbytes} | " + " | ".join(f"{times[a] * 1e6:.4g}" for a in cost_model.MODELLED)
                         + f" | {ranked[0]} | {ranked[1]} ({times[ranked[1]] / times[ranked[0]]:.2f}) |")
        lines.append("")
    return "\n".join(lines)


def cores_of(measured: dict) -> int:
    """The measuring machine's CPUs, from its lscpu."""
    return next(int(line.split(":")[1]) for line in measured["cpu"].splitlines() if line.startswith("CPU(s):"))


def report(measured: dict) -> str:
    configurations = measured["configurations"]
    cores = cores_of(measured)
    everything = [row for c in configurations for row in rows_of(c, cores)]
    fitted = cost_model.fit(everything, SEGMENT_BYTES)
    sections, held_out_errors, fitted_errors, regrets, builtin_regrets = [], [], [], [], []
    for configuration in configurations:
        others = [row for c in configurations if c is not configuration for row in rows_of(c, cores)]
        held_out = cost_model.fit(others, SEGMENT_BYTES)
        rows = rows_of(configuration, cores)
        if cost_model.predict(held_out, "mpi", 8, cost_model.row_layout(rows[0]), SEGMENT_BYTES) is None:
            held_out = fitted  # the only configuration of its link: nothing else to predict it from
        sections.append(configuration_section(configuration, rows, fitted, held_out))
        fitted_errors += errors(fitted, rows)
        held_out_errors += errors(held_out, rows)
        costs = choice_cost(held_out, rows)
        regrets += [cost[3] for cost in costs]
        builtin_regrets += [cost[5] for cost in costs]
    on_node = cost_model.fit([row for c in configurations if c["nodes"] == 1 for row in rows_of(c, cores)],
                             SEGMENT_BYTES)
    chosen_well = sum(r <= 1.1 for r in regrets)
    return "\n".join([
        "# All-reduce cost model: predicted against measured (benchmarks/cost_model.py)", "",
        f"Command: `{measured.get('command', 'python benchmarks/cost_model.py')}` ({measured.get('load', '')}); "
        f"link of the emulated nodes: {measured['rate']}; segment {SEGMENT_BYTES} bytes.", "",
        "Fitted parameters (every configuration; seconds per call, message, byte or barrier round):", "", "```",
        json.dumps({k: float(f"{v:.4g}") for k, v in fitted.items()}, indent=1), "```", "",
        f"Error of predicted time against measured, all rows: fitted to everything {summary(fitted_errors)}; "
        f"each configuration predicted from the others {summary(held_out_errors)}.", "",
        f"Algorithm chosen by the model fitted without the configuration: within 10% of the measured "
        f"fastest at {chosen_well} of {len(regrets)} sizes; its measured time over the fastest's: median "
        f"{statistics.median(regrets):.2f}, worst {max(regrets):.2f}. The built-in table's choice: within 10% at "
        f"{sum(r <= 1.1 for r in builtin_regrets)} of {len(builtin_regrets)} sizes; median "
        f"{statistics.median(builtin_regrets):.2f}, worst {max(builtin_regrets):.2f}.", "",
        "## Predicted against measured", "", *sections,
        "## Predicted for larger machines", "", predicted_section(on_node),
        "Machine:", "", "```", measured.get("cpu", ""), "```", ""])


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
    text = report(measured)
    with open(args.output + ".md", "w") as out:
        out.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
