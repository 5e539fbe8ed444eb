"""The controller's durable state: an append-only journal, pending jobs, and one lock.

The state lives in an admin-owned directory (default /var/lib/slurm-guard), never in the run
directory: a user can write anything into their run directory, so what the controller has done
must be kept where they cannot rewrite it.

Every cluster change is journaled twice: an `intent` line before the command and a `done`,
`skipped` or `failed` line after it. A rerun reads the journal, skips what is done and re-checks
(against Slurm) what has an intent but no result, so a crash halfway is finished by the next run
and nothing is done twice. The epilog, the in-job recovery step and the watcher may run at the
same moment; all of them take the same `flock` before reading the journal, so decisions and
actions are serialised.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import os.path
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_guard.protocol import DEFAULT_STATE_DIR
from slurm_guard.rundir.records import RecordError, atomic_write_json, fsync_dir, read_json_file

JOURNAL = "journal.jsonl"
LOCK = "lock"
PENDING = "pending"
LOCK_POLL_S = 0.05

# Journal entry types.
ALARM = "alarm"  # the decision for one alarm (outcome, reason, nodes)
BAD_FILE = "bad_file"  # an alarm file that could not be read
PLAN = "plan"  # an ordered list of actions for one job
INTENT = "intent"
DONE = "done"
SKIPPED = "skipped"
FAILED = "failed"
APPROVAL = "approval"  # an admin approved an alarm
ADMIN = "admin"  # an admin returned or retired a node
IN_JOB_RESTART = "in_job_restart"  # a job left a node and restarted on a spare of its allocation
JOB_STEP = "job_step"  # the in-job supervisor started or saw the end of a training step
RESTART_DONE = "restart_done"  # an in-job restart's step completed its first step (resumes/)
RESTART_FAILED = "restart_failed"  # an in-job restart never ran its first step: completed so
BUDGET_RESET = "budget_reset"  # an admin reset a run's restart budget and loop history
RESULTS = (DONE, SKIPPED, FAILED)


class StateError(RuntimeError):
    """The state directory is missing, not writable, or locked for too long."""


class LockTimeout(StateError):
    """Another controller process held the lock for longer than we may wait."""


@dataclass(frozen=True)
class Action:
    """One cluster change. `key` is unique for the lifetime of the state directory."""

    key: str
    op: str  # drain | requeue_hold | exclude | release | start
    target: str  # node name or job id
    args: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "op": self.op, "target": self.target, "args": list(self.args)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Action:
        return cls(str(obj["key"]), str(obj["op"]), str(obj["target"]), tuple(obj["args"]))


@dataclass
class Plan:
    """An ordered set of actions and how far it got."""

    plan_id: str
    job_id: str
    run_dir: str
    alarm_ids: tuple[str, ...]
    auto: bool
    actions: tuple[Action, ...]
    created: float

    def to_json(self) -> dict[str, Any]:
        return {
            "plan_id": self.plan_id,
            "job_id": self.job_id,
            "run_dir": self.run_dir,
            "alarm_ids": list(self.alarm_ids),
            "auto": self.auto,
            "actions": [a.to_json() for a in self.actions],
            "created": self.created,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Plan:
        return cls(
            plan_id=str(obj["plan_id"]),
            job_id=str(obj["job_id"]),
            run_dir=str(obj["run_dir"]),
            alarm_ids=tuple(obj["alarm_ids"]),
            auto=bool(obj["auto"]),
            actions=tuple(Action.from_json(a) for a in obj["actions"]),
            created=float(obj["created"]),
        )


class Journal:
    """The in-memory view of the journal file, rebuilt from it on every locked read."""

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        self.entries = entries
        self.alarms: dict[str, dict[str, Any]] = {}
        self.approvals: dict[str, dict[str, Any]] = {}
        self.plans: dict[str, Plan] = {}
        self.results: dict[str, dict[str, Any]] = {}
        self.intents: set[str] = set()
        self.bad_files: set[str] = set()
        self.in_job_restarts: list[dict[str, Any]] = []
        self.job_steps: list[dict[str, Any]] = []
        self.restarts_settled: dict[str, dict[str, Any]] = {}  # restart plan id -> its result
        self.budget_resets: dict[str, float] = {}  # run dir -> time of its latest reset
        for e in entries:
            kind = e.get("type")
            if kind == ALARM:
                self.alarms[str(e["alarm_id"])] = e
            elif kind == APPROVAL:
                self.approvals[str(e["alarm_id"])] = e
            elif kind == PLAN:
                plan = Plan.from_json(e["plan"])
                self.plans[plan.plan_id] = plan
            elif kind == INTENT:
                self.intents.add(str(e["key"]))
            elif kind in RESULTS:
                self.results[str(e["key"])] = e
            elif kind == BAD_FILE:
                self.bad_files.add(str(e["fingerprint"]))
            elif kind == IN_JOB_RESTART:
                self.in_job_restarts.append(e)
            elif kind == JOB_STEP:
                self.job_steps.append(e)
            elif kind in (RESTART_DONE, RESTART_FAILED):
                self.restarts_settled[str(e.get("plan_id"))] = e
            elif kind == BUDGET_RESET:
                self.budget_resets[same_run(e.get("run_dir"))] = float(e.get("time", 0))

    def unfinished_plans(self) -> list[Plan]:
        return [p for p in self.plans.values() if any(a.key not in self.results for a in p.actions)]

    def auto_drains_since(self, since: float) -> int:
        """Automatic drains done, or planned and not yet failed, since `since`.

        The circuit breaker's count. A planned drain counts before it is carried out: a plan
        interrupted by an outage or a crash is finished later, and by then other alarms must
        already have seen it, or the limit would be exceeded once it completes.
        """
        count = 0
        for plan in self.plans.values():
            if not plan.auto:
                continue
            for action in plan.actions:
                if action.op != "drain":
                    continue
                result = self.results.get(action.key)
                if result is None:
                    count += plan.created >= since
                elif result["type"] == DONE and float(result["time"]) >= since:
                    count += 1
        return count

    def counts_from(self, run_dir: str, since: float) -> float:
        """Where the run's history starts counting: `since`, or its latest budget reset."""
        return max(since, self.budget_resets.get(same_run(run_dir), -1.0))

    def restarts_since(self, run_dir: str, since: float) -> int:
        """The run's restarts since `since`, across its job ids: in-job restarts and planned
        requeues together, none before the run's latest budget reset.

        The restart budget's count, per run directory: a job resubmitted on the same run gets
        no fresh budget. A requeue counts when it is planned (as drains do for the circuit
        breaker): an interrupted plan is finished later and must already count. An in-job
        restart that never ran (RESTART_FAILED) does not count: the requeue that completed it
        does.
        """
        run, since = same_run(run_dir), self.counts_from(run_dir, since)
        in_job = sum(
            1
            for e in self.in_job_restarts
            if same_run(e.get("run_dir")) == run
            and float(e.get("time", 0)) >= since
            and self.restarts_settled.get(str(e.get("plan_id")), {}).get("type") != RESTART_FAILED
        )
        requeues = sum(
            1
            for p in self.plans.values()
            if same_run(p.run_dir) == run
            and p.created >= since
            and any(a.op == "release" for a in p.actions)
        )
        return in_job + requeues

    def unsettled_restarts(self, job_id: str | None) -> list[dict[str, Any]]:
        """In-job restarts of `job_id` (None: of every job) planned and not yet seen to run,
        nor completed otherwise (`controller.settle`)."""
        return [
            e
            for e in self.in_job_restarts
            if job_id in (None, e.get("job_id"))
            and str(e.get("plan_id")) not in self.restarts_settled
        ]

    def supervised(self, job_id: str) -> bool:
        """An in-job supervisor runs the job's training steps (it journaled one)."""
        return any(e.get("job_id") == job_id for e in self.job_steps)

    def nodes_left_by(self, job_id: str) -> set[str]:
        """Nodes the job left in its allocation after an alarm: never used by it again."""
        return {
            str(n)
            for e in self.in_job_restarts
            if e.get("job_id") == job_id
            for n in e.get("left", [])
        }

    def for_job(self, job_id: str) -> list[dict[str, Any]]:
        keys = {a.key for p in self.plans.values() if p.job_id == job_id for a in p.actions}
        out = []
        for e in self.entries:
            if e.get("job_id") == job_id or e.get("key") in keys:
                out.append(e)
        return out


