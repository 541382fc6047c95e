"""benchmarks/cost_model.py's report from the committed measurements (no measuring: that needs
root and minutes): every configuration is compared, and every predicted table names as fastest
the algorithm with the smallest predicted time in its row."""
import json
import os
import re
import runpy

from conftest import REPO


def test_cost_model_report_compares_every_configuration_and_names_the_fastest():
    script = runpy.run_path(os.path.join(REPO, "benchmarks", "cost_model.py"), run_name="cost_model")
    with open(os.path.join(REPO, "benchmarks", "results", "cost-model-cpu-measured.json")) as handle:
        measured = json.load(handle)
    text = script["report"](measured)
    layouts = {(c["nodes"], c["ranks_per_node"]) for c in measured["configurations"]}
    assert {(1, 2), (1, 4), (2, 1), (2, 2), (4, 1)} <= layouts  # one node and across nodes, both shapes
    for nodes, per_node in layouts:
        configuration = f"1 node x {per_node}" if nodes == 1 else f"{nodes} nodes x {per_node}"
        assert f"### {configuration} (" in text, configuration
    assert text.count("Error predicted from the other configurations alone") == len(layouts)
    tables = re.split(r"\n### (\d+) ranks", text.split("## Predicted for larger machines")[1])[1:]
    assert [int(ranks) for ranks in tables[::2]] == [64, 256, 1024]
    for body in tables[1::2]:
        header = next(line for line in body.splitlines() if line.startswith("| bytes"))
        algorithms = [cell.strip() for cell in header.split("|")[2:-3]]
        rows = [line for line in body.splitlines() if re.match(r"\| \d", line)]
        assert len(rows) == 14
        for row in rows:
            cells = [cell.strip() for cell in row.split("|")[1:-1]]
            times = dict(zip(algorithms, map(float, cells[1:1 + len(algorithms)])))
            assert times[cells[1 + len(algorithms)]] == min(times.values()), row
