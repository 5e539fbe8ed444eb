"""Is this the run directory earlier starts and every rank use? identity.json and rank markers.

A run directory deleted and recreated, replaced by another run's, or a shared filesystem that is
not mounted (or is node-local disk) on some node would let a start trust checkpoints it must
not, or let ranks write to different places. Two checks catch that:

    identity.json                 the run's random id, written once by the first start; every
                                  later start and every save compares it (and the directory's
                                  device and inode) with what this start began with
    .markers/<attempt>/node-<i>   each node's first rank writes one at start and counts the others'

Both refuse with `RunDirError`, whose message says what to check and how to override.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from pathlib import Path

from slurm_guard.rundir.layout import (
    IDENTITY_FILE,
    OVERRIDE_HINT,
    RESUME_ENV,
    RunDir,
    RunDirError,
    listdir_or_raise,
)
from slurm_guard.rundir.records import RecordError, atomic_write_json, read_json_file

logger = logging.getLogger(__name__)


def establish_identity(rd: RunDir, *, job_id: str | None, fresh: bool) -> str:
    """The run's id from identity.json, creating it on a run directory's first start.

    Refused (RunDirError) when the directory is not the one earlier starts used: identity.json
    unreadable, or gone while run.json (written by an earlier start) names a run id, or the two
    disagree. That is a run directory deleted and recreated, replaced by another run's, or a
    mount that is missing. With `fresh` a new identity replaces the old one.
    """
    recorded: str | None = None
    with contextlib.suppress(RecordError):
        run = read_json_file(rd.run_file)
        if isinstance(run, dict) and isinstance(run.get("run_id"), str):
            recorded = run["run_id"]
    try:
        obj = read_json_file(rd.identity_file)
        run_id = obj.get("run_id") if isinstance(obj, dict) else None
        if not isinstance(run_id, str) or not re.fullmatch(r"[0-9a-f]{8,64}", run_id):
            raise RecordError(f"{rd.identity_file}: no valid 'run_id'")
    except RecordError as exc:
        missing = not os.path.lexists(rd.identity_file)
        if fresh:
            logger.warning("%s=fresh: replacing the run directory's identity", RESUME_ENV)
            if not missing:
                os.replace(
                    rd.identity_file, rd.root / f".{IDENTITY_FILE}.replaced-{time.time():.0f}"
                )
            return _create_identity(rd, job_id)
        if not missing:
            raise RunDirError(
                f"the run's identity cannot be read ({str(exc)[:200]}): is this the directory "
                f"earlier starts used? {OVERRIDE_HINT}"
            ) from None
        if recorded is not None:
            raise RunDirError(
                f"{rd.identity_file} is gone but run.json names run {recorded[:16]}: not the "
                "directory earlier starts used (recreated, restored in part, or a shared "
                f"filesystem not mounted here). Check the path and the mount. {OVERRIDE_HINT}"
            ) from None
        return _create_identity(rd, job_id)
    if recorded is not None and recorded != run_id and not fresh:
        raise RunDirError(
            f"{rd.root}: run.json names run {recorded[:16]}, identity.json {run_id[:16]}: "
            f"files of two runs are mixed in one directory. {OVERRIDE_HINT}"
        )
    return run_id


def _create_identity(rd: RunDir, job_id: str | None) -> str:
    run_id = os.urandom(8).hex()
    try:
        atomic_write_json(
            rd.identity_file,
            {"schema": 1, "run_id": run_id, "created": time.time(), "job_id": job_id},
            overwrite=False,
        )
    except FileExistsError:
        obj = read_json_file(rd.identity_file)
        return str(obj["run_id"])
    return run_id


def identity_stamp(rd: RunDir) -> tuple[int, int, int, int]:
    """(device, inode) of the run directory and of checkpoints/, as this process sees them."""
    a, b = os.stat(rd.root), os.stat(rd.checkpoints_dir)
    return (a.st_dev, a.st_ino, b.st_dev, b.st_ino)


def check_unchanged(rd: RunDir, stamp: tuple[int, int, int, int], run_id: str) -> str | None:
    """None if the run directory is still the one this start began with; else what changed.

    Called before each save: a directory removed (`rm -rf`) and recreated, or a shared
    filesystem unmounted under a path that still exists, must not receive checkpoints that
    later starts would trust.
    """
    try:
        now = identity_stamp(rd)
    except OSError as exc:
        return f"{rd.root} or its checkpoints/ is gone ({exc.strerror})"
    if now != stamp:
        return f"{rd.root} was replaced (another directory now has its path)"
    try:
        obj = read_json_file(rd.identity_file)
    except RecordError as exc:
        return f"its identity is gone ({exc})"
    if not isinstance(obj, dict) or obj.get("run_id") != run_id:
        return f"{rd.identity_file} now names another run"
    return None


# ---------------------------------------------------------------------- markers


def marker_path(rd: RunDir, attempt: str, node: int) -> Path:
    """One marker per node, not per rank: W markers listed by W ranks were O(W^2) directory
    entries served by the shared file server at every start; a node-local directory or a
    missing mount is a property of the node, so its first rank checks for all of its ranks."""
    return rd.markers_dir / attempt / f"node-{node}"


def prepare_markers(rd: RunDir, attempt: str) -> None:
    """Rank 0: a fresh marker directory for this attempt; earlier attempts' are removed."""
    for name in listdir_or_raise(rd.markers_dir, "markers"):
        if name != attempt:
            shutil.rmtree(rd.markers_dir / name, ignore_errors=True)
    (rd.markers_dir / attempt).mkdir(parents=True, exist_ok=True)


def write_marker(rd: RunDir, attempt: str, node: int, run_id: str) -> str | None:
    """Each node's first rank: leave the node's marker; None on success, else why not."""
    try:
        path = marker_path(rd, attempt, node)
        path.write_text(run_id)
    except OSError as exc:
        return f"cannot write {rd.markers_dir / attempt} ({exc.strerror})"
    return None


MARKER_RETRIES_S = (0.5, 1.0, 2.0, 4.0)


def markers_seen(rd: RunDir, attempt: str, nodes: int) -> int:
    """How many of the nodes' markers this rank sees.

    One directory listing when all is well. A listing can be stale on NFS (directory attribute
    caching), so a marker it misses is looked up by name, which a client does not answer from
    an old listing, and, if still missing, again after growing pauses (~7 s in all) before the
    rank reports it unseen.
    """
    directory = rd.markers_dir / attempt
    try:
        names = set(os.listdir(directory))
    except OSError:
        names = set()
    missing = [n for n in range(nodes) if f"node-{n}" not in names]
    for pause in (0.0, *MARKER_RETRIES_S):
        if not missing:
            break
        time.sleep(pause)
        missing = [n for n in missing if not os.path.lexists(directory / f"node-{n}")]
    return nodes - len(missing)


def markers_problem(
    seen: list[int], nodes: list[str], root: Path, expected: int | None = None
) -> str | None:
    """The start-up error if some rank did not see every marker (`expected`, default one per
    rank of `seen`), naming who."""
    world = len(seen) if expected is None else expected
    blind = [r for r, n in enumerate(seen) if n != world]
    if not blind:
        return None
    who = ", ".join(f"rank {r} ({nodes[r]}) sees {seen[r]} of {world}" for r in blind[:8])
    more = f" and {len(blind) - 8} more ranks" if len(blind) > 8 else ""
    return (
        f"the ranks do not share the run directory {root}: every rank wrote a marker into it "
        f"and {who}{more}. It must be one directory on a filesystem that every node mounts at "
        "the same path (not node-local disk such as /tmp or a missing mount)"
    )
