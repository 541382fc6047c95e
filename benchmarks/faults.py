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
scenario: runs, completed as documented, hangs (killed at the runner's own deadline), wrong
results, unloadable newest checkpoints, and the median and p95 of the time to detect, to recover
and lost per failure; for the parameter server's scenarios also the test accuracy (min / median
/ max) of their runs and of their job's references, the runs' lost shares of work and the bounds
they were judged by (below).

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
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
HOOK = os.path.join(HERE, "fault_hook.py")
CLUSTER = os.path.join(REPO, "tests", "multinode", "cluster.sh")
NOTES_HEADING = "## Notes"  # the summary's own section, written by hand; kept when the summary is rewritten
DEADLINE = 180  # s: a launch still running then is a hang, killed with its whole process group
REPLAY_TOLERANCE = 1e-4  # elastic: float32 training against the float64 replay, relative to the weights
STALL_WARNING, TIMEOUT = 5, 20  # MPIDIST_STALL_WARNING and MPIDIST_TIMEOUT for the frozen rank
STEP_PHASES = ("forward", "backward", "apply")

PS_WORKER_DIED = r"mpidist parameter server: worker \d+ died"
MPIRUN_SAW_IT = r"prterun noticed that process rank \d+"
ULFM_DETECTOR = ["--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread", "true",
                 "--mca", "mpi_ft_detector_period", "1", "--mca", "mpi_ft_detector_timeout", "4"]
# mpirun notices a node that dropped off the network only through TCP keepalive on its connection
# to that node's daemon (Open MPI's defaults: 300 s idle, then 9 probes 20 s apart); these settings,
# the ones docs/faults.md recommends, end the job about 25 s after the cut.
LAUNCHER_KEEPALIVE = ["--prtemca", "oob_tcp_keepalive_time", "10", "--prtemca", "oob_tcp_keepalive_intvl", "5",
                      "--prtemca", "oob_tcp_keepalive_probes", "3"]
LOST_NODE = r"PRTE has lost communication with a remote daemon"
PS = ["--mode", "ps", "--lr", "0.01"]  # the default 0.05 diverges with stale gradients and momentum
# name: the job (--mode ps options, elastic), the fault, who it strikes, what the docs say follows.
SCENARIOS = {
    "elastic-kill": dict(train=["--elastic"], ulfm=True, action="kill", victims="any", survives=True,
                         detect=r"mpidist elastic: rank \d+ of \d+ died; going on", baseline="elastic-kill-restart"),
    "elastic-kill-restart": dict(train=[], action="kill", victims="any", detect=MPIRUN_SAW_IT),
    "ps-async-kill": dict(train=[*PS, "--elastic", "--ps-mode", "async"], ulfm=True, action="kill",
                          victims="workers", survives=True, detect=PS_WORKER_DIED, baseline="ps-async-kill-restart"),
    "ps-softsync-kill": dict(train=[*PS, "--elastic", "--ps-mode", "softsync", "--softsync", "2"],
                             ulfm=True, action="kill", victims="workers", survives=True, detect=PS_WORKER_DIED,
                             baseline="ps-async-kill-restart"),
    "ps-sync-backup-kill": dict(train=[*PS, "--elastic", "--ps-mode", "sync"], backup_workers=1,
                                ulfm=True, action="kill", victims="workers", survives=True, detect=PS_WORKER_DIED,
                                baseline="ps-async-kill-restart"),
    "ps-async-kill-restart": dict(train=[*PS, "--ps-mode", "async"], action="kill", victims="workers",
                                  detect=MPIRUN_SAW_IT),
    "ps-server-kill": dict(train=[*PS, "--elastic", "--ps-mode", "async"], ulfm=True, action="kill",
                           victims="server", detect=r"the server \(rank 0\) died, and the parameter server cannot go on"),
    "exception": dict(train=[], action="raise", victims="any",
                      detect=r"ended with an uncaught InjectedFault: aborting the whole job"),
    "sigterm": dict(train=[], action="ranks", signal="SIGTERM", victims="rank0", stops=True,
                    detect=r"stopped early: a stop signal \(SIGTERM\)"),
    "sigusr1": dict(train=[], action="launcher", signal="SIGUSR1", victims="rank0", stops=True,
                    detect=r"stopped early: a stop signal \(SIGUSR1\)"),
    "sigstop": dict(train=[], action="stop", victims="any", detect=r"mpidist: stall: rank \d+ has waited"),
    # ULFM's heartbeat failure detector (off by default) takes a frozen rank for a dead one.
    "elastic-sigstop-detector": dict(train=["--elastic"], ulfm=True, mpirun=ULFM_DETECTOR, action="stop", victims="any",
                                     survives=True, detect=r"mpidist elastic: rank \d+ of \d+ died; going on"),
    "rank0-checkpoint-kill": dict(train=[], action="checkpoint-kill", victims="rank0", detect=MPIRUN_SAW_IT),
    # Across the emulated nodes (tests/multinode/cluster.sh; root): a rank of the second node cuts
    # its node's link during a step (its all-reduces cross the link in backward and apply), or
    # has a share of the link's packets dropped, and the campaign restores the link `down_s` later
    # (a cut link: when the job has ended, or at the runner's deadline). link-down's outage, with
    # TCP's retransmission backoff after it, stays short of TIMEOUT: a longer one is a cut.
    "link-down": dict(train=[], nodes=True, action="link-down", victims="node2", phases=("backward", "apply"),
                      down_s=(3, TIMEOUT / 2), loses_nothing=True),
    # A cut link: the ranks waiting in a transfer with the cut node's raise at TIMEOUT, naming its
    # ranks, and mpirun, with LAUNCHER_KEEPALIVE, ends the job, naming the lost node; whichever
    # comes first is the detection. Open MPI 5.0's mpirun may then exit with status 0, so the
    # status is recorded but not judged (any_status).
    "link-cut": dict(train=[], nodes=True, action="link-down", victims="node2", phases=("backward", "apply"),
                     down_s=(DEADLINE, DEADLINE), mpirun=LAUNCHER_KEEPALIVE, any_status=True,
                     detect=rf"{LOST_NODE}|did not complete within \d+ s \(MPIDIST_TIMEOUT\): no answer from rank"),
    "link-loss": dict(train=[], nodes=True, action="link-loss", victims="node2", phases=("backward", "apply"),
                      down_s=(3, 8), percent=(10, 40), loses_nothing=True),
}


