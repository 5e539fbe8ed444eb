"""What happened to one run, read back from its run directory in step order.

The run directory already holds the whole story (docs/formats.md): the ledger has every
verification result, `alarms/` what stopped the run, `handled/` each rollback, `checkpoints/`
and `quarantine/` what was saved and what was moved aside, and the example trainer's
`train-events.jsonl` each start. This module only gathers them into one structure; drawing
is `plot`'s job and the page is `html`'s, so the reading can be tested without matplotlib.

A run is numbered by its restart count, and a restart inside the job's allocation (on a spare
node, issue 31) keeps Slurm's count. So a rollback whose restart count already ran before it
starts a run of its own here: the runs are numbered again in time order, and every drawing of
restarts shows the in-job ones as well.

Files are untrusted and may be damaged; an unreadable one becomes a line in `problems`, shown
on the page, never an exception that hides the rest of the story.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_guard.errors import GuardError
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import Alarm, RecordError, read_alarm, read_json_file, read_ledger
from slurm_guard.rundir.resumes import ResumeRecord, read_resumes
from slurm_guard.rundir.seals import located_checkpoints

CHECKPOINT_PREFIX = "step-"
EVENTS_FILE = "train-events.jsonl"  # written by record_loss and slurm_guard.examples.train


class ReportError(RuntimeError):
    """The run directory cannot be reported on; the message says why."""


@dataclass(frozen=True)
class Check:
    """One verification result from the ledger."""

    step: int
    check: str
    passed: bool
    restart_count: int
    time: float
    alarm_id: str | None = None


@dataclass(frozen=True)
class Checkpoint:
    step: int
    restart_count: int | None
    clean_vote: bool
    created: float | None
    quarantined_by: str | None = None  # the alarm whose rollback moved it aside
    location: str | None = None  # a framework's checkpoint (HF, Lightning): where it lives


@dataclass(frozen=True)
class Rollback:
    """A requeued run went back to a trusted checkpoint after an alarm."""

    alarm_id: str
    resumed_from_step: int | None
    restart_count: int | None
    quarantined: tuple[str, ...]
    time: float | None


@dataclass(frozen=True)
class Start:
    """One start of the job (the first run or a restart)."""

    restart_count: int
    step: int
    job_id: str | None
    nodes: tuple[str, ...]
    time: float | None


@dataclass
class Timeline:
    run_dir: Path
    run: dict[str, Any]
    checks: list[Check] = field(default_factory=list)
    losses: list[tuple[int, float, int]] = field(default_factory=list)  # step, loss, restart
    alarms: list[Alarm] = field(default_factory=list)
    rollbacks: list[Rollback] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    starts: list[Start] = field(default_factory=list)
    finished_step: int | None = None
    problems: list[str] = field(default_factory=list)
    loss_times: list[float | None] = field(default_factory=list)  # parallel to `losses`
    resumed: list[ResumeRecord] = field(default_factory=list)  # what each start loaded

    def resume_source(self, rollback: Rollback) -> str | None:
        """What the start that did `rollback` loaded (snapshot or checkpoint), as the guard
        recorded it: the record of that step written closest to the rollback's record."""
        if rollback.time is None:
            return None
        when = rollback.time
        same = [r for r in self.resumed if r.step == rollback.resumed_from_step]
        best = min(same, key=lambda r: abs(r.resumed_at - when), default=None)
        return best.source if best is not None and abs(best.resumed_at - when) < 600 else None

    @property
    def restarts(self) -> list[int]:
        """Every restart count seen, from any source, in order."""
        seen = {c.restart_count for c in self.checks} | {s.restart_count for s in self.starts}
        seen |= {a.restart_count for a in self.alarms}
        seen |= {r.restart_count for r in self.rollbacks if r.restart_count is not None}
        return sorted(seen)

    def segments(self) -> list[tuple[int, int, int]]:
        """(restart, first step, last step) of each run, from its start to its last record."""
        out = []
        for r in self.restarts:
            steps = [c.step for c in self.checks if c.restart_count == r]
            steps += [a.step for a in self.alarms if a.restart_count == r]
            steps += [s.step for s in self.starts if s.restart_count == r]
            steps += [x for x, _, rc in self.losses if rc == r]
            steps += [c.step for c in self.checkpoints if c.restart_count == r]
            if r == max(self.restarts) and self.finished_step is not None:
                steps.append(self.finished_step)
            if steps:
                out.append((r, min(steps), max(steps)))
        return out

    def check_names(self) -> list[str]:
        names = dict.fromkeys(c.check for c in self.checks)
        for a in self.alarms:
            names.setdefault(a.check)
        return list(names)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _read_events(path: Path, problems: list[str]) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    obj = json.loads(raw)
                except (ValueError, RecursionError):
                    continue  # a torn last line
                if isinstance(obj, dict):
                    out.append(obj)
    except OSError as exc:
        problems.append(f"{path}: {exc.strerror}")
    return out


