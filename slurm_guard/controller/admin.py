"""What an admin asks of the controller: approve a waiting alarm, return or retire a node.

Each request is refused with an EngineError that says what to do instead when it is unsafe
(no reason given, a node slurm-guard did not drain, an alarm that does not wait), and is
journaled: who, why, the intent before the Slurm call and its result after it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from slurm_guard.controller.actions import MAX_REASON_LEN, make_plan
from slurm_guard.controller.evidence import node_evidence
from slurm_guard.controller.policy import Outcome, Policy
from slurm_guard.controller.report import EngineError, JobReport, RetryLater
from slurm_guard.controller.state import (
    ADMIN,
    APPROVAL,
    BUDGET_RESET,
    DONE,
    FAILED,
    INTENT,
    PLAN,
    Journal,
    Plan,
    StateStore,
    same_run,
)
from slurm_guard.protocol import REASON_PREFIX
from slurm_guard.slurm.client import SlurmClient, SlurmCommandError, SlurmUnavailable


class Engine(Protocol):
    """What an admin request needs of the engine (controller.engine.Engine provides it)."""

    client: SlurmClient
    store: StateStore
    policy: Policy
    lock_timeout_s: float
    clock: Callable[[], float]

    def narrate(self, text: str) -> list[str]: ...

    def execute(self, plan: Plan, journal: Journal, report: JobReport) -> None: ...

    def pend(self, report: JobReport, run_dir: Path, reason: str) -> None: ...


def require_reason(reason: str) -> None:
    if not reason.strip():
        raise EngineError("a reason is required for every admin action (--reason '...')")


def require_ours(node: str, reason: str | None, verb: str) -> None:
    """`reason` is the node's reason in force (NodeInfo.effective_reason), None in service."""
    if not reason:
        raise EngineError(
            f"{node} is in service (not drained, failed or down), so slurm-guard holds nothing "
            f"to {verb}; a reason Slurm 24.11 still shows after a resume is left over"
        )
    if not reason.startswith(REASON_PREFIX):
        raise EngineError(
            f"{node} has reason {reason!r}, not set by slurm-guard: slurm-guard does not "
            f"{verb} nodes it did not drain. Use scontrol directly if that is intended."
        )


def approve(engine: Engine, alarm_id: str, reason: str, admin: str) -> JobReport:
    """Carry out an alarm that waits for approval (policy, circuit breaker, ambiguous hold)."""
    require_reason(reason)
    with engine.store.locked(engine.lock_timeout_s):
        journal = engine.store.read()
        entry = journal.alarms.get(alarm_id)
        if entry is None:
            raise EngineError(
                f"no decision recorded for alarm {alarm_id}; list alarms with "
                "`slurm-guard review` (the controller must have seen the alarm first)"
            )
        if entry["outcome"] not in (Outcome.AWAIT_APPROVAL.value, Outcome.HOLD.value):
            raise EngineError(
                f"alarm {alarm_id} is {entry['outcome']!r}, not waiting for approval: "
                "nothing to approve"
            )
        if alarm_id in journal.approvals:
            raise EngineError(f"alarm {alarm_id} was already approved; see `slurm-guard status`")
        job_id = str(entry["job_id"])
        report = JobReport(job_id, str(entry["run_dir"]))
        info = engine.client.job(job_id)
        if info is None:
            raise EngineError(
                f"job {job_id} of alarm {alarm_id} is no longer known to Slurm; drain the "
                "node by hand if still needed"
            )
        engine.store.append(APPROVAL, alarm_id=alarm_id, job_id=job_id, reason=reason, admin=admin)
        nodes = tuple(entry.get("suspect_nodes", ()))
        plan = make_plan(
            journal,
            job_id,
            str(entry["run_dir"]),
            (alarm_id,),
            drains=[(n, str(entry["drain_reason"]), alarm_id) for n in nodes],
            exclude=nodes,
            restart_count=info.restart_count,
            hold_only=False,
            auto=False,
            now=engine.clock(),
        )
        engine.store.append(PLAN, job_id=plan.job_id, plan=plan.to_json())
        try:
            engine.execute(plan, engine.store.read(), report)
        except (SlurmUnavailable, RetryLater) as exc:
            engine.pend(report, Path(str(entry["run_dir"])), str(exc))
        return report


