"""Read-only views for `slurm-guard status` and `slurm-guard review`.

They merge three sources: the run directory (what the guard saw), the controller's journal (what
was decided and done) and Slurm (what the job and nodes look like now). Slurm being unreachable
degrades a view, it never fails it: the run directory and the journal still answer.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from slurm_guard.controller.intake import find_run_dir, read_alarm_files
from slurm_guard.controller.state import ADMIN, APPROVAL, RESULTS, StateStore
from slurm_guard.protocol import REASON_PREFIX
from slurm_guard.records import RecordError, read_json_file, read_ledger
from slurm_guard.rundir import RunDir, choose_trusted_checkpoint
from slurm_guard.slurm.client import JobInfo, SlurmClient, SlurmCommandError

_ALARM_IN_REASON = re.compile(r"\balarm (\S+)")


def job_comment(info: JobInfo | None) -> str | None:
    """The job's `Comment=` as scontrol prints it (the run-dir link, see docs/admin-guide.md)."""
    if info is None:
        return None
    value = info.fields.get("Comment")
    return None if value in (None, "", "(null)") else value


def resolve_target(
    target: str, client: SlurmClient | None, store: StateStore, runs_root: Path | None
) -> tuple[str | None, Path | None]:
    """A `status` argument (job id or run dir) as (job id, run dir); either may stay unknown."""
    path = Path(target)
    if path.is_dir():
        job_id = None
        try:
            run = read_json_file(RunDir(path).run_file)
            if isinstance(run, dict) and run.get("job_id") is not None:
                job_id = str(run["job_id"])
        except RecordError:
            pass
        return job_id, path
    job_id = target
    for entry in store.read().alarms.values():
        if entry.get("job_id") == job_id:
            return job_id, Path(str(entry["run_dir"]))
    comment = None
    if client is not None:
        try:
            comment = job_comment(client.job(job_id))
        except SlurmCommandError:
            comment = None
    run_dir, _how = find_run_dir(job_id, comment, runs_root)
    return job_id, run_dir


def _job_view(client: SlurmClient | None, job_id: str | None) -> dict[str, Any]:
    if job_id is None:
        return {"error": "job id unknown (no run.json with a job id)"}
    if client is None:
        return {"error": "no Slurm client"}
    try:
        info = client.job(job_id)
    except SlurmCommandError as exc:
        return {"error": f"Slurm unreachable: {exc}"}
    if info is None:
        return {"error": f"job {job_id} not known to Slurm (finished and purged?)"}
    return {
        "state": info.state,
        "reason": info.reason,
        "nodes": list(info.nodes),
        "restart_count": info.restart_count,
        "excluded_nodes": list(info.excluded_nodes),
        "held": info.held,
        "user": info.user,
    }


def _resumes(rd: RunDir) -> list[dict[str, Any]]:
    """Rollbacks the guard carried out after alarms (handled/<alarm_id>.json), oldest first."""
    out: list[dict[str, Any]] = []
    if not rd.handled_dir.is_dir():
        return out
    for path in sorted(rd.handled_dir.glob("*.json")):
        try:
            obj = read_json_file(path)
        except RecordError:
            continue
        if isinstance(obj, dict):
            out.append(
                {
                    "alarm_id": obj.get("alarm_id", path.stem),
                    "resumed_from_step": obj.get("resumed_from_step"),
                    "restart_count": obj.get("restart_count"),
                    "quarantined": obj.get("quarantined", []),
                    "time": obj.get("time"),
                }
            )
    out.sort(key=lambda r: float(r["time"] or 0))
    return out


