"""Where a restarted job resumes, and the bookkeeping that makes a rollback happen once.

Planned by rank 0; the guard broadcasts each step it tries, every rank loads it and checks the
weight fingerprint, and a checkpoint that fails anywhere is skipped for the next older one.
Alarms that are not yet handled limit the choice (the resume rule of
`rundir.choose_trusted_checkpoint`).

Fail closed: what the rule needs but cannot read (an alarm file, the checkpoint listing) is an
error, not a warning, and so is a run whose every allowed checkpoint is damaged. The one
override is `SLURM_GUARD_RESUME=fresh` (`rundir.fresh_start_requested`): start from step 0 with
every existing checkpoint moved to quarantine/, which can never load anything untrusted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from slurm_guard.rundir import checkpoint as ckpt
from slurm_guard.rundir.layout import OVERRIDE_HINT, RunDir, RunDirError
from slurm_guard.rundir.records import read_ledger
from slurm_guard.rundir.trust import CheckpointMeta, counts_for_trust, trust_limit

logger = logging.getLogger(__name__)

FRESH_START_ID = "fresh-start"
"""quarantine/<this>-<attempt>/ receives the checkpoints a requested fresh start moves aside."""


@dataclass(frozen=True)
class ResumePoint:
    step: int  # the trusted checkpoint's step, -1 for a fresh start
    last_verified_step: int  # the newest passing replay at or before it, -1 if none
    pending_alarms: list[str] = field(default_factory=list)  # rolled back by this resume
    verified_steps: list[int] = field(default_factory=list)  # passing replays up to `step`
    fresh: bool = False  # a requested fresh start: every checkpoint moves to quarantine/
    # framework checkpoints (HF, Lightning) the integration already moved aside, where they are
    quarantined: list[str] = field(default_factory=list)


@dataclass
class ResumePlan:
    """Rank 0's view of what may be resumed from, newest first, before anything is loaded."""

    run_dir: RunDir
    candidates: list[CheckpointMeta]  # allowed by the resume rule, newest first
    damaged: dict[int, str]  # allowed steps known to be damaged, with the reason
    pending_alarms: list[str]  # alarms (and lost alarms) this resume rolls back
    verified: list[int]  # passing replay steps from the ledger
    fresh: bool = False  # SLURM_GUARD_RESUME=fresh: load nothing, move everything aside
    window: TrustWindow | None = None  # the pending alarms' limit (snapshots obey it too)

    def allows(self, step: int) -> bool:
        """Whether the resume rule allows state of `step` (a checkpoint's or a snapshot's)."""
        return not self.fresh and (self.window is None or self.window.allows(step))

    def next_candidate(self) -> CheckpointMeta | None:
        """Pop the newest remaining candidate whose files match their hashes.

        One whose files do not is recorded as damaged with a warning and the next is tried.
        """
        while self.candidates:
            meta = self.candidates.pop(0)
            problem = ckpt.verify_files(self.run_dir, meta)
            if problem is None:
                return meta
            self.reject(meta.step, problem)
        return None

    def reject(self, step: int, problem: str) -> None:
        logger.warning("skipping checkpoint step-%08d: %s", step, problem)
        self.damaged[step] = problem

    def point(self, step: int) -> ResumePoint:
        passes = sorted({s for s in self.verified if s <= step})
        return ResumePoint(
            step, max(passes, default=-1), list(self.pending_alarms), passes, self.fresh
        )

    def nothing_usable(self) -> RunDirError | None:
        """The error when checkpoints were allowed but every one of them is damaged."""
        if self.fresh or not self.damaged:
            return None
        newest = sorted(self.damaged.items())[-3:]
        listed = "; ".join(f"step-{step:08d}: {problem[:80]}" for step, problem in newest)
        return RunDirError(
            f"all {len(self.damaged)} checkpoints the resume rule allows are damaged "
            f"({listed}); nothing was loaded. Restore one from a backup. {OVERRIDE_HINT}"
        )


@dataclass(frozen=True)
class TrustWindow:
    """Which checkpoint steps the pending alarms still allow, as the resume rule decides.

    Shared by the guard's own checkpoints and a framework's (`slurm_guard.integrations`), so
    the two can never disagree about what is trusted.
    """

    up_to: int | None  # the newest allowed step; None: no alarm limits the choice
    nothing_trusted: bool  # an alarm with too few passing replays before it: start over
    pending_alarms: list[str]  # alarms (and lost alarms) a resume rolls back
    verified: list[int]  # passing replay steps from the ledger

    def allows(self, step: int) -> bool:
        return not self.nothing_trusted and (self.up_to is None or step <= self.up_to)


