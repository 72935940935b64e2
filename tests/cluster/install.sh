#!/usr/bin/env bash
# Install what tests/cluster needs, only where missing (Debian/Ubuntu, root):
# ip and tc (iproute2), nsenter and unshare (util-linux).
#
#   sudo tests/cluster/install.sh          # CI: .ci/run calls this before the tests
#
# Exits 0 when every tool is present afterwards, 3 where it cannot install them (no
# apt-get, not root): the cluster tests then skip with the reason.
set -euo pipefail

declare -A package=([ip]=iproute2 [tc]=iproute2 [nsenter]=util-linux [unshare]=util-linux)
missing=()
for tool in "${!package[@]}"; do
    command -v "$tool" >/dev/null || missing+=("${package[$tool]}")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "install.sh: all present: ${!package[*]}"
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
if ! apt-get install -y -q --no-install-recommends "${missing[@]}"; then
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
echo "install.sh: installed ${missing[*]}"
