#!/bin/sh
# The launch agent of the virtual cluster of tests/cluster/cluster.sh: ssh's place,
# without ssh. Open MPI's PRRTE and MPICH's Hydra call it as they would call ssh,
#
#     agent.sh [ssh options] HOST COMMAND...
#
# where HOST is a node's address (or name) from the cluster's hostfile and COMMAND is a
# shell command line (PRRTE's `prted ...`, Hydra's `hydra_pmi_proxy ...`). The agent
# enters that node's network namespace (nsenter, not `ip netns exec`, which also
# remounts /sys) and a new UTS namespace carrying the node's host name, then runs
# COMMAND with /bin/sh as sshd would.
#
# The node table is $MPIDL_CLUSTER_DIR/nodes (lines "NAME NETNS ADDRESS VETH"), written
# by `cluster.sh up`; cluster.sh mpiexec exports MPIDL_CLUSTER_DIR to mpiexec, whose
# children (this agent, and prted where it spawns further) inherit it.
set -eu

dir=${MPIDL_CLUSTER_DIR:-${TMPDIR:-/tmp}/mpidl-cluster}
# ssh's options, if the launcher passes any (PRRTE's plm_ssh_args, Hydra's -x): skipped,
# with their values.
while [ $# -gt 0 ]; do
    case $1 in
        -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
if [ $# -lt 2 ]; then
    echo "agent.sh: usage: agent.sh HOST COMMAND..." >&2
    exit 255
fi
host=$1
shift
line=$(awk -v h="$host" '$1 == h || $3 == h { print; exit }' "$dir/nodes" 2>/dev/null || true)
if [ -z "$line" ]; then
    echo "agent.sh: $host is not a node of the cluster in $dir (is it up?)" >&2
    exit 255
fi
set -- "$*"   # ssh joins the remote command's words with spaces, as we do
name=$(echo "$line" | awk '{print $1}')
netns=$(echo "$line" | awk '{print $2}')
# Each node gets a temporary folder of its own (TMPDIR, for its daemon and ranks), as a
# real node has its own /tmp: what a killed job leaves there (PRRTE's session folders)
# goes with `cluster.sh down`.
tmp=$dir/tmp/$name
mkdir -p "$tmp"
exec nsenter --net="/var/run/netns/$netns" \
    unshare --uts /usr/bin/env TMPDIR="$tmp" \
    /bin/sh -c 'hostname "$0" && eval "$1"' "$name" "$1"
