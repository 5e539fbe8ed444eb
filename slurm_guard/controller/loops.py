"""No restart loops: the restart budget and the rule for alarms that follow the job.

A fault that follows the job from node to node (bad data, a software bug, a broken image) is
not a node's fault: draining the next node and restarting again only spends nodes and hours.
Two rules, both pure and both read from the journal (never from memory, so every entry point
counts the same way):

* the same check fails at the same step again after a resume, on another node; or alarms of one
  check have named `policy.loop_nodes` different nodes of the job. Then the job is held and no
  further node is drained.
* the job has used its restart budget (in-job restarts and requeues together) within the
  window. Then the convicted node is still drained (the evidence stands), but the job is held.

`numerical` verdicts never get here: they drain nothing and restart nothing, so they spend no
budget and are not counted as alarms of the job.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from slurm_guard.controller.policy import Decision, Outcome, Policy
from slurm_guard.controller.state import Journal
from slurm_guard.protocol import REASON_PREFIX
from slurm_guard.rundir.records import Alarm

LOOP = "loop"
BUDGET = "budget"
COUNTED_OUTCOMES = frozenset({Outcome.ACT.value, Outcome.HOLD.value, "await_approval"})


@dataclass(frozen=True)
class PastAlarm:
    """One earlier decided alarm of the job, as the journal recorded it."""

    alarm_id: str
    check: str
    step: int
    nodes: frozenset[str]


def past_alarms(journal: Journal, job_id: str) -> list[PastAlarm]:
    """The job's earlier alarms that named nodes (numerical and rejected ones left out)."""
    out = []
    for alarm_id, e in journal.alarms.items():
        if e.get("job_id") != job_id or e.get("outcome") not in COUNTED_OUTCOMES:
            continue
        if e.get("verdict") == "numerical":
            continue
        nodes = frozenset(str(n) for n in e.get("suspect_nodes", []))
        if nodes:
            out.append(PastAlarm(alarm_id, str(e.get("check")), int(e.get("step", -1)), nodes))
    return out


def follows_job(alarm: Alarm, past: list[PastAlarm], policy: Policy) -> str | None:
    """The hold reason when this alarm and the job's earlier ones follow the job; else None."""
    here = frozenset(alarm.suspect_nodes)
    if not here or alarm.verdict == "numerical":
        return None
    same = [p for p in past if p.check == alarm.check and p.alarm_id != alarm.alarm_id]
    nodes = here.union(*(p.nodes for p in same))
    repeat = any(p.step == alarm.step and p.nodes != here for p in same)
    if not repeat and len(nodes) < policy.loop_nodes:
        return None
    steps = sorted({p.step for p in same} | {alarm.step})
    at = f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"
    return (
        f"{REASON_PREFIX} {len(same) + 1} alarms on {len(nodes)} nodes at {at}: suspect "
        "software or data, not hardware"
    )


def budget_reason(used: int, policy: Policy) -> str | None:
    """The hold reason when the job has no restart left in the window; else None."""
    if used < policy.restart_budget:
        return None
    hours = policy.restart_window_s / 3600
    return (
        f"{REASON_PREFIX} restart budget spent: {used} restart(s) in {hours:g} h "
        f"(restart_budget {policy.restart_budget}); job held for review"
    )


def apply_job_rules(
    alarm: Alarm, decision: Decision, journal: Journal, job_id: str, policy: Policy, now: float
) -> Decision:
    """Turn an ACT decision into a HOLD when the alarms follow the job or the budget is spent."""
    if decision.outcome is not Outcome.ACT:
        return decision
    loop = follows_job(alarm, past_alarms(journal, job_id), policy)
    if loop is not None:
        return Decision(Outcome.HOLD, loop, hold_kind=LOOP)
    spent = budget_reason(journal.restarts_since(job_id, now - policy.restart_window_s), policy)
    if spent is not None:
        return dataclasses.replace(decision, outcome=Outcome.HOLD, reason=spent, hold_kind=BUDGET)
    return decision
