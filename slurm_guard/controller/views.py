"""Read-only views for `slurm-guard status` and `slurm-guard review`.

They merge three sources: the run directory (what the guard saw), the controller's journal (what
was decided and done) and Slurm (what the job and nodes look like now). Slurm being unreachable
degrades a view, it never fails it: the run directory and the journal still answer.

Everything here reads files a user can write (the run directory) and prints them to an admin's
terminal, so: every field is type-checked (an odd field is shown as unknown, never a traceback),
and `printable` escapes control characters before anything reaches a terminal. A mistake in
what was asked (a path that is not a run directory, a job nobody knows) is a `ViewError` whose
message says what to give instead.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from slurm_guard.controller.evidence import node_evidence
from slurm_guard.controller.intake import find_run_dir, read_alarm_files
from slurm_guard.controller.state import ADMIN, APPROVAL, DONE, RESULTS, Journal, StateStore
from slurm_guard.errors import GuardError
from slurm_guard.protocol import REASON_PREFIX
from slurm_guard.records import Alarm, LedgerEntry, read_ledger
from slurm_guard.rundir import RunDir, RunDirError, trust_limit
from slurm_guard.slurm.client import JobInfo, SlurmClient, SlurmCommandError, validate_job_id

_ALARM_IN_REASON = re.compile(r"\balarm (\S+)")

DEFAULT_TRUST_REPLAYS = 2
"""GuardConfig's default, for a run.json that does not name trust_replays (older runs)."""

RUN_MARKERS = ("run.json", "identity.json", "ledger.jsonl", "alarms", "checkpoints", "handled")
"""What a directory the guard has used contains (any one of them)."""

# C0 and C1 controls, DEL, and the Unicode line/paragraph separators and bidi controls that
# can reorder or fake what a terminal shows.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


class ViewError(GuardError):
    """What was asked for cannot be shown; the message says what to give instead."""


def printable(value: Any) -> str:
    """`value` as text that cannot drive a terminal: control characters become escapes.

    Alarm messages, node reasons, run.json fields and evidence come from files a user (or a
    broken program) can write. An ESC sequence could clear the admin's screen or recolour it,
    and a newline could forge a line of the report ("FAKE LINE: all clear").
    """
    text = value if isinstance(value, str) else str(value)

    def escape(m: re.Match[str]) -> str:
        code = ord(m.group())
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return _UNPRINTABLE.sub(escape, text)


def job_comment(info: JobInfo | None) -> str | None:
    """The job's `Comment=` as scontrol prints it (the run-dir link, see docs/admin-guide.md)."""
    if info is None:
        return None
    value = info.fields.get("Comment")
    return None if value in (None, "", "(null)") else value


# ------------------------------------------------------------------------ what was asked


def _looks_like_path(target: str) -> bool:
    return os.sep in target or target.startswith((".", "~")) or os.path.lexists(target)


def _check_run_dir(path: Path, target: str) -> None:
    """ViewError unless `path` is a directory the guard has used."""
    try:
        if not path.is_dir():
            hint = (
                f"; give the run directory that holds it: slurm-guard status {path.parent}"
                if path.name in RUN_MARKERS or path.parent.name in ("alarms", "handled")
                else ""
            )
            raise ViewError(f"{target} is a file, not a run directory{hint}")
        names = set(os.listdir(path))
    except PermissionError:
        raise ViewError(
            f"{target}: permission denied; run status as a user who can read the run "
            "directory (its owner, or root)"
        ) from None
    except OSError as exc:
        raise ViewError(f"{target}: {exc.strerror}") from None
    if not names & set(RUN_MARKERS):
        what = "is empty" if not names else "holds none of " + ", ".join(RUN_MARKERS)
        raise ViewError(
            f"{target} is not a slurm-guard run directory (it {what}); give the directory "
            "passed to Guard(..., run_dir), or a job id"
        )


