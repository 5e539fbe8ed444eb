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

from slurm_guard.cli.evidence import print_node_evidence
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


class _JsonError(click.ClickException):
    """An error for a command run with --json: one JSON object on stdout, exit status 1.

    A script that pipes `--json` into a parser gets something it can parse either way.
    """

    def show(self, file: Any = None) -> None:
        click.echo(json.dumps({"error": self.format_message(), "exit_code": self.exit_code}))


def _wants_json(kwargs: dict[str, Any]) -> bool:
    if kwargs.get("as_json"):
        return True
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        if ctx.params.get("as_json"):
            return True
        ctx = ctx.parent
    return False


def _slurm_message(exc: Exception) -> str:
    """Slurm's failure in words: unreachable (not installed, not configured, down) or refused."""
    from slurm_guard.controller.views import slurm_reason
    from slurm_guard.slurm.client import SlurmUnavailable

    text = slurm_reason(exc)
    if isinstance(exc, SlurmUnavailable):
        return f"slurmctld unreachable ({text}); check `scontrol ping` and SLURM_CONF, then retry"
    if getattr(exc, "returncode", 0) is None or "no Slurm configuration" in text:
        return f"Slurm is unreachable from here ({text})"
    return f"Slurm refused: {text}"


def _handle_errors(f: F) -> F:
    """Turn library errors into ClickExceptions with a next step instead of a traceback.

    With --json the error is a JSON object on stdout (exit status 1).
    """

    @wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from slurm_guard.controller.report import EngineError
        from slurm_guard.controller.views import ViewError, printable
        from slurm_guard.slurm.client import SlurmCommandError

        error = _JsonError if _wants_json(kwargs) else click.ClickException
        try:
            return f(*args, **kwargs)
        except _JsonError:
            raise
        except click.ClickException as exc:
            if error is _JsonError:
                raise _JsonError(exc.format_message()) from None
            raise
        except (EngineError, StateError, PolicyError, ViewError) as exc:
            raise error(printable(exc)) from None
        except SlurmCommandError as exc:
            raise error(printable(_slurm_message(exc))) from None

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


def _safe(value: Any) -> str:
    from slurm_guard.controller.views import printable

    return printable("-" if value is None else value)


