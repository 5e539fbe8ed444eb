"""Operator commands: status and review (their own modules), and the controller's three entry
points: recover (in the job), controller (a scan or a service) and epilog (EpilogSlurmctld).

Thin on purpose: each command parses options, builds an Engine or a view from
`slurm_guard.controller`, prints, and turns library errors into ClickExceptions that say what
to do next (`cli.common`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import click

from slurm_guard.cli.common import handle_errors, make_engine, print_reports, usable_dir
from slurm_guard.cli.options import (
    dry_run_option,
    job_run_dir_option,
    json_option,
    runs_root_option,
    state_dir_option,
)
from slurm_guard.cli.review import review_group
from slurm_guard.cli.status import status_cmd

if TYPE_CHECKING:
    from collections.abc import Iterator

EPILOG_RETRY_LOCK_S = 0.5  # an epilog retries other jobs only if the state lock is free


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


@click.command("recover")
@job_run_dir_option
@state_dir_option
@dry_run_option
@json_option
@click.pass_context
@handle_errors
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
    usable_dir(run_dir, "run directory", must_exist=True)
    usable_dir(state_dir, "state directory")
    engine = make_engine(ctx, state_dir, dry_run)
    if engine.store.read().supervised(job_id):
        # Only the supervisor can start the step again on a spare; acting here would requeue
        # a job that can recover inside its allocation.
        click.echo(f"job {job_id} runs under `slurm-guard supervise`, which decides; nothing done")
        return
    with _ignoring_sigterm():
        report = engine.process_job(job_id, run_dir, in_job=True)
    print_reports([report], as_json)


@click.command("supervise", context_settings={"ignore_unknown_options": True})
@job_run_dir_option
@click.option(
    "--nodes",
    "train_nodes",
    type=click.IntRange(min=1),
    required=True,
    help="Nodes a training step runs on; the rest of the allocation are spares.",
)
@click.option(
    "--tasks-per-node",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Tasks of the training step on each node (one per GPU).",
)
@state_dir_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
@handle_errors
def supervise_cmd(
    ctx: click.Context,
    run_dir: Path,
    train_nodes: int,
    tasks_per_node: int,
    state_dir: Path,
    command: tuple[str, ...],
) -> None:
    """In-job supervisor: run the training step on N nodes, restart it on a spare after an alarm.

    Runs inside the batch script of a job that holds more nodes than it trains on (submit
    --spares). After an alarm the controller engine drains the convicted node and the step
    starts again on N healthy nodes of the same allocation: same job id, no trip through the
    queue. With no healthy spare left it requeues the job without the node; when the alarms
    follow the job from node to node it holds the job. Exits with the last step's status.

    Example:

        \b
        slurm-guard supervise --nodes 3 --run-dir "$RUN_DIR" -- slurm-guard task -- python train.py
    """
    from slurm_guard.controller.supervisor import supervise
    from slurm_guard.slurm.client import run_training_step
    from slurm_guard.slurm.parsers import expand_hostlist

    job_id = os.environ.get("SLURM_JOB_ID")
    allocation = expand_hostlist(os.environ.get("SLURM_JOB_NODELIST", "") or "")
    if not job_id or not allocation:
        raise click.ClickException(
            "SLURM_JOB_ID or SLURM_JOB_NODELIST is not set: run `supervise` in the batch script"
        )
    if len(allocation) < train_nodes:
        raise click.ClickException(
            f"the job holds {len(allocation)} node(s) but --nodes is {train_nodes}: submit with "
            "--nodes N+S (submit --spares S does it)"
        )
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    usable_dir(run_dir, "run directory")  # the training's rank 0 creates it
    usable_dir(state_dir, "state directory")
    engine = make_engine(ctx, state_dir, False)
    status = supervise(
        engine,
        job_id,
        run_dir.absolute(),
        allocation,
        train_nodes,
        tasks_per_node,
        command,
        run_training_step,
        deciding=_ignoring_sigterm,
        echo=lambda line: click.echo(line),
    )
    sys.stdout.flush()
    sys.exit(status)


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
@handle_errors
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

    engine = make_engine(ctx, state_dir, dry_run)
    if not watch:
        print_reports(scan_once(engine, runs_root), as_json)
        return
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    watch_loop(
        engine, runs_root, interval_s=interval, on_report=lambda r: print_reports([r], as_json)
    )


@click.command("epilog")
@state_dir_option
@runs_root_option()
@dry_run_option
@click.pass_context
@handle_errors
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
    engine = make_engine(ctx, state_dir, dry_run)
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
    print_reports(reports, as_json=False)
    sys.stdout.flush()


def register_admin_commands(group: click.Group) -> None:
    """Attach the operator commands to the top-level group."""
    for command in (
        status_cmd,
        review_group,
        recover_cmd,
        supervise_cmd,
        controller_cmd,
        epilog_cmd,
    ):
        group.add_command(command)