def return_node(engine: Engine, node: str, reason: str, admin: str, *, force: bool = False) -> str:
    """Resume a node slurm-guard drained, after diagnostics cleared it.

    Refused while the evidence speaks against the node (its latest `slurm-guard diagnose`
    failed, or the policy's retire rule names it) unless `force`; a forced return is journaled
    with what it overrode.
    """
    require_reason(reason)
    with engine.store.locked(engine.lock_timeout_s):
        info = engine.client.node(node)
        require_ours(node, info.effective_reason, "return")
        evidence = node_evidence(engine.store, node, policy=engine.policy, now=engine.clock())
        blockers: list[str] = evidence["return_blockers"]
        if blockers and not force:
            raise EngineError(
                f"{node} not returned: {'; '.join(blockers)}. Rerun `slurm-guard diagnose` on "
                f"it, or retire it (`slurm-guard review retire {node}`); `review return --force` "
                "returns it anyway and records that it was forced"
            )
        _admin_action(
            engine,
            "return",
            node,
            reason,
            admin,
            info.reason,
            "resume",
            "resumed",
            lambda: engine.client.resume(node),
            forced=force,
            overrode=blockers,
        )
        return "\n".join(engine.narrate(f"resumed {node} (was: {info.reason})"))


def retire_node(engine: Engine, node: str, reason: str, admin: str) -> str:
    """Keep a node slurm-guard drained out for good (FAIL), for hardware replacement."""
    require_reason(reason)
    with engine.store.locked(engine.lock_timeout_s):
        info = engine.client.node(node)
        require_ours(node, info.effective_reason, "retire")
        fail_reason = f"{REASON_PREFIX} retired by {admin}: {reason}"[:MAX_REASON_LEN]
        _admin_action(
            engine,
            "retire",
            node,
            reason,
            admin,
            info.reason,
            "fail",
            fail_reason,
            lambda: engine.client.fail(node, fail_reason),
        )
        return "\n".join(engine.narrate(f"set {node} FAIL: {fail_reason}"))


def _admin_action(
    engine: Engine,
    op: str,
    node: str,
    reason: str,
    admin: str,
    previous_reason: str | None,
    slurm_op: str,
    done_detail: str,
    call: Callable[[], None],
    **extra: Any,
) -> None:
    """An admin's change to a node: recorded before (who, why, intent) and after (result)."""
    key = f"admin:{op}:{node}:{engine.clock():.6f}"
    engine.store.append(
        ADMIN,
        op=op,
        node=node,
        reason=reason,
        admin=admin,
        previous_reason=previous_reason,
        key=key,
        **extra,
    )
    engine.store.append(INTENT, key=key, op=slurm_op, target=node)
    try:
        call()
    except SlurmCommandError as exc:
        engine.store.append(FAILED, key=key, detail=str(exc))
        raise
    engine.store.append(DONE, key=key, detail=done_detail)


def reset_budget(engine: Engine, run_dir: str, reason: str, admin: str) -> str:
    """Start a run directory's restart budget and loop history afresh (journaled).

    The budget and the loop rule count the run's history across job ids, so resubmitting never
    resets them; an admin who has fixed the cause (replaced the image, the data) does, here.
    Nothing in Slurm changes: a job held by the rules stays held until released.
    """
    require_reason(reason)
    run = same_run(run_dir)
    with engine.store.locked(engine.lock_timeout_s):
        journal = engine.store.read()
        known = {same_run(e.get("run_dir")) for e in journal.alarms.values()}
        known |= {same_run(p.run_dir) for p in journal.plans.values()}
        if run not in known:
            raise EngineError(
                f"the journal records no alarm or plan for run directory {run}: nothing to "
                "reset (give the run directory the job's comment names)"
            )
        used = journal.restarts_since(run, engine.clock() - engine.policy.restart_window_s)
        engine.store.append(BUDGET_RESET, run_dir=run, reason=reason, admin=admin, used=used)
    return "\n".join(
        engine.narrate(f"reset the restart budget and loop history of {run} (was {used} used)")
    )
