"""Operator commands: status, review, recover, controller, epilog.

Thin on purpose: each command parses options, builds an Engine or a view from
`slurm_guard.controller`, prints, and turns library errors into ClickExceptions that say what
to do next. Tests pass a SlurmClient through `ctx.obj["slurm_client"]`.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from slurm_guard.cli.options import dry_run_option, json_option, runs_root_option, state_dir_option
from slurm_guard.controller.policy import Policy, PolicyError
from slurm_guard.controller.state import StateError, StateStore

if TYPE_CHECKING:
    from collections.abc import Iterator

    from slurm_guard.controller.engine import Engine
    from slurm_guard.controller.report import JobReport
    from slurm_guard.slurm.client import SlurmClient

F = TypeVar("F", bound=Callable[..., Any])


EPILOG_RETRY_LOCK_S = 0.5  # an epilog retries other jobs only if the state lock is free


def _client(ctx: click.Context) -> SlurmClient:
    obj = ctx.find_root().obj
    if isinstance(obj, dict) and obj.get("slurm_client") is not None:
        client: SlurmClient = obj["slurm_client"]
        return client
    from slurm_guard.slurm.client import default_client

    return default_client()


def _engine(ctx: click.Context, state_dir: Path, dry_run: bool) -> Engine:
    from slurm_guard.controller.engine import Engine

    store = StateStore(state_dir)
    try:
        if not dry_run:
            store.ensure()
        policy = Policy.load(state_dir)
    except (StateError, PolicyError) as exc:
        raise click.ClickException(str(exc)) from None
    return Engine(_client(ctx), store, policy, dry_run=dry_run)


def _handle_errors(f: F) -> F:
    """Turn library errors into ClickExceptions with a next step instead of a traceback."""

    @wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from slurm_guard.controller.report import EngineError
        from slurm_guard.slurm.client import SlurmCommandError, SlurmUnavailable

        try:
            return f(*args, **kwargs)
        except click.ClickException:
            raise
        except (EngineError, StateError, PolicyError) as exc:
            raise click.ClickException(str(exc)) from None
        except SlurmUnavailable as exc:
            raise click.ClickException(
                f"slurmctld unreachable ({exc}); check `scontrol ping` and SLURM_CONF, then retry"
            ) from None
        except SlurmCommandError as exc:
            raise click.ClickException(f"Slurm refused: {exc}") from None

    return wrapper  # type: ignore[return-value]


def _admin_name() -> str:
    return os.environ.get("SUDO_USER") or getpass.getuser()


def _print_reports(reports: list[JobReport], as_json: bool) -> None:
    from slurm_guard.controller.report import summarize

    if as_json:
        click.echo(json.dumps(summarize(reports), indent=2, sort_keys=True))
        return
    for report in reports:
        for line in report.lines():
            click.echo(line)


@contextmanager
def _ignoring_sigterm() -> Iterator[None]:
    """Keep the in-job recovery alive while it requeues its own job.

    `requeuehold` of the running job makes Slurm send SIGTERM to the batch script (and us),
    then SIGKILL after KillWait; the remaining steps take milliseconds. A SIGKILL anyway is
    covered by the journal: the epilog or the watcher finishes the plan.
    """
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ------------------------------------------------------------------- status


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _print_status(view: dict[str, Any]) -> None:
    job = view["job"]
    state = job.get("state", job.get("error", "?"))
    if "state" in job:
        state += f" on {','.join(job['nodes']) or '-'}, restarts {job['restart_count']}"
        if job["excluded_nodes"]:
            state += f", excluded {','.join(job['excluded_nodes'])}"
        if job["held"]:
            state += ", held"
    click.echo(f"job:                 {view['job_id'] or '?'}  ({state})")
    click.echo(f"run dir:             {view['run_dir'] or '? (not found)'}")
    checks = view.get("checks") or {}
    click.echo(f"checks:              {', '.join(f'{k}={v}' for k, v in checks.items()) or '-'}")
    click.echo(f"last verified step:  {view.get('last_verified_step')}")
    click.echo(f"trusted checkpoint:  step {view.get('trusted_checkpoint')}")
    for r in view.get("resumes", []):
        moved = ", ".join(r["quarantined"]) or "-"
        click.echo(
            f"resumed:             restart {r['restart_count']} from step "
            f"{r['resumed_from_step']} after alarm {r['alarm_id']} (moved aside: {moved})"
        )
    click.echo(f"latest checkpoint:   step {view.get('latest_checkpoint')}")
    if view["pending"]:
        click.echo(f"pending:             {view['pending'].get('reason')}")
    click.echo("")
    rows = [
        [
            a["alarm_id"],
            str(a["step"]),
            a["check"],
            a["verdict"],
            ",".join(a["suspect_nodes"]),
            a["decision"] + (" (approved)" if a["approved"] else ""),
        ]
        for a in view["alarms"]
    ]
    click.echo(
        _table(rows, ["ALARM", "STEP", "CHECK", "VERDICT", "SUSPECTS", "DECISION"])
        if rows
        else "alarms: none"
    )
    for err in view["bad_alarm_files"]:
        click.echo(f"rejected file: {err}")
    if view["controller_actions"]:
        click.echo("")
        rows = [
            [a["op"] or "", a["target"] or "", a["result"], a["detail"]]
            for a in view["controller_actions"]
        ]
        click.echo(_table(rows, ["ACTION", "TARGET", "RESULT", "DETAIL"]))


@click.command("status")
@click.argument("target", required=False)
@json_option
@state_dir_option
@runs_root_option()
@click.pass_context
@_handle_errors
def status_cmd(
    ctx: click.Context, target: str | None, as_json: bool, state_dir: Path, runs_root: Path | None
) -> None:
    """Show a run: checks, last verified step, alarms, trusted checkpoint, actions, job state.

    TARGET is a job id or a run directory (default: $SLURM_JOB_ID).

    Example:

        \b
        slurm-guard status 4242
        slurm-guard status /shared/runs/llama-7b --json
    """
    from slurm_guard.controller.views import status_view

    target = target or os.environ.get("SLURM_JOB_ID")
    if not target:
        raise click.ClickException("give a job id or a run directory, e.g. `slurm-guard status 42`")
    view = status_view(
        target, client=_client(ctx), store=StateStore(state_dir), runs_root=runs_root
    )
    if view["run_dir"] is None and view["job_id"] is None:
        raise click.ClickException(f"{target}: neither a run directory nor a known job")
    if as_json:
        click.echo(json.dumps(view, indent=2, sort_keys=True, default=str))
    else:
        _print_status(view)


# ------------------------------------------------------------------- review


@click.group("review", invoke_without_command=True)
@json_option
@state_dir_option
@click.pass_context
@_handle_errors
def review_group(ctx: click.Context, as_json: bool, state_dir: Path) -> None:
    """List nodes drained by slurm-guard with their evidence, and alarms awaiting approval.

    Example:

        \b
        slurm-guard review
        slurm-guard review approve a1b2c3 --reason "replay evidence is clear"
    """
    if ctx.invoked_subcommand is not None:
        return
    from slurm_guard.controller.views import review_view

    view = review_view(client=_client(ctx), store=StateStore(state_dir))
    if as_json:
        click.echo(json.dumps(view, indent=2, sort_keys=True, default=str))
        return
    rows = [
        [n["node"], "+".join(n["states"]), ",".join(n["jobs"]) or "-", n["reason"]]
        for n in view["nodes"]
    ]
    click.echo(
        _table(rows, ["NODE", "STATE", "JOBS", "REASON"])
        if rows
        else "no nodes drained by slurm-guard"
    )
    for n in view["nodes"]:
        for a in n["alarms"]:
            click.echo(
                f"  {n['node']}: alarm {a['alarm_id']} job {a['job_id']} step {a['step']} "
                f"{a['check']}/{a['verdict']}: {a['message']}"
            )
            click.echo(f"    evidence: {json.dumps(a['evidence'], sort_keys=True)[:300]}")
    if view["awaiting_approval"]:
        click.echo("")
        rows = [
            [
                w["alarm_id"],
                str(w["job_id"]),
                w["outcome"],
                ",".join(w["suspect_nodes"]),
                w["reason"],
            ]
            for w in view["awaiting_approval"]
        ]
        click.echo(_table(rows, ["ALARM", "JOB", "STATE", "SUSPECTS", "WHY"]))
    for p in view["pending_jobs"]:
        click.echo(f"pending job {p['job_id']}: {p.get('reason')} ({p.get('attempts')} attempts)")


@review_group.command("approve")
@click.argument("alarm_id")
@click.option("--reason", required=True, help="Why the alarm is approved (recorded).")
@dry_run_option
@click.pass_context
@state_dir_option
@json_option
@_handle_errors
def review_approve(
    ctx: click.Context, alarm_id: str, reason: str, dry_run: bool, state_dir: Path, as_json: bool
) -> None:
    """Drain an alarm's suspects and requeue its job excluding them (policy approve, breaker).

    Example:

        \b
        slurm-guard review approve 20260101-0042-replay --reason "two replays agree"
    """
    engine = _engine(ctx, state_dir, dry_run)
    _print_reports([engine.approve(alarm_id, reason, _admin_name())], as_json)


@review_group.command("return")
@click.argument("node")
@click.option("--reason", required=True, help="Why the node may serve again (recorded).")
@dry_run_option
@click.pass_context
@state_dir_option
@_handle_errors
def review_return(
    ctx: click.Context, node: str, reason: str, dry_run: bool, state_dir: Path
) -> None:
    """Resume a node slurm-guard drained, after diagnostics cleared it.

    Nodes drained for any other reason are refused.

    Example:

        \b
        slurm-guard review return node2 --reason "dcgmi diag -r 3 passed, GPU reseated"
    """
    engine = _engine(ctx, state_dir, dry_run)
    click.echo(engine.return_node(node, reason, _admin_name()))


@review_group.command("retire")
@click.argument("node")
@click.option("--reason", required=True, help="Why the node stays out (recorded).")
@dry_run_option
@click.pass_context
@state_dir_option
@_handle_errors
def review_retire(
    ctx: click.Context, node: str, reason: str, dry_run: bool, state_dir: Path
) -> None:
    """Keep a node slurm-guard drained out of service for replacement (state FAIL).

    Example:

        \b
        slurm-guard review retire node2 --reason "GPU 3 fails replay again, RMA 1234"
    """
    engine = _engine(ctx, state_dir, dry_run)
    click.echo(engine.retire_node(node, reason, _admin_name()))


# ------------------------------------------------------------------- entry points


@click.command("recover")
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="SLURM_GUARD_RUN_DIR",
    required=True,
    help="The job's run directory (default: $SLURM_GUARD_RUN_DIR).",
)
@state_dir_option
@dry_run_option
@json_option
@click.pass_context
@_handle_errors
def recover_cmd(
    ctx: click.Context, run_dir: Path, state_dir: Path, dry_run: bool, as_json: bool
) -> None:
    """In-job recovery: act on this job's alarms right after `srun` returns.

    Put it in the batch script after srun; it reads $SLURM_JOB_ID. Requeuing the job ends the
    batch script, so make it the last command. Run it on any non-zero status, as the launcher
    does: with --kill-on-bad-exit a guard stop often ends srun with 143 or a signal, not 86.

    Example:

        \b
        srun --kill-on-bad-exit=1 python train.py; rc=$?
        [ $rc -ne 0 ] && slurm-guard recover --run-dir "$RUN_DIR"
        exit $rc
    """
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise click.ClickException("SLURM_JOB_ID is not set: run `recover` inside the batch job")
    engine = _engine(ctx, state_dir, dry_run)
    with _ignoring_sigterm():
        report = engine.process_job(job_id, run_dir, in_job=True)
    _print_reports([report], as_json)


@click.command("controller")
@click.option("--watch", is_flag=True, help="Keep scanning (a service); default is one pass.")
@runs_root_option(required=True, exists=True)
@click.option(
    "--interval",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds between scans with --watch.",
)
@state_dir_option
@dry_run_option
@json_option
@click.pass_context
@_handle_errors
def controller_cmd(
    ctx: click.Context,
    watch: bool,
    runs_root: Path,
    interval: float,
    state_dir: Path,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Scan a runs root for alarms and act on them; retry pending jobs.

    Example:

        \b
        slurm-guard controller --watch --runs-root /shared/runs --state-dir /var/lib/slurm-guard
    """
    from slurm_guard.controller.watch import scan_once
    from slurm_guard.controller.watch import watch as watch_loop

    engine = _engine(ctx, state_dir, dry_run)
    if not watch:
        _print_reports(scan_once(engine, runs_root), as_json)
        return
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    watch_loop(
        engine, runs_root, interval_s=interval, on_report=lambda r: _print_reports([r], as_json)
    )


