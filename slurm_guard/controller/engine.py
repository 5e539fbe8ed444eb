"""The one place that changes the cluster: decide a finished job's alarms, then act and record.

Three entry points share this engine: the EpilogSlurmctld program, the in-job `slurm-guard
recover` step and the `slurm-guard controller --watch` service. Each call takes the state lock,
re-reads the journal, and carries out only what is not done yet, so any number of them may see
the same job, in any order, and a crash halfway is finished by whichever runs next.

Requeue order matters: Slurm only accepts a new exclusion list while the job is pending, so the
job is requeue-held first, the exclusion set, and only then released (and given a start time a
few seconds ahead, instead of Slurm's default two-minute credential delay). If any step fails,
the later ones are skipped and the job stays held: a held job costs time, a job restarted on the
bad node costs correctness.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_guard.controller.intake import read_alarm_files
from slurm_guard.controller.policy import (
    ACTIVE_JOB_STATES,
    Decision,
    JobFacts,
    Outcome,
    Policy,
    decide,
    drain_reason,
    foreign_reason,
)
from slurm_guard.controller.state import (
    ADMIN,
    ALARM,
    APPROVAL,
    BAD_FILE,
    DONE,
    FAILED,
    INTENT,
    PLAN,
    SKIPPED,
    Action,
    Journal,
    LockTimeout,
    Plan,
    StateStore,
)
from slurm_guard.protocol import REASON_PREFIX
from slurm_guard.slurm.client import JobInfo, SlurmClient, SlurmCommandError, SlurmUnavailable

logger = logging.getLogger(__name__)

START_DELAY = "now+2"
"""Restart delay after release. `now` once failed a job for good ("Job credential revoked")."""
REQUEUE_OPS = ("requeue_hold", "exclude", "release", "start")
MAX_REASON_LEN = 200


class EngineError(RuntimeError):
    """An admin request the engine refuses; the message says what to do instead."""


class RetryLater(Exception):
    """An action cannot be done yet (the job is not pending yet); the plan resumes later."""


@dataclass
class JobReport:
    """What one engine call did for one job, for the log and the CLI."""

    job_id: str
    run_dir: str
    pending: bool = False
    pending_reason: str = ""
    allocation: tuple[str, ...] = ()  # the node list the epilog was given, kept when pending
    lock_busy: bool = False  # another controller held the state lock
    decisions: dict[str, tuple[str, str]] = field(default_factory=dict)  # alarm -> outcome, why
    actions: list[str] = field(default_factory=list)  # human-readable, in order
    problems: list[str] = field(default_factory=list)  # rejected files and alarms

    def lines(self) -> list[str]:
        out = [f"job {self.job_id} (run dir {self.run_dir})"]
        out += [f"  alarm {a}: {o} - {why}" for a, (o, why) in self.decisions.items()]
        out += [f"  {a}" for a in self.actions]
        out += [f"  problem: {p}" for p in self.problems]
        if self.pending:
            out.append(f"  pending, retried later: {self.pending_reason}")
        return out


@dataclass(frozen=True)
class _Result:
    status: str  # DONE | SKIPPED | FAILED
    detail: str


def job_facts(info: JobInfo | None) -> JobFacts:
    if info is None:
        return JobFacts(exists=False)
    return JobFacts(
        exists=True,
        state=info.state,
        nodes=frozenset(info.nodes),
        user_id=info.user_id,
        restart_count=info.restart_count,
    )


class Engine:
    """Decide, act, record. Only this class calls the SlurmClient's mutating methods."""

    def __init__(
        self,
        client: SlurmClient,
        store: StateStore,
        policy: Policy | None = None,
        *,
        dry_run: bool = False,
        lock_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.store = store
        self.policy = policy if policy is not None else Policy.load(store.root)
        self.dry_run = dry_run
        self.lock_timeout_s = lock_timeout_s
        self.clock = clock

    # ---------------------------------------------------------------- entry points

    def process_job(
        self,
        job_id: str,
        run_dir: Path,
        *,
        in_job: bool = False,
        allocation: tuple[str, ...] = (),
        lock_timeout_s: float | None = None,
    ) -> JobReport:
        """Handle every undecided alarm of `job_id` in `run_dir` and finish unfinished plans.

        `allocation` is the job's node list as slurmctld handed it to the epilog
        (SLURM_JOB_NODELIST): while EpilogSlurmctld runs, `scontrol show job` may already
        show no nodes. Never raises for bad input or an unreachable slurmctld: the job is
        left pending in the state dir and the report says why.
        """
        report = JobReport(job_id, str(run_dir), allocation=allocation)
        wait = self.lock_timeout_s if lock_timeout_s is None else lock_timeout_s
        try:
            with self.store.locked(wait):
                self._process_locked(job_id, run_dir, in_job, allocation, report)
        except LockTimeout as exc:
            report.lock_busy = True
            self._pend(report, run_dir, str(exc))
        except SlurmUnavailable as exc:
            self._pend(report, run_dir, f"slurmctld unreachable: {exc}")
        except RetryLater as exc:
            self._pend(report, run_dir, str(exc))
        return report

    def retry_pending(self, lock_timeout_s: float | None = None) -> list[JobReport]:
        """Look again at every job left pending (slurmctld was down, the job was running...)
        and finish every plan a crash or an outage interrupted.

        An epilog passes a short `lock_timeout_s`: it retries others' jobs only when the lock is
        free. Waiting the full timeout per pending job made every epilog of a burst queue behind
        every other (a convoy that grew with the square of the burst); the watcher and later
        epilogs pick the jobs up instead.
        """
        pending = self.store.pending()
        todo = {job_id: str(e.get("run_dir", "")) for job_id, e in pending.items()}
        for plan in self.store.read().unfinished_plans():
            todo.setdefault(plan.job_id, plan.run_dir)
        reports = []
        for job_id, rd in sorted(todo.items()):
            raw = pending.get(job_id, {}).get("allocation", [])
            allocation = tuple(str(n) for n in raw) if isinstance(raw, list) else ()
            report = self.process_job(
                job_id, Path(rd), allocation=allocation, lock_timeout_s=lock_timeout_s
            )
            reports.append(report)
            if report.lock_busy and lock_timeout_s is not None:
                break  # someone else is working through the jobs; leave the rest to them
        return reports

    def approve(self, alarm_id: str, reason: str, admin: str) -> JobReport:
        """Carry out an alarm that waits for approval (policy, circuit breaker, ambiguous hold)."""
        _require_reason(reason)
        with self.store.locked(self.lock_timeout_s):
            journal = self.store.read()
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
                raise EngineError(
                    f"alarm {alarm_id} was already approved; see `slurm-guard status`"
                )
            job_id = str(entry["job_id"])
            report = JobReport(job_id, str(entry["run_dir"]))
            info = self.client.job(job_id)
            if info is None:
                raise EngineError(
                    f"job {job_id} of alarm {alarm_id} is no longer known to Slurm; drain the "
                    "node by hand if still needed"
                )
            if not self.dry_run:
                self.store.append(
                    APPROVAL, alarm_id=alarm_id, job_id=job_id, reason=reason, admin=admin
                )
            nodes = tuple(entry.get("suspect_nodes", ()))
            plan = self._make_plan(
                journal,
                job_id,
                str(entry["run_dir"]),
                (alarm_id,),
                drains=[(n, str(entry["drain_reason"]), alarm_id) for n in nodes],
                exclude=nodes,
                restart_count=info.restart_count,
                hold_only=False,
                auto=False,
            )
            self._record_plan(plan, report)
            try:
                self._execute(plan, self.store.read(), report)
            except (SlurmUnavailable, RetryLater) as exc:
                self._pend(report, Path(str(entry["run_dir"])), str(exc))
            return report

    def return_node(self, node: str, reason: str, admin: str) -> str:
        """Resume a node slurm-guard drained, after diagnostics cleared it."""
        _require_reason(reason)
        with self.store.locked(self.lock_timeout_s):
            info = self.client.node(node)
            self._require_ours(node, info.reason, "return")
            if self.dry_run:
                return f"would resume {node} (reason was: {info.reason})"
            self._admin_action(
                "return",
                node,
                reason,
                admin,
                info.reason,
                "resume",
                "resumed",
                lambda: self.client.resume(node),
            )
            return f"resumed {node} (was: {info.reason})"

    def retire_node(self, node: str, reason: str, admin: str) -> str:
        """Keep a node slurm-guard drained out for good (FAIL), for hardware replacement."""
        _require_reason(reason)
        with self.store.locked(self.lock_timeout_s):
            info = self.client.node(node)
            self._require_ours(node, info.reason, "retire")
            fail_reason = f"{REASON_PREFIX} retired by {admin}: {reason}"[:MAX_REASON_LEN]
            if self.dry_run:
                return f"would set {node} FAIL with reason {fail_reason!r}"
            self._admin_action(
                "retire",
                node,
                reason,
                admin,
                info.reason,
                "fail",
                fail_reason,
                lambda: self.client.fail(node, fail_reason),
            )
            return f"set {node} FAIL: {fail_reason}"

    def _admin_action(
        self,
        op: str,
        node: str,
        reason: str,
        admin: str,
        previous_reason: str | None,
        slurm_op: str,
        done_detail: str,
        call: Callable[[], None],
    ) -> None:
        """An admin's change to a node: recorded before (who, why, intent) and after (result)."""
        key = f"admin:{op}:{node}:{self.clock():.6f}"
        self.store.append(
            ADMIN,
            op=op,
            node=node,
            reason=reason,
            admin=admin,
            previous_reason=previous_reason,
            key=key,
        )
        self.store.append(INTENT, key=key, op=slurm_op, target=node)
        try:
            call()
        except SlurmCommandError as exc:
            self.store.append(FAILED, key=key, detail=str(exc))
            raise
        self.store.append(DONE, key=key, detail=done_detail)

    # ---------------------------------------------------------------- decisions

    def _process_locked(
        self,
        job_id: str,
        run_dir: Path,
        in_job: bool,
        allocation: tuple[str, ...],
        report: JobReport,
    ) -> None:
        journal = self.store.read()
        for plan in journal.unfinished_plans():
            if plan.job_id == job_id:
                report.actions.append(f"finishing plan {plan.plan_id} left by an earlier run")
                self._execute(plan, journal, report)
                journal = self.store.read()

        files, bad = read_alarm_files(run_dir)
        for b in bad:
            report.problems.append(b.error)
            if b.fingerprint not in journal.bad_files:
                logger.warning("rejected alarm file: %s", b.error)
                if not self.dry_run:
                    self.store.append(
                        BAD_FILE,
                        job_id=job_id,
                        path=str(b.path),
                        error=b.error,
                        fingerprint=b.fingerprint,
                    )
        todo = []
        for f in files:
            if f.alarm.alarm_id in journal.alarms:
                continue
            if f.alarm.job_id != job_id:
                report.problems.append(
                    f"{f.path}: names job {f.alarm.job_id}, not {job_id}; left for that job"
                )
                continue
            todo.append(f)
        if not todo:
            if not journal.unfinished_plans() or all(
                p.job_id != job_id for p in journal.unfinished_plans()
            ):
                self._unpend(job_id)
            return

        info = self.client.job(job_id)
        facts = job_facts(info)
        if facts.exists and not facts.nodes and allocation:
            facts = dataclasses.replace(facts, nodes=frozenset(allocation))
        drains = journal.auto_drains_since(self.clock() - self.policy.window_s)
        act: list[tuple[str, Decision, str]] = []  # alarm id, decision, drain reason
        hold: list[str] = []
        deferred = False
        for f in todo:
            d = decide(
                f.alarm,
                job_id,
                facts,
                f.owner_uid,
                self.policy,
                drains_in_window=drains,
                in_job=in_job,
            )
            report.decisions[f.alarm.alarm_id] = (d.outcome.value, d.reason)
            log = logger.warning if d.outcome is Outcome.REJECTED else logger.info
            log("job %s alarm %s: %s (%s)", job_id, f.alarm.alarm_id, d.outcome.value, d.reason)
            if d.outcome is Outcome.DEFER:
                deferred = True
                continue
            if not self.dry_run:
                self.store.append(
                    ALARM,
                    alarm_id=f.alarm.alarm_id,
                    job_id=job_id,
                    run_dir=str(run_dir),
                    path=str(f.path),
                    outcome=d.outcome.value,
                    reason=d.reason,
                    verdict=f.alarm.verdict,
                    check=f.alarm.check,
                    step=f.alarm.step,
                    restart_count=f.alarm.restart_count,
                    suspect_nodes=list(f.alarm.suspect_nodes),
                    suspect_ranks=list(f.alarm.suspect_ranks),
                    drain_reason=drain_reason(f.alarm)[:MAX_REASON_LEN],
                    message=f.alarm.message[:500],
                    evidence=f.alarm.evidence,
                )
            if d.outcome is Outcome.ACT:
                drains += len(d.drain_nodes)
                act.append((f.alarm.alarm_id, d, drain_reason(f.alarm)[:MAX_REASON_LEN]))
            elif d.outcome is Outcome.HOLD:
                hold.append(f.alarm.alarm_id)

        if (act or hold) and info is not None:
            exclude = tuple(sorted({n for _, d, _ in act for n in d.exclude_nodes}))
            plan = self._make_plan(
                journal,
                job_id,
                str(run_dir),
                tuple(a for a, _, _ in act) + tuple(hold),
                drains=[(n, why, a) for a, d, why in act for n in d.drain_nodes],
                exclude=exclude,
                restart_count=info.restart_count,
                hold_only=not act,
                auto=True,
            )
            self._record_plan(plan, report)
            self._execute(plan, self.store.read(), report)
        if deferred:
            self._pend(report, run_dir, "an alarm's job is still running")
        elif not report.pending:
            self._unpend(job_id)

    def _make_plan(
        self,
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
    ) -> Plan:
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
        actions.append(Action(f"{plan_id}:requeue_hold", "requeue_hold", job_id, (rc,)))
        if not hold_only:
            actions.append(Action(f"{plan_id}:exclude", "exclude", job_id, (rc, *exclude)))
            actions.append(Action(f"{plan_id}:release", "release", job_id, (rc, *exclude)))
            actions.append(Action(f"{plan_id}:start", "start", job_id, (rc,)))
        return Plan(plan_id, job_id, run_dir, alarm_ids, auto, tuple(actions), self.clock())

    def _record_plan(self, plan: Plan, report: JobReport) -> None:
        if self.dry_run:
            for a in plan.actions:
                report.actions.append(f"would {a.op} {a.target} {' '.join(a.args)}".rstrip())
            return
        self.store.append(PLAN, job_id=plan.job_id, plan=plan.to_json())

    # ---------------------------------------------------------------- actions

    def _execute(self, plan: Plan, journal: Journal, report: JobReport) -> None:
        """Carry out the plan's remaining actions; SlurmUnavailable propagates (retry later)."""
        if self.dry_run:
            return
        chain_broken = False
        for action in plan.actions:
            previous = journal.results.get(action.key)
            if previous is not None:
                if action.op in REQUEUE_OPS and previous["type"] == FAILED:
                    chain_broken = True
                continue
            if chain_broken and action.op in REQUEUE_OPS:
                result = _Result(SKIPPED, "an earlier requeue step failed; job left as it is")
            else:
                self.store.append(
                    INTENT, key=action.key, op=action.op, target=action.target, job_id=plan.job_id
                )
                try:
                    result = self._run(action)
                except SlurmUnavailable:
                    raise
                except SlurmCommandError as exc:
                    result = _Result(FAILED, str(exc))
            if result.status == FAILED and action.op in REQUEUE_OPS:
                chain_broken = True
            self.store.append(
                result.status,
                key=action.key,
                op=action.op,
                target=action.target,
                job_id=plan.job_id,
                detail=result.detail,
            )
            text = f"{action.op} {action.target}: {result.status} ({result.detail})"
            report.actions.append(text)
            (logger.warning if result.status == FAILED else logger.info)("%s", text)

    def _run(self, action: Action) -> _Result:
        """Check the current state first, so that a repeated action (after a crash) is a no-op."""
        if action.op == "drain":
            return self._drain(action.target, action.args[0])
        job_id = action.target
        restart = int(action.args[0])
        nodes = tuple(action.args[1:])
        info = self.client.job(job_id)
        if info is None:
            return _Result(FAILED, f"job {job_id} no longer exists")
        restarted = info.restart_count > restart
        if action.op == "requeue_hold":
            if info.held and info.state == "PENDING":
                return _Result(DONE, "already held")
            if restarted:
                return _Result(SKIPPED, "job was already requeued by an earlier run")
            self.client.requeue_hold(job_id)
            return _Result(DONE, "requeued and held")
        if action.op == "exclude":
            if set(nodes) <= set(info.excluded_nodes):
                return _Result(DONE, f"already excludes {','.join(nodes) or '-'}")
            union = tuple(sorted(set(info.excluded_nodes) | set(nodes)))
            try:
                self.client.set_excluded_nodes(job_id, union)
            except SlurmUnavailable:
                raise
            except SlurmCommandError as exc:
                if info.state == "PENDING":
                    raise
                # Slurm changes the exclusion only of a pending job. After requeuehold of a
                # running job (in-job recovery) the job is pending only once its batch script
                # ends; the epilog or the watcher picks the plan up then.
                raise RetryLater(
                    f"job {job_id} is {info.state}; exclusion waits until it is pending ({exc})"
                ) from None
            return _Result(DONE, f"excluded {','.join(union)}")
        if action.op == "release":
            if not set(nodes) <= set(info.excluded_nodes):
                return _Result(FAILED, "exclusion not in place; job left held for review")
            if info.state in ACTIVE_JOB_STATES:
                return _Result(DONE, f"job already {info.state}")
            # Not `if info.held`: inside EpilogSlurmctld the requeuehold is still in flight
            # (job COMPLETING, hold not visible yet) and Slurm applies the release anyway.
            try:
                self.client.release(job_id)
            except SlurmUnavailable:
                raise
            except SlurmCommandError as exc:
                again = self.client.job(job_id)
                if again is not None and not again.held and again.state == "PENDING":
                    return _Result(DONE, "not held")
                return _Result(FAILED, str(exc))
            return _Result(DONE, "released")
        if action.op == "start":
            if info.held or info.state in ACTIVE_JOB_STATES:
                return _Result(SKIPPED, f"job is {info.state}{' held' if info.held else ''}")
            self.client.set_start_time(job_id, START_DELAY)
            return _Result(DONE, f"StartTime={START_DELAY}")
        raise ValueError(f"unknown action {action.op!r}")

    def _drain(self, node: str, reason: str) -> _Result:
        info = self.client.node(node)
        if foreign_reason(info.reason):
            return _Result(
                SKIPPED,
                f"left untouched: node has a reason not set by slurm-guard ({info.reason!r})",
            )
        if (info.drained or info.failed) and info.reason:
            return _Result(DONE, f"already drained by slurm-guard ({info.reason})")
        self.client.drain(node, reason)
        return _Result(DONE, f"drained: {reason}")

    # ---------------------------------------------------------------- helpers

    def _pend(self, report: JobReport, run_dir: Path, reason: str) -> None:
        report.pending = True
        report.pending_reason = reason
        logger.warning("job %s pending: %s", report.job_id, reason)
        if not self.dry_run:
            try:
                self.store.add_pending(report.job_id, run_dir, reason, report.allocation)
            except OSError as exc:
                report.problems.append(f"cannot record pending job: {exc}")

    def _unpend(self, job_id: str) -> None:
        if not self.dry_run:
            self.store.clear_pending(job_id)

    @staticmethod
    def _require_ours(node: str, reason: str | None, verb: str) -> None:
        if not reason or not reason.startswith(REASON_PREFIX):
            raise EngineError(
                f"{node} has reason {reason!r}, not set by slurm-guard: slurm-guard does not "
                f"{verb} nodes it did not drain. Use scontrol directly if that is intended."
            )


def _require_reason(reason: str) -> None:
    if not reason.strip():
        raise EngineError("a reason is required for every admin action (--reason '...')")


def summarize(reports: list[JobReport]) -> dict[str, Any]:
    """A JSON-friendly view of reports, for `--json` output."""
    return {
        "jobs": [
            {
                "job_id": r.job_id,
                "run_dir": r.run_dir,
                "pending": r.pending,
                "pending_reason": r.pending_reason,
                "decisions": {a: {"outcome": o, "reason": w} for a, (o, w) in r.decisions.items()},
                "actions": r.actions,
                "problems": r.problems,
            }
            for r in reports
        ]
    }
