"""The `slurm-guard review` view: nodes slurm-guard drained, with their alarms and evidence,
alarms awaiting an admin's approval, and jobs the controller still has to requeue. Read-only;
Slurm being unreachable degrades it to what the journal records."""

from __future__ import annotations

import re
from typing import Any

from slurm_guard.controller.evidence import node_evidence
from slurm_guard.controller.state import ADMIN, APPROVAL, DONE, Journal, StateStore
from slurm_guard.controller.views import (
    ViewError,
    read_journal,
    slurm_reason,
)
from slurm_guard.protocol import REASON_PREFIX
from slurm_guard.rundir.gpus import gpu_label
from slurm_guard.slurm.client import SlurmClient, SlurmCommandError

_ALARM_IN_REASON = re.compile(r"\balarm (\S+)")


def _alarm_evidence(journal: Journal, node: str, reason: str | None) -> list[dict[str, Any]]:
    related = []
    match = _ALARM_IN_REASON.search(reason or "")
    for alarm_id, e in journal.alarms.items():
        named = match is not None and match.group(1) == alarm_id
        if named or (node in e.get("suspect_nodes", []) and e.get("outcome") == "act"):
            related.append(
                {"gpu": gpu_label(e.get("suspect_gpus"))}
                | {
                    k: e.get(k)
                    for k in (
                        "alarm_id",
                        "job_id",
                        "step",
                        "check",
                        "verdict",
                        "suspect_ranks",
                        "suspect_gpus",
                        "message",
                        "evidence",
                        "run_dir",
                    )
                }
            )
    return related


def journal_nodes(journal: Journal) -> dict[str, dict[str, Any]]:
    """Nodes the journal says slurm-guard holds out of service: drained and not returned since.

    Used when Slurm cannot be asked; the node's state now is then unknown.
    """
    last: dict[str, dict[str, Any]] = {}
    events: list[tuple[float, str, str, str]] = []  # time, node, what, reason
    for plan in journal.plans.values():
        for action in plan.actions:
            result = journal.results.get(action.key)
            if action.op == "drain" and result is not None and result.get("type") == DONE:
                reason = action.args[0] if action.args else ""
                events.append((_time(result.get("time")), action.target, "drained", reason))
    for e in journal.entries:
        if e.get("type") == ADMIN and isinstance(e.get("node"), str):
            result = journal.results.get(str(e.get("key")))
            if result is not None and result.get("type") == DONE:
                what = "retired" if e.get("op") == "retire" else "returned"
                events.append((_time(result.get("time")), e["node"], what, str(e.get("reason"))))
    for when, node, what, reason in sorted(events):
        last[node] = {"what": what, "time": when, "reason": reason}
    return {n: v for n, v in last.items() if v["what"] != "returned"}


def _time(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def review_view(*, client: SlurmClient | None, store: StateStore) -> dict[str, Any]:
    """Nodes drained by slurm-guard with their evidence, and alarms waiting for an admin.

    Without Slurm (not installed, no configuration, slurmctld down) the node list comes from
    the journal and says so; alarms waiting for approval and pending jobs need no Slurm.
    """
    journal, journal_error = read_journal(store)
    if journal_error is not None:
        raise ViewError(journal_error)
    nodes = []
    slurm_error = None
    listed = None
    if client is None:
        slurm_error = "no Slurm client"
    else:
        try:
            listed = client.nodes()
        except (SlurmCommandError, ValueError) as exc:  # ValueError: output we cannot parse
            slurm_error = slurm_reason(exc)
    if listed is not None:
        for node in listed:
            # 24.11 keeps the reason of a resumed node: only a reason in force counts.
            reason = node.effective_reason
            if not reason or not reason.startswith(REASON_PREFIX):
                continue
            related = _alarm_evidence(journal, node.name, reason)
            nodes.append(
                {
                    "node": node.name,
                    "states": sorted(node.states),
                    "reason": reason,
                    "reason_user": node.reason_user,
                    "alarms": related,
                    "jobs": sorted({str(a["job_id"]) for a in related}),
                }
            )
    else:
        for name, last in sorted(journal_nodes(journal).items()):
            related = _alarm_evidence(journal, name, last["reason"])
            nodes.append(
                {
                    "node": name,
                    "states": [f"unknown (journal: {last['what']})"],
                    "reason": last["reason"],
                    "reason_user": None,
                    "alarms": related,
                    "jobs": sorted({str(a["job_id"]) for a in related}),
                }
            )
    for entry in nodes:  # alarms over time across jobs, triage, latest diagnosis
        entry.update(node_evidence(store, str(entry["node"]), journal=journal))
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
        if e.get("outcome") in ("await_approval", "hold") and alarm_id not in journal.approvals
    ]
    admin = [e for e in journal.entries if e.get("type") in (ADMIN, APPROVAL)]
    try:
        pending = list(store.pending().values())
    except OSError:
        pending = []
    return {
        "slurm": {"reachable": slurm_error is None, "error": slurm_error},
        "state_dir": str(store.root),
        "nodes": nodes,
        "awaiting_approval": waiting,
        "pending_jobs": pending,
        "held_jobs": held_jobs(journal),
        "admin_actions": admin,
    }


def held_jobs(journal: Journal) -> list[dict[str, Any]]:
    """Jobs the loop rule or a spent restart budget holds: the newest reason per job."""
    out: dict[str, dict[str, Any]] = {}
    for alarm_id, e in journal.alarms.items():
        kind = e.get("hold_kind")
        if e.get("outcome") != "hold" or kind not in ("loop", "budget"):
            continue
        job_id = str(e.get("job_id"))
        out[job_id] = {
            "job_id": job_id,
            "kind": kind,
            "reason": e.get("reason"),
            "alarm_id": alarm_id,
            "run_dir": e.get("run_dir"),
            "time": e.get("time"),
        }
    return list(out.values())