def mpirun_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_")) and k != "PYTEST_ISOLATE_MPI_IS_FORKED"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_mpi_yield_when_idle": "1"})
    env.update(extra)
    return env


def launch(scenario: dict, directory: str, checkpoints: str, args, spec=None, resume=False, seed=0,
           epochs=None) -> dict:
    """One mpirun of `mpidist train --seed seed --epochs epochs` (default: args.epochs) through the
    hook, its phase logs in `directory`; its output lines with the time each came, its exit status
    (None: killed at DEADLINE) and the times it started and ended."""
    os.makedirs(directory, exist_ok=True)
    train = [*scenario["train"], "--seed", str(seed)]
    if resume:
        train.append("--resume=auto")
    # A TMPDIR of its own: a killed mpirun leaves its session directory behind, which can make a
    # later mpirun refuse to start.
    session = tempfile.mkdtemp(prefix="faults-mpirun-")
    extra = {"FAULT_DIR": directory, "MPIDIST_STALL_WARNING": str(STALL_WARNING), "MPIDIST_TIMEOUT": str(TIMEOUT),
             "TMPDIR": session}
    if spec is not None:
        extra["FAULT_SPEC"] = json.dumps(spec)
    if scenario.get("backup_workers"):
        extra["FAULT_BACKUP_WORKERS"] = str(scenario["backup_workers"])
    ft = (["--with-ft", "ulfm"] if scenario.get("ulfm") else []) + scenario.get("mpirun", [])
    # Across the emulated nodes: mpirun runs in the first node, with the cluster's environment.
    on_nodes = ["bash", CLUSTER, "exec", "1"] if scenario.get("nodes") else []
    cmd = [*on_nodes, "mpirun", *ft, "--oversubscribe", "--bind-to", "none", "-np", str(args.ranks), sys.executable, HOOK,
           "train", "--epochs", str(epochs or args.epochs), "--batch-size", str(args.batch_size), "--no-progress",
           "--checkpoint-dir", checkpoints, *train]
    started = time.time()
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                               env=mpirun_env(extra), start_new_session=True)
    if spec is not None and "launcher_pid_file" in spec:
        with open(spec["launcher_pid_file"], "w") as f:
            f.write(str(process.pid))
    lines = []

    def read():
        for line in process.stdout:
            lines.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    link = LinkRestorer(directory, spec) if spec is not None and scenario.get("nodes") else None
    try:
        status = process.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        status = None
    ended = time.time()
    if link is not None:
        link.finish()
    reader.join(timeout=10)
    shutil.rmtree(session, ignore_errors=True)
    return {"cmd": cmd, "status": status, "started": started, "ended": ended, "lines": lines,
            "checkpoints": checkpoints, "directory": directory, "link": link and link.record}


