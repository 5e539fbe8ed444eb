"""Decisions that survive their executor: an in-job restart is planned, then seen done.

The engine journals an in-job restart (`in_job_restart`) before the supervisor starts the
step again. That is the plan. It is done only when the restarted step ran its first step: the
guard's resume record for that start (`rundir.resumes`, keyed by job, restart count and the
supervisor's attempt) then carries `first_step_at`, and the next entry point that looks
journals `restart_done` with what the step really resumed from.

A supervisor killed between the two (SIGKILL while it starts the step, the batch script's node
lost) leaves a plan nobody carries out: the job ends, and before this module the epilog and the
watcher found its alarm decided and did nothing, so the run stopped for good. Now the first
entry point that sees the job ended with the restart unfinished completes the decision the other
way: it requeues the job without the nodes the job left (they were drained by the restart's
plan already), sized to its training nodes, and journals `restart_failed` naming that plan.
Once: both entries settle the restart, and a settled restart is never looked at again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from slurm_guard.controller.actions import make_plan
from slurm_guard.controller.policy import ACTIVE_JOB_STATES
from slurm_guard.controller.report import JobReport
from slurm_guard.controller.state import (
    PLAN,
    RESTART_DONE,
    RESTART_FAILED,
    Journal,
    Plan,
    StateStore,
)
from slurm_guard.rundir.resumes import ResumeRecord, read_resume
from slurm_guard.slurm.client import JobInfo, SlurmClient

logger = logging.getLogger(__name__)

REQUEUED_FROM = frozenset(
    {"FAILED", "NODE_FAIL", "TIMEOUT", "BOOT_FAIL", "OUT_OF_MEMORY", "DEADLINE", "COMPLETING"}
)
"""Ended states from which an unfinished restart is completed by a requeue. Not CANCELLED (the
user or an admin stopped the job), COMPLETED (it finished anyway), nor PENDING or RUNNING (it
was requeued by something else and goes on)."""


class Executor(Protocol):
    """What settling needs of the engine (controller.engine.Engine provides it)."""

    client: SlurmClient
    store: StateStore
    clock: Callable[[], float]

    def execute(self, plan: Plan, journal: Journal, report: JobReport) -> None: ...


def settle_restarts(
    engine: Executor, job_id: str, run_dir: Path, in_job: bool, report: JobReport
) -> bool:
    """Journal each unsettled in-job restart of `job_id` as done or, if the job ended without
    it, complete it with a requeue; True when the journal changed. Call under the lock."""
    journal = engine.store.read()
    todo = journal.unsettled_restarts(job_id)
    if not todo:
        return False
    info = engine.client.job(job_id)
    changed = False
    for entry in todo:
        record = read_resume(
            Path(str(entry.get("run_dir") or run_dir)),
            job_id,
            int(entry.get("restart_count", 0)),
            int(entry.get("attempt", 0)),
        )
        if record is not None and record.first_step_at is not None:
            _done(engine.store, entry, record, report)
            changed = True
            continue
        if _alive(info, entry, "COMPLETED"):
            # it ran to the end without a record (a training script that never resumes)
            _done(engine.store, entry, record, report)
            changed = True
            continue
        if _alive(info, entry) or in_job:
            continue  # the supervisor still runs the job: the step may yet start
        later = [
            p
            for p in journal.plans.values()
            if p.job_id == job_id and p.created > float(entry.get("time", 0))
        ]
        if later:  # a later alarm was decided: that decision owns the job now
            _failed(engine.store, entry, "superseded by plan " + later[0].plan_id, None, report)
        elif info is None or info.state not in REQUEUED_FROM:
            state = "gone from Slurm" if info is None else info.state
            _failed(engine.store, entry, f"job {state}: nothing requeued", None, report)
        else:
            _complete(engine, journal, entry, info, report)
        changed = True
    return changed


def _alive(info: JobInfo | None, entry: dict[str, Any], *states: str) -> bool:
    """The run of the job that planned the restart is still going (its supervisor lives), or,
    with `states`, ended in one of them."""
    if info is None:
        return False
    same_run = info.restart_count == int(entry.get("restart_count", 0))
    return same_run and info.state in (states or ACTIVE_JOB_STATES)


def _done(
    store: StateStore, entry: dict[str, Any], record: ResumeRecord | None, report: JobReport
) -> None:
    """Journal the restart as done: with the guard's record, or (None) seen only to complete."""
    alarm_time = entry.get("alarm_time")
    first = None if record is None else record.first_step_at
    seconds = None
    if first is not None and isinstance(alarm_time, int | float):
        seconds = round(first - float(alarm_time), 2)
    store.append(
        RESTART_DONE,
        job_id=entry.get("job_id"),
        plan_id=entry.get("plan_id"),
        attempt=entry.get("attempt"),
        resume_source=None if record is None else record.source,
        resume_step=None if record is None else record.step,
        resume_path=None if record is None else record.path,
        first_step_at=first,
        seconds=seconds,
    )
    what = "no resume record" if record is None else f"resumed from {record.source} {record.step}"
    report.actions.append(f"in-job restart {entry.get('plan_id')} ran: {what}")


def _failed(
    store: StateStore,
    entry: dict[str, Any],
    why: str,
    completed_by: str | None,
    report: JobReport,
) -> None:
    store.append(
        RESTART_FAILED,
        job_id=entry.get("job_id"),
        plan_id=entry.get("plan_id"),
        attempt=entry.get("attempt"),
        reason=why,
        completed_by=completed_by,
    )
    text = f"in-job restart {entry.get('plan_id')} never ran its first step: {why}"
    logger.warning("job %s: %s", entry.get("job_id"), text)
    report.actions.append(text)


def _complete(
    engine: Executor,
    journal: Journal,
    entry: dict[str, Any],
    info: JobInfo,
    report: JobReport,
) -> None:
    """Requeue the job without every node it left, as the engine does without a spare."""
    job_id = str(entry.get("job_id"))
    left = sorted(journal.nodes_left_by(job_id))
    train = int(entry.get("train_nodes") or len(entry.get("nodes", [])))
    per_node = int(entry.get("tasks_per_node") or 1)
    spares = int(entry.get("spares") or 0)
    plan = make_plan(
        journal,
        job_id,
        str(entry.get("run_dir", "")),
        tuple(str(a) for a in entry.get("alarm_ids", [])),
        drains=[],
        exclude=tuple(left),
        restart_count=info.restart_count,
        hold_only=False,
        auto=True,
        now=engine.clock(),
        shrink=(train, train * per_node) if spares > 0 else None,
    )
    why = f"job {info.state}; requeued without {','.join(left) or '-'}"
    _failed(engine.store, entry, why, plan.plan_id, report)
    engine.store.append(PLAN, job_id=job_id, plan=plan.to_json())
    engine.execute(plan, engine.store.read(), report)
