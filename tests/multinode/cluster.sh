#!/usr/bin/env bash
# Emulated nodes on this machine, joined by a shaped network, for running mpidist across nodes
# (`make test-multinode`, benchmarks/multinode.py, docs/multinode.md).
#
#   tests/multinode/cluster.sh up               create the nodes and the network
#   tests/multinode/cluster.sh down             remove everything `up` created
#   tests/multinode/cluster.sh exec NODE CMD... run CMD inside node NODE (1..N) with the cluster's environment
#   tests/multinode/cluster.sh run CMD...       up, CMD inside node 1, down (also when CMD fails
#                                               or the script is interrupted); CMD's exit status
#   tests/multinode/cluster.sh env              print the environment that points mpirun at the nodes
#
# A node is a network namespace (its own interface and address), a UTS namespace (its own
# hostname) and a mount namespace (its own /dev/shm, so that no shared-memory segment is seen by
# two nodes, its own /var/tmp for node-local scratch such as Slurm's TmpFS, and its own
# /etc/hosts naming every node), held by one sleeping process. Each node's veth pair joins a
# bridge, which has the address .254 on the nodes' subnet (this machine as the nodes see it:
# Slurm's controller and client commands run there); `tc` shapes every node's outgoing traffic
# to MPIDIST_MN_RATE, plus MPIDIST_MN_DELAY of one-way latency where the kernel has the netem queueing discipline (without
# it the delay is not applied, and `up` says so). Open MPI starts its daemons on the nodes through
# node-agent.sh (its ssh launcher's agent), which enters the node's namespaces; ranks of one node
# talk through shared memory, ranks of different nodes through TCP over the veth interfaces only.
#
# Needs root (namespaces, veth, bridge, tc) and iproute2, util-linux (unshare, nsenter).
#
# Environment:
#   MPIDIST_MN_NODES    number of nodes                               [2]
#   MPIDIST_MN_SLOTS    ranks per node in the hostfile                [2]
#   MPIDIST_MN_RATE     rate of every node's link (tc units)          [10gbit]
#   MPIDIST_MN_DELAY    one-way delay of every node's link (netem)    [25us]
#   MPIDIST_MN_SUBNET   the first three octets of the nodes' addresses [10.231.7]
#   MPIDIST_MN_DIR      state: hostfile, hosts, pid files             [/tmp/mpidist-multinode]
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NODES=${MPIDIST_MN_NODES:-2}
SLOTS=${MPIDIST_MN_SLOTS:-2}
RATE=${MPIDIST_MN_RATE:-10gbit}
DELAY=${MPIDIST_MN_DELAY:-25us}
SUBNET=${MPIDIST_MN_SUBNET:-10.231.7}
STATE_DIR=${MPIDIST_MN_DIR:-/tmp/mpidist-multinode}
BRIDGE=mpidist-br
PREFIX=mpidist-node   # hostnames mpidist-node1..N; network namespaces and veths derive from it

die() { echo "multinode: $*" >&2; exit 1; }
log() { echo "multinode: $*" >&2; }