def node_pid(node: int) -> str:
    """The pid of the process holding emulated node `node`'s namespaces (cluster.sh)."""
    with open(os.path.join(os.environ.get("MPIDIST_MN_DIR", "/tmp/mpidist-multinode"), f"node{node}.pid")) as f:
        return f.read().strip()


def node_slots() -> int:
    """Ranks per emulated node (cluster.sh's MPIDIST_MN_SLOTS): ranks from it on are on node 2."""
    return int(os.environ.get("MPIDIST_MN_SLOTS", "2"))


def restore_link(node: int) -> dict:
    """Undo a link fault of the hook on emulated node `node`: its link up, the loss filter gone
    (with the packets it dropped, for the record)."""
    from fault_hook import LINK, LOSS_TABLE
    enter = ["nsenter", "-t", node_pid(node), "--net", "--"]
    table = subprocess.run([*enter, "nft", "list", "table", "inet", LOSS_TABLE], capture_output=True, text=True)
    dropped = sum(int(n) for n in re.findall(r"counter packets (\d+)", table.stdout)) if table.returncode == 0 else None
    if table.returncode == 0:
        subprocess.run([*enter, "nft", "delete", "table", "inet", LOSS_TABLE], check=True)
    subprocess.run([*enter, "ip", "link", "set", LINK, "up"], check=True)
    return {"restored": time.time(), "dropped_packets": dropped}


class LinkRestorer:
    """Restores the link of the victim's node `spec["down_s"]` seconds after the hook's fault
    (fault.json), or when the job ends, whichever comes first."""

    def __init__(self, directory: str, spec: dict):
        self.fault_file, self.spec, self.record = os.path.join(directory, "fault.json"), spec, None
        self.done, self.lock = threading.Event(), threading.Lock()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def watch(self) -> None:
        while not self.done.is_set() and not os.path.exists(self.fault_file):
            time.sleep(0.05)
        if self.done.is_set():
            return
        time.sleep(0.05)  # the hook's record is written and closed at once, then the fault
        with open(self.fault_file) as f:
            fault_time = json.load(f)["time"]
        self.done.wait(max(0.0, fault_time + self.spec["down_s"] - time.time()))
        self.restore()

    def restore(self) -> None:
        with self.lock:
            if self.record is None:
                self.record = restore_link(self.spec["node"])

    def finish(self) -> None:
        self.done.set()
        self.thread.join()
        if os.path.exists(self.fault_file):
            self.restore()


def phase_log(directory: str) -> dict:
    """rank -> [(time, phase, step)] from the hook's logs."""
    logs = {}
    for path in glob.glob(os.path.join(directory, "rank-*.log")):
        rank = int(re.search(r"rank-(\d+)\.log", path).group(1))
        with open(path) as f:
            logs[rank] = [(float(t), phase, int(step)) for t, phase, step in
                          (line.split() for line in f if len(line.split()) == 3)]
    return logs


def accuracy_of(run: dict):
    for _, line in run["lines"]:
        found = re.search(r"final test accuracy: ([0-9.]+)", line)
        if found:
            return float(found.group(1))
    return None


def newest_checkpoint(directory: str):
    from mpidist.checkpoint import latest_checkpoint
    for where in (os.path.join(directory, "ps"), directory):
        if os.path.isdir(where):
            found = latest_checkpoint(where)
            if found is not None:
                return found
    return None


def loads(path: str, args) -> str | None:
    """None when the checkpoint at `path` loads into the network and optimizer of `mpidist train`,
    else the error."""
    import torch

    from mpidist.checkpoint import load_checkpoint
    from mpidist.cli.train import build_model
    model = build_model()
    try:
        load_checkpoint(path, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), restore_rng=False)
    except Exception as exc:  # any failure to load is what the record keeps
        return f"{type(exc).__name__}: {exc}"
    return None


