# shellcheck shell=bash
# Slurm on the virtual nodes (`cluster.sh up --slurm`), sourced by cluster.sh.
#
# munged and slurmctld run in this (the machine's own) namespace, the controller at the
# bridge's address; each node nI runs its own slurmd in its network namespace, under a
# UTS namespace with the host name nI, as a real node would. Started with `nsenter
# --net`, not `ip netns exec`: the latter remounts /sys, and slurmd then finds no
# cgroup filesystem and refuses to start. The configuration names every node's address
# (NodeAddr), and puts a %n (the node's name) in every slurmd path, so that the slurmds
# of one machine keep apart: spool, pid and log files, and TmpFS (two slurmstepds of
# one job both create TmpFS/spmix_appdir_<uid>_<job>.<step>, "File exists" without %n).
# Each slurmd listens on the same port in its own namespace.
#
# Everything is under $dir/slurm; the daemons of this namespace are written to `made`
# ("daemon PIDFILE") before they start, so `down` stops them even after a failed `up`.
# Clients need SLURM_CONF: `eval "$(cluster.sh env)"`.
#
# Settings (environment):
#   MPIDL_CLUSTER_SLURM_CPUS   CPUs every node advertises [4] (more than the machine
#                              has is fine: SlurmdParameters=config_overrides)
#   MPIDL_CLUSTER_SLURM_PORT   slurmctld's port, slurmd's is the next [16900 + 2 x the
#                              subnet's last number: the tests' cluster and one brought
#                              up by hand do not meet, nor tests/slurm's 16817]

# here, root, dir, prefix, subnet, record, die, need_up: cluster.sh's, which sources this.
# shellcheck disable=SC2154
true
# shellcheck source=../slurm/common.sh
source "$here/../slurm/common.sh"

slurm_dir() { echo "$dir/slurm"; }

# slurm_unavailable: why Slurm cannot run on the nodes, or nothing.
slurm_unavailable() {
    local tool
    for tool in munged slurmctld slurmd sinfo scontrol; do
        command -v "$tool" >/dev/null \
            || { echo "$tool not found; run tests/slurm/install.sh (root) first"; return; }
    done
}

