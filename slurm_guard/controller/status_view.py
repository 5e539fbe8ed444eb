"""The `slurm-guard status` view of one run: what the guard saw (run directory), what the
controller decided and did (journal), what Slurm shows now, and what a restart would load by the
guard's resume rule. Read-only; see `views` for how files users write are treated."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from slurm_guard.controller.intake import read_alarm_files
from slurm_guard.controller.state import RESULTS, Journal, StateStore
from slurm_guard.controller.views import (
    job_view,
    read_journal,
    resolve_target,
)
from slurm_guard.errors import GuardError
from slurm_guard.report.timeline import ReportError, read_timeline, restart_numbers
from slurm_guard.rundir import fault_effects
from slurm_guard.rundir.layout import RunDir, RunDirError
from slurm_guard.rundir.records import Alarm, LedgerEntry, RecordError, read_json_file, read_ledger
from slurm_guard.rundir.resumes import read_resume, read_resumes
from slurm_guard.rundir.seals import located_checkpoints, run_id_of
from slurm_guard.rundir.trust import counts_for_trust, trust_limit
from slurm_guard.slurm.client import SlurmClient

DEFAULT_TRUST_REPLAYS = 2
"""GuardConfig's default, for a run.json that does not name trust_replays (older runs)."""


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def trust_replays_of(config: dict[str, Any]) -> int:
    """The run's `trust_replays` from run.json's config (the guard's default if absent/odd)."""
    value = _int(config.get("trust_replays"))
    return value if value is not None and 1 <= value <= 100 else DEFAULT_TRUST_REPLAYS


def lineage_passes(entries: list[LedgerEntry], resumes: list[dict[str, Any]]) -> list[int]:
    """Steps with a passing replay in the run's current history, oldest first.

    A resume from checkpoint P discards every later step of what ran before it: those
    verifications speak for weights that no longer exist. Two records say where that happened:
    a handled/ record (an alarm's rollback: its time and resume step P), which works outside
    Slurm too, where every attempt has restart count 0; and, for restarts without an alarm
    (preemption, requeue), the first step a higher restart count logged, so that earlier
    attempts' verifications from that step on are dropped (conservative). Votes verify no
    computation and are not counted.
    """
    bound: dict[int, float] = {}
    for e in entries:
        bound[e.restart_count] = min(bound.get(e.restart_count, math.inf), e.step - 1)
    rollbacks = []
    for r in resumes:
        when, step = r.get("time"), _int(r.get("resumed_from_step"))
        if isinstance(when, (int, float)) and not isinstance(when, bool) and step is not None:
            rollbacks.append((float(when), step))
    passes = set()
    for e in entries:
        if e.check != "replay" or not e.passed:
            continue
        if any(e.time < when and e.step > step for when, step in rollbacks):
            continue
        if all(e.step <= b for rc, b in bound.items() if rc > e.restart_count):
            passes.add(e.step)
    return sorted(passes)


def resume_preview(rd: RunDir, trust_replays: int) -> dict[str, Any]:
    """What a restart of the run would load now, by the guard's resume rule.

    The rule of `recovery.plan_resume`, on the same run-directory readers and `trust_limit`:
    unhandled alarms (numerical verdicts excepted) and lost alarms bound the step; the newest
    checkpoint saved after a clean vote within the bound wins; an unreadable alarm stops the
    resume. It is restated here because recovery.py loads torch, which the controller must not:
    tests/test_cli_status.py checks both agree on real run directories. Checkpoint files are
    not re-hashed (the guard does that at load and falls back to the next older one).
    """
    try:
        handled = rd.handled_ids()
        alarms, _ = rd.alarms()
        unreadable = {k: v for k, v in rd.unreadable_alarms().items() if k not in handled}
        lost = [a for a in rd.lost_alarms() if a.alarm_id not in handled]
        scan = rd.scan_checkpoints()
    except RunDirError as exc:
        return {"trusted_checkpoint": None, "blocked": str(exc), "limiting_alarm": None}
    if unreadable:
        name, why = sorted(unreadable.items())[0]
        return {
            "trusted_checkpoint": None,
            "blocked": f"a restart stops: alarm file {name}.json cannot be used ({why})",
            "limiting_alarm": name,
        }
    pending = [a for a in alarms if a.alarm_id not in handled and a.verdict != "numerical"]
    verified = [e.step for e in read_ledger(rd.ledger) if counts_for_trust(e)]
    limits: list[tuple[int | None, str]] = [
        (trust_limit(a.last_verified_step, verified, trust_replays), a.alarm_id) for a in pending
    ] + [(a.trust_upto, a.alarm_id) for a in lost]
    nothing = [alarm_id for limit, alarm_id in limits if limit is None]
    bound = min((limit for limit, _ in limits if limit is not None), default=None)
    limiting = (
        nothing[0]
        if nothing
        else next((alarm_id for limit, alarm_id in limits if limit == bound), None)
    )
    clean = [
        m.step
        for m in scan.metas
        if m.clean_vote and not nothing and (bound is None or m.step <= bound)
    ]
    preview = {
        "trusted_checkpoint": max(clean, default=None),
        "blocked": None,
        "limiting_alarm": limiting,
        "pending_alarms": [a.alarm_id for a in pending] + [a.alarm_id for a in lost],
        "damaged_checkpoints": {str(s): p for s, p in sorted(scan.damaged.items())},
        "latest_checkpoint": max((m.step for m in scan.metas), default=None),
    }
    preview["snapshot"] = _snapshot_in_memory(rd, None if nothing else bound, bool(nothing))
    return _with_framework_checkpoints(rd, preview, None if nothing else bound, bool(nothing))


