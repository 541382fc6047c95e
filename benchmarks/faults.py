"""What each fault does to `mpidist train`, over many runs: for each scenario, N runs of the real
job under mpirun, each with one fault injected at a drawn step and moment within it
(benchmarks/fault_hook.py), judged against what docs/faults.md says and against an undisturbed
run, and timed against the baseline users have without mpidist's recovery: the job ends and is
relaunched with --resume from its newest checkpoint.

    python benchmarks/faults.py                                  # every scenario, 50 runs each
    python benchmarks/faults.py --runs 5 --scenarios elastic-kill,sigusr1 --out /tmp/faults

The network's scenarios (link-down, link-cut, link-loss) run the job across the emulated nodes of
tests/multinode/cluster.sh, which needs root: the campaign brings the nodes up (and down at its
end) unless they are up already, and link-loss needs nftables' `nft`.

Each run's record is appended as one JSON line to <out>.jsonl as soon as it ends; a restart skips
the runs already there. <out>.json and <out>.md summarize every record in the file, per
scenario: runs, completed as documented, hangs (killed at the runner's own deadline; the record
lists the processes still alive then), wrong results, unloadable newest checkpoints, and the
median and p95 of the time to detect, to recover and lost per failure; for the parameter
server's scenarios also the test accuracy (min / median / max) of their runs and of their job's
references, the runs' lost shares of work, the bounds they were judged by (below) and the rule's
false alarms: how many references it calls wrong when each is judged against the other seeds'.

Per run, times are seconds from the fault (the moment the victim rank records just before it):
detect, to the first line of the job that names the fault (or, where none does, to the end of
mpirun); recover, to the first training step completed after it: by a survivor for the faults
the job survives, by the relaunched job (--resume=auto) for those that end it; lost, recover plus
the time the steps that are done again had taken (those since the last elastic commit, or since
the newest checkpoint). Wrong: a run that ends and resumes must reach the undisturbed run's
final weights bit for bit (data parallel restores its sampler and RNG states); an elastic run
must come within REPLAY_TOLERANCE of a float64 replay of its survivors' batches.

A parameter-server run, whose updates race, differs from run to run even undisturbed, and a dead
worker's share of the data goes untrained from its death on. So each parameter-server job (the
job's options: async, softsync, sync with backup workers, ...) is first run undisturbed, the
references: --references times (training seeds 0, 1, ...) for --epochs, and as many times for
one epoch less, with as much less work as a worker killed at its first step loses at most with
3 workers and 3 epochs (or 2 and 2). Each records its final test accuracy and its work, the steps
its workers did. They are appended to <out>.jsonl as reference records and reused by a campaign
that restarts. Disturbed run i trains with seed i modulo --references, so that the references and
the disturbed runs differ in the same ways but for the fault. Its work w: the steps its workers
did (for a job that ended and resumed: the gradients of the checkpoint it resumed from and the
relaunch's steps); its lost share of work: 1 - w / W, W the full references' work. It is judged
against the references trained to their end with as much work: each seed's accuracy at w,
interpolated linearly between its two lengths (the shorter's for less work), ranges from low to
high over the seeds, and the run is wrong when its accuracy is below low - max(high - low, one
test item): below the worst reference by more than the references' own spread (at least the
accuracy's resolution). tests/test_ps_resume.py and tests/test_ps_faults.py compare the
parameter server with its float64 replay.

This module runs the campaign and judges each run. Its parts: fault_scenarios.py (the scenarios
and the fault drawn for a run), fault_launch.py (one launch under mpirun; the emulated nodes'
links), fault_evidence.py (what a launch left: its output, phase logs and checkpoints),
fault_references.py (what a run is compared with) and fault_report.py (the records and their
summary).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling modules, however it is run

from fault_accuracy import accuracy_verdict, digits_test_size  # noqa: E402
from fault_evidence import (  # noqa: E402
    accuracy_of,
    final_weights,
    first_line,
    first_step,
    gradients_resumed,
    loads,
    newest_checkpoint,
    output_tail,
    phase_log,
    rate,
    step_times,
    training_seconds,
    work_done,
)
from fault_launch import HERE, launch, nodes_up  # noqa: E402
from fault_references import elastic_replay, reference  # noqa: E402
from fault_report import append_record, read_records, write_reports  # noqa: E402
from fault_scenarios import SCENARIOS, draw, is_ps  # noqa: E402

REPLAY_TOLERANCE = 1e-4  # elastic: float32 training against the float64 replay, relative to the weights


def judge(scenario: dict, ref: dict, run: dict, relaunch, fault: dict, logs: dict, args) -> dict:
    """The record's verdicts and times."""
    t_fault = fault["time"]
    detected = first_line(run, scenario["detect"], t_fault) if "detect" in scenario else None
    record = {"status": run["status"], "hang": run["status"] is None or (relaunch is not None and
                                                                       relaunch["status"] is None),
              "detect_s": (detected if detected is not None else run["ended"]) - t_fault,
              "named": detected is not None,
              "detected_by": next((line for t, line in run["lines"] if t == detected), None)}
    survivors = [r for r in range(args.ranks) if r != fault["rank"] and not (r == 0 and is_ps(scenario))]
    if scenario.get("loses_nothing"):  # the job goes on as if nothing had happened
        recovered = judge_link_fault(record, ref, run, logs, survivors, t_fault)
        redone = 0
        lost_s = training_seconds(logs) - ref["train_s"] if "train_s" in ref else None
    else:
        if scenario.get("survives"):
            recovered = judge_survived(record, scenario, ref, run, logs, survivors, t_fault, detected)
        else:
            recovered = judge_relaunched(record, scenario, ref, run, relaunch, logs, survivors, t_fault, detected,
                                         args.ranks)
        redone = 0 if scenario.get("stops") else redone_steps(scenario, run, logs, fault["rank"], survivors, t_fault)
        before = step_times(logs.get(min(survivors), []), t_fault)
        step_s = statistics.median(before) if before else 0.0
        lost_s = recovered - t_fault + redone * step_s if recovered is not None else None
    record["recover_s"] = recovered - t_fault if recovered is not None else None
    record["redone_steps"] = redone
    record["lost_s"] = lost_s
    if not record["completed"] or record["wrong"] or record["hang"]:
        record["output_tail"] = output_tail(run)
    if record["hang"]:
        record["alive_at_deadline"] = run["alive_at_deadline"]
    return record


