"""The run directory: where every file lives, and the resume rule that picks a checkpoint.

Layout (all on a filesystem shared by the nodes and the controller):

    identity.json                 the run's random id, written once by the first start
    guard.lock                    the job that uses the directory now (one job at a time)
    run.json                      seed, configuration, rank -> node map (rewritten per start)
    ledger.jsonl                  one line per verification result
    alarms/<alarm_id>.json        one alarm each, written once
    lost-alarm.<alarm_id>.upto-<S>  an alarm that could not be written: trust nothing after S
    handled/<alarm_id>.json       written by resume() once the rollback for that alarm is done
    checkpoints/step-NNNNNNNN/    meta.json + model.pt + optimizer.pt + rng-rank-<r>.pt
    quarantine/<alarm_id>/...     checkpoints newer than the trusted one, moved aside, never loaded

Fail closed: anything the resume rule needs but cannot read (an alarm, the checkpoint listing,
the run's identity) raises `RunDirError` instead of being skipped, because skipping it could
load a checkpoint saved after a fault.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_guard.errors import GuardError
from slurm_guard.protocol import CHECKPOINT_SCHEMA
from slurm_guard.records import (
    Alarm,
    RecordError,
    atomic_write_json,
    fsync_dir,
    read_alarm,
    read_json_file,
)

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "step-"
STAGING_PREFIX = ".staging-"
MARKERS_DIR = ".markers"
IDENTITY_FILE = "identity.json"
LOCK_FILE = "guard.lock"
LOST_ALARM_PREFIX = "lost-alarm."
HEARTBEAT_S = 15.0
"""Rank 0 refreshes the lock's mtime this often."""
STALE_AFTER_S = 120.0
"""A lock whose mtime is older than this (by the file server's clock) belongs to a dead job.

Longer than NFS attribute caching (acregmax, 60 s by default) plus a few heartbeats, so a live
job on another node is never taken for dead.
"""
RESUME_ENV = "SLURM_GUARD_RESUME"
"""`SLURM_GUARD_RESUME=fresh`: the deliberate override of every refusal at start and resume."""

_LOST_ALARM = re.compile(r"^lost-alarm\.(?P<id>[^/]+)\.upto-(?P<upto>none|\d+)$")


class RunDirError(GuardError):
    """The run directory cannot be trusted as it is; the message says why and what to do."""


def fresh_start_requested() -> bool:
    """Whether the user asked to start over from step 0 (`SLURM_GUARD_RESUME=fresh`)."""
    return os.environ.get(RESUME_ENV, "").strip().lower() == "fresh"


OVERRIDE_HINT = (
    f"Or start over: {RESUME_ENV}=fresh for one start (loads nothing, moves the old "
    "checkpoints to quarantine/)."
)
"""Ends every refusal; kept short: other ranks see the first ~600 characters of an error."""


@dataclass(frozen=True)
class CheckpointMeta:
    """What `meta.json` says about one checkpoint; written last, so its presence means complete."""

    step: int
    weight_fingerprint: str
    clean_vote: bool
    files: dict[str, str]  # file name -> sha256
    world_size: int
    restart_count: int
    created: float
    schema: int = CHECKPOINT_SCHEMA
    fingerprint_seed: int | None = None  # the seed weight_fingerprint was computed under
    run_id: str | None = None  # identity.json's run_id of the run that saved it


