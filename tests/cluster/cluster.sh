#!/usr/bin/env bash
# A cluster of N virtual nodes inside this machine, for tests that cross nodes (root).
#
#   bash tests/cluster/cluster.sh up --nodes 2 [--rate 1gbit] [--slots 2] [--slurm]
#   bash tests/cluster/cluster.sh mpiexec -n 4 mpidl train     # ranks 0-1 on n1, 2-3 on n2
#   bash tests/cluster/cluster.sh mpiexec --nodes 1 -n 2 ...   # only the first K nodes
#   bash tests/cluster/cluster.sh mpiexec --ppn 1 -n 2 ...     # ranks per node
#   MPIEXEC=.venv-mpich/bin/mpiexec bash tests/cluster/cluster.sh mpiexec -n 4 ...  # MPICH
#   eval "$(bash tests/cluster/cluster.sh env)"               # with --slurm: sbatch -N 2 ...
#   bash tests/cluster/cluster.sh status
#   bash tests/cluster/cluster.sh mpi                          # which MPI mpiexec runs
#   bash tests/cluster/cluster.sh link n2 down|up              # cut or mend a node's link
#   bash tests/cluster/cluster.sh slurmd n2 stop|start         # with --slurm: a node's slurmd
#   bash tests/cluster/cluster.sh reap                         # stop orphaned daemons
#   bash tests/cluster/cluster.sh down                         # idempotent
#
# Each node nI is a network namespace mpidl-nI, holding one end of a veth pair (eth0,
# address SUBNET.(I+1)); the other end, mpidl-vI, is on the bridge mpidl-br (address
# SUBNET.1, this namespace's way in). mpiexec (Open MPI's, or MPICH's Hydra) runs on a
# head node, the namespace mpidl-h (SUBNET.254), whose kernel gives up on a silent TCP
# peer in seconds (see up), and reaches the nodes through a launch agent (agent.sh)
# instead of ssh. The subnet (MPIDL_CLUSTER_SUBNET, default 10.213.0, a /24) exists
# only on the bridge and in these namespaces: the nodes have no default route and
# nothing is forwarded or NATed, so no packet of theirs can leave the machine. A node's
# processes also get their own UTS namespace with the host name nI and a TMPDIR of its
# own, so host names differ per node as on a real cluster; /etc/hosts is never touched
# (the hostfile holds addresses).
#
# --rate RATE shapes both directions of every node's link (its eth0 and its bridge
# port) with `tc`: htb by default, or tbf with --shaper tbf (this kernel has no netem,
# so there is no added delay). Measured here, MPI Send/Recv between two nodes at 1gbit:
# 0.10-0.12 GB/s for 16 KB and 1-16 MB messages with htb, and with this tbf (burst
# 256kb); a tbf with a small burst drops packets and falls to 0.06 GB/s for 4 MB and
# more as TCP backs off. Unshaped: 0.2-0.5 GB/s. 64 KB messages crawl at 0.02-0.03 GB/s
# shaped or not (Open MPI's TCP eager limit is 64 KB: the rendezvous round trip).
#
# --slurm adds a Slurm: slurmctld here, one slurmd per node (slurm.sh says how).
#
# What `up` makes is written to $MPIDL_CLUSTER_DIR/made before it is made (default
# ${TMPDIR:-/tmp}/mpidl-cluster), so `down` removes exactly that, also after an `up`
# that failed half-way, and leaves the machine as it found it. `down` with nothing up
# does nothing and succeeds.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
dir=${MPIDL_CLUSTER_DIR:-${TMPDIR:-/tmp}/mpidl-cluster}
subnet=${MPIDL_CLUSTER_SUBNET:-10.213.0}
# Prefix of every name made (MPIDL_CLUSTER_NAME): namespaces NAME-nI, links NAME-br and
# NAME-vI; a second cluster (the tests' own) needs another name, subnet and folder.
prefix=${MPIDL_CLUSTER_NAME:-mpidl}
[[ $prefix =~ ^[a-z][a-z0-9]{0,8}$ ]] \
    || { echo "cluster.sh: MPIDL_CLUSTER_NAME=$prefix: use 1-9 lowercase letters and digits" >&2; exit 2; }
