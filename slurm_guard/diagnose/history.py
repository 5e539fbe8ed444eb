"""What `slurm-guard review` shows per node: its alarm history and whether it may return.

A drained node goes back into service only on evidence: a passing diagnosis recorded after its
last confirmed alarm. These functions read the controller's records and the node's diagnoses and
say what stands in the way; they decide nothing and change nothing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from slurm_guard.diagnose.evidence import Diagnosis, latest_diagnosis

CONFIRMED_OUTCOMES = ("act",)
"""Decisions that count as a confirmed alarm against a node: drained on the evidence at once, or
(`approved`) after an admin approved it. Holds, rejections and numerical verdicts do not count."""


def node_history(
    alarm_entries: list[dict[str, Any]], approved: set[str] | dict[str, Any], node: str
) -> list[dict[str, Any]]:
    """Every alarm the controller decided that names `node`, across jobs, oldest first.

    `alarm_entries` are the journal's `alarm` decisions; `approved` the ids an admin approved.
    Each item says whether it is confirmed (it drained, or would have with approval) and carries
    the alarm's triage (`evidence["triage"]`, when the guard recorded one).
    """
    out = []
    for e in alarm_entries:
        if node not in e.get("suspect_nodes", []):
            continue
        alarm_id = str(e.get("alarm_id"))
        outcome = str(e.get("outcome"))
        confirmed = e.get("verdict") == "sdc" and (
            outcome in CONFIRMED_OUTCOMES or alarm_id in approved
        )
        evidence = e.get("evidence")
        triage = evidence.get("triage") if isinstance(evidence, dict) else None
        out.append(
            {
                "time": e.get("time"),
                "alarm_id": alarm_id,
                "job_id": e.get("job_id"),
                "step": e.get("step"),
                "check": e.get("check"),
                "verdict": e.get("verdict"),
                "outcome": outcome,
                "approved": alarm_id in approved,
                "confirmed": confirmed,
                "triage": triage,
            }
        )
    out.sort(key=lambda a: float(a["time"] or 0.0))
    return out


def confirmed_since(history: list[dict[str, Any]], since: float) -> int:
    return sum(1 for a in history if a["confirmed"] and float(a["time"] or 0.0) >= since)


def diagnosis_summary(d: Diagnosis | None) -> dict[str, Any] | None:
    """The latest diagnosis in the few fields an admin decides on."""
    if d is None:
        return None
    return {
        "passed": d.passed,
        "finished": d.finished,
        "golden": d.golden,
        "device": f"{d.device.get('kind')} x{d.device.get('count', 1)} {d.device.get('model')}",
        "failures": d.failures()[:5],
        "faults": list(d.faults),
    }


def return_blockers(
    state_dir: Path,
    node: str,
    history: list[dict[str, Any]],
    *,
    retire_after: int | None,
    retire_days: float,
    now: float | None = None,
) -> list[str]:
    """Why `review return NODE` should refuse without --force; empty when nothing speaks against.

    The latest diagnosis failed: the hardware is still suspect. The policy's retire rule is met
    (`retire_after` confirmed alarms in `retire_days` days): the node keeps coming back.
    """
    out = []
    latest = latest_diagnosis(state_dir, node)
    if latest is not None and not latest.passed:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(latest.finished))
        first = (latest.failures() or ["failed"])[0]
        out.append(f"its latest `slurm-guard diagnose` ({when}) failed: {first}")
    if retire_after is not None and retire_after > 0:
        now = time.time() if now is None else now
        n = confirmed_since(history, now - retire_days * 86400.0)
        if n >= retire_after:
            out.append(
                f"{n} confirmed alarm(s) in the last {retire_days:g} day(s); the policy retires "
                f"a node after {retire_after}"
            )
    return out
