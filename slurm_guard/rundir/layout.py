"""The run directory: where every file lives, and the readers and writers of its records.

Layout (all on a filesystem shared by the nodes and the controller):

    identity.json                 the run's random id, written once by the first start
    guard.lock                    the job that uses the directory now (one job at a time)
    run.json                      seed, configuration, rank -> node map (rewritten per start)
    ledger.jsonl                  one line per verification result
    alarms/<alarm_id>.json        one alarm each, written once
    lost-alarm.<alarm_id>.upto-<S>  an alarm that could not be written: trust nothing after S
    handled/<alarm_id>.json       written by resume() once the rollback for that alarm is done
    checkpoints/step-NNNNNNNN/    meta.json + model.pt + optimizer.pt + rng-rank-<r>.pt
                                  [+ stateful-rank-<r>.pt: Guard(stateful=...), the scaler]
    quarantine/<alarm_id>/...     checkpoints newer than the trusted one, moved aside, never loaded

This module holds the paths, the readers and writers of the records above and the checkpoint
listing. The resume rule is in `trust`, guard.lock in `lock`, identity.json and the per-rank
markers (.markers/) in `identity`.

Fail closed: anything the resume rule needs but cannot read (an alarm, the checkpoint listing,
the run's identity) raises `RunDirError` instead of being skipped, because skipping it could
load a checkpoint saved after a fault.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_guard.errors import GuardError
from slurm_guard.rundir.records import (
    Alarm,
    RecordError,
    atomic_write_json,
    fsync_dir,
    read_alarm,
    read_json_file,
)
from slurm_guard.rundir.trust import CheckpointMeta, parse_checkpoint_meta

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "step-"
STAGING_PREFIX = ".staging-"
MARKERS_DIR = ".markers"
IDENTITY_FILE = "identity.json"
LOCK_FILE = "guard.lock"
LOST_ALARM_PREFIX = "lost-alarm."
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
class LostAlarm:
    """An alarm that could not be written: no checkpoint after `trust_upto` may be loaded."""

    alarm_id: str
    trust_upto: int | None  # None: nothing is trusted


@dataclass(frozen=True)
class CheckpointScan:
    """What `RunDir.scan_checkpoints` found: complete checkpoints and the damaged ones."""

    metas: list[CheckpointMeta]
    damaged: dict[int, str]  # step -> what is wrong (unreadable or malformed meta.json)


def listdir_or_raise(path: Path, what: str) -> list[str]:
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
    def snapshot_index(self) -> Path:
        """Rank 0's record of the snapshots its node sealed (status reads it; nothing loads it)."""
        return self.root / "snapshots.json"

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
        for name in listdir_or_raise(self.alarms_dir, "alarms"):
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
        for name in listdir_or_raise(self.alarms_dir, "alarms"):
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
        for name in listdir_or_raise(self.root, "records"):
            m = _LOST_ALARM.match(name)
            if m:
                upto = m.group("upto")
                out.append(LostAlarm(m.group("id"), None if upto == "none" else int(upto)))
        return out

    def handled_ids(self) -> set[str]:
        return {
            name[: -len(".json")]
            for name in listdir_or_raise(self.handled_dir, "handled alarms")
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
        for name in listdir_or_raise(self.checkpoints_dir, "checkpoints"):
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
        for name in listdir_or_raise(self.checkpoints_dir, "checkpoints"):
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
        for name in listdir_or_raise(self.checkpoints_dir, "checkpoints"):
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
        injected = obj.get("injected_faults")
        return {
            "run_id": _str_or_none(obj.get("run_id")),
            "attempt": _str_or_none(obj.get("attempt")),
            "job_id": _str_or_none(obj.get("job_id")),
            "restart_count": _int_or_none(obj.get("restart_count")),
            "world_size": _int_or_none(obj.get("world_size")),
            "config": (
                {str(k): _scalar(v) for k, v in config.items()} if isinstance(config, dict) else {}
            ),
            "injected_faults": (
                [f for f in injected if isinstance(f, str)] if isinstance(injected, list) else []
            ),
            "started": _time_or_none(obj.get("started")),
        }

    def resumes(self) -> list[dict[str, Any]]:
        """handled/<alarm_id>.json records, type-checked, oldest first; never raises."""
        out: list[dict[str, Any]] = []
        try:
            names = listdir_or_raise(self.handled_dir, "handled alarms")
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
