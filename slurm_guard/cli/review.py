"""`slurm-guard review`: the nodes slurm-guard drained with their evidence, alarms awaiting
approval, and the admin's decisions on them (approve, return, retire), each recorded with the
admin's name and reason."""

from __future__ import annotations

import json
from pathlib import Path

import click

from slurm_guard.cli.common import (
    admin_name,
    handle_errors,
    make_engine,
    names,
    print_reports,
    safe,
    slurm_client,
    table,
)
from slurm_guard.cli.evidence import print_node_evidence
from slurm_guard.cli.options import dry_run_option, json_option, state_dir_option
from slurm_guard.controller.state import StateStore


@click.group("review", invoke_without_command=True)
@json_option
@state_dir_option
@click.pass_context
@handle_errors
def review_group(ctx: click.Context, as_json: bool, state_dir: Path) -> None:
    """List nodes drained by slurm-guard with their evidence, and alarms awaiting approval.

    Example:

        \b
        slurm-guard review
        slurm-guard review approve a1b2c3 --reason "replay evidence is clear"
    """
    if ctx.invoked_subcommand is not None:
        return
    from slurm_guard.controller.review_view import review_view

    view = review_view(client=slurm_client(ctx), store=StateStore(state_dir))
    if as_json:
        click.echo(json.dumps(view, indent=2, sort_keys=True, default=str))
        return
    if not view["slurm"]["reachable"]:
        click.echo(
            f"Slurm is unreachable ({safe(view['slurm']['error'])}); the nodes below are what "
            f"the controller's journal in {safe(view['state_dir'])} records, their state now "
            "is unknown"
        )
    rows = [
        [n["node"], "+".join(n["states"]), names(n["jobs"]), n["reason"]] for n in view["nodes"]
    ]
    click.echo(
        table(rows, ["NODE", "STATE", "JOBS", "REASON"])
        if rows
        else "no nodes drained by slurm-guard"
    )
    for n in view["nodes"]:
        print_node_evidence(n)
        for a in n["alarms"]:
            click.echo(
                "  "
                + safe(
                    f"{n['node']}{' ' + a['gpu'] if a.get('gpu') else ''}: alarm "
                    f"{a['alarm_id']} job {a['job_id']} step {a['step']} "
                    f"{a['check']}/{a['verdict']}: {a['message']}"
                )
            )
            evidence = json.dumps(a["evidence"], sort_keys=True, default=str)[:300]
            click.echo(f"    evidence: {safe(evidence)}")
    if view["awaiting_approval"]:
        click.echo("")
        rows = [
            [w["alarm_id"], w["job_id"], w["outcome"], names(w["suspect_nodes"]), w["reason"]]
            for w in view["awaiting_approval"]
        ]
        click.echo(table(rows, ["ALARM", "JOB", "STATE", "SUSPECTS", "WHY"]))
    if view.get("held_jobs"):
        click.echo("")
        rows = [[h["job_id"], h["kind"], h["reason"]] for h in view["held_jobs"]]
        click.echo(table(rows, ["HELD JOB", "RULE", "WHY"]))
    for p in view["pending_jobs"]:
        click.echo(
            safe(f"pending job {p.get('job_id')}: {p.get('reason')} ({p.get('attempts')} attempts)")
        )


@review_group.command("approve")
@click.argument("alarm_id")
@click.option("--reason", required=True, help="Why the alarm is approved (recorded).")
@dry_run_option
@click.pass_context
@state_dir_option
@json_option
@handle_errors
def review_approve(
    ctx: click.Context, alarm_id: str, reason: str, dry_run: bool, state_dir: Path, as_json: bool
) -> None:
    """Drain an alarm's suspects and requeue its job excluding them (policy approve, breaker).

    Example:

        \b
        slurm-guard review approve 20260101-0042-replay --reason "two replays agree"
    """
    engine = make_engine(ctx, state_dir, dry_run)
    print_reports([engine.approve(alarm_id, reason, admin_name())], as_json)


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
@handle_errors
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
    engine = make_engine(ctx, state_dir, dry_run)
    click.echo(engine.return_node(node, reason, admin_name(), force=force))


@review_group.command("retire")
@click.argument("node")
@click.option("--reason", required=True, help="Why the node stays out (recorded).")
@dry_run_option
@click.pass_context
@state_dir_option
@handle_errors
def review_retire(
    ctx: click.Context, node: str, reason: str, dry_run: bool, state_dir: Path
) -> None:
    """Keep a node slurm-guard drained out of service for replacement (state FAIL).

    Example:

        \b
        slurm-guard review retire node2 --reason "GPU 3 fails replay again, RMA 1234"
    """
    engine = make_engine(ctx, state_dir, dry_run)
    click.echo(engine.retire_node(node, reason, admin_name()))


@review_group.command("reset-budget")
@click.argument("run_dir")
@click.option("--reason", required=True, help="Why the run may restart again (recorded).")
@dry_run_option
@click.pass_context
@state_dir_option
@handle_errors
def review_reset_budget(
    ctx: click.Context, run_dir: str, reason: str, dry_run: bool, state_dir: Path
) -> None:
    """Start a run directory's restart budget and loop history afresh.

    Both count the run's history across job ids, so resubmitting a job does not reset them.
    A job the rules hold stays held: release it with `scontrol release`.

    Example:

        \b
        slurm-guard review reset-budget /shared/runs/llm --reason "bad data shard removed"
    """
    engine = make_engine(ctx, state_dir, dry_run)
    click.echo(engine.reset_budget(run_dir, reason, admin_name()))
