#!/usr/bin/env bash
# Install what tests/cluster needs, only where missing (Debian/Ubuntu, root): ip and tc
# (iproute2), nsenter and unshare (util-linux). The installing is tests/slurm/install.sh's;
# the virtual cluster's Slurm (`cluster.sh up --slurm`) needs that script's own packages.
#
#   sudo tests/cluster/install.sh          # CI: .ci/run calls this before the tests
#
# Exits 0 when every tool is present afterwards, 3 where it cannot install them (no
# apt-get, not root): the cluster tests then skip with the reason.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/../slurm/install.sh" iproute2:ip iproute2:tc util-linux:nsenter util-linux:unshare
