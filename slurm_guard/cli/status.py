"""`slurm-guard status`: one run at a glance (checks, last verified step, alarms, trusted
checkpoint, controller actions, job state), as text or --json."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click

from slurm_guard.cli.common import (
    field,
    handle_errors,
    names,
    safe,
    slurm_client,
    table,
    usable_dir,
)
from slurm_guard.cli.options import json_option, runs_root_option, state_dir_option
from slurm_guard.controller.state import StateStore
from slurm_guard.report.timeline import resume_phrase


def _print_status(view: dict[str, Any]) -> None:
    job = view.get("job") or {}
    state = str(job.get("state", job.get("error", "?")))
    if "state" in job:
        state += f" on {names(job.get('nodes'))}, restarts {job.get('restart_count')}"
        if job.get("excluded_nodes"):
            state += f", excluded {names(job['excluded_nodes'])}"
        if job.get("held"):
            state += ", held"
    field("job", view.get("job_id") or ("none" if view.get("local_run") else "?"), f"  ({state})")
    field("run dir", view.get("run_dir") or "? (not found)")
    if view.get("run_dir_error"):
        field("run dir problem", view["run_dir_error"])
    run = view.get("run") or {}
    if run.get("error"):
        field("run.json", run["error"])
    if view.get("controller"):
        field("controller", view["controller"])
    field("checks", _checks_line(view.get("checks") or {}))
    if view.get("injected_faults"):
        field(
            "injected faults",
            "; ".join(view["injected_faults"]),
            "  (on purpose: alarms they cause are not hardware faults)",
        )
    for warning in view.get("fault_warnings") or []:
        field("injected fault", warning.removeprefix("slurm-guard: injected fault "))
    last = view.get("last_verified_step")
    src = view.get("last_verified_from")
    field("last verified step", last, f"  (from {src})" if last is not None and src else "")
    trusted = view.get("trusted_checkpoint")
    if view.get("resume_blocked"):
        field("trusted checkpoint", "none: ", view["resume_blocked"])
    else:
        field(
            "trusted checkpoint",
            "none (a restart starts from step 0)" if trusted is None else f"step {trusted}",
            f"  (resume rule, trust_replays={view.get('trust_replays')})",
        )
    if view.get("snapshot_in_memory") is not None:
        field(
            "snapshot in memory",
            f"step {view['snapshot_in_memory']}",
            "  (a restart loads it if the nodes still hold it; else the trusted checkpoint)",
        )
    for r in view.get("resumes", []):
        moved = [str(m) for m in r.get("quarantined") or []]
        field(
            "resumed",
            resume_phrase(
                r.get("restart"),
                r.get("resumed_from_step"),
                str(r.get("alarm_id")),
                moved,
                r.get("source"),
            ),
        )
    for r in view.get("resumed_from", []):
        what = "nothing (step 0)" if r["step"] is None else f"{r['source']} step {r['step']}"
        ran = "first step ran" if r.get("first_step_at") else "first step not run (yet)"
        where = f", {r['path']}" if r.get("path") else ""
        field(
            "started from",
            what,
            f"  (job {r['job_id']}, attempt {r['attempt']}: {ran}{where})",
        )
    latest = view.get("latest_checkpoint")
    field("latest checkpoint", "none" if latest is None else f"step {latest}")
    for step, problem in (view.get("damaged_checkpoints") or {}).items():
        field("damaged checkpoint", f"step {step}: ", problem)
    if view.get("pending"):
        field("pending", view["pending"].get("reason"))
    if view.get("journal_error"):
        field("controller journal", view["journal_error"])
    click.echo("")
    rows = [
        [
            a["alarm_id"],
            a["step"],
            a["check"],
            a["verdict"] + (" (injected)" if a.get("injected") else ""),
            names(a["suspect_nodes"]),
            a["decision"] + (" (approved)" if a["approved"] else ""),
        ]
        for a in view.get("alarms", [])
    ]
    click.echo(
        table(rows, ["ALARM", "STEP", "CHECK", "VERDICT", "SUSPECTS", "DECISION"])
        if rows
        else "alarms: none"
    )
    for a in view.get("alarms", []):
        if a["decision"] in ("unknown", "undecided") and a.get("decision_reason"):
            click.echo(f"  {safe(a['alarm_id'])}: {safe(a['decision_reason'])}")
    for err in view.get("bad_alarm_files", []):
        click.echo(f"rejected file: {safe(err)}")
    if view.get("controller_actions"):
        click.echo("")
        rows = [
            [a["op"] or "", a["target"] or "", a["result"], a["detail"]]
            for a in view["controller_actions"]
        ]
        click.echo(table(rows, ["ACTION", "TARGET", "RESULT", "DETAIL"]))
    _print_in_job(view)


def _checks_line(checks: dict[str, Any]) -> str:
    """The guard's settings from run.json, without `faults`: the injected faults have their
    own line (from every source, SLURM_GUARD_INJECT too), and `faults=[]` above it misled."""
    return ", ".join(f"{k}={v}" for k, v in checks.items() if k != "faults") or "-"


def _print_in_job(view: dict[str, Any]) -> None:
    """Restarts inside the allocation, and why the job is held, if it is."""
    if view.get("held"):
        click.echo("")
        field("held", view["held"])
    restarts = view.get("in_job_restarts") or []
    if not restarts:
        return
    click.echo("")
    rows = [
        [
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(r["time"] or 0))),
            names(r["left"]),
            names(r["joined"]),
            _restart_state(r),
            "-" if r["resume_step"] is None else f"step {r['resume_step']} ({r['resume_source']})",
            "-" if r["seconds"] is None else f"{r['seconds']:.1f}",
        ]
        for r in restarts
    ]
    heads = ["IN-JOB RESTART", "NODE LEFT", "SPARE JOINED", "STATE", "RESUMED", "SECONDS"]
    click.echo(table(rows, heads))


def _restart_state(row: dict[str, Any]) -> str:
    """done (its first step ran), pending (not yet), or failed and what completed it."""
    if row.get("state") != "failed":
        return str(row.get("state", "?"))
    by = row.get("completed_by")
    return f"failed ({row.get('failed_reason')}{f'; plan {by}' if by else ''})"


@click.command("status")
@click.argument("target", required=False)
@json_option
@state_dir_option
@runs_root_option()
@click.pass_context
@handle_errors
def status_cmd(
    ctx: click.Context, target: str | None, as_json: bool, state_dir: Path, runs_root: Path | None
) -> None:
    """Show a run: checks, last verified step, alarms, trusted checkpoint, actions, job state.

    TARGET is a job id or a run directory (default: $SLURM_JOB_ID). The trusted checkpoint
    is the one a restart would load now, by the guard's resume rule. Exit status 1 when
    TARGET is neither a run directory nor a job that Slurm or the controller knows.

    Example:

        \b
        slurm-guard status 4242
        slurm-guard status /shared/runs/llama-7b --json
    """
    from slurm_guard.controller.status_view import status_view

    target = target or os.environ.get("SLURM_JOB_ID")
    if not target:
        raise click.ClickException("give a job id or a run directory, e.g. `slurm-guard status 42`")
    usable_dir(state_dir, "state directory")  # missing is fine: nothing decided yet
    view = status_view(
        target, client=slurm_client(ctx), store=StateStore(state_dir), runs_root=runs_root
    )
    if as_json:
        click.echo(json.dumps(view, indent=2, sort_keys=True, default=str))
    else:
        _print_status(view)