def judge_link_fault(record: dict, ref: dict, run: dict, logs: dict, survivors: list, t_fault: float):
    """A link fault, which the job rides out with nothing lost: it must complete with the
    undisturbed run's final weights bit for bit. Adds the verdicts and the survivors' steps per
    second before, during and after the fault to `record`; returns the time of the first step
    completed after the link was restored (None: none was)."""
    record["named"] = first_line(run, r"mpidist: stall:", t_fault) is not None  # a stall report, if any
    record["detect_s"] = None
    record["completed"] = run["status"] == 0 and accuracy_of(run) is not None
    record["accuracy"] = accuracy_of(run)
    record["wrong"] = run["status"] != 0 or not same_final_weights(run, ref)
    restored = (run.get("link") or {}).get("restored", t_fault)
    after = [t for r in survivors for t, phase, _ in logs.get(r, []) if phase == "done" and t > restored]
    recovered = min(after) if after else None
    record["steps_per_s_during"] = rate(logs, survivors, t_fault, restored)
    record["steps_per_s_before"] = rate(logs, survivors, first_step(logs, survivors), t_fault)
    record["steps_per_s_after"] = rate(logs, survivors, recovered, max(after)) if after else None
    record["link"] = run.get("link")
    return recovered


def judge_survived(record: dict, scenario: dict, ref: dict, run: dict, logs: dict, survivors: list, t_fault: float,
                   detected):
    """A fault the job survives (elastic, or a parameter server losing a worker): it must name the
    fault and complete, an elastic run within REPLAY_TOLERANCE of its replay, a parameter-server
    run within its references' bound. Adds the verdicts and the survivors' steps per second
    before and after to `record`; returns the time of the first step a survivor completed after
    the fault was named (None: none was)."""
    record["completed"] = run["status"] == 0 and detected is not None and accuracy_of(run) is not None
    after = [t for r in survivors for t, phase, _ in logs.get(r, []) if phase == "done" and
             t > (detected or t_fault)]
    recovered = min(after) if after else None
    record["accuracy"] = accuracy_of(run)
    if is_ps(scenario):
        record.update(accuracy_verdict(record["accuracy"], work_done(logs), ref["references"],
                                       1 / digits_test_size()))
    else:
        record["replay_difference"] = elastic_replay(run["directory"])
        record["wrong"] = record["replay_difference"] is None or record["replay_difference"] > REPLAY_TOLERANCE
    end = max(after) if after else None
    record["steps_per_s_after"] = rate(logs, survivors, recovered, end) if recovered else None
    record["steps_per_s_before"] = rate(logs, survivors, first_step(logs, survivors), t_fault)
    return recovered


