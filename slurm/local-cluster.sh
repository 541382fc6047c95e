#!/usr/bin/env bash
# A real SLURM cluster on this machine, for testing the sbatch scripts: one node (this machine),
# or with MPIDIST_SLURM_NODES=N, N nodes emulated by tests/multinode/cluster.sh (each a network,
# hostname and mount namespace on a shaped link, docs/multinode.md) with a slurmd in each.
#
#   slurm/local-cluster.sh up       start munged, slurmctld and slurmd(s); wait until the nodes are idle
#   slurm/local-cluster.sh down     stop the daemons and remove all state
#   slurm/local-cluster.sh status   sinfo + squeue
#   slurm/local-cluster.sh env      print the `export SLURM_CONF=...` line for your shell
#
# Needs Debian's packages: apt-get install -y slurm-wlm munge libpmix-dev
# (libpmix-dev, not just libpmix2, for `srun --mpi=pmix`: see pmix_usable below).
# This script installs nothing: it says what is missing.
# It runs as root (SlurmUser=root), like the containers it is meant for.
#
# Nothing outside the state directory is touched: munged runs with its own key and socket, the
# daemons read a slurm.conf generated there, and the client commands find it via SLURM_CONF,
# which `up` prints and jobs inherit from sbatch.
#
# With several nodes slurmctld and the client commands run on this machine, which the nodes
# reach at the bridge's address; each slurmd runs inside its node (its own pid file, spool and
# log, %n in slurm.conf) with the node's private /var/tmp as TmpFS, where the pmix plugin keeps
# per-step files that would otherwise clash between nodes sharing this machine's /tmp.
#
# Environment:
#   MPIDIST_SLURM_NODES      nodes: 1 is this machine itself, more are emulated (needs root) [1]
#   MPIDIST_SLURM_DIR        state, config and logs            [/tmp/mpidist-slurm]
#   MPIDIST_SLURM_MIN_CPUS   CPUs each node advertises, at least [4]
#   MPIDIST_SLURM_PORT       slurmctld port; slurmd uses +1     [6817]
#   MPIDIST_SLURM_TIMEOUT    seconds `up` waits for the node    [60]
set -euo pipefail

STATE_DIR=${MPIDIST_SLURM_DIR:-/tmp/mpidist-slurm}
MIN_CPUS=${MPIDIST_SLURM_MIN_CPUS:-4}
CTLD_PORT=${MPIDIST_SLURM_PORT:-6817}
SLURMD_PORT=$((CTLD_PORT + 1))
UP_TIMEOUT=${MPIDIST_SLURM_TIMEOUT:-60}
# The node count of a running cluster is the one it was started with.
NODES=$(cat "$STATE_DIR/node-count" 2>/dev/null || echo "${MPIDIST_SLURM_NODES:-1}")
EMULATED=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tests/multinode/cluster.sh
# The emulated nodes' state lives inside ours, so that `down` finds and removes both.
export MPIDIST_MN_DIR=$STATE_DIR/nodes MPIDIST_MN_NODES=$NODES

CONF=$STATE_DIR/etc/slurm.conf
MUNGE_DIR=$STATE_DIR/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
LOG_DIR=$STATE_DIR/log
export SLURM_CONF=$CONF

die() { echo "local-cluster: $*" >&2; exit 1; }
log() { echo "local-cluster: $*" >&2; }

