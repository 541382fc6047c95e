"""mpidist.launch: launcher detection, the check of a launch against MPI's world and torchrun's
variables from synthetic environments; md.init() and `mpidist info` under a launch MPI does not
join (an srun task's variables around a process that starts MPI alone); under a real mpirun of 2
and 3 ranks, torchrun's variables at `import mpidist` against MPI's own ranks."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_python

from mpidist.errors import InvalidArgumentError, LaunchMismatchError
from mpidist.launch import (
    LaunchInfo,
    check_agrees_with_mpi,
    detect,
    gpu_for_local_rank,
    set_launcher_variables,
    set_torchrun_variables,
)

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


def test_the_documented_gpu_call_needs_no_arguments(monkeypatch):
    # docs/cluster.md: `mpidist.launch.gpu_for_local_rank()` reads this process's own launch.
    for name, value in {**OPENMPI, "CUDA_VISIBLE_DEVICES": "0,1"}.items():
        monkeypatch.setenv(name, value)
    assert gpu_for_local_rank() == 1


OPEN_MPI_LIBRARY = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"
# An srun task, 2 of them in the step, whose srun passed MPI no process-management interface.
SRUN_WITHOUT_PMI = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_PROCID": "1",
                    "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_MPI_TYPE": "none"}


def test_srun_tasks_that_mpi_does_not_join_are_refused_with_the_mpi_option_to_use(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no srun to list its types: the advice stands alone
    with pytest.raises(LaunchMismatchError, match=r"srun started 2 tasks but MPI's world holds 1.*srun --mpi=none.*"
                       r"\(Open MPI v5\.0\.11\).*`srun --mpi=pmix`.*`srun --mpi=pmi2`") as refused:
        check_agrees_with_mpi(1, OPEN_MPI_LIBRARY, SRUN_WITHOUT_PMI)
    assert "offers" not in str(refused.value)


def test_the_refusal_lists_what_srun_offers(monkeypatch, tmp_path):
    # The listing of Slurm 22.05's `srun --mpi=list`.
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\nprintf 'MPI plugin types are...\\n\\tnone\\n\\tcray_shasta\\n\\tpmi2\\n\\tpmix\\n"
                    "specific pmix plugin versions available: pmix_v4\\n'\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchMismatchError, match=r"this cluster's srun offers --mpi=cray_shasta, pmi2, pmix \("):
        check_agrees_with_mpi(1, OPEN_MPI_LIBRARY, SRUN_WITHOUT_PMI)


def test_the_mpirun_of_another_mpi_library_is_refused():
    with pytest.raises(LaunchMismatchError, match=r"Open MPI's mpirun \(OMPI_COMM_WORLD_SIZE=8\) started 8 ranks but "
                       r"MPI's world holds 1.*another MPI library \(MPICH Version:\s+4\.1\.2\)"):
        check_agrees_with_mpi(1, "MPICH Version:\t4.1.2\nMPICH Release date: ...", OPENMPI)
    with pytest.raises(LaunchMismatchError, match=r"PMI_SIZE=8\) started 8 ranks but MPI's world holds 1"):
        check_agrees_with_mpi(1, OPEN_MPI_LIBRARY, MPICH)


@pytest.mark.parametrize("environ, mpi_size", [
    ({}, 1),                                 # python on a laptop
    (SLURM_BATCH, 1),                        # python in the batch script: the job's task count is not its own
    (SLURM_STEP, 8),                         # srun --mpi=pmix
    (OPENMPI, 8),
    (MPICH, 8),
    # mpirun inside an allocation: the ranks inherit the variables of the batch script, or across
    # nodes those of the srun step that started mpirun's daemons, one task per node
    ({**SLURM_BATCH, **OPENMPI}, 8),
    ({**SLURM_STEP, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", **OPENMPI}, 8),
    ({**SLURM_STEP, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", **MPICH}, 8),
])
def test_launches_that_mpi_joins_are_accepted(environ, mpi_size):
    check_agrees_with_mpi(mpi_size, OPEN_MPI_LIBRARY, environ)


def test_md_init_and_mpidist_info_refuse_srun_tasks_that_mpi_does_not_join():
    code = ("import mpidist as md\n"
            "try:\n"
            "    md.init()\n"
            "except md.LaunchMismatchError as error:\n"
            "    print('refused:', error)\n")
    init = run_python(code, env=SRUN_WITHOUT_PMI)
    assert init.returncode == 0 and init.stdout.startswith("refused: srun started 2 tasks but MPI's world holds 1"), \
        init.stdout + init.stderr
    info = run_python("from mpidist.cli import main; raise SystemExit(main(['info']))", env=SRUN_WITHOUT_PMI)
    assert info.returncode == 2, info.stdout + info.stderr
    assert "ranks" not in info.stdout and "srun --mpi=pmix" in info.stderr, info.stdout + info.stderr


def test_torchrun_variables_are_set_from_mpidist_where_unset():
    environ = dict(OPENMPI)
    assert set_torchrun_variables(5, 8, 1, 4, environ) == []
    assert {name: environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == \
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}


def test_torchrun_variables_the_user_set_are_kept_and_a_differing_one_named():
    environ = {**SLURM_STEP, "RANK": "5", "LOCAL_RANK": "3"}
    assert set_torchrun_variables(5, 8, 1, 4, environ) == ["LOCAL_RANK='3' but mpidist's world says 1"]
    assert (environ["RANK"], environ["LOCAL_RANK"], environ["WORLD_SIZE"]) == ("5", "3", "8")


def test_torchrun_variables_are_left_alone_without_a_launcher():
    # A plain python (or the batch script) that starts an mpirun of its own passes on its environment.
    for environ in ({}, dict(SLURM_BATCH)):
        before = dict(environ)
        assert set_torchrun_variables(0, 1, 0, 1, environ) == []
        assert environ == before


def torchrun_variables(environ):
    return {name: environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") if name in environ}


RANK5_VARIABLES = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}


@pytest.mark.parametrize("environ", [OPENMPI, MPICH, SLURM_STEP], ids=["openmpi", "mpich", "slurm"])
def test_launcher_variables_give_torchruns(environ):
    environ = dict(environ)
    set_launcher_variables(environ)
    assert torchrun_variables(environ) == RANK5_VARIABLES


def test_srun_with_pmi2_takes_the_local_rank_from_the_step():
    # srun --mpi=pmi2 sets PMI_RANK and PMI_SIZE but not Hydra's MPI_LOCALRANKID.
    environ = {**SLURM_STEP, "PMI_RANK": "5", "PMI_SIZE": "8", "PMI_FD": "7"}
    assert detect(environ) == LaunchInfo("slurm", **RANK5_OF_8)
    set_launcher_variables(environ)
    assert torchrun_variables(environ) == RANK5_VARIABLES


def test_a_pmix_launcher_gives_the_rank_alone():
    environ = {"PMIX_RANK": "5", "PMIX_NAMESPACE": "prterun-node-1234@1"}
    set_launcher_variables(environ)
    assert torchrun_variables(environ) == {"RANK": "5"}
    # md.init() then sets the others from MPI's world.
    assert set_torchrun_variables(5, 8, 1, 4, environ) == []
    assert torchrun_variables(environ) == RANK5_VARIABLES


def test_launcher_variables_keep_what_the_user_or_torchrun_set():
    environ = {**MPICH, "LOCAL_RANK": "3", "WORLD_SIZE": ""}
    set_launcher_variables(environ)
    assert torchrun_variables(environ) == {"RANK": "5", "WORLD_SIZE": "", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}


def test_launcher_variables_are_not_set_without_a_launcher():
    for environ in ({}, dict(SLURM_BATCH)):
        before = dict(environ)
        set_launcher_variables(environ)
        assert environ == before


def test_malformed_launcher_variables_leave_the_environment_alone():
    # `import mpidist` must not fail on them: md.init() names the variable (check_agrees_with_mpi).
    environ = {**OPENMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "one"}
    set_launcher_variables(environ)
    assert torchrun_variables(environ) == {}


def _mpirun():
    beside_python = Path(sys.executable).parent / "mpirun"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("mpirun")


def _mpirun_env(**variables):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **variables}
    for name in [n for n in env if n.startswith(("OMPI_COMM_WORLD", "PMI_", "PMIX_", "SLURM_"))
                 or (n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") and n not in variables)]:
        del env[name]
    return env


# A torchrun script's first lines, then mpidist's place and MPI's own answer: COMM_WORLD and the
# ranks sharing its node.
READS_TORCHRUN_VARIABLES_AT_IMPORT = """\
import json, os, sys
import mpidist as md
given = {name: int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
mpi_started_by_import = "mpi4py.MPI" in sys.modules
md.init()
from mpi4py import MPI
node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
ours = {"RANK": md.rank(), "WORLD_SIZE": md.size(), "LOCAL_RANK": md.local_rank(), "LOCAL_WORLD_SIZE": md.local_size()}
mpi = {"RANK": MPI.COMM_WORLD.Get_rank(), "WORLD_SIZE": MPI.COMM_WORLD.Get_size(), "LOCAL_WORLD_SIZE": node.Get_size()}
print(json.dumps({"given": given, "ours": ours, "mpi": mpi, "mpi_started_by_import": mpi_started_by_import}), flush=True)
"""


# Open MPI numbers the local ranks in the order it binds them: with its default binding and more
# ranks than cores (3 on the 2 cores CI has) that is not the ranks' order; unbound it is.
@pytest.fixture(scope="module", params=[(2, ["--bind-to", "none"]), (3, ["--bind-to", "none"]), (3, [])],
                ids=["2_unbound", "3_unbound", "3_default_binding"])
def torchrun_script_under_mpirun(request):
    if _mpirun() is None:
        pytest.skip("no mpirun beside this Python or on PATH: cannot start a real Open MPI launch")
    ranks, binding = request.param
    result = subprocess.run(
        [_mpirun(), "-np", str(ranks), "--oversubscribe", *binding, sys.executable, "-c",
         READS_TORCHRUN_VARIABLES_AT_IMPORT],
        cwd=REPO_ROOT, env=_mpirun_env(), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mpidist's world says" not in result.stderr, result.stderr
    places = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(places) == ranks, result.stdout + result.stderr
    return places


def test_torchruns_variables_are_mpidists_places_right_after_import(torchrun_script_under_mpirun):
    """What import set is what md.init() then says: mpidist's local ranks follow the launcher's."""
    places = torchrun_script_under_mpirun
    assert [place["given"] for place in places] == [place["ours"] for place in places]
    assert [{name: place["ours"][name] for name in place["mpi"]} for place in places] == \
        [place["mpi"] for place in places]
    assert sorted(place["ours"]["LOCAL_RANK"] for place in places) == list(range(len(places)))


def test_importing_mpidist_under_mpirun_does_not_start_mpi(torchrun_script_under_mpirun):
    assert not any(rank["mpi_started_by_import"] for rank in torchrun_script_under_mpirun)


@pytest.fixture(scope="module")
def real_mpirun():
    """One launch of 2 ranks under a real mpirun: each prints what it detects before md.init(),
    then torchrun's variables after it (LOCAL_WORLD_SIZE set beforehand, to a wrong value)."""
    if _mpirun() is None:
        pytest.skip("no mpirun beside this Python or on PATH: cannot start a real Open MPI launch")
    env = _mpirun_env(LOCAL_WORLD_SIZE="7")
    code = ("import json, os, dataclasses, mpidist.launch as l\n"
            "print(json.dumps(dataclasses.asdict(l.detect())), flush=True)\n"
            "import mpidist as md\n"
            "md.init()\n"
            "print('torchrun', md.rank(), md.local_rank(), json.dumps({n: os.environ[n] for n in l.TORCHRUN_VARIABLES}))\n")
    result = subprocess.run(
        [_mpirun(), "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "-c", code],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_real_mpirun_is_detected(real_mpirun):
    infos = sorted((json.loads(line) for line in real_mpirun.stdout.splitlines() if line.startswith("{")),
                   key=lambda info: info["rank"])
    assert [info["launcher"] for info in infos] == ["openmpi", "openmpi"]
    assert [(info["rank"], info["size"], info["local_rank"], info["local_size"]) for info in infos] == \
        [(0, 2, 0, 2), (1, 2, 1, 2)]


def test_md_init_under_mpirun_sets_torchruns_variables_and_keeps_the_users(real_mpirun):
    places = sorted(line.split(" ", 3)[1:] for line in real_mpirun.stdout.splitlines() if line.startswith("torchrun"))
    assert [(rank, local_rank, json.loads(variables)) for rank, local_rank, variables in places] == [
        (str(rank), str(rank), {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "7"})
        for rank in range(2)]
    assert real_mpirun.stderr.count("LOCAL_WORLD_SIZE='7' but mpidist's world says 2") == 2, real_mpirun.stderr
