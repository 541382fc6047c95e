#!/usr/bin/env bash
# Submits slurm/*.sbatch to a real local SLURM cluster and checks each job (`make test-slurm`).
#
#   slurm/test-scripts.sh                       every slurm/*.sbatch
#   slurm/test-scripts.sh slurm/info.sbatch     only these
#
# Each script says at its top how it is tested, in comment lines:
#   # mpidist-test: VAR=value ... --sbatch-option ...    one submission per line; words with
#                                                       a leading "-" go to sbatch, those with a
#                                                       leading "+" to this script (below), the
#                                                       others into the job's environment. No
#                                                       line: one submission with the script's
#                                                       defaults.
#   # mpidist-test-expects: $RESULTS_DIR/file           a file each submission must produce
#   +signal=SIG@SECONDS        send SIG to the job's batch shell SECONDS after the job starts
#                              running, once (scancel --batch: what `#SBATCH --signal=B:SIG`
#                              does before the time limit). The job may requeue itself; SLURM
#                              holds a requeued job for 2 minutes, which this script cuts to 10 s
#                              (scontrol update StartTime=now)
#   +signal=SIG@epochN         the same, once $RESULTS_DIR/train.log has the line of epoch N: in
#                              the middle of the training however fast the machine trains
#   +expects=$RESULTS_DIR/file a file this submission must also produce
# A submission passes when its job ends COMPLETED with exit code 0:0 and every expected file
# exists and is not empty; the log of any other job is printed. The cluster, of
# MPIDIST_SLURM_NODES nodes emulated on this machine so that submissions with -N 2 run across
# nodes (tests/multinode/cluster.sh), is brought up first (slurm/local-cluster.sh) and down at
# exit; the exit status is non-zero on any failure.
#
# Environment:
#   MPIDIST_SLURM_NODES         nodes of the cluster (1: this machine alone)  [2]
#   MPIDIST_TEST_TIMEOUT        seconds to wait for all jobs together       [600]
#   MPIDIST_TEST_KEEP_CLUSTER   1: leave the cluster up at exit             [0]
#   MPIDIST_MPIRUN_ARGS         for MPIDIST_LAUNCHER=mpirun jobs            [--bind-to none]
#       (the local node advertises more CPUs than it has cores, so mpirun's default binding
#       to cores would refuse to place the tasks Slurm gave it)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
TIMEOUT=${MPIDIST_TEST_TIMEOUT:-600}
export MPIDIST_MPIRUN_ARGS=${MPIDIST_MPIRUN_ARGS---bind-to none}
export MPIDIST_SLURM_NODES=${MPIDIST_SLURM_NODES:-2}

