"""The run directory: where every file lives, and the resume rule that picks a checkpoint.

Layout (all on a filesystem shared by the nodes and the controller):

    run.json                      seed, configuration, rank -> node map (rewritten per start)
    ledger.jsonl                  one line per verification result
    alarms/<alarm_id>.json        one alarm each, written once
    handled/<alarm_id>.json       written by resume() once the rollback for that alarm is done
    checkpoints/step-NNNNNNNN/    meta.json + model.pt + optimizer.pt + rng-rank-<r>.pt
    quarantine/<alarm_id>/...     checkpoints newer than the trusted one, moved aside, never loaded
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_guard.protocol import CHECKPOINT_SCHEMA
from slurm_guard.records import (
    Alarm,
    RecordError,
    atomic_write_json,
    read_alarm,
    read_json_file,
)

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "step-"


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


class RunDir:
    """Paths and file operations of one run directory."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    @property
    def run_file(self) -> Path:
        return self.root / "run.json"

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

    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints_dir / f"{CHECKPOINT_PREFIX}{step:08d}"

    def alarm_path(self, alarm_id: str) -> Path:
        return self.alarms_dir / f"{alarm_id}.json"

    def ensure(self) -> None:
        for d in (self.alarms_dir, self.handled_dir, self.checkpoints_dir):
            d.mkdir(parents=True, exist_ok=True)

    def write_alarm(self, alarm: Alarm) -> Path:
        path = self.alarm_path(alarm.alarm_id)
        atomic_write_json(path, alarm.to_json(), overwrite=False)
        return path

    def alarms(self) -> tuple[list[Alarm], list[RecordError]]:
        """Every readable alarm, oldest step first, and the errors for the unreadable ones."""
        found: list[Alarm] = []
        errors: list[RecordError] = []
        if not self.alarms_dir.is_dir():
            return found, errors
        for path in sorted(self.alarms_dir.glob("*.json")):
            try:
                found.append(read_alarm(path))
            except RecordError as exc:
                errors.append(exc)
        found.sort(key=lambda a: (a.created, a.step))
        return found, errors

    def handled_ids(self) -> set[str]:
        if not self.handled_dir.is_dir():
            return set()
        return {p.stem for p in self.handled_dir.glob("*.json")}

    def mark_handled(self, alarm_id: str, record: dict[str, Any]) -> None:
        path = self.handled_dir / f"{alarm_id}.json"
        if not path.exists():
            atomic_write_json(path, record, overwrite=False)

    def checkpoints(self) -> list[CheckpointMeta]:
        """Complete checkpoints (meta.json present and parseable), oldest first.

        File hashes are verified at load time, not here: listing must stay cheap.
        """
        metas: list[CheckpointMeta] = []
        if not self.checkpoints_dir.is_dir():
            return metas
        for d in sorted(self.checkpoints_dir.glob(f"{CHECKPOINT_PREFIX}*")):
            meta_path = d / "meta.json"
            if not meta_path.is_file():
                continue  # a save that never finished: meta.json is written last
            try:
                metas.append(parse_checkpoint_meta(read_json_file(meta_path), str(meta_path)))
            except RecordError as exc:
                logger.warning("skipping checkpoint %s: %s", d, exc)
        metas.sort(key=lambda m: m.step)
        return metas

    def quarantine_after(self, step: int, alarm_id: str) -> list[str]:
        """Move every checkpoint newer than `step` aside, never deleting one."""
        moved: list[str] = []
        if not self.checkpoints_dir.is_dir():
            return moved
        target = self.quarantine_dir / alarm_id
        for d in sorted(self.checkpoints_dir.glob(f"{CHECKPOINT_PREFIX}*")):
            try:
                ckpt_step = int(d.name[len(CHECKPOINT_PREFIX) :])
            except ValueError:
                continue
            if ckpt_step > step:
                target.mkdir(parents=True, exist_ok=True)
                os.replace(d, target / d.name)
                moved.append(d.name)
        return moved
