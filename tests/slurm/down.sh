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

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$here/common.sh"

ours() {   # ours PIDFILE -> prints the pid if it is one of our running daemons
    slurm_pid "$1" "$dir"
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