def same_run(run_dir: object) -> str:
    """A run directory as the journal compares it: absolute and normalised, links kept (the
    journal is read without touching the run's filesystem)."""
    return os.path.normpath(os.path.abspath(str(run_dir or "")))


class StateStore:
    """The state directory: journal, pending jobs and the lock."""

    def __init__(self, root: str | os.PathLike[str] = DEFAULT_STATE_DIR) -> None:
        self.root = Path(root)

    @property
    def journal_path(self) -> Path:
        return self.root / JOURNAL

    @property
    def pending_dir(self) -> Path:
        return self.root / PENDING

    def ensure(self) -> None:
        try:
            self.pending_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        except OSError as exc:
            raise StateError(
                f"cannot create state directory {self.root} ({exc.strerror}); create it as the "
                "Slurm user (SlurmUser) or pass --state-dir to a directory the controller owns"
            ) from None
        if not os.access(self.root, os.W_OK):
            raise StateError(
                f"state directory {self.root} is not writable by uid {os.getuid()}; "
                "run as SlurmUser/root or pass --state-dir"
            )

    @contextmanager
    def locked(self, timeout_s: float = 30.0) -> Iterator[None]:
        """Hold the controller lock; raise LockTimeout if another process keeps it too long."""
        self.ensure()
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o640)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        raise LockTimeout(
                            f"{self.root / LOCK} held by another slurm-guard process for "
                            f"{timeout_s:g} s; the job stays pending and is retried"
                        ) from None
                    time.sleep(LOCK_POLL_S)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def read(self) -> Journal:
        """Every complete journal line; a torn last line (crash mid-append) is ignored."""
        entries: list[dict[str, Any]] = []
        try:
            with open(self.journal_path, "rb") as f:
                for raw in f:
                    try:
                        obj = json.loads(raw)
                    except (UnicodeDecodeError, json.JSONDecodeError):
                        continue
                    if isinstance(obj, dict):
                        entries.append(obj)
        except FileNotFoundError:
            pass
        return Journal(entries)

    def append(self, entry_type: str, **fields: Any) -> dict[str, Any]:
        """Append one entry durably (single write on O_APPEND, then fsync) before going on."""
        entry = {"type": entry_type, "time": time.time(), **fields}
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        return entry

    # Pending jobs: to look at again (slurmctld down, job still running, lock busy).

    def _pending_path(self, job_id: str) -> Path:
        return self.pending_dir / f"{job_id}.json"

    def add_pending(
        self, job_id: str, run_dir: Path, reason: str, allocation: tuple[str, ...] = ()
    ) -> None:
        """Remember a job to look at again, with the node list its epilog was given, if any."""
        path = self._pending_path(job_id)
        previous = self.pending().get(job_id, {})
        allocation = allocation or tuple(previous.get("allocation", ()))
        atomic_write_json(
            path,
            {
                "job_id": job_id,
                "run_dir": str(run_dir),
                "reason": reason,
                "allocation": list(allocation),
                "first_seen": previous.get("first_seen", time.time()),
                "attempts": int(previous.get("attempts", 0)) + 1,
                "updated": time.time(),
            },
        )

    def clear_pending(self, job_id: str) -> None:
        path = self._pending_path(job_id)
        if path.exists():
            path.unlink()
            fsync_dir(self.pending_dir)

    def pending(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        if not self.pending_dir.is_dir():
            return out
        for path in sorted(self.pending_dir.glob("*.json")):
            try:
                obj = read_json_file(path)
            except RecordError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("job_id"), str):
                out[obj["job_id"]] = obj
        return out


