#!/bin/sh
# Per-node Epilog for slurm-guard snapshots (GuardConfig(snapshots=True), docs/snapshots.md):
# frees the memory a finished job's snapshots hold on this node. Slurm runs it on every node of
# the job (slurm.conf: Epilog=/path/to/slurm-guard-node-epilog.sh), as root, after the job's
# tasks are gone. A requeued job keeps its id and starts over on its nodes, so its snapshots go
# too; an in-job restart is not the end of the job and keeps them.
#
# The work is done by `python -m slurm_guard.rundir.node_epilog` (no torch import): it removes
# only <root>/<job>[-<run id>] directories that belong to the job's user (SLURM_JOB_UID), inside
# a root that belongs to that user, and never follows a link (docs/admin-guide.md, "What
# slurm-guard keeps on a node").
#
# Site settings come from /etc/default/slurm-guard (optional), for example:
#   SLURM_GUARD_PYTHON=/opt/slurm-guard/venv/bin/python   (a Python with slurm-guard installed)
#   SLURM_GUARD_SNAPSHOT_DIR=/local/nvme/slurm-guard-{uid}  (the jobs' snapshot_dir, if not the
#                                                           default /dev/shm/slurm-guard-{uid})
# It always exits 0: a failing node Epilog drains the node, and a leftover directory in
# /dev/shm is no reason to.
SLURM_GUARD_DEFAULTS=${SLURM_GUARD_DEFAULTS:-/etc/default/slurm-guard}
# shellcheck disable=SC1090
[ -r "$SLURM_GUARD_DEFAULTS" ] && . "$SLURM_GUARD_DEFAULTS"
[ -n "${SLURM_GUARD_SNAPSHOT_DIR:-}" ] && export SLURM_GUARD_SNAPSHOT_DIR
py=${SLURM_GUARD_PYTHON:-python3}
# From /, with no user site-packages: nothing a user wrote can be imported by root here.
cd / || exit 0
"$py" -s -m slurm_guard.rundir.node_epilog ||
    echo "slurm-guard-node-epilog: $py could not run slurm_guard.rundir.node_epilog (set SLURM_GUARD_PYTHON)" >&2
exit 0