def _snapshot_in_memory(rd: RunDir, bound: int | None, nothing: bool) -> int | None:
    """The newest snapshot step rank 0 noted (`snapshots.json`) that the bound allows.

    Only what rank 0's node sealed: a restart uses it if every node still holds it (or can be
    given it), and otherwise the trusted checkpoint. The controller never sees node memory.
    """
    try:
        record = read_json_file(rd.snapshot_index)
        steps = [int(s) for s in record.get("steps", [])]
    except (RecordError, TypeError, ValueError, AttributeError):
        return None
    allowed = [s for s in steps if not nothing and (bound is None or s <= bound)]
    return max(allowed, default=None)


def _with_framework_checkpoints(
    rd: RunDir, preview: dict[str, Any], bound: int | None, nothing: bool
) -> dict[str, Any]:
    """Add the framework checkpoints (HF, Lightning) the run directory records
    (`rundir.seals`), by the integrations' rule: this run's seals, the newest within the
    bound; and `trusted_checkpoint_path`, the path a restart loads."""
    guard_step = preview["trusted_checkpoint"]
    run_id = run_id_of(rd)
    try:
        located = [c for c in located_checkpoints(rd) if c.run_id == run_id]
    except RunDirError as exc:
        return {**preview, "trusted_checkpoint": None, "blocked": str(exc)}
    allowed = [c for c in located if not nothing and (bound is None or c.step <= bound)]
    newest = allowed[0] if allowed else None  # located_checkpoints is in resume order
    path = None if guard_step is None else str(rd.checkpoint_path(guard_step))
    if newest is not None and (guard_step is None or newest.step > guard_step):
        guard_step, path = newest.step, str(newest.path)
    guard_latest = preview["latest_checkpoint"]
    latest = max([c.step for c in located] + [-1 if guard_latest is None else guard_latest])
    return {
        **preview,
        "trusted_checkpoint": guard_step,
        "trusted_checkpoint_path": path,
        "latest_checkpoint": None if latest < 0 else latest,
    }


# ------------------------------------------------------------------------ status


