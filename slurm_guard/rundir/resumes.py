"""What a start of the run really resumed from, written by the guard, read by the admin side.

Before this record the controller could only guess where a restart resumed from (the trusted
checkpoint, by the resume rule), and `status` said "step 10 (checkpoint)" for a restart that
loaded node-local snapshot 15. The guard knows, so rank 0 writes it down: one file per start,
`resumes/<job>-r<restart count>-a<supervisor attempt>.json`, written atomically after every
rank agreed on the load, and written once more (with `first_step_at`) when the first step after
it has completed. The second write is how the controller sees that a restart it decided really
ran (a supervisor killed in between leaves a record without it, or none).

Torch-free: the controller, `status` and the report read these records.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from slurm_guard.protocol import RESUME_SCHEMA
from slurm_guard.rundir.records import RecordError, atomic_write_json, read_json_file
from slurm_guard.slurm.task import ATTEMPT_ENV

logger = logging.getLogger(__name__)

RESUMES_DIR = "resumes"
SNAPSHOT = "snapshot"
CHECKPOINT = "checkpoint"
NOTHING = "none"  # nothing trusted to load: the run started from step 0
SOURCES = (SNAPSHOT, CHECKPOINT, NOTHING)
_NAME = re.compile(r"[A-Za-z0-9_.]+-r\d+-a\d+")


@dataclass(frozen=True)
class ResumeRecord:
    """One start of the run: what it loaded, and whether its first step completed.

    Args:
        job_id: the Slurm job id (empty outside Slurm).
        restart_count: Slurm's restart count of the job (requeues).
        attempt: the in-job supervisor's step attempt (0 for the first step of a job run).
        source: `snapshot`, `checkpoint` or `none`.
        step: the step loaded (None for `none`).
        path: where it came from: the checkpoint directory, or the node-local snapshot
            directory of rank 0's node (None for `none`).
        resumed_at: when every rank had loaded it.
        first_step_at: when the first step after the load completed; None until then.
    """

    job_id: str
    restart_count: int
    attempt: int
    source: str
    step: int | None
    path: str | None
    resumed_at: float
    first_step_at: float | None = None
    schema: int = RESUME_SCHEMA

    @property
    def name(self) -> str:
        return record_name(self.job_id, self.restart_count, self.attempt)

    @classmethod
    def parse(cls, obj: Any, source: str) -> ResumeRecord:
        """Check a record read from a run directory (untrusted input)."""
        if not isinstance(obj, dict):
            raise RecordError(f"{source}: expected a JSON object")
        schema = obj.get("schema")
        if not isinstance(schema, int) or not 1 <= schema <= RESUME_SCHEMA:
            raise RecordError(f"{source}: resume record schema {schema!r} is not understood")
        try:
            step = obj.get("step")
            first = obj.get("first_step_at")
            record = cls(
                job_id=str(obj["job_id"]),
                restart_count=int(obj["restart_count"]),
                attempt=int(obj["attempt"]),
                source=str(obj["source"]),
                step=None if step is None else int(step),
                path=None if obj.get("path") is None else str(obj["path"]),
                resumed_at=float(obj["resumed_at"]),
                first_step_at=None if first is None else float(first),
                schema=schema,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"{source}: malformed resume record ({exc})") from None
        if record.source not in SOURCES:
            raise RecordError(f"{source}: resume source {record.source!r} is not one of {SOURCES}")
        return record


def record_name(job_id: str, restart_count: int, attempt: int) -> str:
    return f"{job_id or 'local'}-r{restart_count}-a{attempt}"


def resumes_dir(run_dir: Path) -> Path:
    return Path(run_dir) / RESUMES_DIR


def supervisor_attempt(env: dict[str, str] | None = None) -> int:
    """The in-job supervisor's step attempt this process belongs to (0 without a supervisor)."""
    value = (os.environ if env is None else env).get(ATTEMPT_ENV) or "0"
    try:
        return int(value)
    except ValueError:
        return 0


def read_resume(
    run_dir: Path, job_id: str, restart_count: int, attempt: int
) -> ResumeRecord | None:
    """The record of one start, or None when there is none (or it cannot be read)."""
    path = resumes_dir(run_dir) / f"{record_name(job_id, restart_count, attempt)}.json"
    if not path.exists():
        return None
    try:
        return ResumeRecord.parse(read_json_file(path), str(path))
    except RecordError as exc:
        logger.warning("%s", exc)
        return None


def read_resumes(run_dir: Path) -> list[ResumeRecord]:
    """Every readable start record of the run, oldest first; unreadable ones are skipped."""
    folder = resumes_dir(run_dir)
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.json")):
        if not _NAME.fullmatch(path.stem):
            continue
        try:
            out.append(ResumeRecord.parse(read_json_file(path), str(path)))
        except RecordError as exc:
            logger.warning("%s", exc)
    return sorted(out, key=lambda r: r.resumed_at)


class ResumeNote:
    """Rank 0's record of one start: written at the resume, completed at the first step."""

    def __init__(self, run_dir: Path, record: ResumeRecord) -> None:
        self.path = resumes_dir(run_dir) / f"{record.name}.json"
        self.record = record
        self._write()

    @classmethod
    def resumed(
        cls,
        run_dir: Path,
        job_id: str,
        restart_count: int,
        source: str,
        step: int | None,
        path: str | None,
    ) -> ResumeNote:
        record = ResumeRecord(
            job_id, restart_count, supervisor_attempt(), source, step, path, time.time()
        )
        return cls(run_dir, record)

    def first_step(self) -> None:
        """The first step after the resume completed: say so, once."""
        if self.record.first_step_at is not None:
            return
        self.record = replace(self.record, first_step_at=time.time())
        self._write()

    def _write(self) -> None:
        # A record that cannot be written costs `status` its answer and the controller its
        # proof that the restart ran (it then requeues): never the training.
        try:
            atomic_write_json(self.path, asdict(self.record))
        except OSError as exc:
            logger.warning("could not write the resume record %s: %s", self.path, exc)


__all__ = [
    "CHECKPOINT",
    "NOTHING",
    "RESUMES_DIR",
    "SNAPSHOT",
    "ResumeNote",
    "ResumeRecord",
    "read_resume",
    "read_resumes",
    "record_name",
    "resumes_dir",
    "supervisor_attempt",
]
