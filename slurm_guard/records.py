"""Versioned records that live in the run directory, and the one way to write them.

The run directory is shared by every rank, by requeued incarnations of the job and by the
controller, which may read a file while a rank writes it. So every record is written to a
temporary file, fsynced and renamed into place: a reader sees the whole file or none of it. Alarm
files are never overwritten; state that changes later (an alarm was handled) goes into a new file.

Readers treat the files as untrusted input: a user's job wrote them and the controller acts on
them as root. `parse_alarm` checks size, type and schema and raises `RecordError` with a message
that says what is wrong and what to do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_guard.protocol import ALARM_SCHEMA, LEDGER_SCHEMA

MAX_RECORD_BYTES = 1 << 20  # an alarm is a few KiB; anything near this is not ours

VERDICTS = ("sdc", "ambiguous", "numerical")
CHECKS = (
    "finite_local",
    "finite_reduced",
    "replay",
    "vote",
    "conservation",
    "reduced_consistency",
)


class RecordError(ValueError):
    """A run-directory file is missing, unreadable, malformed or from an unknown schema."""


def atomic_write_bytes(path: Path, data: bytes, *, overwrite: bool = True) -> None:
    """Write `data` so that readers see all of it or nothing.

    With overwrite=False an existing file is never replaced (alarms are write-once):
    `FileExistsError` is raised instead.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            # link() fails if the target exists, unlike rename(): write-once without a race.
            os.link(tmp, path)
            os.unlink(tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename durable: the directory entry must reach the disk too."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: Any, *, overwrite: bool = True) -> None:
    atomic_write_bytes(
        path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode(), overwrite=overwrite
    )


def read_json_file(path: Path, *, max_bytes: int = MAX_RECORD_BYTES) -> Any:
    """Read one JSON record defensively: no symlinks, no special files, bounded size."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise RecordError(f"{path}: no such file") from None
    if stat.S_ISLNK(st.st_mode):
        raise RecordError(f"{path}: is a symbolic link; records must be regular files")
    if not stat.S_ISREG(st.st_mode):
        raise RecordError(f"{path}: not a regular file")
    if st.st_size > max_bytes:
        raise RecordError(f"{path}: {st.st_size} bytes, larger than the {max_bytes}-byte limit")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    try:
        return json.loads(data)
    # ValueError: also integers longer than Python's digit limit; RecursionError: nesting.
    except (ValueError, RecursionError) as exc:
        raise RecordError(
            f"{path}: not valid JSON ({exc}); the file is truncated or was not written by "
            "slurm-guard. Move it aside and rerun."
        ) from None


@dataclass(frozen=True)
class RankInfo:
    """Where one rank runs: the Slurm node name (what Slurm drains) and the real host name."""

    rank: int
    node: str
    hostname: str


@dataclass(frozen=True)
class Alarm:
    """One detected fault. Written once by rank 0, read by the controller and `resume()`."""

    alarm_id: str
    job_id: str | None
    restart_count: int
    step: int
    check: str
    verdict: str
    suspect_ranks: tuple[int, ...]
    suspect_nodes: tuple[str, ...]
    suspect_hosts: tuple[str, ...]
    last_verified_step: int | None
    trusted_checkpoint: str | None
    update_applied: bool
    evidence: dict[str, Any]
    message: str
    world_size: int
    created: float = field(default_factory=time.time)
    schema: int = ALARM_SCHEMA

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in ("suspect_ranks", "suspect_nodes", "suspect_hosts"):
            d[key] = list(d[key])
        return d


_ALARM_TYPES: dict[str, tuple[type, ...]] = {
    "alarm_id": (str,),
    "job_id": (str, type(None)),
    "restart_count": (int,),
    "step": (int,),
    "check": (str,),
    "verdict": (str,),
    "suspect_ranks": (list,),
    "suspect_nodes": (list,),
    "suspect_hosts": (list,),
    "last_verified_step": (int, type(None)),
    "trusted_checkpoint": (str, type(None)),
    "update_applied": (bool,),
    "evidence": (dict,),
    "message": (str,),
    "world_size": (int,),
    "created": (int, float),
    "schema": (int,),
}


def parse_alarm(obj: Any, source: str = "alarm") -> Alarm:
    """Validate a decoded alarm record; raise RecordError saying exactly what is wrong."""
    if not isinstance(obj, dict):
        raise RecordError(f"{source}: expected a JSON object, got {type(obj).__name__}")
    schema = obj.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool):
        raise RecordError(f"{source}: missing integer 'schema' field")
    if schema > ALARM_SCHEMA:
        raise RecordError(
            f"{source}: schema {schema} is newer than this slurm-guard understands "
            f"({ALARM_SCHEMA}); upgrade slurm-guard on the controller host"
        )
    if schema < 1:
        raise RecordError(f"{source}: invalid schema {schema}")
    for key, types in _ALARM_TYPES.items():
        if key not in obj:
            raise RecordError(f"{source}: missing field {key!r}")
        value = obj[key]
        if isinstance(value, bool) and bool not in types:
            raise RecordError(f"{source}: field {key!r} must not be a boolean")
        if not isinstance(value, types):
            names = "/".join(t.__name__ for t in types)
            raise RecordError(f"{source}: field {key!r} must be {names}")
    if obj["verdict"] not in VERDICTS:
        raise RecordError(f"{source}: unknown verdict {obj['verdict']!r}; expected {VERDICTS}")
    if obj["check"] not in CHECKS:
        raise RecordError(f"{source}: unknown check {obj['check']!r}; expected {CHECKS}")
    ranks = obj["suspect_ranks"]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
        raise RecordError(f"{source}: suspect_ranks must be non-negative integers")
    for key in ("suspect_nodes", "suspect_hosts"):
        if not all(isinstance(n, str) and n and len(n) < 256 for n in obj[key]):
            raise RecordError(f"{source}: {key} must be non-empty strings")
    if not obj["alarm_id"] or "/" in obj["alarm_id"] or len(obj["alarm_id"]) > 200:
        raise RecordError(f"{source}: invalid alarm_id {obj['alarm_id']!r}")
    known = {f.name for f in dataclasses.fields(Alarm)}
    values = {k: v for k, v in obj.items() if k in known}
    for key in ("suspect_ranks", "suspect_nodes", "suspect_hosts"):
        values[key] = tuple(values[key])
    return Alarm(**values)


def read_alarm(path: Path) -> Alarm:
    return parse_alarm(read_json_file(path), source=str(path))


@dataclass(frozen=True)
class LedgerEntry:
    """One verification result: the history `slurm-guard status` shows."""

    step: int
    check: str
    passed: bool
    detail: dict[str, Any]
    restart_count: int
    time: float = field(default_factory=time.time)
    schema: int = LEDGER_SCHEMA


def append_ledger(path: Path, entry: LedgerEntry) -> None:
    """Append one line with a single write() on an O_APPEND descriptor, then fsync.

    A crash leaves at worst a truncated last line, which `read_ledger` skips.
    """
    line = json.dumps(dataclasses.asdict(entry), sort_keys=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_ledger(path: Path) -> list[LedgerEntry]:
    """Every well-formed entry; malformed lines (a torn last write) are skipped."""
    if not path.exists():
        return []
    entries: list[LedgerEntry] = []
    with open(path, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw)
                entries.append(
                    LedgerEntry(
                        step=int(obj["step"]),
                        check=str(obj["check"]),
                        passed=bool(obj["passed"]),
                        detail=dict(obj.get("detail", {})),
                        restart_count=int(obj.get("restart_count", 0)),
                        time=float(obj.get("time", 0.0)),
                        schema=int(obj.get("schema", LEDGER_SCHEMA)),
                    )
                )
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
                continue
    return entries