@click.command("epilog")
@state_dir_option
@runs_root_option()
@dry_run_option
@click.pass_context
@_handle_errors
def epilog_cmd(ctx: click.Context, state_dir: Path, runs_root: Path | None, dry_run: bool) -> None:
    """EpilogSlurmctld entry point: act on the finished job's alarms ($SLURM_JOB_ID).

    Called by epilog/slurm-guard-epilog.sh, which sets PATH, SLURM_CONF and a timeout.

    Example:

        SLURM_JOB_ID=4242 slurm-guard epilog --state-dir /var/lib/slurm-guard --dry-run
    """
    from slurm_guard.controller.intake import find_run_dir, job_failed, run_dir_from_comment
    from slurm_guard.controller.views import job_comment
    from slurm_guard.slurm.parsers import expand_hostlist

    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise click.ClickException("SLURM_JOB_ID is not set: this command is run by Slurm")
    engine = _engine(ctx, state_dir, dry_run)
    reports = []
    comment = os.environ.get("SLURM_JOB_COMMENT")
    if run_dir_from_comment(comment) is None:
        from slurm_guard.slurm.client import SlurmUnavailable

        try:
            comment = job_comment(engine.client.job(job_id))
        except SlurmUnavailable as exc:
            click.echo(f"job {job_id}: slurmctld unreachable ({exc}); the watcher retries")
            comment = None
    exit_code = os.environ.get("SLURM_JOB_EXIT_CODE2", "")
    # Scanning the runs root costs file reads: only for jobs that failed (any non-zero exit or
    # signal; a guard stop under srun --kill-on-bad-exit usually ends the job with 143).
    failed = job_failed(exit_code)
    run_dir, how = find_run_dir(job_id, comment, runs_root if failed else None)
    if run_dir is None:
        click.echo(f"job {job_id}: not a slurm-guard run ({how})")
    else:
        click.echo(f"job {job_id}: run dir {run_dir} (from {how}), exit {exit_code or '?'}")
        allocation = expand_hostlist(os.environ.get("SLURM_JOB_NODELIST", "") or "")
        reports.append(engine.process_job(job_id, run_dir, allocation=tuple(allocation)))
    reports += engine.retry_pending(lock_timeout_s=EPILOG_RETRY_LOCK_S)
    _print_reports(reports, as_json=False)
    sys.stdout.flush()


def register_admin_commands(group: click.Group) -> None:
    """Attach the operator commands to the top-level group."""
    for command in (status_cmd, review_group, recover_cmd, controller_cmd, epilog_cmd):
        group.add_command(command)
