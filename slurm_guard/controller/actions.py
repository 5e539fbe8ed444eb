"""The cluster changes the controller makes, one handler per operation, and how a plan runs.

Every handler first looks at the current state, so that repeating an action (after a crash
between the command and its journal line) is a no-op, and returns what happened instead of
raising: only "slurmctld unreachable" (SlurmUnavailable) and "not yet" (RetryLater) propagate.

Requeue order matters: Slurm only accepts a new exclusion list while the job is pending, so the
job is requeue-held first, the exclusion set, and only then released (and given a start time a
few seconds ahead, instead of Slurm's default two-minute credential delay). If any step fails,
the later ones are skipped and the job stays held: a held job costs time, a job restarted on the
bad node costs correctness.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from slurm_guard.controller.policy import ACTIVE_JOB_STATES, foreign_reason
from slurm_guard.controller.report import ActionResult, JobReport, RetryLater
from slurm_guard.controller.state import (
    DONE,
    FAILED,
    INTENT,
    SKIPPED,
    Action,
    Journal,
    Plan,
    StateStore,
)
from slurm_guard.slurm.client import JobInfo, SlurmClient, SlurmCommandError, SlurmUnavailable

logger = logging.getLogger(__name__)

START_DELAY = "now+2"
"""Restart delay after release. `now` once failed a job for good ("Job credential revoked")."""
REQUEUE_OPS = ("requeue_hold", "exclude", "exclude_resize", "release", "start")
MAX_REASON_LEN = 200

Handler = Callable[[SlurmClient, Action], ActionResult]
JobHandler = Callable[[SlurmClient, str, JobInfo, int, tuple[str, ...]], ActionResult]
Narrate = Callable[[str], list[str]]
"""Turns the line describing one action's result into the report's lines (see Engine)."""


def _drain(client: SlurmClient, action: Action) -> ActionResult:
    node, reason = action.target, action.args[0]
    info = client.node(node)
    if foreign_reason(info.effective_reason):  # 24.11 keeps a resumed node's old reason
        return ActionResult(
            SKIPPED, f"left untouched: node has a reason not set by slurm-guard ({info.reason!r})"
        )
    if (info.drained or info.failed) and info.reason:
        return ActionResult(DONE, f"already drained by slurm-guard ({info.reason})")
    client.drain(node, reason)
    return ActionResult(DONE, f"drained: {reason}")


def _on_job(handler: JobHandler) -> Handler:
    """A job action: args are (restart count when planned, nodes...); the job must exist."""

    def run(client: SlurmClient, action: Action) -> ActionResult:
        info = client.job(action.target)
        if info is None:
            return ActionResult(FAILED, f"job {action.target} no longer exists")
        return handler(client, action.target, info, int(action.args[0]), tuple(action.args[1:]))

    return run


@_on_job
def _requeue_hold(
    client: SlurmClient, job_id: str, info: JobInfo, restart: int, _nodes: tuple[str, ...]
) -> ActionResult:
    if info.held and info.state == "PENDING":
        if info.restart_count > restart:  # this plan's requeue, before a crash lost its line
            return ActionResult(DONE, "already held")
        # held before this plan (waiting for approval): not requeued again, not counted again
        return ActionResult(SKIPPED, "already held (before this plan)")
    if info.restart_count > restart:
        return ActionResult(SKIPPED, "job was already requeued by an earlier run")
    client.requeue_hold(job_id)
    return ActionResult(DONE, "requeued and held")


@_on_job
def _exclude(
    client: SlurmClient, job_id: str, info: JobInfo, _restart: int, nodes: tuple[str, ...]
) -> ActionResult:
    return _set_exclusion(client, job_id, info, nodes, None)


@_on_job
def _exclude_resize(
    client: SlurmClient, job_id: str, info: JobInfo, _restart: int, args: tuple[str, ...]
) -> ActionResult:
    """A job with spares goes back through the queue on N nodes: exclusion and size at once
    (Slurm 22.05 ignores a NumNodes update that does not come with NumTasks)."""
    size = (int(args[0]), int(args[1]))
    return _set_exclusion(client, job_id, info, args[2:], size)


def _set_exclusion(
    client: SlurmClient,
    job_id: str,
    info: JobInfo,
    nodes: tuple[str, ...],
    size: tuple[int, int] | None,
) -> ActionResult:
    same_size = size is None or info.fields.get("NumNodes") == str(size[0])
    if set(nodes) <= set(info.excluded_nodes) and same_size:
        return ActionResult(DONE, f"already excludes {','.join(nodes) or '-'}")
    union = tuple(sorted(set(info.excluded_nodes) | set(nodes)))
    try:
        if size is None:
            client.set_excluded_nodes(job_id, union)
        else:
            client.set_excluded_nodes(job_id, union, node_count=size[0], task_count=size[1])
    except SlurmUnavailable:
        raise
    except SlurmCommandError as exc:
        if info.state == "PENDING":
            raise
        # Slurm changes the exclusion only of a pending job. After requeuehold of a running
        # job (in-job recovery) the job is pending only once its batch script ends; the
        # epilog or the watcher picks the plan up then.
        raise RetryLater(
            f"job {job_id} is {info.state}; exclusion waits until it is pending ({exc})"
        ) from None
    if size is not None:
        return ActionResult(
            DONE, f"excluded {','.join(union)}; {size[0]} nodes, {size[1]} tasks (no spares)"
        )
    return ActionResult(
        DONE, f"excluded {','.join(union)}{_task_count_change(client, job_id, info)}"
    )


def _task_count_change(client: SlurmClient, job_id: str, before: JobInfo) -> str:
    """A warning for the action's detail when setting the exclusion changed the task count.

    Slurm 24.11 recomputes NumTasks as nodes x ntasks-per-node on this update (4 tasks on 3
    nodes with --ntasks-per-node=2 came back as 6, measured). The controller cannot undo it: a
    NumTasks update holds only until the release. The resumed run then starts on a different
    world size (a sharded checkpoint refuses it by name), so the action record says why.
    """
    after = client.job(job_id)
    old, new = before.fields.get("NumTasks"), after.fields.get("NumTasks") if after else None
    if old is None or new is None or old == new:
        return ""
    logger.warning("job %s: Slurm changed its task count from %s to %s", job_id, old, new)
    return (
        f"; Slurm changed the job's task count from {old} to {new} when the exclusion was set "
        "(a job whose --ntasks leaves --ntasks-per-node unfilled: submit it with --ntasks alone)"
    )


@_on_job
def _release(
    client: SlurmClient, job_id: str, info: JobInfo, _restart: int, nodes: tuple[str, ...]
) -> ActionResult:
    if not set(nodes) <= set(info.excluded_nodes):
        return ActionResult(FAILED, "exclusion not in place; job left held for review")
    if info.state in ACTIVE_JOB_STATES:
        return ActionResult(DONE, f"job already {info.state}")
    # Not `if info.held`: inside EpilogSlurmctld the requeuehold is still in flight (job
    # COMPLETING, hold not visible yet) and Slurm applies the release anyway.
    try:
        client.release(job_id)
    except SlurmUnavailable:
        raise
    except SlurmCommandError as exc:
        again = client.job(job_id)
        if again is not None and not again.held and again.state == "PENDING":
            return ActionResult(DONE, "not held")
        return ActionResult(FAILED, str(exc))
    return ActionResult(DONE, "released")


@_on_job
def _start(
    client: SlurmClient, job_id: str, info: JobInfo, _restart: int, _nodes: tuple[str, ...]
) -> ActionResult:
    if info.held or info.state in ACTIVE_JOB_STATES:
        return ActionResult(SKIPPED, f"job is {info.state}{' held' if info.held else ''}")
    client.set_start_time(job_id, START_DELAY)
    return ActionResult(DONE, f"StartTime={START_DELAY}")


HANDLERS: dict[str, Handler] = {
    "drain": _drain,
    "requeue_hold": _requeue_hold,
    "exclude": _exclude,
    "exclude_resize": _exclude_resize,
    "release": _release,
    "start": _start,
}
"""Every operation a plan may hold. A journal naming another one is refused, not guessed at."""


def run_action(client: SlurmClient, action: Action) -> ActionResult:
    """Carry out one action after checking the current state (a repeat is a no-op)."""
    handler = HANDLERS.get(action.op)
    if handler is None:
        raise ValueError(f"unknown action {action.op!r}; known: {', '.join(HANDLERS)}")
    return handler(client, action)


def make_plan(
    journal: Journal,
    job_id: str,
    run_dir: str,
    alarm_ids: tuple[str, ...],
    *,
    drains: list[tuple[str, str, str]],
    exclude: tuple[str, ...],
    restart_count: int,
    hold_only: bool,
    auto: bool,
    now: float,
    in_place: bool = False,
    shrink: tuple[int, int] | None = None,
) -> Plan:
    """Drain each suspect once, then requeue-hold; unless `hold_only`, exclude, release, start.

    `in_place`: the job restarts inside its allocation (the in-job supervisor starts the step
    again): drains only, the job is not touched. `shrink` (nodes, tasks): the exclusion also
    sets the job's size, for a job with spares that goes back through the queue.
    """
    n = sum(1 for p in journal.plans.values() if p.job_id == job_id)
    plan_id = f"job{job_id}-r{restart_count}-p{n}"
    actions: list[Action] = []
    seen: set[str] = set()
    for node, why, _alarm in drains:
        if node in seen:
            continue
        seen.add(node)
        actions.append(Action(f"{plan_id}:drain:{node}", "drain", node, (why,)))
    rc = str(restart_count)
    if in_place:
        return Plan(plan_id, job_id, run_dir, alarm_ids, auto, tuple(actions), now)
    actions.append(Action(f"{plan_id}:requeue_hold", "requeue_hold", job_id, (rc,)))
    if not hold_only and shrink is not None:
        size = (str(shrink[0]), str(shrink[1]))
        actions.append(
            Action(f"{plan_id}:exclude", "exclude_resize", job_id, (rc, *size, *exclude))
        )
    elif not hold_only:
        actions.append(Action(f"{plan_id}:exclude", "exclude", job_id, (rc, *exclude)))
    if not hold_only:
        actions.append(Action(f"{plan_id}:release", "release", job_id, (rc, *exclude)))
        actions.append(Action(f"{plan_id}:start", "start", job_id, (rc,)))
    return Plan(plan_id, job_id, run_dir, alarm_ids, auto, tuple(actions), now)


def execute_plan(
    client: SlurmClient,
    store: StateStore,
    plan: Plan,
    journal: Journal,
    report: JobReport,
    narrate: Narrate,
) -> None:
    """Carry out the plan's remaining actions, each journaled before (intent) and after (result).

    SlurmUnavailable and RetryLater propagate: the job is retried later from the journal.
    """
    chain_broken = False
    for action in plan.actions:
        previous = journal.results.get(action.key)
        if previous is not None:
            if action.op in REQUEUE_OPS and previous["type"] == FAILED:
                chain_broken = True
            continue
        if chain_broken and action.op in REQUEUE_OPS:
            result = ActionResult(SKIPPED, "an earlier requeue step failed; job left as it is")
        else:
            store.append(
                INTENT, key=action.key, op=action.op, target=action.target, job_id=plan.job_id
            )
            try:
                result = run_action(client, action)
            except SlurmUnavailable:
                raise
            except SlurmCommandError as exc:
                result = ActionResult(FAILED, str(exc))
        if result.status == FAILED and action.op in REQUEUE_OPS:
            chain_broken = True
        store.append(
            result.status,
            key=action.key,
            op=action.op,
            target=action.target,
            job_id=plan.job_id,
            detail=result.detail,
        )
        text = f"{action.op} {action.target}: {result.status} ({result.detail})"
        report.actions += narrate(text)
        (logger.warning if result.status == FAILED else logger.info)("%s", text)
