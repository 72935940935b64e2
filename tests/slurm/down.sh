#!/usr/bin/env bash
# Stop the private Slurm cluster of tests/slurm/cluster.sh; idempotent.
#
#   tests/slurm/down.sh                      # cancel its jobs, stop its daemons
#   MPIDL_SLURM_CI_PURGE=1 tests/slurm/down.sh   # ... and delete its state folder
#
# Only pids named in our pid files are signalled, and only when their command line
# still names our folder, so an unrelated process that reused a pid is never killed.
set -euo pipefail

dir=${MPIDL_SLURM_CI_DIR:-/tmp/mpidl-slurm-ci}
export SLURM_CONF=$dir/slurm.conf

ours() {   # ours PIDFILE -> prints the pid if it is one of our running daemons
    local pidfile=$1 pid
    [[ -s $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/cmdline ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF "$dir" || return 1
    [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]] || return 1
    echo "$pid"
}

# Jobs first, while slurmctld can still cancel them and slurmd kill their tasks.
if [[ -f $SLURM_CONF ]] && ours "$dir/run/slurmctld.pid" >/dev/null; then
    timeout 10 scancel --cluster=mpidlci --user=root 2>/dev/null \
        || timeout 10 scancel --user=root 2>/dev/null || true
fi

for name in slurmd slurmctld munged; do
    pidfile=$dir/run/$name.pid
    if pid=$(ours "$pidfile"); then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do
            ours "$pidfile" >/dev/null || break
            sleep 0.1
        done
        if ours "$pidfile" >/dev/null; then
            kill -KILL "$pid" 2>/dev/null || true
        fi
        echo "down.sh: stopped $name (pid $pid)"
    fi
    rm -f "$pidfile"
done

if [[ ${MPIDL_SLURM_CI_PURGE:-0} == 1 ]]; then
    rm -rf "$dir"
    echo "down.sh: removed $dir"
fi
