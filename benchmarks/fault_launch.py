"""One launch of `mpidist train` under mpirun for the fault campaign (benchmarks/faults.py),
through the rank side's hook (benchmarks/fault_hook.py): its output lines with the time each
came, its exit status or its hang; and the emulated nodes of tests/multinode/cluster.sh for the
network's scenarios, whose link the campaign restores itself after the hook's fault."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from fault_scenarios import DEADLINE, STALL_WARNING, TIMEOUT

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
HOOK = os.path.join(HERE, "fault_hook.py")
CLUSTER = os.path.join(REPO, "tests", "multinode", "cluster.sh")


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
    alive = None
    try:
        status = process.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        alive = still_alive(process.pid)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        status = None
    ended = time.time()
    if link is not None:
        link.finish()
    reader.join(timeout=10)
    shutil.rmtree(session, ignore_errors=True)
    return {"cmd": cmd, "status": status, "started": started, "ended": ended, "lines": lines,
            "checkpoints": checkpoints, "directory": directory, "link": link and link.record, "alive_at_deadline": alive}


def still_alive(group: int) -> list:
    """The processes of a hung launch's process group (mpirun's session), with their state and
    the kernel function each sleeps in: which of mpirun, its daemon and the ranks kept the job
    from ending."""
    listing = subprocess.run(["ps", "-o", "pid=,stat=,wchan:32=,args=", "-g", str(group)], capture_output=True,
                             text=True).stdout
    return [line.strip()[:300] for line in listing.splitlines() if line.strip()]


def node_pid(node: int) -> str:
    """The pid of the process holding emulated node `node`'s namespaces (cluster.sh)."""
    with open(os.path.join(os.environ.get("MPIDIST_MN_DIR", "/tmp/mpidist-multinode"), f"node{node}.pid")) as f:
        return f.read().strip()


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


def nodes_up() -> None:
    """The emulated nodes of tests/multinode/cluster.sh, for the scenarios of a network: up
    already, or brought up now and taken down when the campaign ends."""
    import atexit
    state = os.environ.get("MPIDIST_MN_DIR", "/tmp/mpidist-multinode")
    if os.path.exists(os.path.join(state, "up")):
        return
    subprocess.run(["bash", CLUSTER, "up"], check=True)
    atexit.register(subprocess.run, ["bash", CLUSTER, "down"])
