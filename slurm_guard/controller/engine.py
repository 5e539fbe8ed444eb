"""The decision loop: read a finished job's alarms, decide each, plan, act, record.

Three entry points share this engine: the EpilogSlurmctld program, the in-job `slurm-guard
recover` step and the `slurm-guard controller --watch` service. Each call takes the state lock,
re-reads the journal, and carries out only what is not done yet, so any number of them may see
the same job, in any order, and a crash halfway is finished by whichever runs next.

What each cluster change does lives in `actions`, the admin's approve/return/retire in
`admin`. A dry run is the same code against a DryRunSlurm and a ScratchStore: the decisions and
plans are real, nothing reaches the cluster or the state directory, and the report says in
words what would have changed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from slurm_guard.controller import admin
from slurm_guard.controller.actions import MAX_REASON_LEN, Narrate, execute_plan, make_plan
from slurm_guard.controller.in_job import Allocation, InJobOutcome, healthy_nodes, restart_record
from slurm_guard.controller.intake import read_alarm_files
from slurm_guard.controller.loops import BUDGET, LOOP, apply_job_rules
from slurm_guard.controller.metrics import publish
from slurm_guard.controller.policy import Decision, JobFacts, Outcome, Policy, decide, drain_reason
from slurm_guard.controller.report import EngineError, JobReport, RetryLater, summarize
from slurm_guard.controller.settle import settle_restarts
from slurm_guard.controller.state import (
    ALARM,
    BAD_FILE,
    IN_JOB_RESTART,
    JOB_STEP,
    PLAN,
    Journal,
    LockTimeout,
    Plan,
    ScratchStore,
    StateError,
    StateStore,
)
from slurm_guard.protocol import DEFAULT_STATE_DIR
from slurm_guard.slurm.client import JobInfo, SlurmClient, SlurmUnavailable, default_client
from slurm_guard.slurm.dry_run import DryRunSlurm

__all__ = [
    "Engine",
    "EngineError",
    "JobReport",
    "RetryLater",
    "handle_job",
    "job_facts",
    "open_engine",
    "summarize",
]

logger = logging.getLogger(__name__)


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


def _as_is(text: str) -> list[str]:
    return [text]


def _dry_narrator(client: DryRunSlurm) -> Narrate:
    """In a dry run an action's line is what it would have changed, when it changes anything."""
    return lambda text: client.take_changes() or [text]


