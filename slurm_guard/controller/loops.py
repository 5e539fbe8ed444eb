"""No restart loops: the restart budget and the rule for alarms that follow the job.

A fault that follows the job from node to node (bad data, a software bug, a broken image) is
not a node's fault: draining the next node and restarting again only spends nodes and hours.
Two rules, both pure and both read from the journal (never from memory, so every entry point
counts the same way). Both count a run directory's history, across its job ids: a job
resubmitted on the same run gets no fresh budget and no fresh loop rule (an admin resets them,
`slurm-guard review reset-budget`).

* the same check fails at the same step again after a resume, on another node; or alarms of one
  check have named `policy.loop_nodes` different nodes of the run. Then the job is held and no
  further node is drained, unless the evidence singles out this alarm's node (below).
* the run has used its restart budget (in-job restarts and requeues together) within the
  window. Then the convicted node is still drained (the evidence stands), but the job is held.

Evidence before rules: when the alarm's triage reproduced the wrong result on its one suspect
node (k of n repeats disagreed with a witness on another node) and no earlier alarm saw the same
computation (same check, step and suspect ranks) fail on another node, that node is convicted
however often the check and step repeat. Two faulty nodes (a bad node and a bad spare) fail the
same step with different ranks; a fault that follows the job fails the same rank's computation
wherever it runs.

`numerical` verdicts never get here: they drain nothing and restart nothing, so they spend no
budget and are not counted as alarms of the job.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from slurm_guard.controller.policy import Decision, Outcome, Policy
from slurm_guard.controller.state import Journal, same_run
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
    ranks: frozenset[int] = frozenset()


def past_alarms(journal: Journal, run_dir: str, since: float = -1.0) -> list[PastAlarm]:
    """The run's earlier alarms that named nodes, across its job ids, none before its latest
    budget reset (numerical and rejected ones left out)."""
    run, since = same_run(run_dir), journal.counts_from(run_dir, since)
    out = []
    for alarm_id, e in journal.alarms.items():
        if same_run(e.get("run_dir")) != run or e.get("outcome") not in COUNTED_OUTCOMES:
            continue
        if e.get("verdict") == "numerical" or float(e.get("time", 0)) < since:
            continue
        nodes = frozenset(str(n) for n in e.get("suspect_nodes", []))
        ranks = frozenset(int(r) for r in e.get("suspect_ranks", []) if isinstance(r, int))
        if nodes:
            past = PastAlarm(alarm_id, str(e.get("check")), int(e.get("step", -1)), nodes, ranks)
            out.append(past)
    return out


def triage_convicts(alarm: Alarm) -> str | None:
    """The node the alarm's triage singles out, or None.

    Singled out: one suspect node, the triage ran on it and reproduced the wrong result at
    least once (`evidence["triage"]`: `reproduced` of `runs` disagreed with the witness).
    """
    triage = alarm.evidence.get("triage") if isinstance(alarm.evidence, dict) else None
    if not isinstance(triage, dict) or len(set(alarm.suspect_nodes)) != 1:
        return None
    reproduced, node = triage.get("reproduced"), triage.get("suspect_node")
    if not isinstance(reproduced, int) or isinstance(reproduced, bool) or reproduced < 1:
        return None
    return node if node in alarm.suspect_nodes else None


def follows_job(alarm: Alarm, past: list[PastAlarm], policy: Policy) -> str | None:
    """The hold reason when this alarm and the run's earlier ones follow the job; else None."""
    here = frozenset(alarm.suspect_nodes)
    if not here or alarm.verdict == "numerical":
        return None
    same = [p for p in past if p.check == alarm.check and p.alarm_id != alarm.alarm_id]
    ranks = frozenset(alarm.suspect_ranks)
    if triage_convicts(alarm) is not None and not any(
        p.step == alarm.step and p.nodes != here and p.ranks == ranks for p in same
    ):
        return None  # the evidence names this node, and no other node failed this computation
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
    """The hold reason when the run has no restart left in the window; else None."""
    if used < policy.restart_budget:
        return None
    hours = policy.restart_window_s / 3600
    return (
        f"{REASON_PREFIX} restart budget spent: {used} restart(s) of this run directory in "
        f"{hours:g} h (restart_budget {policy.restart_budget}); job held for review"
    )


def apply_job_rules(
    alarm: Alarm, decision: Decision, journal: Journal, run_dir: str, policy: Policy, now: float
) -> Decision:
    """Turn an ACT decision into a HOLD when the alarms follow the job or the run's budget is
    spent; both count the run directory's history (`run_dir`), across job ids."""
    if decision.outcome is not Outcome.ACT:
        return decision
    loop = follows_job(alarm, past_alarms(journal, run_dir), policy)
    if loop is not None:
        return Decision(Outcome.HOLD, loop, hold_kind=LOOP)
    spent = budget_reason(journal.restarts_since(run_dir, now - policy.restart_window_s), policy)
    if spent is not None:
        return dataclasses.replace(decision, outcome=Outcome.HOLD, reason=spent, hold_kind=BUDGET)
    return decision
