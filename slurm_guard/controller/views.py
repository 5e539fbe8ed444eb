"""What the read-only views for `slurm-guard status` and `slurm-guard review` share.

The views (`status_view`, `review_view`) merge three sources: the run directory (what the guard
saw), the controller's journal (what was decided and done) and Slurm (what the job and nodes look
like now). Slurm being unreachable degrades a view, it never fails it: the run directory and the
journal still answer.

Everything here reads files a user can write (the run directory) and prints them to an admin's
terminal, so: every field is type-checked (an odd field is shown as unknown, never a traceback),
and `printable` escapes control characters before anything reaches a terminal. A mistake in
what was asked (a path that is not a run directory, a job nobody knows) is a `ViewError` whose
message says what to give instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from slurm_guard.controller.intake import find_run_dir
from slurm_guard.controller.state import Journal, StateStore
from slurm_guard.errors import GuardError
from slurm_guard.rundir.layout import RunDir
from slurm_guard.slurm.client import JobInfo, SlurmClient, SlurmCommandError, validate_job_id

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
        return job_id, path, job_view(client, job_id)
    try:
        job_id = validate_job_id(target)
    except ValueError:
        raise ViewError(
            f"{target!r} is neither a run directory nor a Slurm job id (digits such as 4242); "
            "give one of them"
        ) from None
    for entry in read_journal(store)[0].alarms.values():
        if str(entry.get("job_id")) == job_id and isinstance(entry.get("run_dir"), str):
            return job_id, Path(entry["run_dir"]), job_view(client, job_id)
    job = job_view(client, job_id)
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


def job_view(client: SlurmClient | None, job_id: str | None) -> dict[str, Any]:
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


def read_journal(store: StateStore) -> tuple[Journal, str | None]:
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