def resolve_target(
    target: str, client: SlurmClient | None, store: StateStore, runs_root: Path | None
) -> tuple[str | None, Path | None, dict[str, Any]]:
    """A `status` argument as (job id, run dir, job view); ViewError if it names nothing.

    A path must be a run directory. A job id is looked up in the controller's journal, then in
    Slurm (the job comment), then under `runs_root`; one that none of them knows is an error.
    """
    if _looks_like_path(target):
        path = Path(target).expanduser()
        if not os.path.lexists(path):
            raise ViewError(
                f"{target}: no such directory; give a run directory (the one passed to "
                "Guard) or a Slurm job id"
            )
        _check_run_dir(path, target)
        info = RunDir(path).run_info()
        job_id = info.get("job_id")
        return job_id, path, _job_view(client, job_id)
    try:
        job_id = validate_job_id(target)
    except ValueError:
        raise ViewError(
            f"{target!r} is neither a run directory nor a Slurm job id (digits such as 4242); "
            "give one of them"
        ) from None
    for entry in _read_journal(store)[0].alarms.values():
        if str(entry.get("job_id")) == job_id and isinstance(entry.get("run_dir"), str):
            return job_id, Path(entry["run_dir"]), _job_view(client, job_id)
    job = _job_view(client, job_id)
    run_dir, how = find_run_dir(job_id, job.get("comment"), runs_root)
    if run_dir is not None:
        return job_id, run_dir, job
    journal = f"the controller's journal in {store.root}"
    if "unreachable" in job:
        raise ViewError(
            f"job {job_id} is not in {journal}, and Slurm is unreachable ({job['unreachable']}); "
            "give the run directory instead: slurm-guard status /path/to/run"
        )
    if job.get("known") is False:
        raise ViewError(
            f"job {job_id} is not known to Slurm (finished jobs are forgotten after MinJobAge) "
            f"nor in {journal}; give its run directory instead (slurm-guard status "
            "/path/to/run), or --state-dir if the controller keeps its state elsewhere"
        )
    raise ViewError(
        f"job {job_id} has no slurm-guard run directory ({how}); it was not submitted with "
        "`--comment=slurm-guard:run_dir=...`. Give the run directory instead, or --runs-root"
    )


def _job_view(client: SlurmClient | None, job_id: str | None) -> dict[str, Any]:
    if job_id is None:
        return {"error": "job id unknown (no run.json with a job id)"}
    if client is None:
        return {"error": "no Slurm client"}
    try:
        info = client.job(job_id)
    except SlurmCommandError as exc:
        return {"error": f"Slurm unreachable: {_first_line(exc)}", "unreachable": _first_line(exc)}
    except ValueError as exc:
        return {"error": str(exc)}
    if info is None:
        return {"error": f"job {job_id} not known to Slurm (finished and purged?)", "known": False}
    return {
        "known": True,
        "state": info.state,
        "reason": info.reason,
        "nodes": list(info.nodes),
        "restart_count": info.restart_count,
        "excluded_nodes": list(info.excluded_nodes),
        "held": info.held,
        "user": info.user,
        "comment": job_comment(info),
    }


def _first_line(exc: BaseException) -> str:
    """The error on one line, without the command's raw stderr (the message already says
    what it means and what to do), at most 300 characters."""
    text = str(exc)
    stderr = getattr(exc, "stderr", "")
    if isinstance(stderr, str) and stderr.strip():
        text = text.replace(f" ({stderr.strip()})", "").replace(stderr.strip(), "")
    text = " ".join(text.split())
    return text[:300] if text else type(exc).__name__


def slurm_reason(exc: BaseException) -> str:
    """A Slurm command's failure for an admin's eyes: one line, no raw stderr dump."""
    return _first_line(exc)


