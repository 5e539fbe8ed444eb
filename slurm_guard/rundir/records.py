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
import errno
import json
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_guard.protocol import ALARM_SCHEMA, LEDGER_SCHEMA, Check, Verdict
from slurm_guard.rundir.gpus import GpuIdentity, parse_gpus

logger = logging.getLogger(__name__)

MAX_RECORD_BYTES = 1 << 20  # an alarm is a few KiB; anything near this is not ours
MAX_LEDGER_BYTES = 64 << 20  # ~400k verifications; older lines than this are not read

VERDICTS = tuple(v.value for v in Verdict)  # "sdc", "ambiguous", "numerical"
CHECKS = tuple(c.value for c in Check)


class RecordError(ValueError):
    """A run-directory file is missing, unreadable, malformed or from an unknown schema."""


def atomic_write_bytes(path: Path, data: bytes, *, overwrite: bool = True) -> None:
    """Write `data` so that readers see all of it or nothing.

    With overwrite=False an existing file is never replaced (alarms are write-once):
    `FileExistsError` is raised instead. The file gets the process umask's permissions (0644
    under umask 022), like any file the training user creates: the controller often runs as
    another user (SlurmUser) and must be able to read alarms. `mkstemp` would force 0600.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
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
        if os.path.lexists(tmp):
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


def open_regular(path: Path, *, write: bool = False) -> int:
    """A descriptor on `path` only if it is a regular file, never following a symlink.

    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer (or reader)
    forever; fstat on the open descriptor then refuses anything but a regular file, without the
    race of checking the path first and opening it after. Raises OSError (ELOOP for a symlink,
    EINVAL for a special file) so that callers that handle I/O errors handle these too.
    """
    flags = os.O_NOFOLLOW | os.O_NONBLOCK
    flags |= (os.O_WRONLY | os.O_APPEND | os.O_CREAT) if write else os.O_RDONLY
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(
                errno.ELOOP, "is a symbolic link; records must be regular files", str(path)
            ) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_json_file(path: Path, *, max_bytes: int = MAX_RECORD_BYTES) -> Any:
    """Read one JSON record defensively: no symlinks, no special files, bounded size."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise RecordError(f"{path}: no such file") from None
    except OSError as exc:
        raise RecordError(f"{path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise RecordError(f"{path}: {size} bytes, larger than the {max_bytes}-byte limit")
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise RecordError(f"{path}: {exc.strerror}") from None
    if len(data) > max_bytes:
        raise RecordError(f"{path}: larger than the {max_bytes}-byte limit")
    try:
        return json.loads(data)
    # ValueError: also integers longer than Python's digit limit; RecursionError: nesting.
    except (ValueError, RecursionError) as exc:
        raise RecordError(
            f"{path}: not valid JSON ({exc}); the file is truncated or was not written by "
            "slurm-guard. Move it aside and rerun."
        ) from None


def new_attempt_id() -> str:
    """A random id for one start of a run (one process group), 12 hex digits.

    Job ids repeat (runs outside Slurm have none; a reset slurmctld starts counting again) and
    restart counts repeat with them, so only this makes an alarm id unique for good.
    """
    return secrets.token_hex(6)


def make_alarm_id(
    job_id: str | None, restart_count: int, attempt: str, step: int, check: str
) -> str:
    """`job<J>-r<restart>-a<attempt>-step<S>-<check>`: readable, sortable, never repeated."""
    return f"job{job_id or 'local'}-r{restart_count}-a{attempt}-step{step}-{check}"


@dataclass(frozen=True)
class RankInfo:
    """Where one rank runs: the Slurm node name (what Slurm drains), the real host name, and
    its GPU (None on CPU)."""

    rank: int
    node: str
    hostname: str
    gpu: GpuIdentity | None = None


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
    injected: bool = False  # a fault injected on purpose was active (optional in the file)
    # per suspect rank, its GPU (GpuIdentity's fields) or None on CPU; optional in the file
    suspect_gpus: tuple[dict[str, Any] | None, ...] = ()

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in ("suspect_ranks", "suspect_nodes", "suspect_hosts", "suspect_gpus"):
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


def check_field_types(obj: dict[str, Any], spec: dict[str, tuple[type, ...]], source: str) -> None:
    """Raise RecordError unless every field of ``spec`` is present with one of its types.

    JSON has no integer/boolean distinction that Python keeps (``True`` is an ``int``), so a
    boolean passes only where the spec names ``bool``: a hand-edited ``"step": true`` is refused
    instead of read as step 1.
    """
    for key, types in spec.items():
        if key not in obj:
            raise RecordError(f"{source}: missing field {key!r}")
        value = obj[key]
        if isinstance(value, bool) and bool not in types:
            raise RecordError(f"{source}: field {key!r} must not be a boolean")
        if not isinstance(value, types):
            names = "/".join(t.__name__ for t in types)
            raise RecordError(f"{source}: field {key!r} must be {names}")


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
    check_field_types(obj, _ALARM_TYPES, source)
    if not isinstance(obj.get("injected", False), bool):
        raise RecordError(f"{source}: field 'injected' must be a boolean")
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
    try:
        values["suspect_gpus"] = parse_gpus(obj.get("suspect_gpus"), len(ranks))
    except ValueError as exc:
        raise RecordError(f"{source}: {exc}") from None
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

    A crash leaves at worst a truncated last line, which `read_ledger` skips. A symlink or a
    special file in the ledger's place raises OSError instead of being written through.
    """
    line = json.dumps(dataclasses.asdict(entry), sort_keys=True) + "\n"
    fd = open_regular(path, write=True)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_ledger(path: Path, *, max_bytes: int = MAX_LEDGER_BYTES) -> list[LedgerEntry]:
    """Every well-formed entry of the newest `max_bytes` of the ledger; never raises.

    Malformed lines (a torn last write) are skipped. A ledger that is a symlink, a FIFO or a
    device (`/dev/zero`), or that cannot be read, counts as empty with a warning: the readers
    (`status`, the resume rule) then know of no passing replay, which trusts less, never more.
    """
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        logger.warning("ignoring ledger %s: %s", path, exc.strerror)
        return []
    try:
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                f.seek(size - max_bytes)
                f.readline()  # the first line is cut: start at the next whole one
            data = f.read(max_bytes)
    except OSError as exc:
        logger.warning("ignoring ledger %s: %s", path, exc.strerror)
        return []
    entries: list[LedgerEntry] = []
    for raw in data.splitlines():
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
