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
# Why these settings (measured on a 2-core container without systemd or cgroups):
#   proctrack/linuxproc, task/none, jobacct_gather/none: cgroups are never touched.
#   MpiDefault=pmix: the Open MPI 5 wheel only speaks PMIx; pmi2 gives size-1 singletons.
#   Fake GPUs must be character devices: plain files leave CUDA_VISIBLE_DEVICES empty.
set -euo pipefail

dir=${MPIDL_SLURM_CI_DIR:-/tmp/mpidl-slurm-ci}
cpus=${MPIDL_SLURM_CI_CPUS:-4}
gpus=${MPIDL_SLURM_CI_FAKE_GPUS:-2}
port=${MPIDL_SLURM_CI_PORT:-16817}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
conf=$dir/slurm.conf
export SLURM_CONF=$conf

for tool in munged slurmctld slurmd scontrol sinfo; do
    if ! command -v "$tool" >/dev/null; then
        echo "cluster.sh: $tool not found; run tests/slurm/install.sh (as root) first" >&2
        exit 3
    fi
done

# Alive means: the pid in our pid file runs and its command line names our folder.
alive() {
    local pidfile=$1 pid
    [[ -s $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ -r /proc/$pid/cmdline ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF "$dir" || return 1
    # A zombie waits for pid 1 to reap it; it is not running.
    [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]]
}

node_state() { sinfo -h -N -o '%t' 2>/dev/null | head -n 1; }

wait_for() {   # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2
    shift 2
    local deadline=$((SECONDS + limit))
    until "$@"; do
        if ((SECONDS >= deadline)); then
            echo "cluster.sh: $what not ready after ${limit}s; logs in $dir/log" >&2
            tail -n 20 "$dir"/log/*.log >&2 || true
            return 1
        fi
        sleep 0.2
    done
}

node_ready() { [[ $(node_state) =~ ^(idle|mix|alloc) ]]; }

if alive "$dir/run/munged.pid" && alive "$dir/run/slurmctld.pid" \
    && alive "$dir/run/slurmd.pid" && node_ready; then
    echo "cluster: already up"
    exit 0
fi

# Half up (a crash, a killed session): stop our leftovers, keep the folder.
"$here/down.sh" >/dev/null 2>&1 || true

mkdir -p "$dir"/{munge,state,spool,log,run,dev}
chmod 0700 "$dir/munge"
# munged refuses a socket folder others cannot traverse ("socket is inaccessible").
mkdir -p "$dir/munge/socket"
chmod 0711 "$dir/munge/socket"
if [[ ! -s $dir/munge/munge.key ]]; then
    (umask 077 && head -c 1024 /dev/urandom >"$dir/munge/munge.key")
fi

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
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/socket/munge.socket.2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/slurmd
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=pmix
ReturnToService=2
MailProg=/bin/true
KillWait=10
MinJobAge=300
SlurmdParameters=config_overrides
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
$gres_types
$comm_params
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$memory $gres_line State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=10
PartitionName=urgent Nodes=$host MaxTime=INFINITE State=UP PriorityTier=2
CONF

printf 'export SLURM_CONF=%q\n' "$conf" >"$dir/env.sh"

# Daemons: in their own session, stdio to files (a caller capturing our output must
# not wait for the daemons to close its pipe), pid files under run/.
setsid munged -F --force --key-file="$dir/munge/munge.key" \
    --socket="$dir/munge/socket/munge.socket.2" --pid-file="$dir/run/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" \
    </dev/null >"$dir/log/munged.out" 2>&1 &
wait_for 10 munged test -S "$dir/munge/socket/munge.socket.2"

# -c: forget jobs of an earlier run; -i: ignore state files that do not match.
setsid slurmctld -D -c -i -f "$conf" </dev/null >"$dir/log/slurmctld.out" 2>&1 &
wait_for 20 slurmctld bash -c 'scontrol ping 2>/dev/null | grep -q UP'

setsid slurmd -D -N "$host" -f "$conf" </dev/null >"$dir/log/slurmd.out" 2>&1 &
wait_for 30 "slurmd (node idle)" node_ready
echo "cluster: started"