bridge=$prefix-br
export MPIDL_CLUSTER_DIR=$dir

die() { echo "cluster.sh: $*" >&2; exit 2; }

# shellcheck source=slurm.sh source-path=SCRIPTDIR
source "$here/slurm.sh"

usage() {
    sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
}

# Why a machine cannot host the cluster, or nothing (the tests skip with this reason).
unavailable() {
    [[ $(id -u) -eq 0 ]] || { echo "network namespaces need root (uid $(id -u))"; return; }
    local tool
    for tool in ip tc nsenter unshare hostname awk; do
        command -v "$tool" >/dev/null || { echo "$tool not found (iproute2/util-linux)"; return; }
    done
    ip netns list >/dev/null 2>&1 || { echo "ip netns does not work here"; return; }
}

record() { echo "$*" >>"$dir/made"; }

# ---- up ---------------------------------------------------------------------------
up() {
    local nodes=2 rate="" slots=2 shaper=htb slurm=0
    while [[ $# -gt 0 ]]; do
        case $1 in
            --nodes) nodes=$2; shift 2 ;;
            --rate) rate=$2; shift 2 ;;
            --slots) slots=$2; shift 2 ;;
            --shaper) shaper=$2; shift 2 ;;
            --slurm) slurm=1; shift ;;
            *) die "up: unknown option $1 (expected --nodes N [--rate RATE] [--slots S] [--shaper htb|tbf] [--slurm])" ;;
        esac
    done
    [[ $nodes =~ ^[0-9]+$ ]] && ((nodes >= 1 && nodes <= 200)) \
        || die "up: --nodes $nodes is not a number of nodes from 1 to 200"
    [[ $slots =~ ^[0-9]+$ ]] && ((slots >= 1)) || die "up: --slots $slots is not a positive number"
    [[ $shaper == htb || $shaper == tbf ]] || die "up: --shaper $shaper: use htb or tbf"
    [[ -z $rate || $rate =~ ^[0-9.]+[kmgt]?(bit|bps)$ ]] \
        || die "up: --rate $rate is not a tc rate such as 1gbit, 10gbit or 500mbit"
    local why
    why=$(unavailable)
    [[ -z $why ]] || { echo "cluster.sh: cannot make namespaces: $why" >&2; exit 3; }
    if [[ -e $dir/made ]]; then
        die "up: a cluster is up already ($dir); run \`cluster.sh down\` first"
    fi
    # The subnet must be ours alone: no address or route of it on this machine.
    if ip -4 addr show | grep -q "inet $subnet\." || ip -4 route show | grep -q "^$subnet\."; then
        die "up: $subnet.0/24 is already in use on this machine; set MPIDL_CLUSTER_SUBNET"
    fi
    ip link show "$bridge" >/dev/null 2>&1 && die "up: a link named $bridge exists already"
    if ((slurm)); then
        why=$(slurm_unavailable)
        [[ -z $why ]] || die "up --slurm: $why"
    fi
    mkdir -p "$dir"
    : >"$dir/made"
    # On any failure from here (set -e, or die), undo what was made.
    trap 'echo "cluster.sh: up failed; undoing" >&2; down >/dev/null 2>&1 || true' EXIT

    record "link $bridge"
    ip link add "$bridge" type bridge
    sysctl -qw "net.ipv6.conf.$bridge.disable_ipv6=1"
    ip addr add "$subnet.1/24" dev "$bridge"
    ip link set "$bridge" up
    # The head node, where mpiexec runs (as on a login node): its kernel gives up on a
    # TCP peer that stopped answering after 5 retransmissions (~13 s) instead of the
    # default 15 (~15 min). Measured: with a node's link cut, Open MPI's mpiexec waits
    # for the lost daemon until TCP gives up, even after MPI_Abort; in the machine's
    # own namespace that was the default's quarter of an hour, and its sysctls are not
    # ours to change.
    local head=$prefix-h
    ip netns list | grep -qw "^$head" && die "up: a namespace named $head exists already"
    record "netns $head"
    ip netns add "$head"
    record "link $prefix-vh"
    ip link add "$prefix-vh" type veth peer name eth0 netns "$head"
    sysctl -qw "net.ipv6.conf.$prefix-vh.disable_ipv6=1"
    ip netns exec "$head" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv4.tcp_retries2=5
    ip link set "$prefix-vh" master "$bridge" up
    ip -n "$head" addr add "$subnet.254/24" dev eth0
    ip -n "$head" link set lo up
    ip -n "$head" link set eth0 up
    echo "$head" >"$dir/head"
    : >"$dir/nodes"
    : >"$dir/hostfile"
    local i ns veth addr
    for ((i = 1; i <= nodes; i++)); do
        ns=$prefix-n$i veth=$prefix-v$i addr=$subnet.$((i + 1))
        ip netns list | grep -qw "^$ns" && die "up: a namespace named $ns exists already"
        record "netns $ns"
        ip netns add "$ns"
        record "link $veth"
        ip link add "$veth" type veth peer name eth0 netns "$ns"
        sysctl -qw "net.ipv6.conf.$veth.disable_ipv6=1"
        ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1
        ip link set "$veth" master "$bridge" up
        ip -n "$ns" addr add "$addr/24" dev eth0
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
        if [[ -n $rate ]]; then
            shape "$veth" "" "$rate" "$shaper"
            shape eth0 "$ns" "$rate" "$shaper"
        fi
        echo "n$i $ns $addr $veth" >>"$dir/nodes"
        echo "$addr slots=$slots" >>"$dir/hostfile"
    done
    printf 'nodes=%s\nrate=%s\nslots=%s\nshaper=%s\nsubnet=%s\nslurm=%s\n' \
        "$nodes" "${rate:-none}" "$slots" "$shaper" "$subnet" "$slurm" >"$dir/config"
    if ((slurm)); then
        slurm_up "$nodes"
    fi
    trap - EXIT
    echo "cluster: up, $nodes nodes ($(awk '{print $1 "=" $3}' "$dir/nodes" | xargs)), rate ${rate:-unshaped}$( ((slurm)) && echo ", Slurm")$( ((slurm)) && echo ' (eval "$(cluster.sh env)")'), state in $dir"
}

