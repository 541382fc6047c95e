"""What the fault campaign (benchmarks/faults.py) compares a disturbed run with: the undisturbed
runs of its job (made once per job; for the parameter server, whose runs differ, several seeds
and lengths kept as reference records), the float64 replay of an elastic run's survivors, and
the bound a parameter-server run's accuracy is judged by."""
from __future__ import annotations

import glob
import json
import os
import shutil

from fault_evidence import accuracy_of, gradients_applied, newest_checkpoint, phase_log, training_seconds, work_done
from fault_launch import launch
from fault_report import append_record, read_records
from fault_scenarios import is_ps, reference_key


def reference(name: str, scenario: dict, args) -> dict:
    """The undisturbed run of `scenario`'s job, made once per job and kept in the work directory;
    for the parameter server's, whose runs differ, the first of its references (ps_references),
    with all of them under "references"."""
    if is_ps(scenario):
        return ps_references(name, scenario, args)
    directory = os.path.join(args.work, f"reference-{reference_key(scenario)}")
    summary = os.path.join(directory, "reference.json")
    if os.path.exists(summary):
        with open(summary) as f:
            return json.load(f)
    result = undisturbed(name, scenario, directory, args)
    with open(summary, "w") as f:
        json.dump(result, f)
    return result


def ps_references(name: str, scenario: dict, args) -> dict:
    """The undisturbed runs of a parameter-server job, with training seeds 0 .. --references - 1,
    each for --epochs and for one epoch less (benchmarks/faults.py's docstring): those <out>.jsonl holds
    already (same job, ranks, epochs and batch size), the others run now and appended to it as
    reference records."""
    key = reference_key(scenario)
    lengths = [args.epochs, args.epochs - 1] if args.epochs > 1 else [args.epochs]
    recorded = {(r["reference_seed"], r["training_epochs"]): r for r in read_records(args.out)
                if r.get("reference") == key and (r["ranks"], r["epochs"], r["batch_size"]) ==
                (args.ranks, args.epochs, args.batch_size)}
    for seed in range(args.references):
        for epochs in lengths:
            if (seed, epochs) not in recorded:
                directory = os.path.join(args.work, f"reference-{key}-seed{seed}-epochs{epochs}")
                run = undisturbed(name, scenario, directory, args, seed, epochs)
                recorded[seed, epochs] = {"reference": key, "reference_seed": seed, "training_epochs": epochs,
                                          "ranks": args.ranks, "epochs": args.epochs, "batch_size": args.batch_size,
                                          "command": args.command, **run}
                append_record(args.out, recorded[seed, epochs])
                print(f"reference {key} seed {seed}, {epochs} epochs: accuracy {run['accuracy']}, work {run['work']}",
                      flush=True)
    spread = [recorded[seed, epochs] for seed in range(args.references) for epochs in lengths]
    return {**spread[0], "references": spread}


def undisturbed(name: str, scenario: dict, directory: str, args, seed=0, epochs=None) -> dict:
    """An undisturbed run of `scenario`'s job: its test accuracy, checkpoint directory, step
    times and checkpoint size in datasets."""
    shutil.rmtree(directory, ignore_errors=True)  # one cut short before
    run = launch(scenario, directory, os.path.join(directory, "checkpoints"), args, seed=seed, epochs=epochs)
    if run["status"] != 0 or accuracy_of(run) is None:
        raise RuntimeError(f"the undisturbed run of {name} failed:\n" + "\n".join(line for _, line in run["lines"]))
    logs = phase_log(directory)
    steps = max(step for _, phase, step in logs[max(logs)] if phase == "done")
    import h5py
    datasets, newest = [], newest_checkpoint(run["checkpoints"])
    if newest is not None:  # --elastic --mode data commits in memory and writes none
        with h5py.File(newest, "r") as f:
            f.visititems(lambda n, item: datasets.append(n) if isinstance(item, h5py.Dataset) else None)
    result = {"accuracy": accuracy_of(run), "checkpoints": run["checkpoints"], "steps": steps,
              "datasets": len(datasets), "seconds": run["ended"] - run["started"],
              "train_s": training_seconds(logs)}
    if is_ps(scenario):
        result.update(gradients=gradients_applied(run), work=work_done(logs), load_average=os.getloadavg())
    return result


def elastic_replay(directory: str):
    """The largest difference between the final weights of an elastic run in which one rank died
    and a float64 replay, in one process, of its survivors' training from the commit they
    restored (restored-1.pt, their batches after it in the batch logs; fault_hook.py), relative
    to the weight's size; None when the run left no such record."""
    import numpy as np
    import torch

    from mpidist.cli import build_parser
    from mpidist.cli.train import build_model
    from mpidist.data import HDF5Dataset, default_digits_path
    restored_file, final_file = os.path.join(directory, "restored-1.pt"), os.path.join(directory, "final.pt")
    if not (os.path.exists(restored_file) and os.path.exists(final_file)):
        return None
    batches = []  # per survivor, its batches after the reset
    for path in sorted(glob.glob(os.path.join(directory, "batches-*.log"))):
        with open(path) as f:
            lines = f.read().splitlines()
        if "reset 1" in lines:
            batches.append([[int(i) for i in line.split()] for line in lines[lines.index("reset 1") + 1:]])
    if not batches or len({len(b) for b in batches}) != 1:
        return float("inf")
    train_set = HDF5Dataset(default_digits_path(), "train")
    x, y = torch.as_tensor(train_set.x, dtype=torch.float64), torch.as_tensor(train_set.y)
    restored = torch.load(restored_file)
    model = build_model().double()
    model.load_state_dict({k.removeprefix("module."): v for k, v in restored["model"].items()})
    optimizer = torch.optim.SGD(model.parameters(), lr=build_parser().parse_args(["train"]).lr, momentum=0.9)
    optimizer.load_state_dict(restored["optimizer"])
    for step in zip(*batches):
        gradients = [torch.zeros_like(p) for p in model.parameters()]
        for rows in step:  # DataParallel averages the ranks' gradients of their own mean loss
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            for total, p in zip(gradients, model.parameters()):
                total += p.grad / len(step)
        for total, p in zip(gradients, model.parameters()):
            p.grad = total
        optimizer.step()
    final = torch.load(final_file)
    return max(float(np.max(np.abs(final[k].double().numpy() - v.detach().numpy())) /
                     max(float(np.max(np.abs(v.detach().numpy()))), 1e-12))
               for k, v in model.state_dict().items())