check_requirements() {
    [[ $(id -u) -eq 0 ]] || die "needs root: network namespaces, veth pairs, a bridge and tc need CAP_NET_ADMIN and CAP_SYS_ADMIN (run it as root, e.g. sudo make test-multinode)"
    local cmd missing=()
    for cmd in ip tc unshare nsenter; do
        command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
    done
    ((${#missing[@]} == 0)) || die "missing ${missing[*]} (Debian: apt-get install -y iproute2 util-linux)"
    [[ $NODES =~ ^[0-9]+$ ]] && ((NODES >= 1 && NODES <= 16)) || die "MPIDIST_MN_NODES=$NODES: give 1 to 16 nodes"
    [[ $SLOTS =~ ^[0-9]+$ ]] && ((SLOTS >= 1)) || die "MPIDIST_MN_SLOTS=$SLOTS: give a positive number of ranks per node"
}

netns() { echo "mpidist-mn$1"; }
address() { echo "$SUBNET.$1"; }
holder_pid() { cat "$STATE_DIR/node$1.pid"; }

# Each node's link: tbf limits the rate (its burst must hold a whole segmentation-offloaded
# packet, 64 KiB); netem adds the delay where the kernel has it.
shape() {
    local ns=$1 dev=$2
    if tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$DELAY" 2>/dev/null; then
        tc -n "$ns" qdisc add dev "$dev" parent 1: handle 2: tbf rate "$RATE" burst 256kb latency 10ms
        echo "rate $RATE, one-way delay $DELAY (netem)"
    else
        tc -n "$ns" qdisc add dev "$dev" root handle 1: tbf rate "$RATE" burst 256kb latency 10ms
        echo "rate $RATE; delay not applied: this kernel has no netem queueing discipline"
    fi
}

# That no emulated nodes are up: checked before anything is created, or set to be removed.
check_free() {
    [[ ! -e $STATE_DIR/up ]] || die "already up ($STATE_DIR/up exists); run: $0 down"
    # One set of nodes at a time: another one's bridge (of another MPIDIST_MN_DIR, or left by a
    # killed run) is not ours to take over or remove.
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        die "the bridge $BRIDGE exists: emulated nodes are up already (slurm/local-cluster.sh's, or another MPIDIST_MN_DIR's); take them down first (ip link del $BRIDGE; ip netns del mpidist-mn<i>, if nothing runs them)"
    fi
}

cmd_up() {
    check_requirements
    check_free
    mkdir -p "$STATE_DIR"
    : >"$STATE_DIR/created"   # what to remove, one "kind name" a line, written before creating it
    local i hosts=$STATE_DIR/hosts link=""
    printf '127.0.0.1 localhost\n' >"$hosts"
    : >"$STATE_DIR/hostfile"
    for ((i = 1; i <= NODES; i++)); do
        printf '%s %s\n' "$(address "$i")" "$PREFIX$i" >>"$hosts"
        printf '%s slots=%s\n' "$PREFIX$i" "$SLOTS" >>"$STATE_DIR/hostfile"
    done
    echo "link $BRIDGE" >>"$STATE_DIR/created"
    ip link add "$BRIDGE" type bridge
    ip addr add "$(address 254)/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for ((i = 1; i <= NODES; i++)); do
        local ns
        ns=$(netns "$i")
        echo "netns $ns" >>"$STATE_DIR/created"
        ip netns add "$ns"
        echo "link $ns-h" >>"$STATE_DIR/created"
        ip link add "$ns-h" type veth peer name eth0 netns "$ns"
        ip link set "$ns-h" master "$BRIDGE" up
        ip -n "$ns" addr add "$(address "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        # This machine's own addresses through the bridge (Slurm's srun listens on them).
        ip -n "$ns" route add default via "$(address 254)"
        link=$(shape "$ns" eth0)
        # The node's holder: its hostname, /dev/shm and /etc/hosts, until `down` ends it.
        echo "holder $STATE_DIR/node$i.pid" >>"$STATE_DIR/created"
        # nsenter rather than `ip netns exec`, which would mount a sysfs of the node's own over
        # /sys and so hide the cgroup file system that slurmd needs.
        nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private sh -c '
            hostname "$1" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm &&
            mount -t tmpfs -o mode=1777 tmpfs /var/tmp && mount --bind "$2" /etc/hosts &&
            echo $$ >"$3" && exec sleep infinity' holder "$PREFIX$i" "$hosts" "$STATE_DIR/node$i.pid" \
            </dev/null >/dev/null 2>&1 &
        disown
    done
    for ((i = 1; i <= NODES; i++)); do
        local waited=0
        until [[ -s $STATE_DIR/node$i.pid ]] && [[ $(nsenter -t "$(holder_pid "$i")" --uts hostname 2>/dev/null) == "$PREFIX$i" ]]; do
            ((waited++ < 100)) || die "node $i did not start"
            sleep 0.1
        done
    done
    echo "$link" >"$STATE_DIR/link"
    touch "$STATE_DIR/up"
    log "up: $NODES nodes (${PREFIX}1..$NODES at $(address 1)..$(address "$NODES")), $SLOTS slots each; link: $link"
}

cmd_down() {
    [[ -f $STATE_DIR/created ]] || { rm -rf "$STATE_DIR"; return 0; }
    local kind name pid
    # Newest first: the holders, then the veths and namespaces, then the bridge.
    while read -r kind name; do
        case $kind in
            holder)
                pid=$(cat "$name" 2>/dev/null || true)
                # Only our sleeping holder in a hostname namespace of its own: a stale pid file must
                # not end whatever reused the pid, nor everything in this namespace.
                if [[ -n $pid && $(cat "/proc/$pid/comm" 2>/dev/null) == sleep &&
                      $(readlink "/proc/$pid/ns/uts") != "$(readlink /proc/self/ns/uts)" ]]; then
                    # Whatever still runs inside the node (a rank left by a failed test) goes too.
                    pkill -KILL --ns "$pid" --nslist uts 2>/dev/null || true
                    kill "$pid" 2>/dev/null || true
                fi ;;
            link) ip link del "$name" 2>/dev/null || true ;;
            netns) ip netns del "$name" 2>/dev/null || true ;;
        esac
    done < <(tac "$STATE_DIR/created")
    rm -rf "$STATE_DIR"
    log "down"
}