def trust_window(run_dir: RunDir, trust_replays: int = 1, *, fresh: bool = False) -> TrustWindow:
    """The resume rule's limit from alarms/, handled/ and the ledger; RunDirError if unknowable.

    Raises RunDirError (unless `fresh`) for an alarm file that cannot be read or is of a newer
    schema and is not marked handled, and for an alarms/ or handled/ directory that cannot be
    listed.
    """
    handled = run_dir.handled_ids()
    alarms, _ = run_dir.alarms()
    unreadable = {k: v for k, v in run_dir.unreadable_alarms().items() if k not in handled}
    lost = [a for a in run_dir.lost_alarms() if a.alarm_id not in handled]
    pending = [a for a in alarms if a.alarm_id not in handled]
    if unreadable and not fresh:
        why = sorted(unreadable.items())[0][1]
        more = f" ({len(unreadable) - 1} more)" if len(unreadable) > 1 else ""
        raise RunDirError(
            f"unusable alarm file{more}: {why[:240]}. An alarm limits which checkpoint may be "
            "loaded, so the guard will not guess: move the file out of alarms/ if it is not a "
            f"real alarm. {OVERRIDE_HINT}"
        )
    verified = [e.step for e in read_ledger(run_dir.ledger) if counts_for_trust(e)]
    ids = [a.alarm_id for a in pending] + [a.alarm_id for a in lost] + sorted(unreadable)
    # A numerical verdict stopped before its update: the weights are fine, nothing to undo.
    limits = [
        trust_limit(a.last_verified_step, verified, trust_replays)
        for a in pending
        if a.verdict != "numerical"
    ] + [a.trust_upto for a in lost]
    nothing = any(limit is None for limit in limits)
    up_to = None if not limits or nothing else min(x for x in limits if x is not None)
    return TrustWindow(up_to, nothing, ids, verified)


def plan_resume(run_dir: RunDir, trust_replays: int = 1, *, fresh: bool = False) -> ResumePlan:
    """Which checkpoints a restart may load, newest first; RunDirError where that is unknowable.

    Raises RunDirError (unless `fresh`) for an alarm file that cannot be read or is of a newer
    schema and is not marked handled, and for an alarms/, checkpoints/ or handled/ directory
    that cannot be listed.
    """
    window = trust_window(run_dir, trust_replays, fresh=fresh)
    scan = run_dir.scan_checkpoints()  # RunDirError if checkpoints/ cannot be listed
    ids, verified = window.pending_alarms, window.verified
    if fresh:
        logger.warning(
            "SLURM_GUARD_RESUME=fresh: starting from step 0; %d checkpoints move to quarantine/",
            len(scan.metas) + len(scan.damaged),
        )
        return ResumePlan(run_dir, [], {}, ids, verified, fresh=True)
    candidates = sorted(
        (m for m in scan.metas if m.clean_vote and window.allows(m.step)),
        key=lambda m: -m.step,
    )
    damaged = {s: p for s, p in scan.damaged.items() if window.allows(s)}
    for step, problem in sorted(damaged.items()):
        logger.warning("skipping checkpoint step-%08d: %s", step, problem)
    return ResumePlan(run_dir, candidates, damaged, ids, verified, window=window)


def choose_resume_point(run_dir: RunDir, trust_replays: int = 1) -> ResumePoint:
    """The newest loadable checkpoint as rank 0 alone sees it (files hashed, nothing loaded)."""
    plan = plan_resume(run_dir, trust_replays)
    meta = plan.next_candidate()
    if meta is None:
        error = plan.nothing_usable()
        if error is not None:
            raise error
    return plan.point(-1 if meta is None else meta.step)


def finish_rollback(
    run_dir: RunDir, point: ResumePoint, restart_count: int, attempt: str = ""
) -> None:
    """Quarantine what the rollback skipped and mark its alarms handled, after the load."""
    if point.fresh:
        # Old checkpoints are never left behind to be trusted by a later start.
        moved = run_dir.quarantine_after(-1, f"{FRESH_START_ID}-{attempt or int(time.time())}")
        if moved:
            logger.warning("fresh start: moved %s to quarantine/", ", ".join(moved))
    for alarm_id in point.pending_alarms:
        # With no trusted checkpoint (step -1) every checkpoint is quarantined.
        moved = run_dir.quarantine_after(point.step, alarm_id)
        run_dir.mark_handled(
            alarm_id,
            {
                "alarm_id": alarm_id,
                "resumed_from_step": max(point.step, 0),
                "quarantined": moved + point.quarantined,
                "restart_count": restart_count,
                "time": time.time(),
            },
        )
