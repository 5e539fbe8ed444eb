"""Seals of framework checkpoints (HF `checkpoint-N/`, Lightning `.ckpt`) and where they live.

A framework writes its checkpoints where its user said (HF's `output_dir`, Lightning's
`ModelCheckpoint.dirpath`, which moves to `version_1/` on a rerun), not into the run
directory. The guard seals each one beside it and records its location in the run directory
(`framework-checkpoints/<key>.json`, a copy of the seal), so that the alarm writer, the
controller and `slurm-guard status` see the checkpoints a rerun really resumes from, and a
rerun finds them wherever earlier attempts wrote them. Torch-free: the controller reads it.

A location record is only a pointer: the seal beside the checkpoint is the truth. A record
whose seal is gone (rotated, quarantined) or says another step (a `last.ckpt` written again)
is stale and ignored.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_guard.errors import GuardError
from slurm_guard.rundir.layout import RunDir, listdir_or_raise
from slurm_guard.rundir.records import RecordError, atomic_write_json, read_json_file

SEAL_SCHEMA = 1
LOCATIONS_DIR = "framework-checkpoints"
"""In the run directory: one record per sealed framework checkpoint location."""


@dataclass(frozen=True)
class Seal:
    """What the guard vouches for about one framework checkpoint."""

    step: int
    weight_fingerprint: str
    fingerprint_seed: int
    run_id: str
    files: dict[str, str]  # path relative to the checkpoint -> sha256
    location: str | None = None  # the checkpoint's absolute path when sealed (older: None)

    def as_json(self, restart_count: int, world_size: int) -> dict[str, Any]:
        return {
            "schema": SEAL_SCHEMA,
            "step": self.step,
            "clean_vote": True,
            "weight_fingerprint": self.weight_fingerprint,
            "fingerprint_seed": self.fingerprint_seed,
            "run_id": self.run_id,
            "files": self.files,
            "location": self.location,
            "restart_count": restart_count,
            "world_size": world_size,
            "created": time.time(),
        }


def parse_seal(obj: Any, source: str) -> Seal:
    if not isinstance(obj, dict) or obj.get("schema") != SEAL_SCHEMA:
        raise RecordError(f"{source}: not a slurm-guard seal of schema {SEAL_SCHEMA}")
    if obj.get("clean_vote") is not True:
        raise RecordError(f"{source}: saved without a clean weight vote")
    try:
        files = {str(k): str(v) for k, v in dict(obj["files"]).items()}
        location = obj.get("location")
        return Seal(
            int(obj["step"]),
            str(obj["weight_fingerprint"]),
            int(obj["fingerprint_seed"]),
            str(obj["run_id"]),
            files,
            location if isinstance(location, str) else None,
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise RecordError(f"{source}: malformed seal ({exc})") from None


def read_seal(path: Path) -> Seal:
    return parse_seal(read_json_file(path), str(path))


def _record_path(run_dir: RunDir, location: Path) -> Path:
    key = hashlib.sha256(str(location).encode()).hexdigest()[:20]
    return run_dir.root / LOCATIONS_DIR / f"{key}.json"


def record_location(
    run_dir: RunDir, seal_json: dict[str, Any], seal_path: Path, framework: str
) -> None:
    """Rank 0, after the seal beside the checkpoint is written: point the run directory at it.

    One record per location, replaced when the location is sealed again (`last.ckpt`).
    """
    location = Path(str(seal_json["location"]))
    record = {**seal_json, "seal": str(seal_path.absolute()), "framework": framework}
    atomic_write_json(_record_path(run_dir, location), record)
    _prune(run_dir.root / LOCATIONS_DIR)


def _prune(folder: Path) -> None:
    """Drop the records whose seal is gone (rotated away, quarantined): without this a run
    that saves every step would leave one record per checkpoint it ever wrote."""
    for name in listdir_or_raise(folder, "framework checkpoints"):
        try:
            record = read_json_file(folder / name)
            seal = Path(str(record["seal"])) if isinstance(record, dict) else None
        except (RecordError, KeyError):
            continue
        if seal is not None and not seal.exists():
            (folder / name).unlink(missing_ok=True)


@dataclass(frozen=True)
class Located:
    """A framework checkpoint the run directory points at, whose seal still says so."""

    step: int
    path: Path
    seal_path: Path
    run_id: str
    framework: str
    restart_count: int | None = None
    created: float | None = None


def located_checkpoints(run_dir: RunDir) -> list[Located]:
    """The sealed framework checkpoints recorded in the run directory that are still there.

    Raises RunDirError when the records' folder cannot be listed. A record that cannot be read
    is skipped (it only points at a seal; the seal is what a resume checks).
    """
    folder = run_dir.root / LOCATIONS_DIR
    found = []
    for name in listdir_or_raise(folder, "framework checkpoints"):
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            record = read_json_file(folder / name)
            if not isinstance(record, dict):
                continue
            recorded = parse_seal(record, str(folder / name))
            seal_path = Path(str(record["seal"]))
            seal = read_seal(seal_path)  # gone: rotated away or quarantined
        except (RecordError, KeyError):
            continue
        if (seal.step, seal.weight_fingerprint) != (recorded.step, recorded.weight_fingerprint):
            continue  # the location was sealed again since; its own record says so
        if recorded.location is None:
            continue
        found.append(
            Located(
                seal.step,
                Path(recorded.location),
                seal_path,
                seal.run_id,
                str(record.get("framework", "")),
                _number(record.get("restart_count"), int),
                _number(record.get("created"), float),
            )
        )
    found.sort(key=resume_order)
    return found


def _number(value: Any, kind: type) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return kind(value) if ok else None


def resume_order(item: Any) -> tuple[int, str]:
    """Newest step first; at one step the first path by name (a named `.ckpt` before
    `last.ckpt`). The resume and every view of it sort by this, so they name the same one."""
    return (-item.step, str(item.path))


def newest_located(run_dir: RunDir, up_to: int | None, run_id: str | None) -> Located | None:
    """The newest recorded framework checkpoint of run `run_id` at or before step `up_to`."""
    try:
        located = located_checkpoints(run_dir)
    except GuardError:
        return None
    allowed = [
        c
        for c in located
        if (up_to is None or c.step <= up_to) and (run_id is None or c.run_id == run_id)
    ]
    return allowed[0] if allowed else None


def run_id_of(run_dir: RunDir) -> str | None:
    """identity.json's run id, None when it cannot be read."""
    try:
        obj = read_json_file(run_dir.identity_file)
    except RecordError:
        return None
    value = obj.get("run_id") if isinstance(obj, dict) else None
    return value if isinstance(value, str) else None