if (($#)); then
    scripts=("$@")
else
    scripts=(slurm/*.sbatch)
fi
for script in "${scripts[@]}"; do
    [[ -f $script ]] || { echo "test-scripts: no such script: $script" >&2; exit 2; }
done

started=$SECONDS
cleanup() {
    if [[ ${MPIDIST_TEST_KEEP_CLUSTER:-0} != 1 ]]; then
        slurm/local-cluster.sh down || true
    fi
}
trap cleanup EXIT
slurm/local-cluster.sh up
eval "$(slurm/local-cluster.sh env)"

RUN_DIR=$ROOT/runs/test-slurm-$(date +%Y%m%d-%H%M%S)
mkdir -p "$RUN_DIR" runs   # runs/: the scripts' --output directory

# One entry per submission: job id, label, results directory, script, its own expected files.
jobs=() labels=() results=() job_scripts=() own_expects=()
declare -A signal_name signal_after running_since signalled pending_since result_of
REQUEUE_RELEASE_S=10
for script in "${scripts[@]}"; do
    name=$(basename "$script" .sbatch)
    mapfile -t variants < <(sed -n 's/^# *mpidist-test: *//p' "$script")
    ((${#variants[@]})) || variants=("")
    n=0
    for variant in "${variants[@]}"; do
        n=$((n + 1))
        env_words=() sbatch_words=() test_words=()
        for word in $variant; do
            case $word in
                -*) sbatch_words+=("$word") ;;
                +*) test_words+=("${word#+}") ;;
                *) env_words+=("$word") ;;
            esac
        done
        result_dir=$RUN_DIR/$name-$n
        # The settings go through sbatch's own environment (--export=ALL), not --export=VAR=...,
        # whose commas would split values such as MPIDIST_BENCH_SIZES=1K,64K.
        job=$(env "${env_words[@]}" RESULTS_DIR="$result_dir" \
              sbatch --parsable --export=ALL "${sbatch_words[@]}" "$script")
        job=${job%%;*}
        jobs+=("$job") labels+=("$name #$n${variant:+ ($variant)}") results+=("$result_dir") job_scripts+=("$script")
        result_of[$job]=$result_dir
        expects=""
        for word in "${test_words[@]}"; do
            case $word in
                signal=*@*) word=${word#signal=}; signal_name[$job]=${word%@*} signal_after[$job]=${word#*@} ;;
                expects=*) expects+="${word#expects=}"$'\n' ;;
                *) echo "test-scripts: $script: unknown test word +$word" >&2; exit 2 ;;
            esac
        done
        own_expects+=("$expects")
        echo "test-scripts: submitted $script as job $job${variant:+ with: $variant}"
    done
done

job_field() { sed -n "s/.*\b$2=\([^ ]*\).*/\1/p" <<<"$1"; }

signal_due() {  # job: whether its +signal is due now (it is RUNNING)
    local job=$1 after=${signal_after[$1]}
    if [[ $after =~ ^epoch([0-9]+)$ ]]; then
        grep -q "^epoch ${BASH_REMATCH[1]}/" "${result_of[$job]}/train.log" 2>/dev/null
    else
        ((SECONDS - running_since[$job] >= after))
    fi
}
terminal='^(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|PREEMPTED|BOOT_FAIL|DEADLINE)$'

declare -A state
deadline=$((SECONDS + TIMEOUT))
while :; do
    pending=0
    for job in "${jobs[@]}"; do
        [[ ${state[$job]:-} =~ $terminal ]] && continue
        state[$job]=$(job_field "$(scontrol -o show job "$job" 2>/dev/null)" JobState)
        [[ ${state[$job]} =~ $terminal ]] || pending=$((pending + 1))
        if [[ -n ${signal_name[$job]:-} && ${state[$job]} == RUNNING ]]; then
            running_since[$job]=${running_since[$job]:-$SECONDS}
            if signal_due "$job"; then
                echo "test-scripts: job $job: sending SIG${signal_name[$job]} to its batch shell"
                scancel --batch --signal="${signal_name[$job]}" "$job" || true
                unset "signal_name[$job]"
                signalled[$job]=1
            fi
        fi
        # Released once it has been pending a while: a requeued job started at once finds its
        # first run still being cleaned up on the node, and fails ("Job credential revoked").
        if [[ -n ${signalled[$job]:-} && ${state[$job]} == PENDING ]]; then
            pending_since[$job]=${pending_since[$job]:-$SECONDS}
            if ((SECONDS - pending_since[$job] >= REQUEUE_RELEASE_S)); then
                scontrol update JobId="$job" StartTime=now || true
                unset "signalled[$job]"
            fi
        fi
    done
    ((pending)) || break
    if ((SECONDS >= deadline)); then
        echo "test-scripts: $pending job(s) still running after ${TIMEOUT}s; cancelling them" >&2
        for job in "${jobs[@]}"; do
            [[ ${state[$job]} =~ $terminal ]] || { scancel "$job" || true; state[$job]="TIMED OUT (test)"; }
        done
        break
    fi
    sleep 0.5
done

failures=0
summary=()
for i in "${!jobs[@]}"; do
    job=${jobs[$i]}
    record=$(scontrol -o show job "$job" 2>/dev/null || true)
    exit_code=$(job_field "$record" ExitCode)
    log=$(job_field "$record" StdOut)
    problems=()
    [[ ${state[$job]} == COMPLETED ]] || problems+=("state ${state[$job]}")
    [[ $exit_code == 0:0 ]] || problems+=("exit code ${exit_code:-unknown}")
    while read -r expected; do
        [[ -n $expected ]] || continue
        file=${expected//\$\{RESULTS_DIR\}/${results[$i]}}
        file=${file//\$RESULTS_DIR/${results[$i]}}
        [[ -s $file ]] || problems+=("no $file")
    done < <(sed -n 's/^# *mpidist-test-expects: *//p' "${job_scripts[$i]}"; printf '%s' "${own_expects[$i]}")
    if ((${#problems[@]})); then
        failures=$((failures + 1))
        summary+=("FAIL  job $job  ${labels[$i]}: $(IFS=';'; echo "${problems[*]}")")
        echo "---------- log of job $job, ${labels[$i]}: ${log:-unknown}" >&2
        if [[ -n $log && -f $log ]]; then tail -n 200 "$log" >&2; else echo "(no log file)" >&2; fi
        echo "---------- end of log of job $job" >&2
    else
        summary+=("ok    job $job  ${labels[$i]}  (${results[$i]})")
    fi
done

echo "test-scripts: ${#jobs[@]} job(s), $failures failed, $((SECONDS - started))s:"
printf '  %s\n' "${summary[@]}"
((failures == 0))