def final_weights(directory: str) -> dict:
    """The model and optimizer tensors of the newest checkpoint in `directory`."""
    import h5py
    path = newest_checkpoint(directory)
    tensors = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: tensors.__setitem__(name, item[()])
                     if isinstance(item, h5py.Dataset) and name.startswith(("model/", "optimizer/")) else None)
    return tensors


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


def reference_key(scenario: dict) -> str:
    """The name of a scenario's job: scenarios with the same job share its undisturbed runs."""
    key = "-".join(a.strip("-") for a in scenario["train"]) or "data"
    if scenario.get("nodes"):
        key += "-nodes"
    if scenario.get("backup_workers"):
        key += f"-backup{scenario['backup_workers']}"
    return key


def is_ps(scenario: dict) -> bool:
    return "ps" in scenario["train"]


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
    each for --epochs and for one epoch less (the module's docstring): those <out>.jsonl holds
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


def gradients_applied(run: dict):
    """The gradients the server applied in this launch (its summary line), or None."""
    for _, line in run["lines"]:
        found = re.search(r"parameter server \(.*\): \d+ updates of (\d+) gradients", line)
        if found:
            return int(found.group(1))
    return None


def gradients_resumed(run: dict) -> int:
    """The gradients applied to the checkpoint a relaunch resumed from (its "resumed from" line)."""
    for _, line in run["lines"]:
        found = re.search(r"resumed from .* gradients per worker \[([0-9, ]*)\]", line)
        if found:
            return sum(int(n) for n in found.group(1).split(",") if n.strip())
    return 0


def work_done(logs: dict) -> int:
    """The training steps the workers did (the server's log has none)."""
    return sum(1 for log in logs.values() for _, phase, _ in log if phase == "done")


def digits_test_size() -> int:
    from mpidist.data import HDF5Dataset, default_digits_path
    return len(HDF5Dataset(default_digits_path(), "test"))


def accuracy_verdict(accuracy, work, references: list, resolution: float) -> dict:
    """A parameter-server run's accuracy judged against its job's references with as much work
    (the module's docstring; `resolution`: one test item's share of the accuracy): its lost share
    of work, the references' range there, the bound, and whether it is wrong."""
    import numpy as np
    if accuracy is None or work is None:
        return {"wrong": True, "work": work}
    lengths = {}  # seed -> [(work, accuracy)] of its references
    for r in references:
        lengths.setdefault(r["reference_seed"], []).append((r["work"], r["accuracy"]))
    at_same_work = [float(np.interp(work, *zip(*sorted(points)))) for points in lengths.values()]
    low, high = min(at_same_work), max(at_same_work)
    bound = low - max(high - low, resolution)
    full = statistics.median(max(points)[0] for points in lengths.values())
    return {"work": work, "lost_share": 1 - work / full, "references_at_same_work": [low, high],
            "accuracy_bound": bound, "wrong": accuracy < bound}


def draw(name: str, scenario: dict, ref: dict, args, rng: random.Random, directory: str) -> dict:
    """The fault of one run: victim rank, step, phase and moment within it."""
    servers = 1 if is_ps(scenario) else 0
    victims = {"any": list(range(args.ranks)), "rank0": [0], "server": [0],
               "workers": list(range(servers, args.ranks)),
               "node2": list(range(node_slots(), args.ranks))}[scenario["victims"]]
    spec = {"action": scenario["action"], "rank": rng.choice(victims), "fraction": rng.random(),
            "step": rng.randint(2, max(2, int(ref["steps"] * 0.7))),
            "phase": rng.choice(scenario.get("phases", STEP_PHASES))}
    if scenario.get("nodes"):
        spec.update(node=2, down_s=round(rng.uniform(*scenario["down_s"]), 2))
    if "percent" in scenario:
        spec.update(percent=rng.randint(*scenario["percent"]))
    if scenario["victims"] == "server":  # its updates, as many as the workers' steps in async mode
        spec.update(phase="update", step=rng.randint(2, max(2, int(ref["steps"] * (args.ranks - 1) * 0.7))))
    if scenario["action"] == "checkpoint-kill":
        # a checkpoint after the first (which leaves one behind), at a drawn point of its write
        spec.update(phase="checkpoint", write_point=rng.randint(1, ref["datasets"] + 1),
                    step=rng.randint(ref["steps"] // args.epochs + 1, ref["steps"]))
    if scenario["action"] in ("launcher", "ranks"):
        spec.update(signal=scenario["signal"], launcher_pid_file=os.path.join(directory, "mpirun.pid"))
    return spec


def first_line(run: dict, pattern: str, after: float):
    for t, line in run["lines"]:
        if t >= after and re.search(pattern, line):
            return t
    return None


def step_times(log: list, until: float) -> list:
    done = [t for t, phase, _ in log if phase == "done" and t < until]
    return [b - a for a, b in zip(done, done[1:])]


def rate(logs: dict, ranks, since: float, until: float) -> float | None:
    """Training steps per second and rank that `ranks` completed in [since, until]: the job's
    steps per second in data parallel, a worker's in parameter-server mode."""
    ranks = list(ranks)
    count = sum(1 for r in ranks for t, phase, _ in logs.get(r, []) if phase == "done" and since <= t <= until)
    return count / len(ranks) / (until - since) if until > since and count else None


def training_seconds(logs: dict) -> float:
    """From the first step completed on any rank to the last."""
    done = [t for log in logs.values() for t, phase, _ in log if phase == "done"]
    return max(done) - min(done)


def first_step(logs: dict, ranks) -> float:
    return min((t for r in ranks for t, phase, _ in logs.get(r, []) if phase == "done"), default=float("inf"))


def judge(name: str, scenario: dict, ref: dict, run: dict, relaunch, fault: dict, logs: dict, args) -> dict:
    """The record's verdicts and times."""
    record = {"status": run["status"], "hang": run["status"] is None or (relaunch is not None and
                                                                       relaunch["status"] is None)}
    output = "\n".join(line for _, line in run["lines"])
    t_fault = fault["time"]
    detected = first_line(run, scenario["detect"], t_fault) if "detect" in scenario else None
    record["detect_s"] = (detected if detected is not None else run["ended"]) - t_fault
    record["named"] = detected is not None
    record["detected_by"] = next((line for t, line in run["lines"] if t == detected), None)
    victim = fault["rank"]
    survivors = [r for r in range(args.ranks) if r != victim and not (r == 0 and is_ps(scenario))]
    before = step_times(logs.get(min(survivors), []), t_fault)
    step_s = statistics.median(before) if before else 0.0
    marks = [t for t, phase, _ in logs.get(0 if victim != 0 else min(survivors), []) if t < t_fault and
             phase in ("commit" if scenario.get("survives") else "checkpoint-done",)]
    done_before = [t for t, phase, _ in logs.get(min(survivors), []) if phase == "done" and t < t_fault]
    last_mark = max(marks) if marks else run["started"]
    redone = sum(1 for t in done_before if t > last_mark) if not is_ps(scenario) else 0
    if scenario.get("loses_nothing"):  # the job goes on as if nothing had happened
        import numpy as np
        record["named"] = first_line(run, r"mpidist: stall:", t_fault) is not None  # a stall report, if any
        record["detect_s"] = None
        record["completed"] = run["status"] == 0 and accuracy_of(run) is not None
        record["accuracy"] = accuracy_of(run)
        record["wrong"] = run["status"] != 0 or not all(
            np.array_equal(a, b) for a, b in _paired(final_weights(run["checkpoints"]),
                                                     final_weights(ref["checkpoints"])))
        restored = (run.get("link") or {}).get("restored", t_fault)
        after = [t for r in survivors for t, phase, _ in logs.get(r, []) if phase == "done" and t > restored]
        recovered = min(after) if after else None
        during = rate(logs, survivors, t_fault, restored)
        record["steps_per_s_during"] = during
        record["steps_per_s_before"] = rate(logs, survivors, first_step(logs, survivors), t_fault)
        record["steps_per_s_after"] = rate(logs, survivors, recovered, max(after)) if after else None
        record["link"] = run.get("link")
        redone = 0
        record["recover_s"] = recovered - t_fault if recovered is not None else None
        record["redone_steps"] = 0
        record["lost_s"] = training_seconds(logs) - ref["train_s"] if "train_s" in ref else None
        if not record["completed"] or record["wrong"] or record["hang"]:
            record["output_tail"] = output[-3000:]
        return record
    if scenario.get("survives"):
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
    else:
        stopped = scenario.get("stops", False)
        record["completed"] = run["status"] is not None and detected is not None and (
            scenario.get("any_status") or (run["status"] == 0) == stopped)
        if stopped:
            redone = 0
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
            import numpy as np
            record["wrong"] = relaunch is None or relaunch["status"] != 0 or not all(
                np.array_equal(a, b) for a, b in _paired(final_weights(relaunch["checkpoints"]),
                                                         final_weights(ref["checkpoints"])))
        record["steps_per_s_before"] = rate(logs, survivors, first_step(logs, survivors), t_fault)
        last = max((t for log in relaunch_logs.values() for t, phase, _ in log if phase == "done"), default=None)
        trainers = [r for r in range(args.ranks) if not (r == 0 and is_ps(scenario))]
        record["steps_per_s_after"] = rate(relaunch_logs, trainers, recovered, last) if recovered else None
        record["job_end_s"] = run["ended"] - t_fault
        if run.get("link"):
            record["link"] = run["link"]
    record["recover_s"] = recovered - t_fault if recovered is not None else None
    record["redone_steps"] = redone
    record["lost_s"] = record["recover_s"] + redone * step_s if record["recover_s"] is not None else None
    if not record["completed"] or record["wrong"] or record["hang"]:
        record["output_tail"] = output[-3000:]
    return record


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
                      output_tail="\n".join(line for _, line in run["lines"])[-3000:])
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
    record.update(injected=True, fault=fault, **judge(name, scenario, ref, run, relaunch, fault, logs, args))
    return record


def percentile(values, q):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


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


def spread(values) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {"min": values[0], "median": statistics.median(values), "max": values[-1], "n": len(values)}


def accuracy_summary(scenario: dict, injected: list, records: list) -> dict:
    """A parameter-server scenario's test accuracies: its runs', and its job's references' (those
    of the runs' ranks, epochs and batch size) per length in epochs, with the runs' lost shares of
    work and the bounds they were judged by."""
    shapes = {(r["ranks"], r.get("epochs"), r.get("batch_size")) for r in injected}
    references = [r for r in records if r.get("reference") == reference_key(scenario) and
                  (r["ranks"], r["epochs"], r["batch_size"]) in shapes]
    lengths = sorted({r["training_epochs"] for r in references}, reverse=True)
    return {"accuracy": spread(r.get("accuracy") for r in injected),
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


def read_records(out: str) -> list:
    """Every record of <out>.jsonl: the runs' (with "scenario") and the references' (with "reference")."""
    if not os.path.exists(out + ".jsonl"):
        return []
    with open(out + ".jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def append_record(out: str, record: dict) -> None:
    with open(out + ".jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


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
              "benchmarks/faults.py).", "",
              "| scenario | references' accuracy (epochs: min / median / max (N)) | runs' accuracy | lost share of work "
              "| bound | wrong |", "|" + "---|" * 6]
    for name, row in summary.items():
        if "references" in row:
            references = "; ".join(f"{r['epochs']}: {fmt_spread(r['accuracy'])}" for r in row["references"])
            lines.append(f"| {name} | {references} | {fmt_spread(row['accuracy'])} | {fmt_spread(row['lost_share'])} "
                         f"| {fmt_spread(row['accuracy_bound'])} | {row['wrong']} |")
    notes = ""  # what was written about the runs by hand, kept from the file being replaced
    if os.path.exists(out + ".md"):
        with open(out + ".md") as f:
            existing = f.read()
        if NOTES_HEADING in existing:
            notes = "\n" + existing[existing.index(NOTES_HEADING):]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n" + notes)


def fmt_spread(cell: dict) -> str:
    if not cell["n"]:
        return "-"
    return f"{cell['min']:.4f} / {cell['median']:.4f} / {cell['max']:.4f} ({cell['n']})"


def nodes_up() -> None:
    """The emulated nodes of tests/multinode/cluster.sh, for the scenarios of a network: up
    already, or brought up now and taken down when the campaign ends."""
    import atexit
    state = os.environ.get("MPIDIST_MN_DIR", "/tmp/mpidist-multinode")
    if os.path.exists(os.path.join(state, "up")):
        return
    subprocess.run(["bash", CLUSTER, "up"], check=True)
    atexit.register(subprocess.run, ["bash", CLUSTER, "down"])


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