# slurm_up NODES: configuration, munged, slurmctld, and one slurmd per node; waits until
# every node is idle, or fails naming the nodes that did not join.
slurm_up() {
    local nodes=$1 sdir port cpus why
    why=$(slurm_unavailable)
    [[ -z $why ]] || die "up --slurm: $why"
    sdir=$(slurm_dir)
    cpus=${MPIDL_CLUSTER_SLURM_CPUS:-4}
    port=${MPIDL_CLUSTER_SLURM_PORT:-$((16900 + 2 * ${subnet##*.}))}
    mkdir -p "$sdir"/{state,spool,log,run,tmp}
    local names="n[1-$nodes]" node_lines="" i
    ((nodes > 1)) || names=n1
    for ((i = 1; i <= nodes; i++)); do
        node_lines+="NodeName=n$i NodeAddr=$subnet.$((i + 1)) CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN"$'\n'
    done
    cat >"$sdir/slurm.conf" <<CONF
# Written by tests/cluster/cluster.sh up --slurm.
ClusterName=$prefix
SlurmctldHost=$(hostname -s)($subnet.1)
$(slurm_conf_common "$sdir" "$port")
SlurmdSpoolDir=$sdir/spool/%n
SlurmdPidFile=$sdir/run/slurmd.%n.pid
SlurmdLogFile=$sdir/log/slurmd.%n.log
TmpFS=$sdir/tmp/%n
# A node whose slurmd stops answering is DOWN after ~10 s (default 300), and its jobs
# end NODE_FAIL: a lost node ends its jobs within the tests' patience.
SlurmdTimeout=10
${node_lines}$(slurm_partitions "$names")
CONF
    for ((i = 1; i <= nodes; i++)); do
        mkdir -p "$sdir/tmp/n$i"
    done
    export SLURM_CONF=$sdir/slurm.conf
    record "daemon $sdir/run/munged.pid"
    slurm_start_munged "$sdir"
    record "daemon $sdir/run/slurmctld.pid"
    # -c: forget jobs of an earlier run; -i: ignore state files that do not match.
    setsid slurmctld -D -c -i -f "$SLURM_CONF" </dev/null >"$sdir/log/slurmctld.out" 2>&1 &
    local ctld=$!
    slurm_wait_for 20 slurmctld "$sdir/log" slurmctld_up "$ctld"
    kill -0 "$ctld" 2>/dev/null \
        || die "up --slurm: slurmctld ended: $(tail -n 3 "$sdir/log/slurmctld.out" | xargs)"
    for ((i = 1; i <= nodes; i++)); do
        slurmd_start "n$i"
    done
    local joined=0
    slurm_wait_for 30 "every node idle" "$sdir/log" slurm_all_idle "$nodes" || joined=$?
    ((joined == 0)) || die "up --slurm: nodes that did not join: $(slurm_not_idle)"
}

# slurmctld_up PID: it answers; a slurmctld that ended (a bad configuration) ends the
# wait at once.
slurmctld_up() {
    kill -0 "$1" 2>/dev/null || return 0
    scontrol ping 2>/dev/null | grep -q UP
}

slurm_all_idle() { [[ $(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l) -eq $1 ]]; }

slurm_not_idle() { sinfo -h -N -o '%N=%t' 2>/dev/null | grep -v '=idle$' | sort -u | xargs; }

# slurmd_start NODE: the node's slurmd, inside its namespaces, in a session of its own.
slurmd_start() {
    local node=$1 ns sdir
    sdir=$(slurm_dir)
    ns=$(awk -v n="$node" '$1 == n {print $2}' "$dir/nodes")
    [[ -n $ns ]] || die "slurmd: $node is not a node ($(awk '{print $1}' "$dir/nodes" | xargs))"
    setsid nsenter --net="/var/run/netns/$ns" unshare --uts /bin/sh -c \
        'hostname "$0" && exec slurmd -D -N "$0" -f "$1"' "$node" "$sdir/slurm.conf" \
        </dev/null >"$sdir/log/slurmd.$node.out" 2>&1 &
}

# slurmd NODE start|stop: start a node's slurmd, or stop it (its running jobs' steps
# stay; slurmctld finds the node not responding after SlurmdTimeout).
slurmd_() {
    need_up
    [[ -s $(slurm_dir)/slurm.conf ]] || die "slurmd: the cluster runs no Slurm (up --slurm)"
    local node=${1:-} action=${2:-} pidfile pid
    pidfile=$(slurm_dir)/run/slurmd.$node.pid
    case $action in
        start) slurmd_start "$node" ;;
        stop)
            pid=$(slurm_pid "$pidfile" "$(slurm_dir)") || die "slurmd: $node's slurmd is not running"
            kill -KILL "$pid"
            rm -f "$pidfile"
            ;;
        *) die "slurmd: usage: slurmd NODE start|stop" ;;
    esac
}

# slurm_down: stop the daemons of this namespace named in `made` (after the nodes'
# processes, slurmd among them, went with their namespaces).
slurm_stop_daemon() {
    local pidfile=$1 pid
    pid=$(slurm_pid "$pidfile" "$dir") || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
        slurm_alive "$pidfile" "$dir" || return 0
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
}

# What a shell needs to use the cluster's Slurm: `eval "$(cluster.sh env)"`.
slurm_env() {
    need_up
    [[ -s $(slurm_dir)/slurm.conf ]] || die "env: the cluster runs no Slurm (up --slurm)"
    printf 'export SLURM_CONF=%q\n' "$(slurm_dir)/slurm.conf"
    # Open MPI's traffic on the nodes' subnet, also for mpirun inside an allocation
    # (which runs here, in the machine's namespace, and must not offer the nodes its
    # other addresses), and ranks that yield when idle (cluster.sh mpiexec says why).
    local net
    net=$(awk -F= '$1 == "subnet" {print $2}' "$dir/config").0/24
    printf 'export OMPI_MCA_btl_tcp_if_include=%s PRTE_MCA_oob_tcp_if_include=%s\n' "$net" "$net"
    printf 'export OMPI_MCA_mpi_yield_when_idle=1\n'
    if [[ $(id -u) -eq 0 ]]; then   # as cluster.sh mpiexec: Open MPI refuses root without
        printf 'export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1\n'
    fi
    # mpidl and its python on PATH, for batch scripts and srun (the templates find the
    # python as MPIDL_PYTHON or from VIRTUAL_ENV, else python3 on PATH)
    if [[ -x $root/.venv/bin/python ]]; then
        printf 'export PATH=%q:"$PATH"\n' "$root/.venv/bin"
    fi
}
