"""mpidist.launch: launcher detection from synthetic environments, and once under a real mpirun."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpidist.errors import InvalidArgumentError
from mpidist.launch import LaunchInfo, detect, gpu_for_local_rank

REPO_ROOT = Path(__file__).resolve().parent.parent

# Rank 3 of 8, two nodes of four ranks, as each launcher writes it.
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "OMPI_COMM_WORLD_NODE_RANK": "1", "PMIX_RANK": "5",
}
MPICH = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
SLURM_STEP = {
    "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
    "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
}
# What the batch script itself sees: no step, yet SLURM_PROCID=0 and the job's task count.
SLURM_BATCH = {
    "SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
    "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)",
}
RANK5_OF_8 = dict(rank=5, size=8, local_rank=1, local_size=4, node_rank=1, num_nodes=2)


@pytest.mark.parametrize("launcher, environ", [
    ("openmpi", OPENMPI), ("mpich", MPICH), ("slurm", SLURM_STEP),
])
def test_each_launcher(launcher, environ):
    assert detect(environ) == LaunchInfo(launcher, **RANK5_OF_8)


def test_plain_process_is_single():
    assert detect({}) == LaunchInfo("single", 0, 1, 0, 1, 0, 1)


def test_batch_script_is_not_a_task():
    assert detect(SLURM_BATCH).launcher == "single"


def test_mpirun_inside_an_allocation_wins_over_inherited_slurm_variables():
    # Every rank inherits the batch step's SLURM_PROCID=0; Open MPI's variables are the truth.
    assert detect({**SLURM_BATCH, **OPENMPI}) == LaunchInfo("openmpi", **RANK5_OF_8)
    assert detect({**SLURM_BATCH, **MPICH}) == LaunchInfo("mpich", **RANK5_OF_8)
    assert detect({**SLURM_STEP, **OPENMPI, "SLURM_PROCID": "0"}).rank == 5


def test_slurm_uneven_tasks_per_node():
    environ = {**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "3,4",
               "SLURM_PROCID": "6", "SLURM_LOCALID": "3", "SLURM_NODEID": "1"}
    assert detect(environ) == LaunchInfo("slurm", 6, 7, 3, 4, 1, 2)
    environ = {**environ, "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_STEP_NUM_NODES": "4",
               "SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "3"}
    assert detect(environ) == LaunchInfo("slurm", 6, 7, 0, 1, 3, 4)


def test_slurm_step_smaller_than_job_uses_step_counts():
    environ = {**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1",
               "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
               "SLURM_NODEID": "0"}
    assert detect(environ) == LaunchInfo("slurm", 1, 2, 1, 2, 0, 1)


def test_slurm_minimal_variables():
    info = detect({"SLURM_STEP_ID": "3", "SLURM_PROCID": "2", "SLURM_NTASKS": "4"})
    assert info == LaunchInfo("slurm", 2, 4, 0, 4, 0, 1)


def test_malformed_variable_names_it():
    with pytest.raises(InvalidArgumentError, match="OMPI_COMM_WORLD_RANK"):
        detect({**OPENMPI, "OMPI_COMM_WORLD_RANK": "five"})
    with pytest.raises(InvalidArgumentError, match="tasks-per-node"):
        detect({**SLURM_STEP, "SLURM_STEP_TASKS_PER_NODE": "4(y2)"})


def test_launch_info_is_frozen():
    with pytest.raises(AttributeError):
        detect({}).rank = 1


def _local(local_rank):
    return LaunchInfo("slurm", local_rank, 8, local_rank, 8, 0, 1)


def test_gpu_cuda_visible_devices_is_renumbered_from_zero():
    environ = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert [gpu_for_local_rank(_local(r), environ) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    uuids = {"CUDA_VISIBLE_DEVICES": "GPU-8c1d,GPU-99ab"}
    assert gpu_for_local_rank(_local(3), uuids) == 1


def test_gpu_slurm_binds_one_gpu_per_task():
    # --gpus-per-task=1: each task sees only its own GPU, whatever its physical index.
    environ = {"CUDA_VISIBLE_DEVICES": "3", "SLURM_STEP_GPUS": "0,1,2,3", "SLURM_JOB_GPUS": "0,1,2,3"}
    assert gpu_for_local_rank(_local(3), environ) == 0


def test_gpu_slurm_list_without_cuda_visible_devices_is_physical():
    environ = {"SLURM_JOB_GPUS": "2,3"}
    assert [gpu_for_local_rank(_local(r), environ) for r in range(3)] == [2, 3, 2]
    assert gpu_for_local_rank(_local(1), {"SLURM_STEP_GPUS": "6,7", "SLURM_JOB_GPUS": "0,1"}) == 7


def test_gpu_none_when_hidden_or_unknown():
    assert gpu_for_local_rank(_local(0), {"CUDA_VISIBLE_DEVICES": ""}) is None
    assert gpu_for_local_rank(_local(0), {"CUDA_VISIBLE_DEVICES": "-1"}) is None
    assert gpu_for_local_rank(_local(0), {}) is None
    assert gpu_for_local_rank(_local(0), {}, device_count=0) is None


def test_gpu_from_driver_count():
    assert gpu_for_local_rank(_local(5), {}, device_count=4) == 1


def _mpirun():
    beside_python = Path(sys.executable).parent / "mpirun"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("mpirun")


@pytest.mark.skipif(_mpirun() is None, reason="no mpirun beside this Python or on PATH: cannot start a real Open MPI launch")
def test_real_mpirun_is_detected():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    for name in [n for n in env if n.startswith(("OMPI_COMM_WORLD", "PMI_", "SLURM_"))]:
        del env[name]
    code = "import json, dataclasses, mpidist.launch as l; print(json.dumps(dataclasses.asdict(l.detect())))"
    result = subprocess.run(
        [_mpirun(), "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "-c", code],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    infos = sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
                   key=lambda info: info["rank"])
    assert [info["launcher"] for info in infos] == ["openmpi", "openmpi"]
    assert [(info["rank"], info["size"], info["local_rank"], info["local_size"]) for info in infos] == \
        [(0, 2, 0, 2), (1, 2, 1, 2)]