class ScratchStore(StateStore):
    """A dry run's view of a state directory: reads the real journal, writes only to memory.

    The engine runs the same code in a dry run as for real; what it would journal or mark
    pending stays in this object, so later steps of the same run see it and nothing on disk
    changes (not even the lock file or the directory). No lock is taken: a dry run changes
    nothing, and reading a journal that another process appends to is safe (whole lines).
    """

    def __init__(self, root: str | os.PathLike[str] = DEFAULT_STATE_DIR) -> None:
        super().__init__(root)
        self.appended: list[dict[str, Any]] = []
        self._pending: dict[str, dict[str, Any] | None] = {}  # None: cleared in this run

    @contextmanager
    def locked(self, timeout_s: float = 30.0) -> Iterator[None]:
        yield

    def read(self) -> Journal:
        return Journal(super().read().entries + self.appended)

    def append(self, entry_type: str, **fields: Any) -> dict[str, Any]:
        entry = {"type": entry_type, "time": time.time(), **fields}
        self.appended.append(json.loads(json.dumps(entry, sort_keys=True)))
        return entry

    def add_pending(
        self, job_id: str, run_dir: Path, reason: str, allocation: tuple[str, ...] = ()
    ) -> None:
        previous = self.pending().get(job_id, {})
        self._pending[job_id] = {
            **previous,
            "job_id": job_id,
            "run_dir": str(run_dir),
            "reason": reason,
            "allocation": list(allocation or previous.get("allocation", ())),
        }

    def clear_pending(self, job_id: str) -> None:
        self._pending[job_id] = None

    def pending(self) -> dict[str, dict[str, Any]]:
        out = super().pending()
        for job_id, entry in self._pending.items():
            if entry is None:
                out.pop(job_id, None)
            else:
                out[job_id] = entry
        return out