def judge_relaunched(record: dict, scenario: dict, ref: dict, run: dict, relaunch, logs: dict, survivors: list,
                     t_fault: float, detected, ranks: int):
    """A fault that ends (or stops) the job, which is relaunched with --resume=auto: the job must
    name the fault and end as documented, and the relaunch reach the undisturbed run's final
    weights bit for bit (a parameter-server relaunch: its references' bound). Adds the verdicts,
    the steps per second before the fault and in the relaunch, and when the job ended to
    `record`; returns the time of the relaunch's first step (None: it made none)."""
    stopped = scenario.get("stops", False)
    record["completed"] = run["status"] is not None and detected is not None and (
        scenario.get("any_status") or (run["status"] == 0) == stopped)
    relaunch_logs = phase_log(relaunch["directory"]) if relaunch else {}
    after = [t for log in relaunch_logs.values() for t, phase, _ in log if phase == "done"]
    recovered = min(after) if after else None
    record["resumed_from"] = next((line for _, line in relaunch["lines"] if "resumed from" in line), None) \
        if relaunch else None
    record["relaunch_status"] = relaunch and relaunch["status"]
    if is_ps(scenario):
        record["accuracy"] = accuracy_of(relaunch) if relaunch else None
        work = gradients_resumed(relaunch) + work_done(relaunch_logs) if relaunch else None
        record.update(accuracy_verdict(record["accuracy"], work, ref["references"], 1 / digits_test_size()))
    else:
        record["wrong"] = relaunch is None or relaunch["status"] != 0 or not same_final_weights(relaunch, ref)
    record["steps_per_s_before"] = rate(logs, survivors, first_step(logs, survivors), t_fault)
    last = max((t for log in relaunch_logs.values() for t, phase, _ in log if phase == "done"), default=None)
    trainers = [r for r in range(ranks) if not (r == 0 and is_ps(scenario))]
    record["steps_per_s_after"] = rate(relaunch_logs, trainers, recovered, last) if recovered else None
    record["job_end_s"] = run["ended"] - t_fault
    if run.get("link"):
        record["link"] = run["link"]
    return recovered


def redone_steps(scenario: dict, run: dict, logs: dict, victim: int, survivors: list, t_fault: float) -> int:
    """The steps completed before the fault since the last elastic commit (or, for a job that
    ends, the last checkpoint), which the job does again; none for the parameter server."""
    if is_ps(scenario):
        return 0
    marks = [t for t, phase, _ in logs.get(0 if victim != 0 else min(survivors), []) if t < t_fault and
             phase in ("commit" if scenario.get("survives") else "checkpoint-done",)]
    done_before = [t for t, phase, _ in logs.get(min(survivors), []) if phase == "done" and t < t_fault]
    last_mark = max(marks) if marks else run["started"]
    return sum(1 for t in done_before if t > last_mark)


def same_final_weights(run: dict, ref: dict) -> bool:
    """Whether `run` ended with the model and optimizer tensors of the undisturbed run `ref`, bit for bit."""
    import numpy as np
    return all(np.array_equal(a, b) for a, b in _paired(final_weights(run["checkpoints"]),
                                                        final_weights(ref["checkpoints"])))


def _paired(mine: dict, theirs: dict):
    if mine.keys() != theirs.keys():
        return [(None, 0)]
    return [(mine[k], theirs[k]) for k in sorted(mine)]


