"""How this process was started: its rank and placement, read from the launcher's environment.

Only environment variables are read, never MPI, so this works before ``MPI_Init`` (to pick a
GPU before CUDA is touched, to name log files) and in processes that never start MPI.

Launchers are recognised in this order, because an outer launcher's variables leak into the
processes of an inner one (``mpirun`` inside ``sbatch`` sees the batch step's SLURM_PROCID=0
on every rank):

===========  =========================================================================
openmpi      Open MPI's mpirun/mpiexec (and prterun): OMPI_COMM_WORLD_{RANK,SIZE,...}
mpich        MPICH / Intel MPI Hydra mpiexec: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, ...
slurm        a task of an srun job step: SLURM_STEP_ID with SLURM_PROCID, SLURM_LOCALID, ...
single       anything else, including the batch script itself (it is not a step)
===========  =========================================================================

(srun --mpi=pmi2 also sets PMI_RANK and PMI_SIZE, but not Hydra's local rank: its tasks are
told by the step's variables.) A PMIx launcher of another personality than Open MPI's puts
only PMIX_RANK in the environment (the rest it gives through the PMIx API): that is a rank
without a launch this module can describe, used for RANK alone.

Run ``python -m mpidist.launch`` under a launcher to see what each rank detects.

``import mpidist`` hands the process its place as torchrun would, from the launcher's variables
(set_launcher_variables), before MPI starts: torchrun scripts read LOCAL_RANK before
init_process_group to pick their GPU. Once MPI has started, md.init() holds the launch against
MPI's world (check_agrees_with_mpi: a launcher whose processes MPI does not join into one job is
refused) and sets what the launcher did not say from MPI's world (set_torchrun_variables).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import asdict, dataclass
from typing import Mapping, Optional

from .errors import InvalidArgumentError, LaunchMismatchError

__all__ = ["LaunchInfo", "check_agrees_with_mpi", "detect", "gpu_for_local_rank", "launcher_place",
           "set_launcher_variables", "set_torchrun_variables"]


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str     # "openmpi", "mpich", "slurm" or "single"
    rank: int         # in the world of the launch
    size: int
    local_rank: int   # among the processes of this launch on this node
    local_size: int
    node_rank: int    # index of this node among the launch's nodes
    num_nodes: int


SINGLE = LaunchInfo("single", rank=0, size=1, local_rank=0, local_size=1, node_rank=0, num_nodes=1)


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        number = int(value)
    except ValueError:
        raise InvalidArgumentError(f"environment variable {name}={value!r} is not an integer") from None
    if number < 0:
        raise InvalidArgumentError(f"environment variable {name}={value!r} is negative")
    return number


def _first_int(environ: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        if environ.get(name, "") != "":
            return _int(environ, name)
    return None


def _block_placement(launcher: str, rank: int, size: int, local_rank: int, local_size: int) -> LaunchInfo:
    # mpirun and Hydra name no node index. With their default placement (fill a node's slots,
    # then the next node) and the same number of ranks per node, it follows from the rank.
    # Round-robin placement (--map-by node) breaks this; node_rank is then a guess.
    local_size = max(local_size, 1)
    return LaunchInfo(launcher, rank, size, local_rank, local_size,
                      node_rank=rank // local_size, num_nodes=-(-size // local_size))


def _slurm_tasks_on_node(tasks_per_node: str, node: int) -> Optional[int]:
    """Tasks on node `node` from Slurm's compressed list, e.g. "2(x3),1" = 2,2,2,1."""
    counts = []
    for item in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise InvalidArgumentError(f"cannot parse Slurm tasks-per-node list {tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if node < len(counts) else None


def _detect_slurm(environ: Mapping[str, str]) -> LaunchInfo:
    rank = _int(environ, "SLURM_PROCID")
    size = _first_int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or 1
    local_rank = _first_int(environ, "SLURM_LOCALID") or 0
    node_rank = _first_int(environ, "SLURM_NODEID") or 0
    num_nodes = _first_int(environ, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1
    local_size = None
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if environ.get(name):
            local_size = _slurm_tasks_on_node(environ[name], node_rank)
            break
    if local_size is None:
        local_size = -(-size // num_nodes)
    return LaunchInfo("slurm", rank, size, local_rank, local_size, node_rank, num_nodes)


# The launchers that name a process's rank, size, local rank and local size each in a variable
# of its own, in the order they are recognised.
LAUNCHER_VARIABLES = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}
PMIX_RANK = "PMIX_RANK"


def _is_slurm_step(environ: Mapping[str, str]) -> bool:
    # SLURM_STEP_ID tells a task of an srun step from the batch script, which also carries
    # SLURM_PROCID=0 and the job's SLURM_NTASKS but is a single process.
    return "SLURM_PROCID" in environ and ("SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ)


def detect(environ: Mapping[str, str] = os.environ) -> LaunchInfo:
    """The launcher of this process and its place in the launch; see the module docstring."""
    for launcher, (rank, size, local_rank, local_size) in LAUNCHER_VARIABLES.items():
        if rank not in environ or size not in environ:
            continue
        if local_rank not in environ and _is_slurm_step(environ):
            continue  # srun --mpi=pmi2: the step names the local rank
        return _block_placement(launcher, rank=_int(environ, rank), size=_int(environ, size),
                                local_rank=_first_int(environ, local_rank) or 0,
                                local_size=_first_int(environ, local_size) or 1)
    if _is_slurm_step(environ):
        return _detect_slurm(environ)
    return SINGLE


def local_order(rank: int, environ: Mapping[str, str] = os.environ) -> int:
    """The key that orders the ranks of a node as the launcher numbers them: this process's local
    rank where a launcher names one (Open MPI numbers them in the order it binds them to cores,
    not always the ranks' order), else `rank`; MPI breaks ties by rank."""
    launch = detect(environ)
    return launch.local_rank if launch.launcher != "single" else rank


def check_agrees_with_mpi(mpi_size: int, mpi_library: str, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse a launch whose launcher started a number of processes other than the `mpi_size`
    ranks of MPI's world (MPI.COMM_WORLD), with what to launch with instead.

    srun without the process-management interface (PMI) that the MPI library reads
    (``--mpi=none``, or a default the library does not speak) starts N processes that each
    initialize MPI alone: N jobs of one rank, each writing the same files. The mpirun of another
    MPI library than the one mpi4py loads (`mpi_library`, MPI.Get_library_version()) does the
    same. A process of no launcher (a plain ``python`` in the batch script) is a world of one.
    """
    launch = detect(environ)
    if launch.launcher == "single" or launch.size == mpi_size:
        return
    library = mpi_library.replace("\x00", "").strip().splitlines()[0].split(",")[0]
    if launch.launcher == "slurm":
        offered = _srun_mpi_types()
        srun = f"srun --mpi={environ['SLURM_MPI_TYPE']}" if environ.get("SLURM_MPI_TYPE") else "srun"
        raise LaunchMismatchError(
            f"srun started {launch.size} tasks but MPI's world holds {mpi_size}: each task is a job of its own, "
            f"because {srun} gave the MPI library ({library}) no "
            "process-management interface it reads. Launch with `srun --mpi=pmix` (Open MPI 5, MPICH built with "
            "PMIx) or `srun --mpi=pmi2` (MPICH, Intel MPI)"
            + (f"; this cluster's srun offers --mpi={', '.join(offered)} (`srun --mpi=list`)" if offered else "")
            + ", or start the ranks with mpirun inside the allocation")
    launcher = {"openmpi": f"Open MPI's mpirun (OMPI_COMM_WORLD_SIZE={launch.size})",
                "mpich": f"an MPICH or Intel MPI mpiexec (PMI_SIZE={launch.size})"}[launch.launcher]
    raise LaunchMismatchError(
        f"{launcher} started {launch.size} ranks but MPI's world holds {mpi_size}: each is a job of its own, "
        f"because mpi4py loads another MPI library ({library}) than the launcher's. Start the program with the "
        "mpiexec of that library, or build mpi4py against the MPI library of this launcher "
        "(docs/cluster.md)")


def _srun_mpi_types() -> list[str]:
    """The --mpi= values `srun --mpi=list` offers besides none, or [] where it cannot tell."""
    try:
        listing = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    # One type a line, under a heading; older versions put "srun: " before each line.
    names = [line.removeprefix("srun:").strip() for line in (listing.stdout + listing.stderr).splitlines()]
    return [name for name in names if re.fullmatch(r"[a-z][a-z0-9_]*", name) and name != "none"]


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def launcher_place(environ: Mapping[str, str] = os.environ) -> dict[str, int]:
    """torchrun's variables, as many as the launcher of this process names: all four under a
    launcher detect() knows, RANK alone under a PMIx launcher that names no more, none in a
    process of no launcher."""
    launch = detect(environ)
    if launch.launcher != "single":
        return dict(zip(TORCHRUN_VARIABLES, (launch.rank, launch.size, launch.local_rank, launch.local_size)))
    if environ.get(PMIX_RANK, "") != "":
        return {"RANK": _int(environ, PMIX_RANK)}
    return {}


def set_launcher_variables(environ=os.environ) -> None:
    """Set RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, as torchrun does, from the
    launcher's own variables (launcher_place) wherever `environ` lacks them; never MPI. A value
    the user or torchrun set is kept. Malformed launcher variables are left for md.init() to
    name: importing mpidist does not fail on them."""
    try:
        place = launcher_place(environ)
    except InvalidArgumentError:
        return
    for name, value in place.items():
        environ.setdefault(name, str(value))


def set_torchrun_variables(rank: int, size: int, local_rank: int, local_size: int,
                           environ=os.environ) -> list[str]:
    """In a process that a launcher started, set RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE, as torchrun does, to the given place in mpidist's world wherever `environ`
    lacks them, so that code written for torchrun (``int(os.environ["LOCAL_RANK"])``) runs under
    mpirun and srun. A value already set is kept; returns a line for each one that differs from
    mpidist's. A process of no launcher is left alone: the programs it starts (an mpirun of
    their own) would inherit its world of one."""
    if not launcher_place(environ):
        return []
    differing = []
    for name, value in zip(TORCHRUN_VARIABLES, (rank, size, local_rank, local_size)):
        given = environ.setdefault(name, str(value))
        if given.strip() != str(value):
            differing.append(f"{name}={given!r} but mpidist's world says {value}")
    return differing


def _device_list(value: str) -> list[str]:
    return [entry.strip() for entry in value.split(",") if entry.strip()]


def gpu_for_local_rank(info: Optional[LaunchInfo] = None, environ: Mapping[str, str] = os.environ,
                       device_count: Optional[int] = None) -> Optional[int]:
    """The CUDA device index this rank should use, or None when it has no GPU. `info`: this
    process's place, detect(environ) when not given.

    CUDA numbers the devices in CUDA_VISIBLE_DEVICES 0..n-1, so with it set the answer is
    ``local_rank % n``: one entry (Slurm's --gpus-per-task=1 or --gpu-bind=single:1, which bind
    one GPU per task) gives device 0, and a node's whole list is shared out by local rank.
    Without it every device is visible under its physical index: Slurm's GPU list for the step
    or job is shared out by local rank, else ``local_rank % device_count`` when the caller
    passes the driver's count (``torch.cuda.device_count()``). None when nothing says there
    are GPUs, or CUDA_VISIBLE_DEVICES hides them all.
    """
    if info is None:
        info = detect(environ)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = _device_list(visible)
        if not devices or devices[0] in ("-1", "NoDevFiles"):
            return None
        return info.local_rank % len(devices)
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        gpus = _device_list(environ.get(name, ""))
        if gpus:
            physical = gpus[info.local_rank % len(gpus)]
            if not physical.isdigit():
                raise InvalidArgumentError(f"environment variable {name}={environ[name]!r} is not a list of GPU indices")
            return int(physical)
    if device_count:
        return info.local_rank % device_count
    return None


if __name__ == "__main__":
    launch = detect()
    print(json.dumps({**asdict(launch), "gpu": gpu_for_local_rank(launch)}, sort_keys=True), flush=True)