def _read_journal(store: StateStore) -> tuple[Journal, str | None]:
    """The journal, or an empty one and why it could not be read (never raises)."""
    try:
        return store.read(), None
    except PermissionError:
        return Journal([]), (
            f"{store.journal_path}: permission denied; decisions are unknown here. Run as the "
            "controller's user (SlurmUser) or root, or pass its --state-dir"
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Journal([]), f"{store.journal_path}: unreadable ({exc})"


# ------------------------------------------------------------------------ the resume rule


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def trust_replays_of(config: dict[str, Any]) -> int:
    """The run's `trust_replays` from run.json's config (the guard's default if absent/odd)."""
    value = _int(config.get("trust_replays"))
    return value if value is not None and 1 <= value <= 100 else DEFAULT_TRUST_REPLAYS


def lineage_passes(entries: list[LedgerEntry], resumes: list[dict[str, Any]]) -> list[int]:
    """Steps with a passing replay in the run's current history, oldest first.

    A resume from checkpoint P discards every later step of what ran before it: those
    verifications speak for weights that no longer exist. Two records say where that happened:
    a handled/ record (an alarm's rollback: its time and resume step P), which works outside
    Slurm too, where every attempt has restart count 0; and, for restarts without an alarm
    (preemption, requeue), the first step a higher restart count logged, so that earlier
    attempts' verifications from that step on are dropped (conservative). Votes verify no
    computation and are not counted.
    """
    bound: dict[int, float] = {}
    for e in entries:
        bound[e.restart_count] = min(bound.get(e.restart_count, math.inf), e.step - 1)
    rollbacks = []
    for r in resumes:
        when, step = r.get("time"), _int(r.get("resumed_from_step"))
        if isinstance(when, (int, float)) and not isinstance(when, bool) and step is not None:
            rollbacks.append((float(when), step))
    passes = set()
    for e in entries:
        if e.check != "replay" or not e.passed:
            continue
        if any(e.time < when and e.step > step for when, step in rollbacks):
            continue
        if all(e.step <= b for rc, b in bound.items() if rc > e.restart_count):
            passes.add(e.step)
    return sorted(passes)


def resume_preview(rd: RunDir, trust_replays: int) -> dict[str, Any]:
    """What a restart of the run would load now, by the guard's resume rule.

    The rule of `recovery.plan_resume`, on the same run-directory readers and `trust_limit`:
    unhandled alarms (numerical verdicts excepted) and lost alarms bound the step; the newest
    checkpoint saved after a clean vote within the bound wins; an unreadable alarm stops the
    resume. It is restated here because recovery.py loads torch, which the controller must not:
    tests/test_cli_status.py checks both agree on real run directories. Checkpoint files are
    not re-hashed (the guard does that at load and falls back to the next older one).
    """
    try:
        handled = rd.handled_ids()
        alarms, _ = rd.alarms()
        unreadable = {k: v for k, v in rd.unreadable_alarms().items() if k not in handled}
        lost = [a for a in rd.lost_alarms() if a.alarm_id not in handled]
        scan = rd.scan_checkpoints()
    except RunDirError as exc:
        return {"trusted_checkpoint": None, "blocked": str(exc), "limiting_alarm": None}
    if unreadable:
        name, why = sorted(unreadable.items())[0]
        return {
            "trusted_checkpoint": None,
            "blocked": f"a restart stops: alarm file {name}.json cannot be used ({why})",
            "limiting_alarm": name,
        }
    pending = [a for a in alarms if a.alarm_id not in handled and a.verdict != "numerical"]
    verified = [e.step for e in read_ledger(rd.ledger) if e.check == "replay" and e.passed]
    limits: list[tuple[int | None, str]] = [
        (trust_limit(a.last_verified_step, verified, trust_replays), a.alarm_id) for a in pending
    ] + [(a.trust_upto, a.alarm_id) for a in lost]
    nothing = [alarm_id for limit, alarm_id in limits if limit is None]
    bound = min((limit for limit, _ in limits if limit is not None), default=None)
    limiting = (
        nothing[0]
        if nothing
        else next((alarm_id for limit, alarm_id in limits if limit == bound), None)
    )
    clean = [
        m.step
        for m in scan.metas
        if m.clean_vote and not nothing and (bound is None or m.step <= bound)
    ]
    return {
        "trusted_checkpoint": max(clean, default=None),
        "blocked": None,
        "limiting_alarm": limiting,
        "pending_alarms": [a.alarm_id for a in pending] + [a.alarm_id for a in lost],
        "damaged_checkpoints": {str(s): p for s, p in sorted(scan.damaged.items())},
        "latest_checkpoint": max((m.step for m in scan.metas), default=None),
    }


# ------------------------------------------------------------------------ status


def _alarm_row(
    alarm: Alarm, journal: Journal, journal_error: str | None, store: StateStore, handled: set[str]
) -> dict[str, Any]:
    decision = journal.alarms.get(alarm.alarm_id)
    if decision is not None:
        outcome, why = str(decision.get("outcome")), str(decision.get("reason", ""))
    elif journal_error is not None:
        outcome, why = "unknown", journal_error
    elif not store.journal_path.exists():
        outcome, why = "unknown", f"no controller journal in {store.root} (pass --state-dir)"
    else:
        outcome, why = "undecided", f"not in the journal in {store.root}"
    return {
        "alarm_id": alarm.alarm_id,
        "job_id": alarm.job_id,
        "step": alarm.step,
        "check": alarm.check,
        "verdict": alarm.verdict,
        "suspect_nodes": list(alarm.suspect_nodes),
        "suspect_ranks": list(alarm.suspect_ranks),
        "last_verified_step": alarm.last_verified_step,
        "trusted_checkpoint": alarm.trusted_checkpoint,
        "message": alarm.message,
        "injected": alarm.injected,
        "handled": alarm.alarm_id in handled,
        "decision": outcome,
        "decision_reason": why,
        "approved": alarm.alarm_id in journal.approvals,
    }


def _run_part(
    run_dir: Path, journal: Journal, journal_error: str | None, store: StateStore
) -> dict[str, Any]:
    rd = RunDir(run_dir)
    view: dict[str, Any] = {}
    info = rd.run_info()
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    assert isinstance(config, dict)
    view["run"] = info
    view["checks"] = config
    # Faults injected on purpose, as run.json lists them: a leftover SLURM_GUARD_INJECT must
    # never pass for a hardware fault in front of an admin.
    view["injected_faults"] = info.get("injected_faults", [])
    trust = trust_replays_of(config)
    view["trust_replays"] = trust
    resumes = rd.resumes()
    view["resumes"] = resumes
    preview = resume_preview(rd, trust)
    view["trusted_checkpoint"] = preview["trusted_checkpoint"]
    view["resume_blocked"] = preview["blocked"]
    view["damaged_checkpoints"] = preview.get("damaged_checkpoints", {})
    view["latest_checkpoint"] = preview.get("latest_checkpoint")
    try:
        handled = rd.handled_ids()
    except RunDirError:
        handled = set()
    files, bad_files = read_alarm_files(run_dir)
    view["alarms"] = [_alarm_row(f.alarm, journal, journal_error, store, handled) for f in files]
    view["bad_alarm_files"] = [b.error for b in bad_files]
    limiting = next((f.alarm for f in files if f.alarm.alarm_id == preview["limiting_alarm"]), None)
    if limiting is not None:
        # Between the alarm and the resume, the alarm's word is the run's state: the guard
        # stopped before the step after it and resumes by it.
        view["last_verified_step"] = limiting.last_verified_step
        view["last_verified_from"] = f"alarm {limiting.alarm_id}"
    else:
        passes = lineage_passes(read_ledger(rd.ledger), resumes)
        view["last_verified_step"] = passes[-1] if passes else None
        view["last_verified_from"] = "the ledger: passing replays of the current history"
    return view


def status_view(
    target: str,
    *,
    client: SlurmClient | None,
    store: StateStore,
    runs_root: Path | None = None,
) -> dict[str, Any]:
    """Everything `slurm-guard status` shows about one job or run directory.

    Raises ViewError when `target` is neither a run directory nor a job anyone knows.
    """
    job_id, run_dir, job = resolve_target(target, client, store, runs_root)
    journal, journal_error = _read_journal(store)
    view: dict[str, Any] = {
        "job_id": job_id,
        "run_dir": str(run_dir) if run_dir else None,
        "state_dir": str(store.root),
        "journal_error": journal_error,
        "alarms": [],
        "bad_alarm_files": [],
    }
    if run_dir is not None and run_dir.is_dir():
        view.update(_run_part(run_dir, journal, journal_error, store))
        named = [a["job_id"] for a in view["alarms"] if isinstance(a.get("job_id"), str)]
        if job_id is None and named:
            # run.json lost or unreadable: the newest alarm still names the job.
            job_id = view["job_id"] = named[-1]
            job = _job_view(client, job_id)
    elif run_dir is not None:
        view["run_dir_error"] = f"{run_dir} is gone or not a directory"
    view["job"] = {k: v for k, v in job.items() if k not in ("known", "unreachable")}
    actions = []
    if job_id is not None:
        for e in journal.for_job(job_id):
            if e.get("type") in RESULTS:
                actions.append(
                    {
                        "time": e.get("time"),
                        "op": e.get("op"),
                        "target": e.get("target"),
                        "result": e.get("type"),
                        "detail": e.get("detail", ""),
                    }
                )
    view["controller_actions"] = actions
    try:
        view["pending"] = store.pending().get(job_id or "", None)
    except OSError:
        view["pending"] = None
    return view


# ------------------------------------------------------------------------ review


def _alarm_evidence(journal: Journal, node: str, reason: str | None) -> list[dict[str, Any]]:
    related = []
    match = _ALARM_IN_REASON.search(reason or "")
    for alarm_id, e in journal.alarms.items():
        named = match is not None and match.group(1) == alarm_id
        if named or (node in e.get("suspect_nodes", []) and e.get("outcome") == "act"):
            related.append(
                {
                    k: e.get(k)
                    for k in (
                        "alarm_id",
                        "job_id",
                        "step",
                        "check",
                        "verdict",
                        "suspect_ranks",
                        "message",
                        "evidence",
                        "run_dir",
                    )
                }
            )
    return related


def journal_nodes(journal: Journal) -> dict[str, dict[str, Any]]:
    """Nodes the journal says slurm-guard holds out of service: drained and not returned since.

    Used when Slurm cannot be asked; the node's state now is then unknown.
    """
    last: dict[str, dict[str, Any]] = {}
    events: list[tuple[float, str, str, str]] = []  # time, node, what, reason
    for plan in journal.plans.values():
        for action in plan.actions:
            result = journal.results.get(action.key)
            if action.op == "drain" and result is not None and result.get("type") == DONE:
                reason = action.args[0] if action.args else ""
                events.append((_time(result.get("time")), action.target, "drained", reason))
    for e in journal.entries:
        if e.get("type") == ADMIN and isinstance(e.get("node"), str):
            result = journal.results.get(str(e.get("key")))
            if result is not None and result.get("type") == DONE:
                what = "retired" if e.get("op") == "retire" else "returned"
                events.append((_time(result.get("time")), e["node"], what, str(e.get("reason"))))
    for when, node, what, reason in sorted(events):
        last[node] = {"what": what, "time": when, "reason": reason}
    return {n: v for n, v in last.items() if v["what"] != "returned"}


def _time(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def review_view(*, client: SlurmClient | None, store: StateStore) -> dict[str, Any]:
    """Nodes drained by slurm-guard with their evidence, and alarms waiting for an admin.

    Without Slurm (not installed, no configuration, slurmctld down) the node list comes from
    the journal and says so; alarms waiting for approval and pending jobs need no Slurm.
    """
    journal, journal_error = _read_journal(store)
    if journal_error is not None:
        raise ViewError(journal_error)
    nodes = []
    slurm_error = None
    listed = None
    if client is None:
        slurm_error = "no Slurm client"
    else:
        try:
            listed = client.nodes()
        except (SlurmCommandError, ValueError) as exc:  # ValueError: output we cannot parse
            slurm_error = _first_line(exc)
    if listed is not None:
        for node in listed:
            # 24.11 keeps the reason of a resumed node: only a reason in force counts.
            reason = node.effective_reason
            if not reason or not reason.startswith(REASON_PREFIX):
                continue
            related = _alarm_evidence(journal, node.name, reason)
            nodes.append(
                {
                    "node": node.name,
                    "states": sorted(node.states),
                    "reason": reason,
                    "reason_user": node.reason_user,
                    "alarms": related,
                    "jobs": sorted({str(a["job_id"]) for a in related}),
                }
            )
    else:
        for name, last in sorted(journal_nodes(journal).items()):
            related = _alarm_evidence(journal, name, last["reason"])
            nodes.append(
                {
                    "node": name,
                    "states": [f"unknown (journal: {last['what']})"],
                    "reason": last["reason"],
                    "reason_user": None,
                    "alarms": related,
                    "jobs": sorted({str(a["job_id"]) for a in related}),
                }
            )
    for entry in nodes:  # alarms over time across jobs, triage, latest diagnosis
        entry.update(node_evidence(store, str(entry["node"]), journal=journal))
    waiting = [
        {
            k: e.get(k)
            for k in (
                "alarm_id",
                "job_id",
                "outcome",
                "reason",
                "suspect_nodes",
                "verdict",
                "check",
                "step",
            )
        }
        for alarm_id, e in journal.alarms.items()
        if e.get("outcome") in ("await_approval", "hold") and alarm_id not in journal.approvals
    ]
    admin = [e for e in journal.entries if e.get("type") in (ADMIN, APPROVAL)]
    try:
        pending = list(store.pending().values())
    except OSError:
        pending = []
    return {
        "slurm": {"reachable": slurm_error is None, "error": slurm_error},
        "state_dir": str(store.root),
        "nodes": nodes,
        "awaiting_approval": waiting,
        "pending_jobs": pending,
        "admin_actions": admin,
    }