def one_run(name: str, index: int, args) -> dict:
    scenario = SCENARIOS[name]
    ref = reference(name, scenario, args)
    rng = random.Random(f"{args.seed}-{name}-{index}")
    shutil.rmtree(os.path.join(args.work, f"{name}-{index}"), ignore_errors=True)  # a run cut short before
    directory = os.path.join(args.work, f"{name}-{index}", "job")
    checkpoints = os.path.join(args.work, f"{name}-{index}", "checkpoints")
    os.makedirs(directory, exist_ok=True)
    spec = draw(name, scenario, ref, args, rng, directory)
    training_seed = index % args.references if is_ps(scenario) else 0  # the references' seeds, in turn
    run = launch(scenario, directory, checkpoints, args, spec=spec, seed=training_seed)
    fault_file = os.path.join(directory, "fault.json")
    record = {"scenario": name, "run": index, "seed": args.seed, "ranks": args.ranks, "epochs": args.epochs,
              "batch_size": args.batch_size, "command": args.command, "spec": spec, "training_seed": training_seed}
    if not os.path.exists(fault_file):  # the job ended (or hung) before the drawn moment came
        record.update(injected=False, hang=run["status"] is None, status=run["status"],
                      output_tail=output_tail(run),
                      alive_at_deadline=run["alive_at_deadline"])
        return record
    with open(fault_file) as f:
        fault = json.load(f)
    relaunch = None
    if not scenario.get("survives"):  # the newest checkpoint the fault left, then the relaunch from it
        newest = newest_checkpoint(checkpoints)
        record["newest_checkpoint"] = newest and os.path.basename(newest)
        record["checkpoint_loadable"] = None if newest is None else loads(newest, args) is None
        relaunch_dir = os.path.join(args.work, f"{name}-{index}", "relaunch")
        if run["status"] is not None:
            relaunch = launch(scenario, relaunch_dir, checkpoints, args, resume=True, seed=training_seed)
    logs = phase_log(directory)
    record.update(injected=True, fault=fault, **judge(scenario, ref, run, relaunch, fault, logs, args))
    return record


def next_utc_time(hours_minutes: str, now: float | None = None) -> float:
    """The next moment (epoch seconds) the UTC clock reads HH:MM, a day later if it has passed
    today: --until 00:30 given at 23:00 means half past midnight."""
    now = time.time() if now is None else now
    hours, minutes = (int(part) for part in hours_minutes.split(":"))
    day = now - now % 86400
    moment = day + hours * 3600 + minutes * 60
    return moment if moment > now else moment + 86400


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per scenario (default 50)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS))
    parser.add_argument("--seed", type=int, default=0, help="the seed of the faults' draws")
    parser.add_argument("--references", type=int, default=5,
                        help="undisturbed runs per parameter-server job, to judge its disturbed runs by (default 5)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "faults-cpu"),
                        help="prefix of the result files: .jsonl (every run), .json and .md (the summary)")
    parser.add_argument("--work", default=None, help="scratch directory (default: a new temporary one)")
    parser.add_argument("--until", default=None, help="stop starting runs after this UTC time (HH:MM)")
    args = parser.parse_args(argv)
    if args.references < 2:
        parser.error(f"--references must be at least 2, for a spread (got {args.references})")
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    args.work = args.work or tempfile.mkdtemp(prefix="faults-")
    args.command = "python benchmarks/faults.py " + " ".join(argv if argv is not None else sys.argv[1:])
    started_load = os.getloadavg()
    done = {(r["scenario"], r["run"]) for r in read_records(args.out) if "scenario" in r and r["seed"] == args.seed}
    stop_at = next_utc_time(args.until) if args.until else None
    if any(SCENARIOS[name].get("nodes") for name in names):
        nodes_up()
    # Round-robin over the scenarios, so that a campaign cut short has runs of each.
    for index in range(args.runs):
        for name in names:
            if (name, index) in done:
                continue
            if stop_at is not None and time.time() >= stop_at:
                write_reports(args.out, args, started_load)
                return 0
            record = one_run(name, index, args)
            append_record(args.out, record)
            print(f"{name} #{index}: injected={record.get('injected')} completed={record.get('completed')} "
                  f"hang={record.get('hang')} wrong={record.get('wrong')} detect={record.get('detect_s')} "
                  f"recover={record.get('recover_s')} lost={record.get('lost_s')}", flush=True)
    write_reports(args.out, args, started_load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