def _checkpoint(meta_path: Path, quarantined_by: str | None) -> Checkpoint | None:
    obj = read_json_file(meta_path)
    if not isinstance(obj, dict) or _int(obj.get("step")) is None:
        raise RecordError(f"{meta_path}: not checkpoint metadata")
    return Checkpoint(
        step=int(obj["step"]),
        restart_count=_int(obj.get("restart_count")),
        clean_vote=obj.get("clean_vote") is True,
        created=_number(obj.get("created")),
        quarantined_by=quarantined_by,
    )


def _framework_checkpoints(run_dir: Path, problems: list[str]) -> list[Checkpoint]:
    """The sealed HF / Lightning checkpoints the run directory records (`rundir.seals`)."""
    try:
        located = located_checkpoints(RunDir(run_dir))
    except GuardError as exc:
        problems.append(str(exc))
        return []
    return [
        Checkpoint(c.step, c.restart_count, True, c.created, location=str(c.path)) for c in located
    ]


def _checkpoints_in(
    directory: Path, quarantined_by: str | None, problems: list[str]
) -> list[Checkpoint]:
    out: list[Checkpoint] = []
    if not directory.is_dir():
        return out
    for sub in sorted(directory.iterdir()):
        if not sub.name.startswith(CHECKPOINT_PREFIX) or not (sub / "meta.json").exists():
            continue  # unfinished saves have no meta.json
        try:
            ckpt = _checkpoint(sub / "meta.json", quarantined_by)
        except RecordError as exc:
            problems.append(str(exc))
            continue
        if ckpt is not None:
            out.append(ckpt)
    return out


