"""The long-running watcher: finds new alarms under a runs root and hands them to the engine.

It complements the epilog rather than replacing it: it catches jobs whose epilog did not run or
could not reach slurmctld, alarms written after the epilog looked, and plans left unfinished.
A scan is cheap (directory listings plus the alarm files of runs that have any), so a plain
polling loop is enough; no inotify, which does not work across NFS clients anyway.

One run directory the controller cannot read (another user's 0700 directory, an alarm written
0600) must not hide the others: it is reported, once, and the pass goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from slurm_guard.controller.engine import Engine
from slurm_guard.controller.intake import (
    BadAlarmFile,
    iter_run_dirs,
    read_alarm_files,
    unreadable,
)
from slurm_guard.controller.report import JobReport
from slurm_guard.controller.state import BAD_FILE, LockTimeout

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0


def scan_once(engine: Engine, runs_root: Path) -> list[JobReport]:
    """One pass: every run dir with undecided alarms, then every pending job and unfinished plan.

    Run directories and alarm files that cannot be read are reported (a report without a job)
    the first time they are seen, and skipped.
    """
    journal = engine.store.read()
    reports: list[JobReport] = []
    seen: set[str] = set()
    problems: list[BadAlarmFile] = []
    for run_dir in iter_run_dirs(
        runs_root, on_error=lambda p, e: problems.append(unreadable(p, e))
    ):
        files, bad = read_alarm_files(run_dir)
        job_ids = sorted(
            {
                f.alarm.job_id
                for f in files
                if f.alarm.job_id is not None and f.alarm.alarm_id not in journal.alarms
            }
        )
        if not job_ids:
            problems.extend(bad)  # with a job to process, the engine reports them
        for job_id in job_ids:
            seen.add(job_id)
            reports.append(engine.process_job(job_id, run_dir))
    reports += _report_problems(engine, runs_root, problems, journal.bad_files)
    pending = set(engine.store.pending()) | {p.job_id for p in journal.unfinished_plans()}
    pending |= {str(e.get("job_id")) for e in journal.unsettled_restarts(None)}
    if pending - seen:
        reports += [r for r in engine.retry_pending() if r.job_id not in seen]
    engine.publish_metrics()  # also after a quiet pass: the last-pass time shows we are alive
    return reports


def _report_problems(
    engine: Engine, runs_root: Path, problems: list[BadAlarmFile], known: set[str]
) -> list[JobReport]:
    """Journal and report each problem not reported before (the journal remembers)."""
    new = [p for p in problems if p.fingerprint not in known]
    if not new:
        return []
    report = JobReport("", str(runs_root))
    try:
        with engine.store.locked(engine.lock_timeout_s):
            for p in new:
                engine.store.append(
                    BAD_FILE,
                    job_id=None,
                    path=str(p.path),
                    error=p.error,
                    fingerprint=p.fingerprint,
                )
    except LockTimeout:
        pass  # reported now, journaled by a later pass
    for p in new:
        logger.warning("watcher skipped: %s", p.error)
        report.problems.append(p.error)
    return [report]


def watch(
    engine: Engine,
    runs_root: Path,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    stop: threading.Event | None = None,
    on_report: Callable[[JobReport], None] | None = None,
) -> None:
    """Scan every `interval_s` until `stop` is set. Errors in one pass never end the loop."""
    stop = stop if stop is not None else threading.Event()
    while not stop.is_set():
        started = time.monotonic()
        try:
            for report in scan_once(engine, runs_root):
                if on_report is not None:
                    on_report(report)
        except Exception:  # a service must outlive one bad pass; the traceback is logged
            logger.exception("watch pass over %s failed; retrying in %.0f s", runs_root, interval_s)
        stop.wait(max(0.0, interval_s - (time.monotonic() - started)))
