"""The fault campaign's scenarios (benchmarks/faults.py): each one's job, fault, victims and what
docs/faults.md says follows; the settings every launch of the job runs under; and the fault drawn
for one run of a scenario."""
from __future__ import annotations

import os
import random

DEADLINE = 180  # s: a launch still running then is a hang, killed with its whole process group
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


def node_slots() -> int:
    """Ranks per emulated node (cluster.sh's MPIDIST_MN_SLOTS): ranks from it on are on node 2."""
    return int(os.environ.get("MPIDIST_MN_SLOTS", "2"))


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