def read_timeline(run_dir: Path) -> Timeline:
    """Everything the run directory says, gathered for the report."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: not a directory; give the run directory of a guarded job")
    problems: list[str] = []
    run: dict[str, Any] = {}
    if (run_dir / "run.json").exists():
        try:
            obj = read_json_file(run_dir / "run.json")
            run = obj if isinstance(obj, dict) else {}
        except RecordError as exc:
            problems.append(str(exc))
    ledger = read_ledger(run_dir / "ledger.jsonl")
    if not ledger and not (run_dir / "alarms").is_dir() and not run:
        raise ReportError(
            f"{run_dir}: no run.json, ledger.jsonl or alarms/: not a slurm-guard run directory"
        )
    t = Timeline(run_dir=run_dir, run=run, problems=problems)
    for e in ledger:
        alarm_id = e.detail.get("alarm")
        t.checks.append(
            Check(
                step=e.step,
                check=e.check,
                passed=e.passed,
                restart_count=e.restart_count,
                time=e.time,
                alarm_id=str(alarm_id) if alarm_id is not None else None,
            )
        )
        loss = _number(e.detail.get("loss"))
        if loss is not None:
            t.losses.append((e.step, loss, e.restart_count))
            t.loss_times.append(e.time)
    alarms_dir = run_dir / "alarms"
    if alarms_dir.is_dir():
        for path in sorted(alarms_dir.glob("*.json")):
            try:
                t.alarms.append(read_alarm(path))
            except RecordError as exc:
                problems.append(str(exc))
    t.alarms.sort(key=lambda a: (a.restart_count, a.step, a.created))
    handled = run_dir / "handled"
    if handled.is_dir():
        for path in sorted(handled.glob("*.json")):
            try:
                obj = read_json_file(path)
            except RecordError as exc:
                problems.append(str(exc))
                continue
            if not isinstance(obj, dict):
                problems.append(f"{path}: expected a JSON object")
                continue
            quarantined = obj.get("quarantined")
            t.rollbacks.append(
                Rollback(
                    alarm_id=str(obj.get("alarm_id", path.stem)),
                    resumed_from_step=_int(obj.get("resumed_from_step")),
                    restart_count=_int(obj.get("restart_count")),
                    quarantined=tuple(str(q) for q in quarantined)
                    if isinstance(quarantined, list)
                    else (),
                    time=_number(obj.get("time")),
                )
            )
    t.rollbacks.sort(key=lambda r: r.time or 0.0)
    t.checkpoints = _checkpoints_in(run_dir / "checkpoints", None, problems)
    quarantine = run_dir / "quarantine"
    if quarantine.is_dir():
        for sub in sorted(quarantine.iterdir()):
            if sub.is_dir():
                t.checkpoints += _checkpoints_in(sub, sub.name, problems)
    t.checkpoints += _framework_checkpoints(run_dir, problems)
    t.checkpoints.sort(key=lambda c: (c.step, c.created or 0.0))
    for ev in _read_events(run_dir / EVENTS_FILE, problems):
        step = _int(ev.get("step"))
        kind = ev.get("event")
        if step is None:
            continue
        loss = _number(ev.get("loss"))
        if loss is not None:
            t.losses.append((step, loss, _int(ev.get("restart_count")) or 0))
            t.loss_times.append(_number(ev.get("time")))
        if kind == "start":
            nodes = ev.get("nodes")
            t.starts.append(
                Start(
                    restart_count=_int(ev.get("restart_count")) or 0,
                    step=step,
                    job_id=str(ev["job_id"]) if ev.get("job_id") is not None else None,
                    nodes=tuple(str(n) for n in nodes) if isinstance(nodes, list) else (),
                    time=_number(ev.get("time")),
                )
            )
        elif kind == "finish":
            t.finished_step = step
    t.resumed = read_resumes(run_dir)
    _number_in_job_restarts(t)
    t.losses.sort(key=lambda x: (x[2], x[0]))
    return t


def resume_phrase(
    run: int | None, step: int | None, alarm_id: str, moved: list[str], source: str | None = None
) -> str:
    """One resume in the words `status` and the report both use, so they cannot drift:
    `restart N from step P (snapshot) after alarm A (moved aside: ...)`. N is the run's number
    in time order (`restart_numbers`), P the step the restarted run began from, and the source
    what the guard recorded it loaded (`rundir.resumes`), where known."""
    return (
        f"restart {'?' if run is None else run} from step {'?' if step is None else step}"
        f"{f' ({source})' if source else ''} after alarm {alarm_id} "
        f"(moved aside: {', '.join(moved) or 'nothing'})"
    )


def restart_numbers(t: Timeline) -> dict[str, int | None]:
    """alarm id -> the number of the run its rollback started, as the report draws it.

    Slurm's restart count numbers a requeue; a local run (`slurm-guard local`, every start
    has count 0) and a restart on a spare inside the allocation (same count) are numbered by
    time instead (`_number_in_job_restarts`), so `status` asks here rather than printing the
    rollback record's raw count.
    """
    return {rb.alarm_id: rb.restart_count for rb in t.rollbacks}


def _number_in_job_restarts(t: Timeline) -> None:
    """Give each restart inside the allocation a run number of its own (see the docstring).

    A rollback starts an in-job run when a record of its restart count is older than it.
    Records are then assigned to the newest run of their restart count that began at or before
    their time; runs are numbered (restart count, start time) in order.
    """
    timed = [(c.restart_count, c.time) for c in t.checks]
    timed += [(a.restart_count, a.created) for a in t.alarms]
    cuts = sorted(
        (rb.restart_count, rb.time)
        for rb in t.rollbacks
        if rb.restart_count is not None
        and rb.time is not None
        and any(rc == rb.restart_count and when < rb.time for rc, when in timed)
    )
    if not cuts:
        return
    starts = sorted({(rc, -math.inf) for rc in t.restarts} | set(cuts))
    run_of = {start: i for i, start in enumerate(starts)}

    def number(rc: int | None, when: float | None) -> int | None:
        if rc is None:
            return None
        moment = -math.inf if when is None else when
        began = [s for s in starts if s[0] == rc and s[1] <= moment]
        return run_of[began[-1]] if began else run_of.get((rc, -math.inf), rc)

    def renumber(rc: int, when: float | None) -> int:
        n = number(rc, when)
        return rc if n is None else n

    t.checks = [
        dataclasses.replace(c, restart_count=renumber(c.restart_count, c.time)) for c in t.checks
    ]
    t.alarms = [
        dataclasses.replace(a, restart_count=renumber(a.restart_count, a.created)) for a in t.alarms
    ]
    t.rollbacks = [
        dataclasses.replace(r, restart_count=number(r.restart_count, r.time)) for r in t.rollbacks
    ]
    t.starts = [
        dataclasses.replace(x, restart_count=renumber(x.restart_count, x.time)) for x in t.starts
    ]
    t.checkpoints = [
        dataclasses.replace(c, restart_count=number(c.restart_count, c.created))
        for c in t.checkpoints
    ]
    t.losses = [
        (step, loss, renumber(rc, when))
        for (step, loss, rc), when in zip(t.losses, t.loss_times, strict=True)
    ]
