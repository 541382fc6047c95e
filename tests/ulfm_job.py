"""One `mpirun --with-ft ulfm` launch of a job whose ranks kill themselves in phases, as the
parameter server's fault tests run it (tests/test_ps_faults.py,
tests/test_ps_worker_dies_mid_exchange.py). The job gets its folder and the phases (as JSON) as
arguments; each survivor writes done-<rank> when it has finished, each phase's records go to
<phase>-<rank>.json. The job is stopped `run_seconds` after its start, or `exit_seconds` after
every survivor has finished: after a death Open MPI's MPI_Finalize sometimes never returns, and
how a job ends is tested on its own where it matters."""
import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO


def run_ulfm_job(out, ranks: int, job: str, phases: dict, survivors, run_seconds: float, exit_seconds: float,
                 exit_on_rank_loss=None):
    """(the job's output, its exit status or None where it was stopped, the seconds it took);
    MPIDIST_EXIT_ON_RANK_LOSS is set to `exit_on_rank_loss` when given."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK",
                                                           "PYTEST_ISOLATE_MPI_IS_FORKED", "MPIDIST_EXIT_ON_RANK_LOSS")}
    env.update(MPIDIST_TIMEOUT="60", MPIDIST_STALL_WARNING="120")
    if exit_on_rank_loss is not None:
        env["MPIDIST_EXIT_ON_RANK_LOSS"] = str(exit_on_rank_loss)
    cmd = ["mpirun", "--with-ft", "ulfm", "--oversubscribe", "--bind-to", "none", "-np", str(ranks), sys.executable,
           "-c", job, str(out), json.dumps(phases)]
    started = time.monotonic()
    with open(out / "output.txt", "w+") as output:
        process = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                                   start_new_session=True)
        done_since = None
        while process.poll() is None:
            if done_since is None and all((out / f"done-{rank}").exists() for rank in survivors):
                done_since = time.monotonic()
            if time.monotonic() - started > run_seconds or \
                    done_since is not None and time.monotonic() - done_since > exit_seconds:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                break
            time.sleep(0.2)
        output.seek(0)
        text = output.read()
    status = None if process.returncode < 0 else process.returncode
    return text, status, time.monotonic() - started


def loss_summaries(output: str, *parts: str) -> list:
    """The summary lines of ranks lost (runtime/losses.py) in a job's output that hold every one
    of `parts`."""
    return [line for line in output.splitlines() if "mpidist: the job lost " in line and all(p in line for p in parts)]


def phase_records(out, phases: dict) -> dict:
    """The records by phase and world rank (phases: name -> (members, ...))."""
    return {name: {rank: json.loads((out / f"{name}-{rank}.json").read_text())
                   for rank in members if (out / f"{name}-{rank}.json").exists()}
            for name, (members, *_) in phases.items()}


def job_start(features: int, classes: int, samples: int, tests: int) -> str:
    """The start of such a job's code: its folder (`out`) and phases from the arguments, the
    world, a data set (x, y: `samples` + `tests` rows of `features` drawn from a linear teacher
    of `classes`) and every phase's communicator (`comms`), made while every rank lives."""
    return f"""
import json, sys
import torch
import mpidist as md
from mpi4py import MPI

out = sys.argv[1]
phases = json.loads(sys.argv[2])
torch.set_num_threads(1)
world = md.init()
generator = torch.Generator().manual_seed(7)
teacher = torch.randn({features}, {classes}, generator=generator)
x = torch.randn({samples} + {tests}, {features}, generator=generator)
y = (x @ teacher + 0.3 * torch.randn(len(x), {classes}, generator=generator)).argmax(1)
comms = {{}}
for name, (members, _, _, _) in phases.items():
    sub = world.mpi.Split(0 if world.rank in members else MPI.UNDEFINED, world.rank)
    comms[name] = md.Communicator(sub) if world.rank in members else None
"""