# shape DEV NETNS RATE SHAPER: limit DEV's egress to RATE (NETNS empty: this namespace).
shape() {
    local dev=$1 ns=$2 rate=$3 shaper=$4
    local tcn=(tc)
    [[ -z $ns ]] || tcn=(ip netns exec "$ns" tc)
    if [[ $shaper == tbf ]]; then
        # burst: a few 64 KB GSO packets; latency bounds the queue (then tbf drops).
        "${tcn[@]}" qdisc add dev "$dev" root tbf rate "$rate" burst 256kb latency 20ms
    else
        "${tcn[@]}" qdisc add dev "$dev" root handle 1: htb default 1
        "${tcn[@]}" class add dev "$dev" parent 1: classid 1:1 htb rate "$rate" ceil "$rate" quantum 200000
    fi
}

# ---- down -------------------------------------------------------------------------
# Stop every process inside one of our namespaces (ranks, prted, slurmd), then the
# daemons of this namespace (slurmctld, munged), then remove the namespaces and links,
# in the reverse order of `made`.
down() {
    if [[ ! -e $dir/made ]]; then
        echo "cluster: nothing up ($dir/made not found)"
        rm -rf "$dir"
        return 0
    fi
    local kind name pids pid sig
    while read -r kind name; do
        [[ $kind == netns ]] || continue
        ip netns list | grep -qw "^$name" || continue
        for sig in TERM KILL; do
            pids=$(ip netns pids "$name" 2>/dev/null || true)
            [[ -n $pids ]] || break
            # shellcheck disable=SC2086
            kill -s "$sig" $pids 2>/dev/null || true
            for _ in $(seq 1 25); do
                [[ -z $(ip netns pids "$name" 2>/dev/null) ]] && break
                sleep 0.2
            done
        done
    done <"$dir/made"
    while read -r kind name; do
        [[ $kind == daemon ]] && slurm_stop_daemon "$name"
    done < <(tac "$dir/made")
    while read -r kind name; do
        case $kind in
            netns) ip netns list | grep -qw "^$name" && ip netns del "$name" ;;
            link) ip link show "$name" >/dev/null 2>&1 && ip link del "$name" ;;
        esac
    done < <(tac "$dir/made")
    # A namespace's links go a moment after the namespace (the kernel frees it later).
    local left
    for _ in $(seq 1 25); do
        left=""
        while read -r kind name; do
            case $kind in
                netns) ip netns list | grep -qw "^$name" && left+=" netns $name" ;;
                link) ip link show "$name" >/dev/null 2>&1 && left+=" link $name" ;;
                daemon) pid=$(slurm_pid "$name" "$dir") && left+=" daemon $pid" ;;
            esac
        done <"$dir/made"
        [[ -n $left ]] || break
        sleep 0.2
    done
    [[ -z $left ]] || { echo "cluster.sh: down could not remove:$left" >&2; return 1; }
    rm -rf "$dir"
    echo "cluster: down"
}