def numbered_resumes(run_dir: Path, resumes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each resume with `restart`, the number the report gives its run (`restart_numbers`),
    and `source`, what the guard recorded it loaded, as the report shows it: the rollback
    record's own `restart_count` is Slurm's, 0 for every start of a local run."""
    try:
        timeline = read_timeline(run_dir)
        numbers = restart_numbers(timeline)
        sources = {rb.alarm_id: timeline.resume_source(rb) for rb in timeline.rollbacks}
    except (ReportError, GuardError, OSError):
        numbers, sources = {}, {}
    return [
        {
            **r,
            "restart": numbers.get(r["alarm_id"], r.get("restart_count")),
            "source": sources.get(r["alarm_id"]),  # what the guard recorded it loaded
        }
        for r in resumes
    ]


def controller_summary(
    job_id: str | None, journal: Journal, journal_error: str | None, store: StateStore
) -> str | None:
    """None when the journal can speak of the run (it names the job, or it is unreadable and
    that is shown instead); else, in plain words, why no decision can be shown."""
    if journal_error is not None:
        return None
    if job_id is None or not store.journal_path.exists():
        return no_controller_words(job_id, store)
    return None


def no_controller_words(job_id: str | None, store: StateStore) -> str:
    """Why no controller decision is shown, in plain words: a local run has none to show; a
    Slurm job's may sit in another state directory."""
    if job_id is None:
        return (
            "no controller has seen this run: it ran without Slurm (no job id), so nothing "
            "drains or requeues for it; the run directory's records are shown"
        )
    return (
        f"no controller has seen this run in {store.root} (no journal there); if one handled "
        "job " + job_id + ", pass its --state-dir"
    )


def _alarm_row(
    alarm: Alarm, journal: Journal, journal_error: str | None, store: StateStore, handled: set[str]
) -> dict[str, Any]:
    decision = journal.alarms.get(alarm.alarm_id)
    if decision is not None:
        outcome, why = str(decision.get("outcome")), str(decision.get("reason", ""))
    elif journal_error is not None:
        outcome, why = "unknown", journal_error
    elif not store.journal_path.exists():
        outcome, why = "none", no_controller_words(alarm.job_id, store)
    else:
        outcome, why = "undecided", f"not in the journal in {store.root}"
    return {
        "alarm_id": alarm.alarm_id,
        "job_id": alarm.job_id,
        "step": alarm.step,
        "check": alarm.check,
        "verdict": alarm.verdict,
        "suspect_nodes": list(alarm.suspect_nodes),
        "suspect_ranks": list(alarm.suspect_ranks),
        "suspect_gpus": list(alarm.suspect_gpus),
        "last_verified_step": alarm.last_verified_step,
        "trusted_checkpoint": alarm.trusted_checkpoint,
        "message": alarm.message,
        "injected": alarm.injected,
        "handled": alarm.alarm_id in handled,
        "decision": outcome,
        "decision_reason": why,
        "approved": alarm.alarm_id in journal.approvals,
    }


def _run_part(
    run_dir: Path, journal: Journal, journal_error: str | None, store: StateStore
) -> dict[str, Any]:
    rd = RunDir(run_dir)
    view: dict[str, Any] = {}
    info = rd.run_info()
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    assert isinstance(config, dict)
    view["run"] = info
    view["checks"] = config
    # Faults injected on purpose, as run.json lists them: a leftover SLURM_GUARD_INJECT must
    # never pass for a hardware fault in front of an admin.
    view["injected_faults"] = info.get("injected_faults", [])
    try:  # and what they changed: a fault that changed no value raised no alarm
        view["fault_warnings"] = fault_effects.warnings_of(fault_effects.read_newest(run_dir))
    except (OSError, RecordError) as exc:
        view["fault_warnings"] = [f"injected faults' effects unreadable: {exc}"]
    trust = trust_replays_of(config)
    view["trust_replays"] = trust
    resumes = rd.resumes()
    view["resumes"] = numbered_resumes(run_dir, resumes)
    # What each start really loaded, as the guard recorded it (`rundir.resumes`): never a guess.
    view["resumed_from"] = [dataclasses.asdict(r) for r in read_resumes(run_dir)]
    preview = resume_preview(rd, trust)
    view["trusted_checkpoint"] = preview["trusted_checkpoint"]
    view["trusted_checkpoint_path"] = preview.get("trusted_checkpoint_path")
    view["resume_blocked"] = preview["blocked"]
    view["damaged_checkpoints"] = preview.get("damaged_checkpoints", {})
    view["latest_checkpoint"] = preview.get("latest_checkpoint")
    snapshot = preview.get("snapshot")
    checkpoint = preview["trusted_checkpoint"]
    view["snapshot_in_memory"] = (
        snapshot
        if snapshot is not None and (checkpoint is None or snapshot >= checkpoint)
        else None
    )
    try:
        handled = rd.handled_ids()
    except RunDirError:
        handled = set()
    files, bad_files = read_alarm_files(run_dir)
    view["alarms"] = [_alarm_row(f.alarm, journal, journal_error, store, handled) for f in files]
    view["bad_alarm_files"] = [b.error for b in bad_files]
    limiting = next((f.alarm for f in files if f.alarm.alarm_id == preview["limiting_alarm"]), None)
    if limiting is not None:
        # Between the alarm and the resume, the alarm's word is the run's state: the guard
        # stopped before the step after it and resumes by it.
        view["last_verified_step"] = limiting.last_verified_step
        view["last_verified_from"] = f"alarm {limiting.alarm_id}"
    else:
        passes = lineage_passes(read_ledger(rd.ledger), resumes)
        view["last_verified_step"] = passes[-1] if passes else None
        view["last_verified_from"] = "the ledger: passing replays of the current history"
    return view


def status_view(
    target: str,
    *,
    client: SlurmClient | None,
    store: StateStore,
    runs_root: Path | None = None,
) -> dict[str, Any]:
    """Everything `slurm-guard status` shows about one job or run directory.

    Raises ViewError when `target` is neither a run directory nor a job anyone knows.
    """
    job_id, run_dir, job = resolve_target(target, client, store, runs_root)
    journal, journal_error = read_journal(store)
    view: dict[str, Any] = {
        "job_id": job_id,
        "run_dir": str(run_dir) if run_dir else None,
        "state_dir": str(store.root),
        "journal_error": journal_error,
        "alarms": [],
        "bad_alarm_files": [],
    }
    if run_dir is not None and run_dir.is_dir():
        view.update(_run_part(run_dir, journal, journal_error, store))
        named = [a["job_id"] for a in view["alarms"] if isinstance(a.get("job_id"), str)]
        if job_id is None and named:
            # run.json lost or unreadable: the newest alarm still names the job.
            job_id = view["job_id"] = named[-1]
            job = job_view(client, job_id)
    elif run_dir is not None:
        view["run_dir_error"] = f"{run_dir} is gone or not a directory"
    view["job"] = {k: v for k, v in job.items() if k not in ("known", "unreachable")}
    if job_id is None and "job_id" in view.get("run", {}):
        view["job"] = {"error": "the run ran without Slurm: run.json names no job id"}
        view["local_run"] = True
    view["controller"] = controller_summary(job_id, journal, journal_error, store)
    actions = []
    if job_id is not None:
        for e in journal.for_job(job_id):
            if e.get("type") in RESULTS:
                actions.append(
                    {
                        "time": e.get("time"),
                        "op": e.get("op"),
                        "target": e.get("target"),
                        "result": e.get("type"),
                        "detail": e.get("detail", ""),
                    }
                )
    view["controller_actions"] = actions
    view["in_job_restarts"] = in_job_restarts(journal, job_id, run_dir) if job_id else []
    view["held"] = held_reason(journal, job_id) if job_id else None
    try:
        view["pending"] = store.pending().get(job_id or "", None)
    except OSError:
        view["pending"] = None
    return view


# ------------------------------------------------------------------------ in-job restarts


def in_job_restarts(
    journal: Journal, job_id: str, run_dir: Path | None = None
) -> list[dict[str, Any]]:
    """Each restart inside the job's allocation: when, the node that left, the spare that
    joined, and its state: `done` once the restarted step ran its first step (then the resume
    point the guard recorded, and the seconds from the alarm record to that first step),
    `pending` before, `failed` when it never ran (and the requeue that completed it).

    Done is what the journal says (`restart_done`) or, before any entry point journaled it,
    the guard's own resume record in the run directory.
    """
    rows = []
    for e in journal.in_job_restarts:
        if e.get("job_id") != job_id:
            continue
        settled = journal.restarts_settled.get(str(e.get("plan_id")), {})
        done = settled if settled.get("type") == "restart_done" else _done_in_run_dir(e, run_dir)
        state = "done" if done else ("failed" if settled else "pending")
        rows.append(
            {
                "time": e.get("time"),
                "attempt": int(e.get("attempt", 0)),
                "left": list(e.get("left", [])),
                "joined": list(e.get("joined", [])),
                "nodes": list(e.get("nodes", [])),
                "alarm_ids": list(e.get("alarm_ids", [])),
                "state": state,
                "resume_source": done.get("resume_source") if done else None,
                "resume_step": done.get("resume_step") if done else None,
                "resume_path": done.get("resume_path") if done else None,
                "planned_resume_step": e.get("resume_step"),
                "seconds": done.get("seconds") if done else None,
                "failed_reason": settled.get("reason") if state == "failed" else None,
                "completed_by": settled.get("completed_by") if state == "failed" else None,
            }
        )
    return rows


def _done_in_run_dir(entry: dict[str, Any], run_dir: Path | None) -> dict[str, Any]:
    """The restart's resume record, as `restart_done` would journal it, if its first step ran."""
    if run_dir is None:
        return {}
    record = read_resume(
        run_dir,
        str(entry.get("job_id")),
        int(entry.get("restart_count", 0)),
        int(entry.get("attempt", 0)),
    )
    if record is None or record.first_step_at is None:
        return {}
    alarm_time = entry.get("alarm_time")
    seconds = None
    if isinstance(alarm_time, int | float):
        seconds = round(record.first_step_at - float(alarm_time), 2)
    return {
        "resume_source": record.source,
        "resume_step": record.step,
        "resume_path": record.path,
        "seconds": seconds,
    }


def held_reason(journal: Journal, job_id: str) -> str | None:
    """Why the controller holds the job (loop rule, spent budget, ambiguous verdict), if it does."""
    holds = [
        e
        for e in journal.alarms.values()
        if e.get("job_id") == job_id and e.get("outcome") == "hold"
    ]
    return str(holds[-1].get("reason", "")) if holds else None
