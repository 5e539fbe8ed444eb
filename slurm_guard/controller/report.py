"""What the controller tells its callers: per-job reports, and the errors it raises.

Kept apart from the engine so that the CLI, the drill and the watcher can read reports
without importing the code that changes the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class EngineError(RuntimeError):
    """An admin request the engine refuses; the message says what to do instead."""


class RetryLater(Exception):
    """An action cannot be done yet (the job is not pending yet); the plan resumes later."""


@dataclass(frozen=True)
class ActionResult:
    """How one cluster action ended; `status` is a journal result type (done/skipped/failed)."""

    status: str
    detail: str


@dataclass
class JobReport:
    """What one engine call did for one job, for the log and the CLI."""

    job_id: str
    run_dir: str
    pending: bool = False
    pending_reason: str = ""
    allocation: tuple[str, ...] = ()  # the node list the epilog was given, kept when pending
    lock_busy: bool = False  # another controller held the state lock
    decisions: dict[str, tuple[str, str]] = field(default_factory=dict)  # alarm -> outcome, why
    actions: list[str] = field(default_factory=list)  # human-readable, in order
    problems: list[str] = field(default_factory=list)  # rejected files and alarms
    held: str = ""  # why the job is held for review (loop rule, budget, ambiguous verdict)
    in_job: Any = None  # in_job.InJobOutcome when the job restarts inside its allocation

    def lines(self) -> list[str]:
        if self.job_id:
            out = [f"job {self.job_id} (run dir {self.run_dir})"]
        else:  # what the watcher could not read: no job to name
            out = [f"under {self.run_dir}, not readable"]
        out += [f"  alarm {a}: {o} - {why}" for a, (o, why) in self.decisions.items()]
        out += [f"  {a}" for a in self.actions]
        out += [f"  problem: {p}" for p in self.problems]
        if self.pending:
            out.append(f"  pending, retried later: {self.pending_reason}")
        return out


def summarize(reports: list[JobReport]) -> dict[str, Any]:
    """A JSON-friendly view of reports, for `--json` output."""
    return {
        "jobs": [
            {
                "job_id": r.job_id,
                "run_dir": r.run_dir,
                "pending": r.pending,
                "pending_reason": r.pending_reason,
                "decisions": {a: {"outcome": o, "reason": w} for a, (o, w) in r.decisions.items()},
                "actions": r.actions,
                "problems": r.problems,
            }
            for r in reports
        ]
    }