def status_view(
    target: str,
    *,
    client: SlurmClient | None,
    store: StateStore,
    runs_root: Path | None = None,
) -> dict[str, Any]:
    """Everything `slurm-guard status` shows about one job or run directory."""
    job_id, run_dir = resolve_target(target, client, store, runs_root)
    view: dict[str, Any] = {"job_id": job_id, "run_dir": str(run_dir) if run_dir else None}
    journal = store.read() if store.journal_path.exists() else None
    alarms: list[dict[str, Any]] = []
    bad: list[str] = []
    if run_dir is not None:
        rd = RunDir(run_dir)
        try:
            run = read_json_file(rd.run_file)
            view["checks"] = run.get("config", {}) if isinstance(run, dict) else {}
        except RecordError as exc:
            view["checks"] = {"error": str(exc)}
        passed = [e.step for e in read_ledger(rd.ledger) if e.passed]
        view["last_verified_step"] = max(passed, default=None)
        files, bad_files = read_alarm_files(run_dir)
        bad = [b.error for b in bad_files]
        for f in files:
            decision = journal.alarms.get(f.alarm.alarm_id) if journal else None
            alarms.append(
                {
                    "alarm_id": f.alarm.alarm_id,
                    "job_id": f.alarm.job_id,
                    "step": f.alarm.step,
                    "check": f.alarm.check,
                    "verdict": f.alarm.verdict,
                    "suspect_nodes": list(f.alarm.suspect_nodes),
                    "suspect_ranks": list(f.alarm.suspect_ranks),
                    "decision": decision["outcome"] if decision else "undecided",
                    "decision_reason": decision["reason"] if decision else "",
                    "approved": bool(journal and f.alarm.alarm_id in journal.approvals),
                }
            )
        latest = files[-1].alarm if files else None
        checkpoints = rd.checkpoints()
        trusted = choose_trusted_checkpoint(checkpoints, latest)
        view["trusted_checkpoint"] = trusted.step if trusted else None
        view["latest_checkpoint"] = checkpoints[-1].step if checkpoints else None
        view["resumes"] = _resumes(rd)
    view["alarms"] = alarms
    view["bad_alarm_files"] = bad
    view["job"] = _job_view(client, job_id)
    actions = []
    if journal is not None and job_id is not None:
        for e in journal.for_job(job_id):
            if e["type"] in RESULTS:
                actions.append(
                    {
                        "time": e["time"],
                        "op": e.get("op"),
                        "target": e.get("target"),
                        "result": e["type"],
                        "detail": e.get("detail", ""),
                    }
                )
    view["controller_actions"] = actions
    view["pending"] = store.pending().get(job_id or "", None)
    return view


def review_view(*, client: SlurmClient, store: StateStore) -> dict[str, Any]:
    """Nodes drained by slurm-guard with their evidence, and alarms waiting for an admin."""
    journal = store.read()
    nodes = []
    for node in client.nodes():
        if not node.reason or not node.reason.startswith(REASON_PREFIX):
            continue
        related = []
        match = _ALARM_IN_REASON.search(node.reason)
        for alarm_id, e in journal.alarms.items():
            named = match is not None and match.group(1) == alarm_id
            if named or (node.name in e.get("suspect_nodes", []) and e["outcome"] == "act"):
                related.append(
                    {
                        k: e.get(k)
                        for k in (
                            "alarm_id",
                            "job_id",
                            "step",
                            "check",
                            "verdict",
                            "suspect_ranks",
                            "message",
                            "evidence",
                            "run_dir",
                        )
                    }
                )
        nodes.append(
            {
                "node": node.name,
                "states": sorted(node.states),
                "reason": node.reason,
                "reason_user": node.reason_user,
                "alarms": related,
                "jobs": sorted({str(a["job_id"]) for a in related}),
            }
        )
    waiting = [
        {
            k: e.get(k)
            for k in (
                "alarm_id",
                "job_id",
                "outcome",
                "reason",
                "suspect_nodes",
                "verdict",
                "check",
                "step",
            )
        }
        for alarm_id, e in journal.alarms.items()
        if e["outcome"] in ("await_approval", "hold") and alarm_id not in journal.approvals
    ]
    admin = [e for e in journal.entries if e.get("type") in (ADMIN, APPROVAL)]
    return {
        "nodes": nodes,
        "awaiting_approval": waiting,
        "pending_jobs": list(store.pending().values()),
        "admin_actions": admin,
    }
