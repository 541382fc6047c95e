#!/usr/bin/env bash
# Open MPI's "ssh" to an emulated node (tests/multinode/cluster.sh sets it as PRRTE's
# plm_ssh_agent): `node-agent.sh [options] HOST COMMAND...` runs COMMAND, as ssh would, in a shell
# inside HOST's network, hostname and mount namespaces. The environment is passed on as it is
# (Open MPI's settings, PATH), as it would be on nodes sharing one installation.
set -euo pipefail
while [[ ${1:-} == -* ]]; do shift; done   # ssh's options, such as -x
host=${1:?node-agent.sh: no host given}
shift
state=${MPIDIST_MN_DIR:-/tmp/mpidist-multinode}
node=${host##*-node}
node=${node%%.*}
[[ $node =~ ^[0-9]+$ && -f $state/node$node.pid ]] || { echo "node-agent.sh: no emulated node named $host in $state" >&2; exit 255; }
exec nsenter -t "$(cat "$state/node$node.pid")" --net --uts --mount -- /bin/sh -c "$*"
