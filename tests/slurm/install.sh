#!/usr/bin/env bash
# Install the Debian packages a test tier needs, only where missing: the one installer
# of the tiers that need the machine's own software (tests/cluster/install.sh calls it).
#
#   sudo tests/slurm/install.sh                      # CI: what tests/slurm needs
#   sudo tests/slurm/install.sh PACKAGE[:TOOL]...    # these instead (a package counts
#                                                    # as present where TOOL is on PATH)
#
# Slurm's packages: slurmctld, slurmd, slurm-client (the three daemons' halves), munge
# (auth), libpmix-dev, shellcheck (lints the templates in tests/unit/test_sbatch.py).
# libpmix-dev is not optional although nothing pulls it in: Slurm's mpi/pmix plugin
# dlopen()s the unversioned libpmix.so that only the -dev package ships, and without it
# every `srun --mpi=pmix` fails with "can not load PMIx library".
#
# Exits 0 when everything is present afterwards. Where apt-get is missing (not Debian
# or Ubuntu) or we are not root it says so and exits 3: the tests then skip with that
# reason.
set -euo pipefail

if [[ $# -eq 0 ]]; then
    set -- slurmctld slurmd slurm-client munge libpmix-dev shellcheck
fi

present() {   # present PACKAGE[:TOOL]
    local package=${1%%:*} tool=
    [[ $1 == *:* ]] && tool=${1#*:}
    if [[ -n $tool ]] && command -v "$tool" >/dev/null; then
        return 0
    fi
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'
}

missing=()
for spec in "$@"; do
    present "$spec" || missing+=("${spec%%:*}")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "install.sh: all present: $(printf '%s\n' "${@%%:*}" | sort -u | xargs)"
    exit 0
fi
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
if ! command -v apt-get >/dev/null; then
    echo "install.sh: apt-get not found; cannot install ${missing[*]}" >&2
    exit 3
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "install.sh: installing ${missing[*]} needs root (run it with sudo)" >&2
    exit 3
fi
export DEBIAN_FRONTEND=noninteractive
# The package lists may be absent on a fresh image; refresh them once if the first
# try cannot find a package.
if ! apt-get install -y -q --no-install-recommends "${missing[@]}"; then
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# Debian's maintainer scripts try to start Slurm's daemons; without systemd policy-rc.d
# refuses, which is harmless: the tests start their own.
echo "install.sh: installed ${missing[*]}"
