#!/usr/bin/env bash
# Start a private single-node Slurm cluster (munged, slurmctld, slurmd) for the tests.
#
#   tests/slurm/install.sh                 # once: the Debian packages (root)
#   tests/slurm/cluster.sh                 # idempotent: starts what is not running
#   export SLURM_CONF=/tmp/mpidl-slurm-ci/slurm.conf   # or: source $DIR/env.sh
#   sbatch -N1 -n2 slurm/test.sbatch
#   tests/slurm/down.sh                    # stops only the daemons started here
#
# Everything (config, munge key and socket, state, spool, logs, pid files) lives under
# MPIDL_SLURM_CI_DIR (default /tmp/mpidl-slurm-ci); nothing is written to /etc, so a
# site's own Slurm is never touched. The last line of output is "cluster: started"
# or "cluster: already up", which tests/slurm/conftest.py uses to decide whether it
# owns the daemons and must stop them afterwards.
#
# Settings (environment):
#   MPIDL_SLURM_CI_DIR        state folder                    [/tmp/mpidl-slurm-ci]
#   MPIDL_SLURM_CI_CPUS       CPUs the node advertises        [4]  (more than the
#                             machine has is fine: two 2-task jobs can run at once)
#   MPIDL_SLURM_CI_FAKE_GPUS  gres/gpu devices, /dev/null clones made with mknod [2]
#   MPIDL_SLURM_CI_PORT       slurmctld port; slurmd uses PORT+1 [16817] (not Slurm's
#                             6817, so a real cluster on this machine is not disturbed)
#
# Why the settings: see common.sh, and below.
#   Fake GPUs must be character devices: plain files leave CUDA_VISIBLE_DEVICES empty.
set -euo pipefail

dir=${MPIDL_SLURM_CI_DIR:-/tmp/mpidl-slurm-ci}
cpus=${MPIDL_SLURM_CI_CPUS:-4}
gpus=${MPIDL_SLURM_CI_FAKE_GPUS:-2}
port=${MPIDL_SLURM_CI_PORT:-16817}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
conf=$dir/slurm.conf
export SLURM_CONF=$conf
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$here/common.sh"

for tool in munged slurmctld slurmd scontrol sinfo; do
    if ! command -v "$tool" >/dev/null; then
        echo "cluster.sh: $tool not found; run tests/slurm/install.sh (as root) first" >&2
        exit 3
    fi
done

alive() { slurm_alive "$1" "$dir"; }

node_state() { sinfo -h -N -o '%t' 2>/dev/null | head -n 1; }

wait_for() { local limit=$1 what=$2; shift 2; slurm_wait_for "$limit" "$what" "$dir/log" "$@"; }

node_ready() { [[ $(node_state) =~ ^(idle|mix|alloc) ]]; }

if alive "$dir/run/munged.pid" && alive "$dir/run/slurmctld.pid" \
    && alive "$dir/run/slurmd.pid" && node_ready; then
    echo "cluster: already up"
    exit 0
fi

# Half up (a crash, a killed session): stop our leftovers, keep the folder.
"$here/down.sh" >/dev/null 2>&1 || true

mkdir -p "$dir"/{state,spool,log,run,dev}

host=$(hostname -s)
# The node's real layout and memory; CPUs may be overridden to advertise more.
memory=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
gres_line=""
gres_types=""
if ((gpus > 0)); then
    : >"$dir/gres.conf"
    for ((i = 0; i < gpus; i++)); do
        [[ -c $dir/dev/gpu$i ]] || mknod "$dir/dev/gpu$i" c 1 3
    done
    echo "NodeName=$host Name=gpu File=$dir/dev/gpu[0-$((gpus - 1))]" >"$dir/gres.conf"
    gres_line="Gres=gpu:$gpus"
    gres_types="GresTypes=gpu"
fi
comm_params=""
if getent hosts "$(hostname)" | grep -q '^127\.'; then
    # The hostname resolves to loopback: listen there only.
    comm_params="CommunicationParameters=NoInAddrAny"
fi

cat >"$conf" <<CONF
# Written by tests/slurm/cluster.sh; regenerated on every start.
ClusterName=mpidlci
SlurmctldHost=$(hostname)(127.0.0.1)
$(slurm_conf_common "$dir" "$port")
SlurmdSpoolDir=$dir/spool/slurmd
SlurmdPidFile=$dir/run/slurmd.pid
SlurmdLogFile=$dir/log/slurmd.log
$gres_types
$comm_params
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$memory $gres_line State=UNKNOWN
$(slurm_partitions "$host")
CONF

printf 'export SLURM_CONF=%q\n' "$conf" >"$dir/env.sh"

# Daemons: in their own session, stdio to files (a caller capturing our output must
# not wait for the daemons to close its pipe), pid files under run/.
slurm_start_munged "$dir"

# -c: forget jobs of an earlier run; -i: ignore state files that do not match.
setsid slurmctld -D -c -i -f "$conf" </dev/null >"$dir/log/slurmctld.out" 2>&1 &
wait_for 20 slurmctld bash -c 'scontrol ping 2>/dev/null | grep -q UP'

setsid slurmd -D -N "$host" -f "$conf" </dev/null >"$dir/log/slurmd.out" 2>&1 &
wait_for 30 "slurmd (node idle)" node_ready
echo "cluster: started"
