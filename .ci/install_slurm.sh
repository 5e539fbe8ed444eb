#!/usr/bin/env bash
# Install the Slurm + MUNGE + MariaDB packages that tests/support/local_cluster.py drives.
#
# Idempotent: does nothing when every package is already installed, so CI and developers can
# call it unconditionally. Never prompts (CI has no stdin). Works on Debian 12 (Slurm 22.05)
# and Debian 13 (Slurm 24.11). Needs root. Service start-up messages from policy-rc.d are
# harmless: there is no systemd, LocalCluster starts its own private daemons.
set -euo pipefail

# debootstrap builds the Slurm 24.11 root (.ci/install_slurm_chroot.sh). It is installed here,
# in the foreground, because .ci/run builds that root in the background while other steps may
# use apt: two apt runs at once fail on dpkg's lock.
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server debootstrap)

missing=()
for pkg in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
    if [[ "$status" != "installed" ]]; then
        missing+=("$pkg")
    fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
    echo "install_slurm: all packages already installed ($(slurmctld -V 2>/dev/null || echo "slurm version unknown"))"
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "install_slurm: need root to install: ${missing[*]}" >&2
    exit 1
fi

echo "install_slurm: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q </dev/null
# Keep existing config files and never ask: CI has no stdin.
apt-get install -y -q --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
    "${PACKAGES[@]}" </dev/null
echo "install_slurm: done ($(slurmctld -V))"