cluster_env() {
    # Open MPI's runtime (PRRTE) reads PRTE_MCA_*, the MPI library OMPI_MCA_*: every mpirun started
    # with this environment places its ranks on the nodes of the hostfile and starts its daemons
    # there through node-agent.sh; TCP only over the nodes' subnet (not the loopback, not the host's).
    cat <<ENV
export MPIDIST_MN_DIR=$STATE_DIR
export PRTE_MCA_prte_default_hostfile=$STATE_DIR/hostfile
export PRTE_MCA_plm_ssh_agent=$HERE/node-agent.sh
export PRTE_MCA_oob_tcp_if_include=$SUBNET.0/24
export OMPI_MCA_btl_tcp_if_include=$SUBNET.0/24
export OMPI_MCA_btl=self,sm,tcp
export MPIDIST_MN_NODES=$NODES
export MPIDIST_MN_SLOTS=$SLOTS
export MPIDIST_MN_HOST_ADDR=$(address 254)
export MPIDIST_MN_NODE_NAMES=$PREFIX[1-$NODES]
export MPIDIST_MN_NODE_ADDRS=$(seq -s, -f "$SUBNET.%g" 1 "$NODES")
ENV
    # The nodes share this machine's cores, but each node sees all of them and only its own
    # ranks. Left alone, (1) each node's MPI does not know that the ranks oversubscribe the cores,
    # and a rank that busy-polls holds a core another rank needs until the scheduler's time slice
    # ends (10 ms per 4 KiB all-reduce on 2 x 2 over 2 cores, instead of 0.15 ms); (2) mpidist's
    # kernels take cores / ranks-on-the-node threads each, as on a real node, so the threads of
    # every node together outnumber the cores, and their waits stall the transfers (on 2 x 1, a
    # 256 KiB ring all-reduce took 9.4 ms with 2 threads per rank, 0.2 ms with 1).
    local ranks=$((NODES * SLOTS)) cores
    cores=$(nproc)
    if ((ranks > cores)); then
        echo "export OMPI_MCA_mpi_yield_when_idle=1"
    fi
    echo "export OMP_NUM_THREADS=\${OMP_NUM_THREADS:-$((cores > ranks ? cores / ranks : 1))}"
}

cmd_exec() {
    local node=$1
    shift
    [[ -e $STATE_DIR/up ]] || die "not up; run: $0 up"
    [[ -f $STATE_DIR/node$node.pid ]] || die "no node $node"
    eval "$(cluster_env)"
    exec nsenter -t "$(holder_pid "$node")" --net --uts --mount --wd="$PWD" -- "$@"
}

cmd_run() {
    (($#)) || die "run: give a command"
    check_requirements
    check_free   # before the trap: a failure here must not take down nodes that are not ours
    trap 'cmd_down' EXIT
    trap 'exit 130' INT TERM
    cmd_up
    # In the background, so that a signal interrupts `wait` and the trap ends the command at
    # once (`down` ends every process left in the nodes).
    local status=0
    cmd_exec 1 "$@" &
    wait $! || status=$?
    return "$status"
}

case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    exec) shift; (($# >= 2)) || die "usage: $0 exec NODE CMD..."; cmd_exec "$@" ;;
    run) shift; cmd_run "$@" ;;
    env) cluster_env ;;
    *) echo "usage: $0 up|down|exec NODE CMD...|run CMD...|env" >&2; exit 2 ;;
esac
