#!/usr/bin/env bash
# Build a Debian 13 (trixie) root holding Slurm 24.11, for a second local test cluster.
#
# Usage: bash .ci/install_slurm_chroot.sh DIR
#
# Sites run Slurm 23.x-25.x while this machine's packages give 22.05, so CI also runs the
# Slurm tests against 24.11 daemons and clients from this root (tests/support/local_cluster.py
# --chroot DIR enters it; jobs run the host's Python, bind-mounted at the same path).
#
# Idempotent: a finished root carries DIR/.slurm-guard-root and is reused as it is, so a
# developer pays the ~1 minute once; CI passes a fresh DIR every time. An unfinished DIR (an
# interrupted run) is wiped and rebuilt. Never prompts (CI has no stdin). Needs root.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 DIR" >&2
    exit 2
fi
root=$(realpath -m "$1")
marker="$root/.slurm-guard-root"
if [[ -e "$marker" ]]; then
    echo "install_slurm_chroot: $root is ready ($(cat "$marker"))"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "install_slurm_chroot: need root (debootstrap, mount, chroot)" >&2
    exit 1
fi
if [[ -z "${SLURM_GUARD_IN_NAMESPACE:-}" ]]; then
    # Two checks on one machine may share a cached root: one builds, the other waits.
    mkdir -p "$(dirname "$root")"
    exec 9>"$root.lock"
    flock 9
    if [[ -e "$marker" ]]; then
        echo "install_slurm_chroot: $root is ready ($(cat "$marker"))"
        exit 0
    fi
fi
case "$root" in
    / | /usr | /usr/* | /etc | /etc/* | /var | /bin | /bin/* | /lib | /lib/*)
        echo "install_slurm_chroot: refusing to build a root in $root" >&2
        exit 1
        ;;
esac

# The Debian mirror apt already uses here (deb822 or one-line sources); a network of this kind
# reaches the Debian mirrors and PyPI only.
mirror=""
for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -r "$f" ]] || continue
    mirror=$(grep -hoE '(https?://[^ ]*/debian)/?( |$)' "$f" | grep -v -- '-security' | head -n 1 | tr -d ' ' || true)
    [[ -n "$mirror" ]] && break
done
mirror=${mirror:-http://deb.debian.org/debian}
mirror=${mirror%/}

export DEBIAN_FRONTEND=noninteractive
if ! command -v debootstrap >/dev/null; then
    apt-get update -q </dev/null
    apt-get install -y -q --no-install-recommends debootstrap </dev/null
fi

# Mounts made here live in a private mount namespace: nothing is left mounted when the script
# ends, even when it fails half way.
if [[ -z "${SLURM_GUARD_IN_NAMESPACE:-}" ]]; then
    exec env SLURM_GUARD_IN_NAMESPACE=1 unshare --mount --propagation private -- bash "$0" "$root"
fi

# Leftovers of an interrupted build: start over (bind mounts cannot be left behind, see above).
if [[ -e "$root" ]]; then
    rm -rf --one-file-system "$root"
fi
mkdir -p "$root"
began=$(date +%s)
echo "install_slurm_chroot: debootstrap trixie into $root from $mirror"
debootstrap --variant=minbase trixie "$root" "$mirror" >"$root.debootstrap.log" 2>&1 || {
    tail -n 30 "$root.debootstrap.log" >&2
    exit 1
}
echo "install_slurm_chroot: debootstrap done in $(($(date +%s) - began)) s"

mount -t proc proc "$root/proc"
# Daemons must not start inside the root while packages install; LocalCluster starts its own.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true

# Slurm, MUNGE and accounting (submitit reads job states through sacct), plus the shared
# libraries the host's Python and its extension modules (ssl, ctypes, sqlite3, torch) load
# when jobs and the EpilogSlurmctld run that Python inside this root.
packages=(
    slurmctld slurmd slurm-client slurmdbd munge mariadb-server mariadb-client
    libssl3t64 libffi8 libsqlite3-0 libbz2-1.0 liblzma5 zlib1g libreadline8t64 libncursesw6
    libuuid1 libexpat1 libgdbm6t64 libstdc++6 libgomp1 procps util-linux
)
began=$(date +%s)
chroot "$root" apt-get update -q </dev/null >"$root.apt.log" 2>&1 || {
    tail -n 30 "$root.apt.log" >&2
    exit 1
}
chroot "$root" apt-get install -y -q --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
    "${packages[@]}" </dev/null >>"$root.apt.log" 2>&1 || {
    tail -n 30 "$root.apt.log" >&2
    exit 1
}
chroot "$root" apt-get clean
echo "install_slurm_chroot: packages installed in $(($(date +%s) - began)) s"

# The packages create the slurm user; make sure it exists either way (a site's slurmctld and
# its EpilogSlurmctld run as this user, which is what the test cluster wants to reproduce).
if ! chroot "$root" getent passwd slurm >/dev/null; then
    chroot "$root" useradd --system --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin slurm
fi
# Bind-mount targets under /root (the host's Python may live in /root/.pyenv) must be
# traversable by that user.
chmod 755 "$root/root"
umount "$root/proc"

version=$(chroot "$root" dpkg-query -W -f='${Version}' slurmctld)
echo "slurm $version, debian $(cat "$root/etc/debian_version")" >"$marker"
echo "install_slurm_chroot: $root ready ($(cat "$marker"))"
