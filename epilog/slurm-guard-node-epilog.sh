#!/bin/sh
# Per-node Epilog for slurm-guard snapshots (GuardConfig(snapshots=True), docs/snapshots.md):
# frees the memory a finished job's snapshots hold on this node. Slurm runs it on every node of
# the job (slurm.conf: Epilog=/path/to/slurm-guard-node-epilog.sh), as root, after the job's
# tasks are gone. A requeued job keeps its id and starts over on its nodes, so its snapshots go
# too; an in-job restart is not the end of the job and keeps them.
#
# Set SLURM_GUARD_SNAPSHOT_DIR here if the site keeps snapshots elsewhere than the default
# (the jobs' GuardConfig(snapshot_dir=...)). It always exits 0: a failing node Epilog drains the
# node, and a leftover directory in /dev/shm is no reason to.
root="${SLURM_GUARD_SNAPSHOT_DIR:-/dev/shm/slurm-guard}"
case "$root" in
*"{node}"*) root=$(printf '%s' "$root" | sed "s/{node}/${SLURMD_NODENAME:-}/g") ;;
esac
job="${SLURM_JOB_ID:-}"
case "$job" in
"" | .* | *[!A-Za-z0-9._-]*)
    echo "slurm-guard-node-epilog: no usable SLURM_JOB_ID ('$job'): nothing removed" >&2
    exit 0
    ;;
esac
if [ -d "$root/$job" ]; then
    rm -rf -- "${root:?}/$job" || echo "slurm-guard-node-epilog: could not remove $root/$job" >&2
fi
exit 0
