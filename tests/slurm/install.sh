#!/usr/bin/env bash
# Install what tests/slurm needs from Debian's own packages, only where missing.
#
#   sudo tests/slurm/install.sh          # CI: .ci/run calls this before the tests
#
# Packages: slurmctld, slurmd, slurm-client (the three daemons' halves), munge (auth),
# libpmix-dev, shellcheck (lints the templates in tests/unit/test_sbatch.py).
# libpmix-dev is not optional although nothing pulls it in: Slurm's mpi/pmix plugin
# dlopen()s the unversioned libpmix.so that only the -dev package ships, and without it
# every `srun --mpi=pmix` fails with "can not load PMIx library".
#
# Exits 0 when everything is present afterwards. Where apt-get is missing (not Debian
# or Ubuntu) it says so and exits 3: the Slurm tests then skip with that reason.
set -euo pipefail

packages=(slurmctld slurmd slurm-client munge libpmix-dev shellcheck)

missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$p")
    fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "install.sh: all present: ${packages[*]}"
    exit 0
fi
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
# Debian's maintainer scripts try to start the daemons; without systemd policy-rc.d
# refuses, which is harmless: tests/slurm/cluster.sh starts its own.
echo "install.sh: installed ${missing[*]}"
