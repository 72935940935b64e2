# shellcheck shell=bash
# What the two test Slurms share, sourced by tests/slurm/cluster.sh (one slurmd on this
# machine) and tests/cluster/slurm.sh (one slurmd per virtual node): munged with a key
# and socket of its own, the slurm.conf lines that do not depend on the nodes, and a
# wait with a limit. Everything lives under the caller's state folder; nothing is
# written to /etc.
#
# Why these settings (measured on a 2-core container without systemd or cgroups):
#   proctrack/linuxproc, task/none, jobacct_gather/none: cgroups are never touched.
#   MpiDefault=pmix: the Open MPI 5 wheel only speaks PMIx; pmi2 gives size-1 singletons.
#   MailProg=/bin/true: without it slurmctld logs "Configured MailProg is invalid".

# slurm_pid PIDFILE DIR: print the pid in PIDFILE when it runs, is no zombie (a zombie
# waits for pid 1 to reap it), and its command line names DIR (a reused pid is not
# ours); else return 1. The file is read once, with cat: a daemon removes its pid file
# as it exits, and under `set -e` a failed `$(<file)` ends the whole script even where
# the caller tests the result (bash 5.2) -- which is how `cluster.sh down` once stopped
# halfway and left the virtual nodes up (CI, 2026-12-02).
slurm_pid() {
    local pidfile=$1 dir=$2 pid state
    pid=$(cat -- "$pidfile" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/cmdline ]] || return 1
    # The process may end at any point here: each read that fails says "not ours".
    { tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null | grep -qF "$dir" || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ -n $state && $state != Z ]] || return 1
    echo "$pid"
}

# slurm_alive PIDFILE DIR: slurm_pid as a predicate.
slurm_alive() { slurm_pid "$@" >/dev/null; }

# slurm_wait_for SECONDS DESCRIPTION LOGDIR COMMAND...: poll COMMAND every 0.2 s; after
# SECONDS say what was not ready, with the logs' tails, and fail.
slurm_wait_for() {
    local limit=$1 what=$2 logs=$3
    shift 3
    local deadline=$((SECONDS + limit))
    until "$@"; do
        if ((SECONDS >= deadline)); then
            echo "slurm: $what not ready after ${limit}s; logs in $logs" >&2
            tail -n 20 "$logs"/*.log >&2 2>/dev/null || true
            return 1
        fi
        sleep 0.2
    done
}

# slurm_start_munged DIR: munged with its own 1 KiB key and socket under DIR/munge,
# pid in DIR/run/munged.pid, log in DIR/log; waits for its socket.
slurm_start_munged() {
    local dir=$1
    mkdir -p "$dir"/{munge,run,log}
    chmod 0700 "$dir/munge"
    # munged refuses a socket folder others cannot traverse ("socket is inaccessible").
    mkdir -p "$dir/munge/socket"
    chmod 0711 "$dir/munge/socket"
    if [[ ! -s $dir/munge/munge.key ]]; then
        (umask 077 && head -c 1024 /dev/urandom >"$dir/munge/munge.key")
    fi
    # In its own session, stdio to files: a caller capturing our output must not wait
    # for the daemon to close its pipe.
    setsid munged -F --force --key-file="$dir/munge/munge.key" \
        --socket="$dir/munge/socket/munge.socket.2" --pid-file="$dir/run/munged.pid" \
        --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" \
        </dev/null >"$dir/log/munged.out" 2>&1 &
    slurm_wait_for 10 munged "$dir/log" test -S "$dir/munge/socket/munge.socket.2"
}

# slurm_conf_common DIR PORT: the slurm.conf lines both clusters share (slurmctld on
# PORT, slurmd on PORT+1; state, logs and pid files of slurmctld under DIR).
slurm_conf_common() {
    local dir=$1 port=$2
    cat <<CONF
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/socket/munge.socket.2
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmctldLogFile=$dir/log/slurmctld.log
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
CONF
}

# slurm_partitions NODES: the two partitions, debug (default) and urgent (preempts it).
slurm_partitions() {
    cat <<CONF
PartitionName=debug Nodes=$1 Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=10
PartitionName=urgent Nodes=$1 MaxTime=INFINITE State=UP PriorityTier=2
CONF
}