class Engine:
    """Decide, act, record. Only this class (through `actions`) changes the cluster.

    With `dry_run`, `client` is wrapped in a DryRunSlurm (unless it is one already) and `store`
    replaced by a ScratchStore over the same directory.
    """

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
        self.policy = policy if policy is not None else Policy.load(store.root)
        self.dry_run = dry_run
        self.narrate: Narrate = _as_is
        if dry_run:
            dry = client if isinstance(client, DryRunSlurm) else DryRunSlurm(client)
            client, store = dry, ScratchStore(store.root)
            self.narrate = _dry_narrator(dry)
        self.client = client
        self.store = store
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
        spares: Allocation | None = None,
    ) -> JobReport:
        """Handle every undecided alarm of `job_id` in `run_dir` and finish unfinished plans.

        `allocation` is the job's node list as slurmctld handed it to the epilog
        (SLURM_JOB_NODELIST): while EpilogSlurmctld runs, `scontrol show job` may already
        show no nodes. `spares` is the in-job supervisor's view of a job with spare nodes:
        then a convicted node is replaced by a spare of the allocation when one is healthy
        (`report.in_job.restart_on`), and the job is requeued only when none is. Never raises
        for bad input or an unreachable slurmctld: the job is left pending in the state dir
        and the report says why.
        """
        report = JobReport(job_id, str(run_dir), allocation=allocation)
        wait = self.lock_timeout_s if lock_timeout_s is None else lock_timeout_s
        try:
            with self.store.locked(wait):
                self._process_locked(job_id, run_dir, in_job, allocation, report, spares)
        except LockTimeout as exc:
            report.lock_busy = True
            self.pend(report, run_dir, str(exc))
        except SlurmUnavailable as exc:
            self.pend(report, run_dir, f"slurmctld unreachable: {exc}")
        except RetryLater as exc:
            self.pend(report, run_dir, str(exc))
        self.publish_metrics()
        return report

    def retry_pending(self, lock_timeout_s: float | None = None) -> list[JobReport]:
        """Look again at every job left pending (slurmctld was down, the job was running...),
        finish every plan a crash or an outage interrupted, and settle every in-job restart
        not yet seen to run (`settle`).

        An epilog passes a short `lock_timeout_s`: it retries others' jobs only when the lock is
        free. Waiting the full timeout per pending job made every epilog of a burst queue behind
        every other (a convoy that grew with the square of the burst); the watcher and later
        epilogs pick the jobs up instead.
        """
        pending = self.store.pending()
        todo = {job_id: str(e.get("run_dir", "")) for job_id, e in pending.items()}
        journal = self.store.read()
        for plan in journal.unfinished_plans():
            todo.setdefault(plan.job_id, plan.run_dir)
        for restart in journal.unsettled_restarts(None):
            todo.setdefault(str(restart.get("job_id")), str(restart.get("run_dir", "")))
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

    def approve(self, alarm_id: str, reason: str, admin_name: str) -> JobReport:
        """Carry out an alarm that waits for approval (see admin.approve)."""
        try:
            return admin.approve(self, alarm_id, reason, admin_name)
        finally:
            self.publish_metrics()

    def return_node(self, node: str, reason: str, admin_name: str, *, force: bool = False) -> str:
        """Resume a node slurm-guard drained (see admin.return_node)."""
        try:
            return admin.return_node(self, node, reason, admin_name, force=force)
        finally:
            self.publish_metrics()

    def retire_node(self, node: str, reason: str, admin_name: str) -> str:
        """Set a node slurm-guard drained to FAIL for good (see admin.retire_node)."""
        try:
            return admin.retire_node(self, node, reason, admin_name)
        finally:
            self.publish_metrics()

    def reset_budget(self, run_dir: str, reason: str, admin_name: str) -> str:
        """Reset a run directory's restart budget and loop history (see admin.reset_budget)."""
        return admin.reset_budget(self, run_dir, reason, admin_name)

    def record_step(self, job_id: str, **fields: object) -> None:
        """Journal one transition of the in-job supervisor (a step started or ended).

        Never raises: a journal that is busy or unwritable for once must not stop training;
        the line is lost and the log says so (decisions take the lock again, and fail closed).
        """
        if self.dry_run:
            return
        try:
            with self.store.locked(self.lock_timeout_s):
                self.store.append(JOB_STEP, job_id=job_id, **fields)
        except (StateError, OSError) as exc:
            logger.warning("job %s: step transition not journaled (%s): %s", job_id, exc, fields)

    def publish_metrics(self) -> bool:
        """Rewrite the Prometheus textfile policy.json names, if any (never raises)."""
        return publish(self.store, self.policy, self.client, dry_run=self.dry_run)

    # ---------------------------------------------------------------- decisions

    def _process_locked(
        self,
        job_id: str,
        run_dir: Path,
        in_job: bool,
        allocation: tuple[str, ...],
        report: JobReport,
        spares: Allocation | None = None,
    ) -> None:
        journal = self.store.read()
        for plan in journal.unfinished_plans():
            if plan.job_id == job_id:
                report.actions.append(f"finishing plan {plan.plan_id} left by an earlier run")
                self.execute(plan, journal, report)
                journal = self.store.read()
        if settle_restarts(self, job_id, run_dir, in_job, report):
            journal = self.store.read()

        files, bad = read_alarm_files(run_dir)
        for b in bad:
            report.problems.append(b.error)
            if b.fingerprint not in journal.bad_files:
                logger.warning("rejected alarm file: %s", b.error)
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
            if all(p.job_id != job_id for p in journal.unfinished_plans()):
                self.store.clear_pending(job_id)
            return

        info = self.client.job(job_id)
        facts = job_facts(info)
        if facts.exists and not facts.nodes and allocation:
            facts = dataclasses.replace(facts, nodes=frozenset(allocation))
        drains = journal.auto_drains_since(self.clock() - self.policy.window_s)
        act: list[tuple[str, Decision, str]] = []  # alarm id, decision, drain reason
        hold: list[tuple[str, Decision, str]] = []
        alarm_times: list[float] = []
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
            d = apply_job_rules(
                f.alarm, d, self.store.read(), str(run_dir), self.policy, self.clock()
            )
            report.decisions[f.alarm.alarm_id] = (d.outcome.value, d.reason)
            log = logger.warning if d.outcome is Outcome.REJECTED else logger.info
            log("job %s alarm %s: %s (%s)", job_id, f.alarm.alarm_id, d.outcome.value, d.reason)
            if d.outcome is Outcome.DEFER:
                deferred = True
                continue
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
                suspect_gpus=list(f.alarm.suspect_gpus),
                drain_reason=drain_reason(f.alarm)[:MAX_REASON_LEN],
                message=f.alarm.message[:500],
                evidence=f.alarm.evidence,
                hold_kind=d.hold_kind,
            )
            entry = (f.alarm.alarm_id, d, drain_reason(f.alarm)[:MAX_REASON_LEN])
            if d.outcome is Outcome.ACT:
                drains += len(d.drain_nodes)
                act.append(entry)
                alarm_times.append(f.alarm.created)
            elif d.outcome is Outcome.HOLD:
                drains += len(d.drain_nodes)  # a spent budget holds the job, drains the node
                hold.append(entry)
                report.held = d.reason
            elif d.outcome is Outcome.AWAIT_APPROVAL:
                # Held in Slurm until `review approve`: a held job outlives MinJobAge, a
                # FAILED one is purged and its approval has nothing left to release.
                hold.append((f.alarm.alarm_id, Decision(d.outcome, d.reason), entry[2]))
                report.held = d.reason

        if (act or hold) and info is not None:
            self._plan(job_id, run_dir, journal, info, act, hold, alarm_times, spares, report)
        if deferred:
            self.pend(report, run_dir, "an alarm's job is still running")
        elif not report.pending:
            self.store.clear_pending(job_id)

    def _plan(
        self,
        job_id: str,
        run_dir: Path,
        journal: Journal,
        info: JobInfo,
        act: list[tuple[str, Decision, str]],
        hold: list[tuple[str, Decision, str]],
        alarm_times: list[float],
        spares: Allocation | None,
        report: JobReport,
    ) -> None:
        """One plan for the pass: restart in the allocation, requeue, or hold; then carry it out.

        In the allocation when the supervisor gave one with a healthy spare, the policy allows
        it and nothing holds the job; the restart is journaled (IN_JOB_RESTART) with the plan,
        before any drain, so the epilog and the watcher see it and requeue nothing.
        """
        leave = {n for _, d, _ in act for n in d.exclude_nodes}
        # The loop rule, a spent budget and an alarm waiting for approval hold the job whatever
        # else the pass found; an ambiguous alarm beside a convicted node does not stop the
        # requeue (as before).
        holding = any(
            d.hold_kind in (LOOP, BUDGET) or d.outcome is Outcome.AWAIT_APPROVAL for _, d, _ in hold
        )
        restart_on = None
        if spares is not None and act and not holding and self.policy.in_job_restarts:
            restart_on = healthy_nodes(spares, leave, journal.nodes_left_by(job_id), self.client)
        shrink: tuple[int, int] | None = None
        if spares is not None and spares.spares > 0 and restart_on is None:
            # Back through the queue without spares: N+S nodes may no longer exist once the
            # spares are spent, and the requeued run trains on N anyway.
            shrink = (spares.train_nodes, spares.train_nodes * spares.tasks_per_node)
        every = act + hold
        plan = make_plan(
            journal,
            job_id,
            str(run_dir),
            tuple(a for a, _, _ in every),
            drains=[(n, why, a) for a, d, why in every for n in d.drain_nodes],
            exclude=tuple(sorted(leave)),
            restart_count=info.restart_count,
            hold_only=not act or holding,
            auto=True,
            now=self.clock(),
            in_place=restart_on is not None,
            shrink=shrink,
        )
        self.store.append(PLAN, job_id=plan.job_id, plan=plan.to_json())
        if restart_on is not None and spares is not None:
            record = restart_record(
                job_id,
                plan.plan_id,
                [a for a, _, _ in act],
                alarm_times,
                spares,
                restart_on,
                run_dir,
                info.restart_count,
            )
            self.store.append(IN_JOB_RESTART, **record)
            report.in_job = InJobOutcome(restart_on, record)
            report.actions.append(
                f"restart in the allocation on {','.join(restart_on)} (left "
                f"{','.join(record['left'])}, joined {','.join(record['joined'])})"
            )
        self.execute(plan, self.store.read(), report)

    # ---------------------------------------------------------------- shared with admin

    def execute(self, plan: Plan, journal: Journal, report: JobReport) -> None:
        """Carry out the plan's remaining actions; SlurmUnavailable propagates (retry later)."""
        execute_plan(self.client, self.store, plan, journal, report, self.narrate)

    def pend(self, report: JobReport, run_dir: Path, reason: str) -> None:
        """Leave the job for a later look (the watcher, the next epilog); say why."""
        report.pending = True
        report.pending_reason = reason
        logger.warning("job %s pending: %s", report.job_id, reason)
        try:
            self.store.add_pending(report.job_id, run_dir, reason, report.allocation)
        except OSError as exc:
            report.problems.append(f"cannot record pending job: {exc}")


def open_engine(
    state_dir: str | os.PathLike[str] = DEFAULT_STATE_DIR,
    client: SlurmClient | None = None,
    *,
    policy: Policy | None = None,
    dry_run: bool = False,
) -> Engine:
    """The controller of one state directory, with its policy.json unless `policy` is given.

    The entry for code outside the controller (the drill, benchmarks, scripts): the journal,
    the lock and the policy file stay the controller's business.
    """
    store = StateStore(state_dir)
    return Engine(
        client if client is not None else default_client(), store, policy, dry_run=dry_run
    )


def handle_job(
    job_id: str,
    run_dir: Path,
    *,
    state_dir: str | os.PathLike[str] = DEFAULT_STATE_DIR,
    client: SlurmClient | None = None,
    allocation: tuple[str, ...] = (),
    in_job: bool = False,
    dry_run: bool = False,
) -> JobReport:
    """Decide (and unless `dry_run`, act on) one finished job's alarms; see Engine.process_job.

    For a dry run without a cluster pass a DryRunSlurm holding the job's and nodes' facts.
    """
    engine = open_engine(state_dir, client, dry_run=dry_run)
    return engine.process_job(job_id, run_dir, allocation=allocation, in_job=in_job)
