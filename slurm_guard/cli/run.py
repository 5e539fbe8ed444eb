"""User commands that run training: the drill (and its local demo) and `submit`.

Thin: options in, library call, exit status out. The drill's stages print as they finish, so a
slow cluster shows progress instead of a silent minute.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from pathlib import Path

import click

from slurm_guard.cli.common import usable_dir
from slurm_guard.cli.options import dry_run_option, json_option, state_dir_option


def _sbatch_options(values: tuple[str, ...]) -> dict[str, str | bool]:
    out: dict[str, str | bool] = {}
    for item in values:
        key, sep, value = item.lstrip("-").partition("=")
        out[key] = value if sep else True
    return out


@click.command("drill")
@click.option(
    "--local/--slurm",
    "local",
    default=False,
    help="--local: no Slurm, local processes, dry-run controller; --slurm (the default): the "
    "real cluster.",
)
@click.option(
    "--sharded",
    is_flag=True,
    help="A sharded job: the tiny Llama under HSDP (2 replica groups) and ShardedGuard.",
)
@click.option(
    "--tp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --local --sharded: FSDP2 + tensor parallel of this degree, TP ranks per node.",
)
@click.option(
    "--nodes",
    type=click.IntRange(min=3),
    default=None,
    help="Nodes of the drill job (the cluster needs one more, free); default 3, "
    "with --sharded 4 local ranks or 3 Slurm nodes.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=25),
    default=30,
    show_default=True,
    help="Training steps (the fault starts at step 17).",
)
@click.option(
    "--via",
    type=click.Choice(["submitit", "sbatch"]),
    default="submitit",
    show_default=True,
    help="How the job is submitted (Slurm drill).",
)
@click.option(
    "--controller",
    type=click.Choice(["in-job", "epilog"]),
    default="in-job",
    show_default=True,
    help="Who acts on the alarm: the in-job recovery step, or the site's epilog only.",
)
@click.option(
    "--spares",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Spare nodes in the drill job's allocation (Slurm drill, in-job controller): the step "
    "restarts on one instead of the job being requeued.",
)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the runs go (shared storage for the Slurm drill; default: a new "
    "temporary directory).",
)
@state_dir_option
@click.option(
    "--timeout", type=float, default=300.0, show_default=True, help="Seconds each stage may wait."
)
@click.option(
    "--keep-drained",
    is_flag=True,
    help="Leave the drained node drained (default: return it to service).",
)
@click.option(
    "--sbatch",
    "sbatch_args",
    multiple=True,
    metavar="KEY=VALUE",
    help="Extra sbatch option for the drill jobs, e.g. --sbatch partition=debug.",
)
@json_option(help="Also print the report as JSON.")
def drill_cmd(
    local: bool,
    sharded: bool,
    tp: int,
    nodes: int | None,
    steps: int,
    via: str,
    controller: str,
    spares: int,
    work_dir: Path | None,
    state_dir: Path,
    timeout: float,
    keep_drained: bool,
    sbatch_args: tuple[str, ...],
    as_json: bool,
) -> None:
    """Prove the whole loop with an injected fault; exit 0 only if every stage passes.

    A persistent fault on one node: the guard must stop the job, the controller drain exactly
    that node, the job come back without it, resume from the checkpoint before the fault and
    end with weights bit-identical to a clean run. --local runs it on local processes without
    Slurm (40 s on two idle cores, up to three minutes when other work shares them). --sharded
    runs a tiny Llama under HSDP (2 replica groups x shards) with ShardedGuard and DCP
    checkpoints instead of DDP; with --tp 2, FSDP2 + tensor parallel, a TP pair per node.

    The Slurm drill drains a real node (returned to service at the end unless
    --keep-drained) and needs nodes+1 free nodes and a --work-dir on shared storage. With
    --spares S it needs nodes+S: the job holds them all, the step restarts on a spare after the
    alarm, and the job is never requeued.

    Example:

        \b
        slurm-guard drill --local
        slurm-guard drill --local --sharded
        slurm-guard drill --local --sharded --tp 2
        slurm-guard drill --nodes 3 --via sbatch --work-dir /shared/drills --sbatch partition=debug
        slurm-guard drill --slurm --spares 1 --work-dir /shared/drills
    """
    from slurm_guard.drill import DrillError, SlurmDrillOptions, run_local_drill, run_slurm_drill

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if work_dir is not None:
        usable_dir(work_dir, "work directory")
    try:
        if local:
            report = run_local_drill(
                work_dir,
                nodes=nodes if nodes is not None else 4 if sharded and tp == 1 else 3,
                steps=steps,
                echo=click.echo,
                timeout=timeout,
                sharded=sharded,
                tp=tp,
            )
        else:
            if tp > 1:
                raise click.UsageError("--tp runs with --local only (no Slurm drill for TP yet)")
            if work_dir is None:
                raise click.UsageError("the Slurm drill needs --work-dir on shared storage")
            opts = SlurmDrillOptions(
                nodes=nodes if nodes is not None else 3,
                steps=steps,
                sharded=sharded,
                via=via,
                controller=controller,
                state_dir=state_dir,
                timeout=timeout,
                keep_drained=keep_drained,
                spares=spares,
                sbatch_options=tuple((k, str(v)) for k, v in _sbatch_options(sbatch_args).items()),
            )
            report = run_slurm_drill(work_dir, opts, echo=click.echo)
    except DrillError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:  # the work dir (or a file in it) unusable: name it, no traceback
        raise click.ClickException(f"{exc.filename or work_dir}: {exc.strerror or exc}") from None
    if as_json:
        click.echo(
            json.dumps(
                {
                    "ok": report.ok,
                    "seconds": report.seconds,
                    "work_dir": str(report.work_dir),
                    "stages": [
                        {
                            "name": s.name,
                            "passed": s.passed,
                            "seconds": s.seconds,
                            "details": s.details,
                        }
                        for s in report.stages
                    ],
                },
                indent=2,
            )
        )
    sys.exit(0 if report.ok else 1)


@click.command("submit", context_settings={"ignore_unknown_options": True})
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Absolute run directory on shared storage (created).",
)
@click.option("--nodes", type=click.IntRange(min=1), required=True, help="Nodes to allocate.")
@click.option(
    "--gpus-per-node",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="GPUs per node; one task per GPU (0: CPU, one task per node).",
)
@click.option(
    "--tasks-per-node", type=click.IntRange(min=1), default=None, help="Override tasks per node."
)
@click.option(
    "--tasks",
    type=click.IntRange(min=1),
    default=None,
    help="Total tasks instead of --tasks-per-node (CPU), for a layout that leaves CPUs unused.",
)
@click.option(
    "--spares",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Spare nodes held in the allocation: after an alarm the step restarts on one "
    "instead of requeuing the job.",
)
@click.option("--job-name", default="guarded-ddp", show_default=True)
@state_dir_option
@click.option(
    "--sbatch",
    "sbatch_args",
    multiple=True,
    metavar="KEY=VALUE",
    help="Extra #SBATCH option, e.g. --sbatch partition=gpu --sbatch time=60.",
)
@click.option(
    "--template",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Template to render (default: sbatch_templates/guarded_ddp.sbatch).",
)
@dry_run_option(help="Print the batch script; submit nothing.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def submit_cmd(
    run_dir: Path,
    nodes: int,
    gpus_per_node: int,
    tasks_per_node: int | None,
    tasks: int | None,
    spares: int,
    job_name: str,
    state_dir: Path,
    sbatch_args: tuple[str, ...],
    template: Path | None,
    dry_run: bool,
    command: tuple[str, ...],
) -> None:
    """Render the guarded DDP sbatch template for a run and submit it.

    COMMAND is the training command each task runs (after `--`); it gets the run directory
    as $SLURM_GUARD_RUN_DIR. Default: the example trainer (python -m
    slurm_guard.examples.train). Prints the job id. With --spares S the job holds N+S nodes
    and trains on N through `slurm-guard supervise`.

    Example:

        \b
        slurm-guard submit --run-dir /shared/runs/demo --nodes 3 --gpus-per-node 8 \\
            -- python train.py --epochs 3
        slurm-guard submit --run-dir /shared/runs/demo --nodes 3 --spares 1 --dry-run
    """
    from slurm_guard.slurm.launch import (
        LaunchError,
        default_train_command,
        render_sbatch,
        template_path,
    )

    run_dir = run_dir.absolute()
    usable_dir(run_dir, "run directory")
    usable_dir(state_dir, "state directory")
    try:
        text = render_sbatch(
            run_dir=run_dir,
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            tasks_per_node=tasks_per_node,
            tasks=tasks,
            spares=spares,
            train_command=list(command) or default_train_command(),
            job_name=job_name,
            state_dir=str(state_dir),
            sbatch_options=_sbatch_options(sbatch_args),
            template=(template or template_path()).read_text(),
        )
    except FileNotFoundError:
        raise click.ClickException(
            f"template {template_path()} not found (installed without the source tree?); "
            "pass --template PATH to a copy of sbatch_templates/guarded_ddp.sbatch"
        ) from None
    except LaunchError as exc:
        raise click.ClickException(str(exc)) from None
    if dry_run:
        click.echo(text, nl=False)
        return
    from slurm_guard.slurm.client import SlurmCommandError, default_client

    run_dir.mkdir(parents=True, exist_ok=True)
    script = run_dir / "job.sbatch"
    script.write_text(text)
    try:
        job_id = default_client().submit(script)
    except SlurmCommandError as exc:
        raise click.ClickException(f"sbatch refused {script}: {exc}") from None
    click.echo(job_id)
    click.echo(
        f"submitted job {job_id}: {shlex.quote(str(script))}; follow it with "
        f"`slurm-guard status {job_id}`",
        err=True,
    )


@click.command("local", context_settings={"ignore_unknown_options": True})
@click.option(
    "-n",
    "--nprocs",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks to start, each its own pose node: rank r is node<r+1>, LOCAL_RANK=r.",
)
@click.option(
    "--nodes",
    type=click.IntRange(min=1),
    default=None,
    help="Pose nodes (torchrun's --nnodes); with --ranks-per-node [default: 1].",
)
@click.option(
    "--ranks-per-node",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks on each pose node (torchrun's --nproc-per-node), placed as srun "
    "--ntasks-per-node places them: ranks 0..G-1 on node1, G..2G-1 on node2, ... [default: 1].",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds the other ranks get to exit 86 after one exits 86 (the guard's alarm), "
    "before they are stopped [default: the guard's default watchdog_seconds (300) + 60; set "
    "it to your GuardConfig's watchdog_seconds + 60]. After any other error they are stopped "
    "within seconds.",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def local_cmd(
    nprocs: int | None,
    nodes: int | None,
    ranks_per_node: int | None,
    grace: float | None,
    command: tuple[str, ...],
) -> None:
    """Run a training script on local processes, each posing as a Slurm node.

    -n N: N ranks, each its own node. --nodes N --ranks-per-node G: N x G ranks placed as srun
    --ntasks-per-node=G places them, with srun's and torchrun's variables (docs/cli.md); the
    replays pair ranks of different nodes, as on the cluster.

    Fails fast, like torchrun: a rank that exits with an error is named at once (rank, node,
    code), the others are stopped within seconds, and the launcher exits with its code. After
    a rank exits 86 (an alarm) the others get --grace seconds to exit 86 too, and the launcher
    exits 86 (torchrun turns it into 1). Ctrl-C, SIGTERM, SIGHUP stop every rank first.

    Example:

        \b
        slurm-guard local -n 3 -- python train.py --steps 20
        slurm-guard local --nodes 3 --ranks-per-node 2 -- python train.py
        SLURM_GUARD_INJECT=kind=grad-scale,node=node2,step=5,persistent=1 \\
            slurm-guard local -n 3 -- python train.py
    """
    from slurm_guard.local.script import DEFAULT_GRACE_SECONDS, LaunchError, run_script

    if nprocs is not None and (nodes is not None or ranks_per_node is not None):
        raise click.UsageError("give -n N, or --nodes N --ranks-per-node G, not both")
    if nprocs is None and nodes is None and ranks_per_node is None:
        raise click.UsageError("give -n N (one rank per node) or --nodes N --ranks-per-node G")
    per_node = None if nprocs is not None else (ranks_per_node or 1)
    world = nprocs if nprocs is not None else (nodes or 1) * (ranks_per_node or 1)
    grace_seconds = DEFAULT_GRACE_SECONDS if grace is None else grace
    try:
        code = run_script(command, world, grace_seconds=grace_seconds, ranks_per_node=per_node)
    except LaunchError as exc:
        raise click.ClickException(str(exc)) from None
    raise SystemExit(code)


@click.command("task", context_settings={"ignore_unknown_options": True})
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def task_cmd(command: tuple[str, ...]) -> None:
    """Run COMMAND in this Slurm task as torchrun would run a worker.

    Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT
    (and the ROLE_* pair) from Slurm's task variables, then replaces itself with COMMAND. A
    script written for torchrun (the HF Trainer, Accelerate, init_process_group on env://) then
    runs under srun unchanged; the sbatch template starts every task through it. Rank 0 asks
    Slurm for the first node's address once per step (through the run directory).

    Example:

        \b
        srun slurm-guard task -- python train.py
    """
    from slurm_guard.slurm.task import LaunchError, task_environment

    try:
        _, exported = task_environment()
    except LaunchError as exc:
        raise click.ClickException(str(exc)) from None
    os.environ.update(exported)
    try:
        os.execvp(command[0], list(command))
    except OSError as exc:
        raise click.ClickException(f"cannot run {command[0]!r}: {exc.strerror}") from None


def register_run_commands(group: click.Group) -> None:
    """Attach the run commands to the top-level group."""
    group.add_command(task_cmd)
    group.add_command(local_cmd)
    group.add_command(drill_cmd)
    group.add_command(submit_cmd)