# ---- use --------------------------------------------------------------------------
need_up() { [[ -s $dir/nodes ]] || die "no cluster is up ($dir/nodes not found); run \`cluster.sh up --nodes N\`"; }

# The mpiexec to run: $MPIEXEC, else the one on PATH, else the repository's venv's.
launcher() {
    local launcher=${MPIEXEC:-}
    if [[ -z $launcher ]]; then
        launcher=$(command -v mpiexec || true)
        [[ -n $launcher ]] || launcher=$root/.venv/bin/mpiexec
    fi
    [[ -x $launcher ]] \
        || die "mpiexec not found; set MPIEXEC or put Open MPI's or MPICH's mpiexec on PATH"
    echo "$launcher"
}

# mpi_of LAUNCHER: which MPI's mpiexec LAUNCHER is, from its --version: openmpi, or
# hydra (MPICH's process manager). The one place the launch options are chosen from.
mpi_of() {
    local launcher=$1 said
    said=$(timeout 30 "$launcher" --version 2>&1 || true)
    case $said in
        *"Open MPI"* | *OpenRTE*) echo openmpi ;;
        *HYDRA*) echo hydra ;;
        *) die "mpiexec: $launcher is neither Open MPI's nor MPICH's (Hydra) mpiexec:" \
            "its --version said \"$(head -n 1 <<<"$said")\"; set MPIEXEC to one of those" ;;
    esac
}

# mpi: the MPI that `mpiexec` would run, and its path ("openmpi PATH" or "hydra PATH").
mpi_() {
    local launcher mpi
    launcher=$(launcher) || exit 2
    mpi=$(mpi_of "$launcher") || exit 2
    echo "$mpi $launcher"
}