check_requirements() {
    local missing=()
    local cmd
    for cmd in munged slurmctld slurmd sinfo squeue srun sbatch scontrol; do
        command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
    done
    if ((${#missing[@]})); then
        die "missing ${missing[*]}; install them with: apt-get install -y slurm-wlm munge libpmix-dev"
    fi
    [[ $(id -u) -eq 0 ]] || die "run as root: the local cluster uses SlurmUser=root"
    [[ $NODES =~ ^[0-9]+$ ]] && ((NODES >= 1)) || die "MPIDIST_SLURM_NODES=$NODES: give a positive number of nodes"
}

# Whether the daemon of pid file DIR/NAME.pid or DIR/NAME-NODE.pid runs: the process lives and
# is named NAME (a stale pid file must not make us skip a start, or kill whatever reused the pid).
pid_alive() {
    local pid name
    name=$(basename "$1" .pid)
    [[ -f $1 ]] && pid=$(cat "$1") && [[ -n $pid ]] &&
        [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "${name%%-*}" ]]
}

start_munge() {
    mkdir -p "$MUNGE_DIR"
    chmod 0755 "$MUNGE_DIR"   # munged wants its socket directory searchable by all
    if [[ ! -f $MUNGE_DIR/munge.key ]]; then
        dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1 count=1024 status=none
        chmod 0400 "$MUNGE_DIR/munge.key"
    fi
    pid_alive "$MUNGE_DIR/munged.pid" && return
    # --force: munged refuses sockets below world-writable directories such as /tmp otherwise.
    munged --force \
        --key-file="$MUNGE_DIR/munge.key" \
        --socket="$MUNGE_SOCKET" \
        --pid-file="$MUNGE_DIR/munged.pid" \
        --seed-file="$MUNGE_DIR/munged.seed" \
        --log-file="$LOG_DIR/munged.log"
}

# Whether `srun --mpi=pmix` can work. `srun --mpi=list` names pmix whenever the plugin file
# exists, but the plugin dlopen()s the *unversioned* libpmix.so from the directory Slurm was
# built against, and Debian ships that name only in libpmix-dev (libpmix2 alone has
# libpmix.so.2): without it every pmix step fails with "can not load PMIx library".
pmix_usable() {
    local plugin dir
    for plugin in /usr/lib/*/slurm-wlm/mpi_pmix.so /usr/lib64/slurm/mpi_pmix.so /usr/lib/slurm/mpi_pmix.so; do
        [[ -e $plugin ]] || continue
        dir=$(grep -ao '/[^[:space:][:cntrl:]]*pmix[^[:space:][:cntrl:]]*/lib' "$plugin" | head -n1)
        if [[ -z $dir || -e $dir/libpmix.so ]]; then
            return 0
        fi
        log "warning: $plugin needs $dir/libpmix.so (Debian: apt-get install -y libpmix-dev);" \
            "MpiDefault=none and srun --mpi=pmix will fail"
        return 1
    done
    log "warning: no Slurm pmix plugin found; MpiDefault=none and srun --mpi=pmix will fail"
    return 1
}

write_config() {
    # The node as slurmd sees it: "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 ..."
    local hw node cpus sockets cores threads memory
    hw=$(slurmd -C | head -n1)
    field() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p" <<<"$hw"; }
    node=$(field NodeName)
    cpus=$(field CPUs)
    sockets=$(field SocketsPerBoard)
    cores=$(field CoresPerSocket)
    threads=$(field ThreadsPerCore)
    memory=$(field RealMemory)

    # The tests run up to 4 tasks on a 2-core machine. Slurm never places more tasks than
    # CPUs in one job (unless the job asks --overcommit), and OverSubscribe only lets *jobs*
    # share CPUs. So the node advertises at least MIN_CPUS, as extra cores per socket, and
    # SlurmdParameters=config_overrides makes slurmd trust this rather than drain the node
    # for having fewer cores than configured. With TaskPlugin=task/none nothing is pinned,
    # so the extra "cores" are simply time-shared by the kernel.
    if ((cpus < MIN_CPUS)); then
        cores=$(( (MIN_CPUS + sockets * threads - 1) / (sockets * threads) ))
        cpus=$((sockets * cores * threads))
    fi

    local mpi_default=none
    if pmix_usable; then
        mpi_default=pmix
    fi

    # One node: this machine, reached at 127.0.0.1. Several: the emulated nodes, each slurmd with
    # files of its own (%n: its node name), and slurmctld at the bridge's address.
    local ctld_addr=127.0.0.1 nodes=$node node_addr=127.0.0.1 tmp_fs=/tmp suffix=""
    if ((NODES > 1)); then
        eval "$("$EMULATED" env | grep -E '^export (MPIDIST_MN_HOST_ADDR|MPIDIST_MN_NODE_NAMES|MPIDIST_MN_NODE_ADDRS)=')"
        ctld_addr=$MPIDIST_MN_HOST_ADDR
        nodes=$MPIDIST_MN_NODE_NAMES
        node_addr=$MPIDIST_MN_NODE_ADDRS
        tmp_fs=/var/tmp
        suffix=-%n
    fi

    mkdir -p "$STATE_DIR/etc" "$STATE_DIR/ctld" "$STATE_DIR/slurmd" "$LOG_DIR"
    cat >"$CONF" <<CONF
# Generated by slurm/local-cluster.sh from \`slurmd -C\`: $hw
ClusterName=mpidist
SlurmctldHost=$node($ctld_addr)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root

AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET

StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/slurmd$suffix
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd$suffix.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd$suffix.log
TmpFS=$tmp_fs
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true

# Containers rarely give us a writable cgroup hierarchy: track processes through /proc,
# bind nothing, gather no accounting.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none

SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=$mpi_default

# Finished jobs stay visible to \`scontrol show job\` (exit codes) for 10 minutes: no slurmdbd.
MinJobAge=600
ReturnToService=2
InactiveLimit=0
KillWait=5
Waittime=0
SlurmdTimeout=60
SlurmctldTimeout=60

NodeName=$nodes NodeAddr=$node_addr CPUs=$cpus Sockets=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
    echo "$nodes" >"$STATE_DIR/nodename"
}

# The state of the nodes, when they all share one (else "mixed states").
node_state() {
    sinfo --noheader --nodes="$(cat "$STATE_DIR/nodename")" -o '%T' 2>/dev/null | sort -u |
        awk '{ states[NR] = $0 } END { print (NR == 1 ? states[1] : "mixed states") }'
}

# The pid files of the slurmd(s): one, or one per emulated node.
slurmd_pidfiles() {
    local i
    if ((NODES > 1)); then
        for ((i = 1; i <= NODES; i++)); do echo "$STATE_DIR/slurmd-mpidist-node$i.pid"; done
    else
        echo "$STATE_DIR/slurmd.pid"
    fi
}

start_slurmds() {
    local i
    if ((NODES == 1)); then
        pid_alive "$STATE_DIR/slurmd.pid" || slurmd -f "$CONF" -N "$(cat "$STATE_DIR/nodename")"
        return
    fi
    for ((i = 1; i <= NODES; i++)); do
        pid_alive "$STATE_DIR/slurmd-mpidist-node$i.pid" && continue
        mkdir -p "$STATE_DIR/slurmd-mpidist-node$i"
        "$EMULATED" exec "$i" slurmd -f "$CONF" -N "mpidist-node$i" ||
            die "the slurmd of mpidist-node$i did not start; see $LOG_DIR/slurmd-mpidist-node$i.log"
    done
}

daemons_alive() {
    local pidfile
    pid_alive "$STATE_DIR/slurmctld.pid" || return 1
    while read -r pidfile; do pid_alive "$pidfile" || return 1; done < <(slurmd_pidfiles)
}

wait_idle() {
    local start=$SECONDS deadline=$((SECONDS + UP_TIMEOUT)) state='' daemon
    while ((SECONDS < deadline)); do
        # A daemon that dies at start (port in use, bad config) will not come back: stop early.
        # The grace period covers the time before a daemonized slurmd writes its pid file.
        if ((SECONDS - start >= 3)) && ! daemons_alive; then
            log "slurmctld or a slurmd is not running"
            deadline=0
        fi
        state=$(node_state || true)
        case $state in
            idle|mixed|allocated|completing) return 0 ;;
            drain*|down*)  # ReturnToService=2 revives a node that registers, but not one drained
                scontrol update nodename="$(cat "$STATE_DIR/nodename")" state=resume >/dev/null 2>&1 || true ;;
        esac
        sleep 1
    done
    ((deadline == 0)) || log "node did not become idle within ${UP_TIMEOUT}s (last state: '${state:-unknown}')"
    sinfo -R 2>&1 | sed 's/^/  /' >&2 || true
    local f
    for f in "$LOG_DIR"/*.log; do
        [[ -f $f ]] && { echo "--- tail $f" >&2; tail -n 25 "$f" >&2; }
    done
    return 1
}

cmd_up() {
    check_requirements
    mkdir -p "$LOG_DIR"
    start_munge
    echo "$NODES" >"$STATE_DIR/node-count"
    if ((NODES > 1)) && [[ ! -e $MPIDIST_MN_DIR/up ]]; then
        "$EMULATED" up
    fi
    if ! daemons_alive; then
        write_config
        pid_alive "$STATE_DIR/slurmctld.pid" || slurmctld -f "$CONF"
        start_slurmds
    fi
    wait_idle || die "cluster did not come up; logs are in $LOG_DIR"
    # An idle node proves registration, not that steps launch (munge credentials, slurmstepd).
    if ! timeout 30 srun --quiet --mpi=none -N "$NODES" true; then
        tail -n 25 "$LOG_DIR/slurmd.log" >&2 || true
        die "the node is idle but a one-task srun failed; logs are in $LOG_DIR"
    fi
    log "up: partition debug on $(cat "$STATE_DIR/nodename"); in your shell: export SLURM_CONF=$CONF"
}

# SIGTERM to every daemon at once (munged alone takes 2 s to exit), SIGKILL after 10 s.
stop_daemons() {
    local pidfile pids=() _
    for pidfile in "$@"; do
        pid_alive "$pidfile" && pids+=("$(cat "$pidfile")")
    done
    ((${#pids[@]})) || return 0
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "${pids[@]}" 2>/dev/null || return 0   # true while any of them lives
        sleep 0.1
    done
    kill -9 "${pids[@]}" 2>/dev/null || true
}

cmd_down() {
    [[ -d $STATE_DIR ]] || { log "nothing to stop ($STATE_DIR does not exist)"; return; }
    if [[ -f $CONF ]] && pid_alive "$STATE_DIR/slurmctld.pid"; then
        scancel --full --quiet --partition=debug 2>/dev/null || true
    fi
    mapfile -t slurmds < <(slurmd_pidfiles)
    stop_daemons "${slurmds[@]}" "$STATE_DIR/slurmctld.pid" "$MUNGE_DIR/munged.pid"
    if [[ -d $MPIDIST_MN_DIR ]]; then
        "$EMULATED" down
    fi
    rm -rf "$STATE_DIR"
    log "down"
}

cmd_status() {
    [[ -f $CONF ]] || die "not up ($CONF does not exist)"
    echo "SLURM_CONF=$CONF"
    sinfo
    squeue
}

case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
