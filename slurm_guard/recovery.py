"""Where a restarted job resumes, and the bookkeeping that makes a rollback happen once.

Run by rank 0 only; the guard broadcasts the decision. Alarms that are not yet handled limit
the choice (the resume rule of `rundir.choose_trusted_checkpoint`); a checkpoint whose files do
not match their recorded hashes is skipped with a warning, never loaded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from slurm_guard import checkpoint as ckpt
from slurm_guard.records import read_ledger
from slurm_guard.rundir import RunDir, choose_trusted_checkpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePoint:
    step: int  # the trusted checkpoint's step, -1 for a fresh start
    last_verified_step: int  # the newest passing replay at or before it, -1 if none
    pending_alarms: list[str] = field(default_factory=list)  # rolled back by this resume
    verified_steps: list[int] = field(default_factory=list)  # passing replays up to `step`


def choose_resume_point(run_dir: RunDir, trust_replays: int = 1) -> ResumePoint:
    alarms, errors = run_dir.alarms()
    for err in errors:
        logger.warning("ignoring unreadable alarm file: %s", err)
    handled = run_dir.handled_ids()
    # A numerical verdict stopped before its update: the weights are fine, nothing to undo.
    pending = [a for a in alarms if a.alarm_id not in handled and a.verdict != "numerical"]
    limiting = min(
        pending,
        key=lambda a: -1 if a.last_verified_step is None else a.last_verified_step,
        default=None,
    )
    candidates = run_dir.checkpoints()
    verified = [e.step for e in read_ledger(run_dir.ledger) if e.check == "replay" and e.passed]
    chosen = -1
    while (
        meta := choose_trusted_checkpoint(candidates, limiting, verified, trust_replays)
    ) is not None:
        problem = ckpt.verify_files(run_dir, meta)
        if problem is None:
            chosen = meta.step
            break
        logger.warning("skipping checkpoint at step %d: %s", meta.step, problem)
        candidates = [c for c in candidates if c.step != meta.step]
    passes = [s for s in verified if s <= chosen]
    return ResumePoint(
        chosen, max(passes, default=-1), [a.alarm_id for a in pending], sorted(set(passes))
    )


def finish_rollback(run_dir: RunDir, point: ResumePoint, restart_count: int) -> None:
    """Quarantine what the rollback skipped and mark its alarms handled, after the load."""
    for alarm_id in point.pending_alarms:
        # With no trusted checkpoint (step -1) every checkpoint is quarantined.
        moved = run_dir.quarantine_after(point.step, alarm_id)
        run_dir.mark_handled(
            alarm_id,
            {
                "alarm_id": alarm_id,
                "resumed_from_step": max(point.step, 0),
                "quarantined": moved,
                "restart_count": restart_count,
                "time": time.time(),
            },
        )
