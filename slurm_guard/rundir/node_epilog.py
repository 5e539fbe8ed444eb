"""The node epilog's work: remove a finished job's snapshot directories, as root, safely.

Slurm runs `epilog/slurm-guard-node-epilog.sh` as root on every node of a job once its tasks are
gone; the script runs `python -m slurm_guard.rundir.node_epilog`. Everything below the site's
snapshot directory may have been made by a user, so this treats it as hostile: the user's root
(`/dev/shm/slurm-guard-<uid>` by default) is opened without following a link and must belong to
the job's user (`SLURM_JOB_UID`, else `SLURM_JOB_USER`); only its entries named `<job>` or
`<job>-<run id>` that are directories of that user are removed, through directory descriptors
(`rundir.private_dir.remove_owned_dirs`): a link is never followed, at any depth. Whatever
happens, it exits 0: a failing node epilog drains the node, and a leftover directory in
/dev/shm is no reason to. Torch is never imported (it must be quick).
"""

from __future__ import annotations

import os
import pwd
import sys
from collections.abc import Mapping
from pathlib import Path

from slurm_guard.rundir.private_dir import remove_owned_dirs

__all__ = ["clean", "main"]

DEFAULT_ROOT = "/dev/shm/slurm-guard-{uid}"  # rundir.snapshots.DEFAULT_SNAPSHOT_ROOT
PREFIX = "slurm-guard-node-epilog"


def _plain(name: str) -> bool:
    return bool(name) and name[0] != "." and all(c.isalnum() or c in "._-" for c in name)


def _job_uid(env: Mapping[str, str]) -> int | None:
    uid = env.get("SLURM_JOB_UID", "")
    if uid.isdigit():
        return int(uid)
    try:
        return pwd.getpwnam(env.get("SLURM_JOB_USER", "")).pw_uid
    except KeyError:
        return None


def clean(env: Mapping[str, str]) -> list[str]:
    """Remove the job's snapshot directories on this node; the lines to log."""
    job = env.get("SLURM_JOB_ID", "")
    if not _plain(job):
        return [f"no usable SLURM_JOB_ID ({job!r}): nothing removed"]
    uid = _job_uid(env)
    if uid is None:
        return [f"job {job}: no SLURM_JOB_UID or known SLURM_JOB_USER: nothing removed"]
    template = env.get("SLURM_GUARD_SNAPSHOT_DIR") or DEFAULT_ROOT
    node = env.get("SLURMD_NODENAME", "")
    if "{node}" in template and not _plain(node):
        return [f"job {job}: no usable SLURMD_NODENAME for {template}: nothing removed"]
    root = Path(os.path.abspath(template.replace("{node}", node).replace("{uid}", str(uid))))
    if not os.path.lexists(root):
        return []
    try:
        removed, refused = remove_owned_dirs(root, uid, job)
    except OSError as exc:
        return [f"job {job}: {exc.filename or root}: {exc.strerror or exc}: nothing removed"]
    return [f"removed {path}" for path in removed] + [f"not removed: {why}" for why in refused]


def main() -> int:
    try:
        for line in clean(os.environ):
            print(f"{PREFIX}: {line}", file=sys.stderr)
    except BaseException as exc:  # always 0: a failing node epilog would drain the node
        print(f"{PREFIX}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
