"""The fault campaign's records (benchmarks/faults.py): every run and reference appended to
<out>.jsonl as it ends, and the summary of the whole file per scenario in <out>.json and <out>.md
(a hand-written "## Notes" section of the .md is kept when it is rewritten)."""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess

from fault_accuracy import digits_test_size, undisturbed_below_bound
from fault_scenarios import DEADLINE, SCENARIOS, STALL_WARNING, TIMEOUT, is_ps, reference_key

NOTES_HEADING = "## Notes"  # the summary's own section, written by hand; kept when the summary is rewritten


def read_records(out: str) -> list:
    """Every record of <out>.jsonl: the runs' (with "scenario") and the references' (with "reference")."""
    if not os.path.exists(out + ".jsonl"):
        return []
    with open(out + ".jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def append_record(out: str, record: dict) -> None:
    with open(out + ".jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def percentile(values, q):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def spread(values) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {"min": values[0], "median": statistics.median(values), "max": values[-1], "n": len(values)}


def summarize(records: list) -> dict:
    summary = {}
    for name in SCENARIOS:
        mine = [r for r in records if r.get("scenario") == name]
        if not mine:
            continue
        injected = [r for r in mine if r.get("injected")]
        row = {"runs": len(mine), "injected": len(injected),
               "completed_as_documented": sum(bool(r.get("completed")) for r in injected),
               "hangs": sum(bool(r.get("hang")) for r in mine),
               "wrong": sum(bool(r.get("wrong")) for r in injected),
               "unloadable_checkpoints": sum(r.get("checkpoint_loadable") is False for r in injected),
               "phases": sorted({r["fault"]["phase"] for r in injected})}
        for key in ("detect_s", "job_end_s", "recover_s", "lost_s", "steps_per_s_before", "steps_per_s_after",
                    "steps_per_s_during"):
            values = [r.get(key) for r in injected]
            row[key] = {"median": percentile(values, 0.5), "p95": percentile(values, 0.95),
                        "n": sum(v is not None for v in values)}
        if is_ps(SCENARIOS[name]):
            row.update(accuracy_summary(SCENARIOS[name], injected, records))
        summary[name] = row
    for name, row in summary.items():
        baseline = SCENARIOS[name].get("baseline")
        if baseline in summary and row["lost_s"]["median"] and summary[baseline]["lost_s"]["median"]:
            row["lost_vs_restart"] = row["lost_s"]["median"] / summary[baseline]["lost_s"]["median"]
    return summary


def accuracy_summary(scenario: dict, injected: list, records: list) -> dict:
    """A parameter-server scenario's test accuracies: its runs', and its job's references' (those
    of the runs' ranks, epochs and batch size) per length in epochs, with the runs' lost shares of
    work and the bounds they were judged by."""
    shapes = {(r["ranks"], r.get("epochs"), r.get("batch_size")) for r in injected}
    references = [r for r in records if r.get("reference") == reference_key(scenario) and
                  (r["ranks"], r["epochs"], r["batch_size"]) in shapes]
    lengths = sorted({r["training_epochs"] for r in references}, reverse=True)
    below, judged = undisturbed_below_bound(references, 1 / digits_test_size())
    return {"accuracy": spread(r.get("accuracy") for r in injected),
            "undisturbed_below_bound": [below, judged],
            "lost_share": spread(r.get("lost_share") for r in injected),
            "accuracy_bound": spread(r.get("accuracy_bound") for r in injected),
            "references": [{"epochs": epochs, "seeds": sorted(r["reference_seed"] for r in mine),
                            "accuracy": spread(r["accuracy"] for r in mine), "work": spread(r["work"] for r in mine)}
                           for epochs in lengths
                           for mine in [[r for r in references if r["training_epochs"] == epochs]]]}


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s*(.*)", lscpu)
    return {"cpu": model.group(1).strip() if model else platform.processor(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "load_average": os.getloadavg()}


def write_reports(out: str, args, started_load) -> None:
    """The summary of every record in <out>.jsonl (other campaigns may append to it too)."""
    records = read_records(out)
    summary = summarize(records)
    commands = sorted({r["command"] for r in records if "command" in r}) or [args.command]
    report = {"commands": commands, "machine": machine(), "load_average_at_start": started_load,
              "ranks": args.ranks, "epochs": args.epochs, "batch_size": args.batch_size,
              "stall_warning_s": STALL_WARNING, "timeout_s": TIMEOUT, "deadline_s": DEADLINE,
              "scenarios": summary}
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)

    def fmt(cell):
        if cell["median"] is None:
            return "-"
        return f"{cell['median']:.2f} / {cell['p95']:.2f} ({cell['n']})"

    lines = [f"# Fault campaign: {report['machine']['cpu']} ({report['machine']['cpus']} CPUs)", "",
             "Commands (each appended its runs to the same .jsonl):", "",
             *[f"    {command}" for command in commands], "",
             f"{args.ranks} ranks, `mpidist train` (MLP on the digits), {args.epochs} epochs of batches of "
             f"{args.batch_size}, a checkpoint every epoch. Load average at the start "
             f"{', '.join(f'{v:.2f}' for v in started_load)}, at the end "
             f"{', '.join(f'{v:.2f}' for v in report['machine']['load_average'])}: the machine was shared with "
             "other work, so the times are longer than on a quiet one. Times: median / p95 (N), in seconds from "
             "the fault.", "",
             "| scenario | runs | injected | completed as documented | hangs | wrong | unloadable checkpoints | "
             "detect | job ended | recover | lost | lost vs restart | steps/s before / after |", "|" + "---|" * 13]
    for name, row in summary.items():
        ratio = f"{row['lost_vs_restart']:.2f}" if "lost_vs_restart" in row else "-"
        before, after = row["steps_per_s_before"]["median"], row["steps_per_s_after"]["median"]
        rates = f"{before:.0f} / {after:.0f}" if before and after else "-"
        if row["steps_per_s_during"]["median"] is not None:
            rates += f" (during the fault: {row['steps_per_s_during']['median']:.1f})"
        lines.append(f"| {name} | {row['runs']} | {row['injected']} | {row['completed_as_documented']} | "
                     f"{row['hangs']} | {row['wrong']} | {row['unloadable_checkpoints']} | {fmt(row['detect_s'])} | "
                     f"{fmt(row['job_end_s'])} | {fmt(row['recover_s'])} | {fmt(row['lost_s'])} | {ratio} | {rates} |")
    lines += ["", "Parameter server: test accuracy, min / median / max (N), of the undisturbed references (training "
              "seeds 0, 1, ..., each for all the epochs and for one less) and of the disturbed runs; the runs' lost "
              "share of work (1 - their workers' steps / the full references') and the bound each was judged by (the "
              "references' lowest accuracy with as much work, less their range there, at least one test item; "
              "benchmarks/faults.py). The rule's false alarms: the references that it calls wrong when each is judged "
              "against the other seeds' (undisturbed below bound).", "",
              "| scenario | references' accuracy (epochs: min / median / max (N)) | runs' accuracy | lost share of work "
              "| bound | wrong | undisturbed below bound |", "|" + "---|" * 7]
    for name, row in summary.items():
        if "references" in row:
            references = "; ".join(f"{r['epochs']}: {fmt_spread(r['accuracy'])}" for r in row["references"])
            lines.append(f"| {name} | {references} | {fmt_spread(row['accuracy'])} | {fmt_spread(row['lost_share'])} "
                         f"| {fmt_spread(row['accuracy_bound'])} | {row['wrong']} | {fmt_false_alarms(row)} |")
    notes = ""  # what was written about the runs by hand, kept from the file being replaced
    if os.path.exists(out + ".md"):
        with open(out + ".md") as f:
            existing = f.read()
        if NOTES_HEADING in existing:
            notes = "\n" + existing[existing.index(NOTES_HEADING):]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n" + notes)


def fmt_false_alarms(row: dict) -> str:
    below, judged = row.get("undisturbed_below_bound", (0, 0))
    return f"{below} of {judged}" if judged else "-"


def fmt_spread(cell: dict) -> str:
    if not cell["n"]:
        return "-"
    return f"{cell['min']:.4f} / {cell['median']:.4f} / {cell['max']:.4f} ({cell['n']})"