def _table(rows: list[list[Any]], headers: list[str]) -> str:
    """Columns padded to width; every cell escaped (cells come from files users write)."""
    cells = [[_safe(c) for c in r] for r in rows]
    widths = [max(len(c) for c in col) for col in zip(headers, *cells, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def _field(label: str, *values: Any) -> None:
    click.echo(f"{label + ':':<21}{''.join(_safe(v) for v in values)}")


def _names(values: Any) -> str:
    return ",".join(str(v) for v in values) if isinstance(values, list) and values else "-"


def _print_status(view: dict[str, Any]) -> None:
    job = view.get("job") or {}
    state = str(job.get("state", job.get("error", "?")))
    if "state" in job:
        state += f" on {_names(job.get('nodes'))}, restarts {job.get('restart_count')}"
        if job.get("excluded_nodes"):
            state += f", excluded {_names(job['excluded_nodes'])}"
        if job.get("held"):
            state += ", held"
    _field("job", view.get("job_id") or "?", f"  ({state})")
    _field("run dir", view.get("run_dir") or "? (not found)")
    if view.get("run_dir_error"):
        _field("run dir problem", view["run_dir_error"])
    run = view.get("run") or {}
    if run.get("error"):
        _field("run.json", run["error"])
    checks = view.get("checks") or {}
    _field("checks", ", ".join(f"{k}={v}" for k, v in checks.items()) or "-")
    if view.get("injected_faults"):
        _field(
            "injected faults",
            "; ".join(view["injected_faults"]),
            "  (on purpose: alarms they cause are not hardware faults)",
        )
    last = view.get("last_verified_step")
    src = view.get("last_verified_from")
    _field("last verified step", last, f"  (from {src})" if last is not None and src else "")
    trusted = view.get("trusted_checkpoint")
    if view.get("resume_blocked"):
        _field("trusted checkpoint", "none: ", view["resume_blocked"])
    else:
        _field(
            "trusted checkpoint",
            "none (a restart starts from step 0)" if trusted is None else f"step {trusted}",
            f"  (resume rule, trust_replays={view.get('trust_replays')})",
        )
    for r in view.get("resumes", []):
        _field(
            "resumed",
            f"restart {r.get('restart_count')} from step {r.get('resumed_from_step')} after alarm ",
            r.get("alarm_id"),
            f" (moved aside: {', '.join(r.get('quarantined') or []) or '-'})",
        )
    latest = view.get("latest_checkpoint")
    _field("latest checkpoint", "none" if latest is None else f"step {latest}")
    for step, problem in (view.get("damaged_checkpoints") or {}).items():
        _field("damaged checkpoint", f"step {step}: ", problem)
    if view.get("pending"):
        _field("pending", view["pending"].get("reason"))
    if view.get("journal_error"):
        _field("controller journal", view["journal_error"])
    click.echo("")
    rows = [
        [
            a["alarm_id"],
            a["step"],
            a["check"],
            a["verdict"] + (" (injected)" if a.get("injected") else ""),
            _names(a["suspect_nodes"]),
            a["decision"] + (" (approved)" if a["approved"] else ""),
        ]
        for a in view.get("alarms", [])
    ]
    click.echo(
        _table(rows, ["ALARM", "STEP", "CHECK", "VERDICT", "SUSPECTS", "DECISION"])
        if rows
        else "alarms: none"
    )
    for a in view.get("alarms", []):
        if a["decision"] in ("unknown", "undecided") and a.get("decision_reason"):
            click.echo(f"  {_safe(a['alarm_id'])}: {_safe(a['decision_reason'])}")
    for err in view.get("bad_alarm_files", []):
        click.echo(f"rejected file: {_safe(err)}")
    if view.get("controller_actions"):
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

    TARGET is a job id or a run directory (default: $SLURM_JOB_ID). The trusted checkpoint
    is the one a restart would load now, by the guard's resume rule. Exit status 1 when
    TARGET is neither a run directory nor a job that Slurm or the controller knows.

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
    if not view["slurm"]["reachable"]:
        click.echo(
            f"Slurm is unreachable ({_safe(view['slurm']['error'])}); the nodes below are what "
            f"the controller's journal in {_safe(view['state_dir'])} records, their state now "
            "is unknown"
        )
    rows = [
        [n["node"], "+".join(n["states"]), _names(n["jobs"]), n["reason"]] for n in view["nodes"]
    ]
    click.echo(
        _table(rows, ["NODE", "STATE", "JOBS", "REASON"])
        if rows
        else "no nodes drained by slurm-guard"
    )
    for n in view["nodes"]:
        print_node_evidence(n)
        for a in n["alarms"]:
            click.echo(
                "  "
                + _safe(
                    f"{n['node']}: alarm {a['alarm_id']} job {a['job_id']} step {a['step']} "
                    f"{a['check']}/{a['verdict']}: {a['message']}"
                )
            )
            evidence = json.dumps(a["evidence"], sort_keys=True, default=str)[:300]
            click.echo(f"    evidence: {_safe(evidence)}")
    if view["awaiting_approval"]:
        click.echo("")
        rows = [
            [w["alarm_id"], w["job_id"], w["outcome"], _names(w["suspect_nodes"]), w["reason"]]
            for w in view["awaiting_approval"]
        ]
        click.echo(_table(rows, ["ALARM", "JOB", "STATE", "SUSPECTS", "WHY"]))
    for p in view["pending_jobs"]:
        click.echo(
            _safe(
                f"pending job {p.get('job_id')}: {p.get('reason')} ({p.get('attempts')} attempts)"
            )
        )


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
@click.option(
    "--force",
    is_flag=True,
    help="Return it although its latest diagnosis failed or the retire rule names it (recorded).",
)
@dry_run_option
@click.pass_context
@state_dir_option
@_handle_errors
def review_return(
    ctx: click.Context, node: str, reason: str, force: bool, dry_run: bool, state_dir: Path
) -> None:
    """Resume a node slurm-guard drained, after diagnostics cleared it.

    Nodes drained for any other reason are refused, and so is a node whose latest
    `slurm-guard diagnose` failed or that the policy's retire rule names, unless --force.

    Example:

        \b
        slurm-guard review return node2 --reason "dcgmi diag -r 3 passed, GPU reseated"
    """
    engine = _engine(ctx, state_dir, dry_run)
    click.echo(engine.return_node(node, reason, _admin_name(), force=force))


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

        \b
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