mpiexec_() {
    need_up
    local use=0 ppn=""
    while [[ ${1:-} == --nodes || ${1:-} == --ppn ]]; do
        case $1 in
            --nodes) use=${2:-}; shift 2
                [[ $use =~ ^[0-9]+$ ]] && ((use >= 1 && use <= $(wc -l <"$dir/hostfile"))) \
                    || die "mpiexec: --nodes $use: the cluster has $(wc -l <"$dir/hostfile") nodes" ;;
            --ppn) ppn=${2:-}; shift 2
                [[ $ppn =~ ^[0-9]+$ ]] && ((ppn >= 1)) \
                    || die "mpiexec: --ppn $ppn is not a positive number of ranks per node" ;;
        esac
    done
    local launcher mpi
    launcher=$(launcher) || exit 2
    mpi=$(mpi_of "$launcher") || exit 2
    # The hostfile of the first --nodes nodes (all by default), in the MPI's own format.
    ((use > 0)) || use=$(wc -l <"$dir/hostfile")
    local hostfile=$dir/hostfile.$mpi.$use
    head -n "$use" "$dir/hostfile" >"$hostfile"
    [[ $mpi == openmpi ]] || sed -i 's/ slots=/:/' "$hostfile"
    if [[ $(id -u) -eq 0 ]]; then
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
    local options=()
    if [[ $mpi == openmpi ]]; then
        open_mpi_options "$hostfile" "$ppn" "$@"
    else
        hydra_options "$hostfile" "$ppn"
    fi
    # mpiexec runs on the head node, through `mpidl launch`: measured with Open MPI
    # 5.0.11, after MPI_Abort (the watchdog's, status 124) and then "PRTE has lost
    # communication with a remote daemon" (a node's link cut), mpiexec exits 0;
    # mpidl launch exits with the abort's code instead (1 if none), and turns a SIGTERM
    # into a checkpoint (hpc/launch.py).
    local python
    for python in ${MPIDL_PYTHON:-} "$(dirname "$launcher")/python" "$root/.venv/bin/python" \
        python3 ""; do
        [[ -n $python ]] || die "mpiexec: no python that imports mpidl; set MPIDL_PYTHON"
        "$python" -c 'import hpc.launch' 2>/dev/null && break
    done
    local status=0
    # TMPDIR: Open MPI's session folder (/tmp/ompi.PID, left behind when mpiexec is
    # killed) goes with `down`; the agent gives each node its own. Hydra's mpiexec gets
    # none: it hands its whole environment to the ranks, whose TMPDIR would then be the
    # head's instead of their node's.
    mkdir -p "$dir/tmp/head"
    local tmp=(env TMPDIR="$dir/tmp/head")
    [[ $mpi == openmpi ]] || tmp=(env -u TMPDIR)
    "${tmp[@]}" nsenter --net="/var/run/netns/$(<"$dir/head")" \
        "$python" -m mpidl launch --launcher="$launcher" "${options[@]}" "$@" || status=$?
    reap
    return "$status"
}

# open_mpi_options HOSTFILE PPN ARGS...: Open MPI's options (into `options`).
open_mpi_options() {
    local hostfile=$1 ppn=$2
    shift 2
    local net
    net=$(awk -F= '$1 == "subnet" {print $2}' "$dir/config").0/24
    # btl tcp,sm,self: ranks on one node talk through shared memory and ranks on
    # different nodes over TCP, as on a real cluster. sm is right here because PRRTE
    # counts a node by its daemon (one prted per namespace, each with its own host
    # name and session directory), so MPI's COMM_TYPE_SHARED split and sm's peers are
    # exactly a node's ranks; leaving sm out would send even a node's own traffic
    # through its loopback, which no real node does. MPIDL_CLUSTER_BTL=tcp,self does
    # that, for an experiment.
    #
    # mpi_yield_when_idle 1: a rank waiting for a message yields the CPU between
    # polls. Measured here (2 cores, 4 ranks busy-polling): without it every TCP
    # message waited for a 4 ms scheduler tick, because the kernel's network work for
    # the veth links got no CPU, and a small allreduce took 4 ms; with it, 24 us. Any
    # TCP cluster whose ranks take every core meets the same thing.
    # --bind-to none: every node's prted thinks it owns the machine's cores and would
    # bind its first rank to core 0, so that the first ranks of all nodes shared one
    # core. Given explicitly, the caller's binding wins.
    local arg
    options=(--hostfile "$hostfile" --bind-to none)
    for arg in "$@"; do
        [[ $arg == --bind-to ]] && options=(--hostfile "$hostfile")
    done
    [[ -z $ppn ]] || options+=(--map-by "ppr:$ppn:node")
    options+=(--prtemca plm_ssh_agent "$here/agent.sh"
        --prtemca oob_tcp_if_include "$net"
        --mca btl "${MPIDL_CLUSTER_BTL:-tcp,sm,self}" --mca btl_tcp_if_include "$net"
        --mca mpi_yield_when_idle 1)
}