def parse_checkpoint_meta(obj: Any, source: str) -> CheckpointMeta:
    if not isinstance(obj, dict):
        raise RecordError(f"{source}: expected a JSON object")
    schema = obj.get("schema")
    if not isinstance(schema, int) or schema < 1 or schema > CHECKPOINT_SCHEMA:
        raise RecordError(f"{source}: unsupported checkpoint schema {schema!r}")
    try:
        files = obj["files"]
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and "/" not in k for k, v in files.items()
        ):
            raise RecordError(f"{source}: 'files' must map plain file names to sha256 strings")
        return CheckpointMeta(
            step=int(obj["step"]),
            weight_fingerprint=str(obj["weight_fingerprint"]),
            clean_vote=obj["clean_vote"] is True,
            files=dict(files),
            world_size=int(obj["world_size"]),
            restart_count=int(obj["restart_count"]),
            created=float(obj["created"]),
            schema=schema,
            fingerprint_seed=(
                int(obj["fingerprint_seed"]) if obj.get("fingerprint_seed") is not None else None
            ),
            run_id=str(obj["run_id"]) if isinstance(obj.get("run_id"), str) else None,
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise RecordError(f"{source}: malformed checkpoint metadata ({exc})") from None


def trust_limit(
    last_verified: int | None, verified_steps: Iterable[int], trust_replays: int
) -> int | None:
    """The newest step a trusted checkpoint may have: `trust_replays` passing replays after it.

    With trust_replays=1 that is the last passing replay V itself (the published rule). A fault
    that only shows on some data (dropout zeroing the corrupted activation in both computations,
    say) can pass one replay after its onset; each further required pass makes that less likely.
    """
    if last_verified is None:
        return None
    passes = sorted({s for s in verified_steps if s <= last_verified} | {last_verified})
    return passes[-trust_replays] if len(passes) >= trust_replays else None


def choose_trusted_checkpoint(
    checkpoints: list[CheckpointMeta],
    alarm: Alarm | None,
    verified_steps: Iterable[int] = (),
    trust_replays: int = 1,
) -> CheckpointMeta | None:
    """The resume rule.

    Without an alarm: the newest checkpoint saved after a clean vote. After an alarm: the newest
    clean checkpoint whose step (= completed steps) is at most `trust_limit`, i.e. followed by
    `trust_replays` passing replays before the alarm. A persistent fault that began after those
    replays cannot have touched it. With too few verified steps nothing is trusted and training
    restarts from scratch.
    """
    if alarm is None:
        return newest_clean(checkpoints)
    limit = trust_limit(alarm.last_verified_step, verified_steps, trust_replays)
    return None if limit is None else newest_clean(checkpoints, limit)


def newest_clean(
    checkpoints: list[CheckpointMeta], up_to: int | None = None
) -> CheckpointMeta | None:
    """The newest checkpoint saved after a clean vote, at or before step `up_to` if given."""
    clean = [c for c in checkpoints if c.clean_vote and (up_to is None or c.step <= up_to)]
    return max(clean, key=lambda c: c.step, default=None)


@dataclass(frozen=True)
class LostAlarm:
    """An alarm that could not be written: no checkpoint after `trust_upto` may be loaded."""

    alarm_id: str
    trust_upto: int | None  # None: nothing is trusted


@dataclass(frozen=True)
class CheckpointScan:
    """What `RunDir.scan_checkpoints` found: complete checkpoints and the damaged ones."""

    metas: list[CheckpointMeta]
    damaged: dict[int, str]  # step -> what is wrong (unreadable or malformed meta.json)


def _listdir(path: Path, what: str) -> list[str]:
    """Names in `path`; [] if it does not exist; RunDirError if it exists but cannot be listed.

    `Path.glob` hides a permission error as "no files", which made an unreadable checkpoints/
    look like a fresh run (and its checkpoints got overwritten).
    """
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise RunDirError(
            f"{path} cannot be listed ({exc.strerror}): the guard cannot tell which {what} "
            "exist. Give the training user read and search permission on it (chmod u+rx)."
        ) from None


def _step_of(name: str) -> int | None:
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    digits = name[len(CHECKPOINT_PREFIX) :]
    return int(digits) if digits.isdigit() else None


class RunDir:
    """Paths and file operations of one run directory."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    @property
    def run_file(self) -> Path:
        return self.root / "run.json"

    @property
    def identity_file(self) -> Path:
        return self.root / IDENTITY_FILE

    @property
    def lock_file(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.jsonl"

    @property
    def alarms_dir(self) -> Path:
        return self.root / "alarms"

    @property
    def handled_dir(self) -> Path:
        return self.root / "handled"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def quarantine_dir(self) -> Path:
        return self.root / "quarantine"

    @property
    def markers_dir(self) -> Path:
        return self.root / MARKERS_DIR

    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints_dir / f"{CHECKPOINT_PREFIX}{step:08d}"

    def alarm_path(self, alarm_id: str) -> Path:
        return self.alarms_dir / f"{alarm_id}.json"

    def ensure(self) -> None:
        for d in (self.alarms_dir, self.handled_dir, self.checkpoints_dir):
            d.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ alarms

    def write_alarm(self, alarm: Alarm) -> Path:
        path = self.alarm_path(alarm.alarm_id)
        atomic_write_json(path, alarm.to_json(), overwrite=False)
        return path

    def alarms(self) -> tuple[list[Alarm], list[RecordError]]:
        """Every readable alarm, oldest step first, and the errors for the unreadable ones.

        Raises RunDirError if alarms/ exists but cannot be listed.
        """
        found: list[Alarm] = []
        errors: list[RecordError] = []
        for name in _listdir(self.alarms_dir, "alarms"):
            if not name.endswith(".json") or name.startswith("."):
                continue
            path = self.alarms_dir / name
            try:
                found.append(read_alarm(path))
            except RecordError as exc:
                errors.append(exc)
        found.sort(key=lambda a: (a.created, a.step))
        return found, errors

    def unreadable_alarms(self) -> dict[str, str]:
        """Alarm files (by name without .json) that `read_alarm` refuses, with the reason."""
        bad: dict[str, str] = {}
        for name in _listdir(self.alarms_dir, "alarms"):
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                alarm = read_alarm(self.alarms_dir / name)
            except RecordError as exc:
                bad[name[: -len(".json")]] = str(exc)
                continue
            if alarm.alarm_id != name[: -len(".json")]:
                bad[name[: -len(".json")]] = (
                    f"{self.alarms_dir / name}: alarm_id {alarm.alarm_id[:80]!r} differs from "
                    "the file name"
                )
        return bad

    def mark_lost_alarm(self, alarm_id: str, trust_upto: int | None) -> Path:
        """Record, as an empty file whose name says it all, an alarm that could not be written.

        An empty file needs no data blocks, so this still works on a full disk, and it is in
        the run directory's root, which the guard checked is writable at start.
        """
        upto = "none" if trust_upto is None else str(int(trust_upto))
        path = self.root / f"{LOST_ALARM_PREFIX}{alarm_id}.upto-{upto}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
        os.close(fd)
        with contextlib.suppress(OSError):
            fsync_dir(self.root)
        return path

    def lost_alarms(self) -> list[LostAlarm]:
        """Alarms the guard could not write (see `mark_lost_alarm`)."""
        out = []
        for name in _listdir(self.root, "records"):
            m = _LOST_ALARM.match(name)
            if m:
                upto = m.group("upto")
                out.append(LostAlarm(m.group("id"), None if upto == "none" else int(upto)))
        return out

    def handled_ids(self) -> set[str]:
        return {
            name[: -len(".json")]
            for name in _listdir(self.handled_dir, "handled alarms")
            if name.endswith(".json") and not name.startswith(".")
        }

    def mark_handled(self, alarm_id: str, record: dict[str, Any]) -> None:
        path = self.handled_dir / f"{alarm_id}.json"
        if not path.exists():
            atomic_write_json(path, record, overwrite=False)

    # ------------------------------------------------------------------ checkpoints

    def checkpoints(self) -> list[CheckpointMeta]:
        """Complete checkpoints (meta.json present and parseable), oldest first.

        File hashes are verified at load time, not here: listing must stay cheap. Damaged ones
        are skipped with a warning (see `scan_checkpoints` for the fail-closed variant).
        """
        try:
            scan = self.scan_checkpoints()
        except RunDirError as exc:
            logger.warning("%s", exc)
            return []
        for step, problem in scan.damaged.items():
            logger.warning("skipping checkpoint %s: %s", self.checkpoint_path(step), problem)
        return scan.metas

    def scan_checkpoints(self) -> CheckpointScan:
        """Complete checkpoints and damaged ones; RunDirError if checkpoints/ can't be listed.

        A step directory without meta.json is an unfinished save (meta.json is written last)
        and is neither; one whose meta.json or directory cannot be read is damaged.
        """
        metas: list[CheckpointMeta] = []
        damaged: dict[int, str] = {}
        for name in _listdir(self.checkpoints_dir, "checkpoints"):
            step = _step_of(name)
            if step is None:
                continue
            meta_path = self.checkpoints_dir / name / "meta.json"
            try:
                os.lstat(meta_path)
            except FileNotFoundError:
                continue  # a save that never finished
            except OSError as exc:
                damaged[step] = f"{meta_path} cannot be read ({exc.strerror})"
                continue
            try:
                meta = parse_checkpoint_meta(read_json_file(meta_path), str(meta_path))
            except RecordError as exc:
                damaged[step] = str(exc)
                continue
            if meta.step != step:
                damaged[step] = f"{meta_path} says step {meta.step}, not {step}"
                continue
            metas.append(meta)
        metas.sort(key=lambda m: m.step)
        return CheckpointScan(metas, damaged)

    def quarantine_after(self, step: int, alarm_id: str) -> list[str]:
        """Move every checkpoint newer than `step` aside, never deleting one."""
        moved: list[str] = []
        target = self.quarantine_dir / alarm_id
        for name in _listdir(self.checkpoints_dir, "checkpoints"):
            ckpt_step = _step_of(name)
            if ckpt_step is not None and ckpt_step > step:
                target.mkdir(parents=True, exist_ok=True)
                os.replace(self.checkpoints_dir / name, target / name)
                moved.append(name)
        return moved

    def remove_stale_staging(self, keep: str | None = None) -> list[str]:
        """Delete staging directories of earlier attempts (killed saves); names removed.

        Only safe while this job holds the lock: no other job can be writing one.
        """
        removed = []
        for name in _listdir(self.checkpoints_dir, "checkpoints"):
            if name.startswith(STAGING_PREFIX) and (keep is None or not name.endswith(keep)):
                shutil.rmtree(self.checkpoints_dir / name, ignore_errors=True)
                removed.append(name)
        return removed

    # ------------------------------------------------------------------ readers for views

    def run_info(self) -> dict[str, Any]:
        """run.json with every field type-checked: odd fields become None, never a traceback."""
        try:
            obj = read_json_file(self.run_file)
        except RecordError as exc:
            return {"error": str(exc)}
        if not isinstance(obj, dict):
            return {"error": f"{self.run_file}: expected a JSON object"}
        config = obj.get("config")
        return {
            "run_id": _str_or_none(obj.get("run_id")),
            "attempt": _str_or_none(obj.get("attempt")),
            "job_id": _str_or_none(obj.get("job_id")),
            "restart_count": _int_or_none(obj.get("restart_count")),
            "world_size": _int_or_none(obj.get("world_size")),
            "config": (
                {str(k): _scalar(v) for k, v in config.items()} if isinstance(config, dict) else {}
            ),
            "started": _time_or_none(obj.get("started")),
        }

    def resumes(self) -> list[dict[str, Any]]:
        """handled/<alarm_id>.json records, type-checked, oldest first; never raises."""
        out: list[dict[str, Any]] = []
        try:
            names = _listdir(self.handled_dir, "handled alarms")
        except RunDirError as exc:
            logger.warning("%s", exc)
            return out
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                obj = read_json_file(self.handled_dir / name)
            except RecordError:
                continue
            if not isinstance(obj, dict):
                continue
            moved = obj.get("quarantined")
            out.append(
                {
                    "alarm_id": name[: -len(".json")],
                    "resumed_from_step": _int_or_none(obj.get("resumed_from_step")),
                    "restart_count": _int_or_none(obj.get("restart_count")),
                    "quarantined": (
                        [m for m in moved if isinstance(m, str)] if isinstance(moved, list) else []
                    ),
                    "time": _time_or_none(obj.get("time")),
                }
            )
        out.sort(key=lambda r: r["time"] or 0.0)
        return out


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _time_or_none(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        t = float(v)
    except OverflowError:
        return None
    return t if math.isfinite(t) else None


def _scalar(v: Any) -> Any:
    """A config value as status shows it: scalars kept, anything else as compact JSON text."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    try:
        return json.dumps(v, sort_keys=True)[:200]
    except (TypeError, ValueError, RecursionError):
        return "?"


# ---------------------------------------------------------------------- identity


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


def marker_path(rd: RunDir, attempt: str, rank: int) -> Path:
    return rd.markers_dir / attempt / f"rank-{rank}"


def prepare_markers(rd: RunDir, attempt: str) -> None:
    """Rank 0: a fresh marker directory for this attempt; earlier attempts' are removed."""
    for name in _listdir(rd.markers_dir, "markers"):
        if name != attempt:
            shutil.rmtree(rd.markers_dir / name, ignore_errors=True)
    (rd.markers_dir / attempt).mkdir(parents=True, exist_ok=True)


def write_marker(rd: RunDir, attempt: str, rank: int, run_id: str) -> str | None:
    """Every rank: leave a marker; None on success, else why it could not."""
    try:
        path = marker_path(rd, attempt, rank)
        path.write_text(run_id)
    except OSError as exc:
        return f"cannot write {rd.markers_dir / attempt} ({exc.strerror})"
    return None


MARKER_RETRIES_S = (0.5, 1.0, 2.0, 4.0)


def markers_seen(rd: RunDir, attempt: str, world_size: int) -> int:
    """How many of the ranks' markers this rank sees.

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
    missing = [r for r in range(world_size) if f"rank-{r}" not in names]
    for pause in (0.0, *MARKER_RETRIES_S):
        if not missing:
            break
        time.sleep(pause)
        missing = [r for r in missing if not os.path.lexists(directory / f"rank-{r}")]
    return world_size - len(missing)


def markers_problem(seen: list[int], nodes: list[str], root: Path) -> str | None:
    """The start-up error if some rank did not see every rank's marker, naming who."""
    world = len(seen)
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


# ---------------------------------------------------------------------- lock


@dataclass(frozen=True)
class LockHolder:
    job_id: str | None
    restart_count: int
    attempt: str
    host: str
    pid: int


def _fs_now(directory: Path) -> float:
    """The file server's clock: the mtime of a file created now (node clocks may differ)."""
    probe = directory / f".clock-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        os.unlink(probe)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def stale_reason(holder: LockHolder | None, age: float, me: LockHolder) -> str | None:
    """Why the lock's holder is dead (so the lock may be taken over), or None if it may live.

    The rule, in order: the same process (an earlier Guard object) or a process of this host
    that no longer exists; an earlier incarnation (lower restart count) of this very Slurm job,
    which Slurm ended before the requeue; a heartbeat older than STALE_AFTER_S. A lock file that
    cannot be parsed is judged by its heartbeat alone.
    """
    if holder is not None:
        if holder.host == me.host and holder.pid == me.pid:
            return "an earlier Guard of this process"
        if holder.host == me.host and not _pid_alive(holder.pid):
            return f"process {holder.pid} on this host has exited"
        if (
            holder.job_id is not None
            and holder.job_id == me.job_id
            and holder.restart_count < me.restart_count
        ):
            return f"restart {holder.restart_count} of this job ended before this restart"
    if age > STALE_AFTER_S:
        return f"no heartbeat for {age:.0f} s"
    return None


class RunLock:
    """One job per run directory: `guard.lock`, held by rank 0, refreshed by a heartbeat.

    The file holds the holder's job id, restart count, attempt, host and pid; its mtime is the
    heartbeat, refreshed every HEARTBEAT_S by a daemon thread. See `stale_reason` for when a
    lock is taken over.
    """

    def __init__(self, rd: RunDir, me: LockHolder) -> None:
        self.rd = rd
        self.me = me
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(
        cls, rd: RunDir, *, job_id: str | None, restart_count: int, attempt: str
    ) -> RunLock:
        me = LockHolder(job_id, restart_count, attempt, socket.gethostname(), os.getpid())
        lock = cls(rd, me)
        for _ in range(5):
            try:
                atomic_write_json(rd.lock_file, me.__dict__, overwrite=False)
            except FileExistsError:
                pass
            else:
                lock._start_heartbeat()
                return lock
            holder, age = lock._read_holder()
            if holder is not None and holder.attempt == attempt:
                lock._start_heartbeat()
                return lock
            reason = stale_reason(holder, age, me)
            if reason is None:
                who = (
                    f"job {holder.job_id or '(none)'} restart {holder.restart_count}, host "
                    f"{holder.host}, pid {holder.pid}"
                    if holder is not None
                    else "an unreadable lock"
                )
                raise RunDirError(
                    f"run directory {rd.root} is in use by {who} (heartbeat {age:.0f} s ago): "
                    "one job per run directory. Give this job its own, or stop the other. A "
                    f"dead job's lock is taken over after {STALE_AFTER_S:.0f} s without "
                    f"heartbeat; to take it now, delete {rd.lock_file}."
                )
            aside = rd.root / f".{LOCK_FILE}.stale-{attempt}"
            try:
                os.replace(rd.lock_file, aside)  # one contender wins; the other retries
                os.unlink(aside)
            except FileNotFoundError:
                continue
            logger.warning(
                "run directory %s: taking over the lock of %s: %s",
                rd.root,
                holder or "an unreadable lock file",
                reason,
            )
        raise RunDirError(f"could not take the lock {rd.lock_file}: other jobs keep taking it")

    def _read_holder(self, *, with_age: bool = True) -> tuple[LockHolder | None, float]:
        """The holder (None if unreadable) and its heartbeat's age (0 unless `with_age`)."""
        try:
            mtime = os.lstat(self.rd.lock_file).st_mtime
            age = _fs_now(self.rd.root) - mtime if with_age else 0.0
        except FileNotFoundError:
            return None, math.inf
        try:
            obj = read_json_file(self.rd.lock_file)
            holder = LockHolder(
                job_id=obj["job_id"] if isinstance(obj["job_id"], str) else None,
                restart_count=int(obj["restart_count"]),
                attempt=str(obj["attempt"]),
                host=str(obj["host"]),
                pid=int(obj["pid"]),
            )
        except (RecordError, KeyError, TypeError, ValueError, OverflowError):
            return None, age
        return holder, age

    def held(self) -> bool:
        """Whether the lock file still names this attempt (another job may have taken it)."""
        holder, _ = self._read_holder(with_age=False)
        return holder is not None and holder.attempt == self.me.attempt

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(
            target=self._beat, name=f"slurm-guard-lock-{self.me.attempt}", daemon=True
        )
        self._thread.start()
        atexit.register(self.release)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self.held():
                    logger.error("run directory %s: the lock was taken over", self.rd.root)
                    return
                os.utime(self.rd.lock_file)
            except OSError as exc:
                logger.warning("lock heartbeat failed: %s", exc)

    def release(self) -> None:
        """Remove the lock if it is still ours (at exit; a crash leaves it to go stale)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            if self.held():
                os.unlink(self.rd.lock_file)