# hydra_options HOSTFILE PPN: MPICH's Hydra options (into `options`).
hydra_options() {
    local hostfile=$1 ppn=$2
    # -launcher ssh -launcher-exec: Hydra calls the agent as ssh (`agent.sh -x HOST
    # hydra_pmi_proxy --control-port ADDRESS:PORT ...`), one proxy per node.
    # -iface eth0: the address the proxies call back is the head node's eth0. Without
    # it Hydra gives them its host name, the machine's, which /etc/hosts here says is
    # 127.0.0.1: inside a node that is the node's own loopback (seen: "unable to connect
    # from n2 to vm (Connection refused)"). A node's namespace holds only lo and eth0, so
    # the ranks' own traffic has no other way to take.
    # MPIR_CVAR_ENABLE_HEAVY_YIELD: MPICH's mpi_yield_when_idle (a waiting rank sleeps
    # between polls instead of sched_yield). Measured here at 2x2 on the 2 loaded cores:
    # a 64-byte allreduce took 7.4-8.4 ms without and 0.9-2.1 ms with; 8 MB, 65-108 ms
    # either way. Hydra hands its environment to the ranks, so the caller's setting wins.
    # No binding: Hydra binds nothing unless asked.
    export MPIR_CVAR_ENABLE_HEAVY_YIELD=${MPIR_CVAR_ENABLE_HEAVY_YIELD:-1}
    options=(-launcher ssh -launcher-exec "$here/agent.sh" -iface eth0 -f "$hostfile")
    [[ -z $ppn ]] || options+=(-ppn "$ppn")
}

# reap: stop the daemons (and their ranks) whose mpiexec has ended. A node cut off when
# its mpiexec gave up keeps its prted, which holds mpiexec's standard output and error
# open: whoever reads them (a test) would wait for ever. PRRTE names a job after its
# launcher, "prterun-HOST-PID@0"; a daemon whose PID is gone is an orphan. (Hydra's
# proxies are not found here: one ends when its connection to mpiexec closes, but a
# node cut off keeps it until TCP gives up, or until `down`.)
reap() {
    [[ -s $dir/nodes ]] || return 0
    local name ns addr veth pid launcher orphans=()
    while read -r name ns addr veth; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do
            launcher=$({ tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null \
                | grep -o 'ess_base_nspace prterun-[^ ]*-[0-9]*@' | sed 's/.*-\([0-9]*\)@$/\1/' || true)
            [[ -n $launcher ]] && ! kill -0 "$launcher" 2>/dev/null && orphans+=("$pid")
        done
    done < <(sort -u -k2,2 "$dir/nodes")
    ((${#orphans[@]})) || return 0
    local sig p
    for sig in TERM KILL; do
        for p in "${orphans[@]}"; do
            pkill -"$sig" -P "$p" 2>/dev/null || true   # its ranks
            kill -"$sig" "$p" 2>/dev/null || true
        done
        sleep 1
    done
}

status() {
    if [[ ! -s $dir/nodes ]]; then
        echo "cluster: down"
        return 0
    fi
    echo "cluster: up ($dir)"
    cat "$dir/config"
    local name ns addr veth
    while read -r name ns addr veth; do
        echo "$name $addr netns=$ns link=$(ip -br link show "$veth" 2>/dev/null | awk '{print $2}') processes=$(ip netns pids "$ns" 2>/dev/null | wc -l)"
    done <"$dir/nodes"
    if [[ -s $(slurm_dir)/slurm.conf ]]; then
        echo "slurm: $(SLURM_CONF=$(slurm_dir)/slurm.conf sinfo -h -N -o '%N=%t' 2>&1 | sort -u | xargs)"
    fi
}

# link NODE up|down: the node's bridge port, as if its cable were pulled or put back.
link() {
    need_up
    local node=${1:-} state=${2:-}
    [[ $state == up || $state == down ]] || die "link: usage: link NODE up|down"
    local veth
    veth=$(awk -v n="$node" '$1 == n || $3 == n {print $4}' "$dir/nodes")
    [[ -n $veth ]] || die "link: $node is not a node ($(awk '{print $1}' "$dir/nodes" | xargs))"
    ip link set "$veth" "$state"
}

case ${1:-} in
    up) shift; up "$@" ;;
    down) shift; down ;;
    mpiexec) shift; mpiexec_ "$@" ;;
    status) status ;;
    link) shift; link "$@" ;;
    env) slurm_env ;;
    slurmd) shift; slurmd_ "$@" ;;
    reap) reap ;;
    unavailable) unavailable ;;
    mpi) mpi_ ;;
    *) usage ;;
esac
