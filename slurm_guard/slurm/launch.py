"""Submitting a guarded DDP job: submitit (`launch`) and the sbatch template (`render_sbatch`).

`launch(train_fn, ...)` submits `train_fn` through submitit as one Slurm job: one task per GPU
(one per node on CPU), `--requeue`, and the job comment `slurm-guard:run_dir=<abs path>` that
the controller uses to find the run directory from the job alone (EpilogSlurmctld sees neither
the job's environment nor its files). A job the controller requeues runs the very same pickled
call again; the training function resumes through `Guard.resume()`. Inside the job, each task
joins the process group through `slurm_guard.slurm.task.init_distributed_from_slurm`.

The pure parts (run dir checks, task layout, the rendered script) are separate functions so
that they are tested without Slurm.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from slurm_guard.protocol import COMMENT_KEY, DEFAULT_STATE_DIR
from slurm_guard.slurm.task import (  # the task side's names stay importable from here too
    RUN_DIR_ENV,
    LaunchError,
    SlurmTask,
    init_distributed_from_slurm,
    task_from_env,
)

logger = logging.getLogger(__name__)

# The comment is printed unquoted by `scontrol show -o job` and split on ',' by the
# controller; #SBATCH directives cannot quote and treat '#' as a comment. So the run directory
# may contain neither whitespace, ',', quotes, '\\' nor '#'. Everything else is quoted properly.
_RUN_DIR_FORBIDDEN = re.compile(r"[\s,'\"\\#]")


def check_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    """Validate a run directory for the job comment and sbatch directives; return it absolute.

    Raises:
        LaunchError: the path is relative or holds a character the comment cannot carry.
    """
    path = Path(run_dir)
    if not path.is_absolute():
        raise LaunchError(
            f"run directory {str(run_dir)!r} is relative: give an absolute path on storage "
            "shared by all nodes and the controller (e.g. /shared/runs/my-run)"
        )
    bad = _RUN_DIR_FORBIDDEN.search(str(path))
    if bad is not None or ".." in path.parts:
        what = repr(bad.group()) if bad is not None else "'..'"
        raise LaunchError(
            f"run directory {str(path)!r} contains {what}: the controller reads it from the job "
            "comment, which cannot carry whitespace, commas, quotes, '\\', '#' or '..'; "
            "choose a plainer path"
        )
    return path


def job_comment(run_dir: Path) -> str:
    """The job comment that tells the controller where the run directory is."""
    return f"{COMMENT_KEY}{run_dir}"


def recovery_lines(
    run_dir: Path, state_dir: str | None, slurm_guard: str | None = None
) -> list[str]:
    """Batch-script lines that run `slurm-guard recover` when the training step failed.

    Placed right after `srun`; any non-zero status triggers it (with --kill-on-bad-exit the
    status of a guard stop may be a signal's, not 86), and `recover` does nothing without an
    undecided alarm. The script then exits with srun's status.
    """
    exe = slurm_guard or str(Path(sys.executable).with_name("slurm-guard"))
    cmd = [exe, "recover", "--run-dir", str(run_dir)]
    if state_dir is not None:
        cmd += ["--state-dir", state_dir]
    return [
        "sg_rc=$?",
        f'if [ "$sg_rc" -ne 0 ]; then {shlex.join(cmd)}; fi',
        'exit "$sg_rc"',
    ]


def task_layout(
    nodes: int, gpus_per_node: int, tasks_per_node: int | None, tasks: int | None
) -> tuple[int | None, int | None]:
    """(--ntasks-per-node, --ntasks) for a job: one of them is None.

    A job that gives its total (`tasks`, e.g. 4 tasks on 3 nodes so that one rank is alone on
    its node) gets `--ntasks` and no `--ntasks-per-node`: Slurm 24.11 recomputes the task count
    as nodes x ntasks-per-node when the controller sets the requeued job's ExcNodeList (4 tasks
    came back as 6, measured), and a sharded checkpoint saved on 4 ranks cannot be loaded on 6.

    Raises:
        LaunchError: counts Slurm would refuse or that contradict each other.
    """
    if nodes < 1 or gpus_per_node < 0:
        raise LaunchError(f"nodes={nodes}, gpus_per_node={gpus_per_node}: need nodes >= 1")
    if tasks is None:
        return tasks_per_node or (gpus_per_node if gpus_per_node > 0 else 1), None
    if tasks_per_node is not None:
        raise LaunchError("give tasks (the job's total) or tasks_per_node, not both")
    if gpus_per_node > 0:
        raise LaunchError("tasks is for CPU layouts; with GPUs, one task per GPU is the layout")
    if tasks < nodes:
        raise LaunchError(f"tasks={tasks} on nodes={nodes}: every node needs a task")
    return None, tasks


def check_spares(spares: int, tasks: int | None) -> None:
    """Spares need a per-node layout: the supervisor starts N x tasks-per-node tasks.

    Raises:
        LaunchError: a negative count, or spares with a total task count.
    """
    if spares < 0:
        raise LaunchError(f"spares={spares}: give 0 or more spare nodes")
    if spares and tasks is not None:
        raise LaunchError(
            "spares need tasks per node (one per GPU, or --tasks-per-node), not a total --tasks: "
            "the restarted step must have the same layout on whichever nodes it gets"
        )


def supervise_command(
    run_dir: Path,
    nodes: int,
    tasks_per_node: int,
    state_dir: str | None,
    slurm_guard: str | None = None,
) -> list[str]:
    """`slurm-guard supervise ... --`: the in-job supervisor; the step's command follows."""
    exe = slurm_guard or str(Path(sys.executable).with_name("slurm-guard"))
    cmd = [exe, "supervise", "--nodes", str(nodes), "--tasks-per-node", str(tasks_per_node)]
    cmd += ["--run-dir", str(run_dir)]
    if state_dir is not None:
        cmd += ["--state-dir", state_dir]
    return [*cmd, "--"]


def launch(
    train_fn: Callable[..., Any],
    *args: Any,
    nodes: int,
    gpus_per_node: int = 0,
    run_dir: str | os.PathLike[str],
    tasks_per_node: int | None = None,
    tasks: int | None = None,
    folder: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    in_job_recovery: bool = False,
    state_dir: str | None = None,
    spares: int = 0,
    **slurm_params: Any,
) -> Any:
    """Submit `train_fn(*args)` as one guarded DDP job through submitit; return the submitit Job.

    Every task calls `train_fn(*args)`, which should call `init_distributed_from_slurm()` and
    resume through `Guard.resume()` (see slurm_guard/examples/train.py: `slurm_task`).

    Args:
        train_fn: an importable function (submitit pickles it by reference).
        nodes: nodes to allocate; the controller needs >= 3 to attribute a fault to one.
        gpus_per_node: GPUs per node; one task per GPU. 0 means CPU: one task per node.
        run_dir: absolute run directory on shared storage (also put into the job comment).
        tasks_per_node: override the number of tasks per node (e.g. several CPU ranks).
        tasks: the job's total task count, for a layout that leaves some node's CPUs unused;
            see `task_layout`.
        folder: submitit's folder for logs and pickles (default: `<run_dir>/submitit`).
        env: variables exported in the batch script before srun.
        in_job_recovery: run `slurm-guard recover` after srun fails, as the sbatch template
            does; leave False where the site's EpilogSlurmctld runs the controller.
        state_dir: `--state-dir` for the in-job recovery (default: the controller's default).
        spares: extra nodes to hold in the allocation. The job asks for nodes + spares and
            trains on `nodes`; after an alarm the in-job supervisor (`slurm-guard supervise`)
            restarts the step on a spare instead of requeuing the job. Spares imply in-job
            recovery.
        **slurm_params: submitit SlurmExecutor parameters (`partition`, `time`, `mem`,
            `additional_parameters`, ...).

    Raises:
        LaunchError: bad run directory or node counts.
    """
    import submitit

    path = check_run_dir(run_dir)
    per_node, total = task_layout(nodes, gpus_per_node, tasks_per_node, tasks)
    check_spares(spares, tasks)
    path.mkdir(parents=True, exist_ok=True)
    setup = [f"export {RUN_DIR_ENV}={shlex.quote(str(path))}"]
    if spares:
        # submitit writes the step's `srun` itself; a shell function of that name hands it to
        # the supervisor, which runs the real srun on N nodes (and again on a spare).
        supervisor = shlex.join(supervise_command(path, nodes, per_node or 1, state_dir))
        setup.append(f'srun() {{ {supervisor} "$@"; }}')
    for key, value in (env or {}).items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise LaunchError(f"environment variable name {key!r} is not valid")
        setup.append(f"export {key}={shlex.quote(value)}")
    setup += list(slurm_params.pop("setup", []))
    extra = dict(slurm_params.pop("additional_parameters", {}) or {})
    extra.setdefault("requeue", True)
    if total is not None:
        extra["ntasks"] = total
    srun_args = list(slurm_params.pop("srun_args", []) or [])
    if not any(a.startswith("--kill-on-bad-exit") for a in srun_args):
        # One crashed rank must end the step, not leave the others in a collective until the
        # process-group timeout.
        srun_args.append("--kill-on-bad-exit=1")
    teardown = list(slurm_params.pop("teardown", []) or [])
    if in_job_recovery and not spares:
        teardown = recovery_lines(path, state_dir) + teardown
    executor = submitit.SlurmExecutor(folder=str(folder or path / "submitit"))
    params: dict[str, Any] = {
        "nodes": nodes + spares,
        "comment": job_comment(path),
        "additional_parameters": extra,
        "setup": setup,
        "srun_args": srun_args,
    }
    if per_node is not None:
        # Without it submitit writes no --ntasks-per-node (its Job then counts one task per
        # node; job.result() reads task 0's, the same either way).
        params["ntasks_per_node"] = per_node
    if gpus_per_node > 0:
        params["gpus_per_node"] = gpus_per_node
    if teardown:
        params["teardown"] = teardown
    params.update(slurm_params)
    executor.update_parameters(**params)
    job = executor.submit(train_fn, *args)
    logger.info("submitted job %s (run dir %s)", job.job_id, path)
    return job


# ------------------------------------------------------------------------- sbatch template

TEMPLATE_NAME = "guarded_ddp.sbatch"
_MARKER = re.compile(r"@([A-Z_]+)@")
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")


def template_path() -> Path:
    """The sbatch template: the source tree's in a checkout, else the installed copy.

    A wheel installs it under `<prefix>/share/slurm-guard/sbatch_templates/` (pyproject's
    data-files).
    """
    source = Path(__file__).resolve().parents[2] / "sbatch_templates" / TEMPLATE_NAME
    if source.is_file():
        return source
    return Path(sys.prefix) / "share" / "slurm-guard" / "sbatch_templates" / TEMPLATE_NAME


def default_train_command(train_args: Sequence[str] = ()) -> list[str]:
    """The example trainer with this interpreter (no PATH or venv activation needed in the job)."""
    return [sys.executable, "-m", "slurm_guard.examples.train", *train_args]


def render_sbatch(
    *,
    run_dir: str | os.PathLike[str],
    nodes: int,
    gpus_per_node: int = 0,
    tasks_per_node: int | None = None,
    tasks: int | None = None,
    train_command: Sequence[str] | None = None,
    job_name: str = "guarded-ddp",
    state_dir: str = str(DEFAULT_STATE_DIR),
    slurm_guard: str | None = None,
    sbatch_options: Mapping[str, str | bool] | None = None,
    template: str | None = None,
    python: str | None = None,
    spares: int = 0,
) -> str:
    """The guarded DDP batch script for one run (pure: returns text, submits nothing).

    `python` runs the kernels' pre-build step (`python -m slurm_guard.kernels`, once per node);
    by default the `python` beside `slurm_guard` when that is given, else this interpreter.
    `spares` nodes are asked for on top of `nodes`; the script then trains through `slurm-guard
    supervise` on `nodes` of them.

    Shell values are quoted with shlex; `#SBATCH` lines cannot be quoted, so the run
    directory is validated by `check_run_dir` and '%' is doubled in the output file pattern.

    Raises:
        LaunchError: bad run directory, counts, option names, or a marker left unreplaced.
    """
    path = check_run_dir(run_dir)
    per_node, total = task_layout(nodes, gpus_per_node, tasks_per_node, tasks)
    check_spares(spares, tasks)
    if not re.fullmatch(r"[A-Za-z0-9._-]+", job_name):
        raise LaunchError(f"job name {job_name!r}: use letters, digits, '.', '_', '-'")
    extra = [] if total is None else [f"#SBATCH --ntasks={total}"]
    for key, value in (sbatch_options or {}).items():
        if not _SBATCH_KEY.match(key):
            raise LaunchError(f"sbatch option {key!r}: give the long name without dashes")
        if value is True:
            extra.append(f"#SBATCH --{key}")
        elif re.search(r"[\s'\"\\#]", str(value)):
            raise LaunchError(f"sbatch option --{key}={value!r}: #SBATCH lines cannot quote")
        else:
            extra.append(f"#SBATCH --{key}={value}")
    command = list(train_command) if train_command else default_train_command()
    exe = slurm_guard or str(Path(sys.executable).with_name("slurm-guard"))
    if python is None:
        python = str(Path(slurm_guard).with_name("python")) if slurm_guard else sys.executable
    values = {
        "JOB_NAME": job_name,
        "NODES": str(nodes + spares),
        "TRAIN_NODES": str(nodes),
        "SPARES": str(spares),
        "TASKS_PER_NODE": str(per_node or ""),
        "GPUS_PER_NODE": str(gpus_per_node),
        "RUN_DIR_PATTERN": str(path).replace("%", "%%"),
        "RUN_DIR_PLAIN": str(path),
        "EXTRA_SBATCH": "\n".join(extra),
        "RUN_DIR": shlex.quote(str(path)),
        "STATE_DIR": shlex.quote(state_dir),
        "TRAIN_COMMAND": shlex.join(command),
        "SLURM_GUARD": shlex.quote(exe),
        "PYTHON": shlex.quote(python),
    }
    text = template if template is not None else template_path().read_text()
    lines = []
    for line in text.splitlines():
        if line.startswith("#SBATCH --gpus-per-node=") and gpus_per_node == 0:
            continue  # CPU job: asking for 0 GPUs is refused on clusters without GRES
        if line.startswith("#SBATCH --ntasks-per-node=") and per_node is None:
            continue  # `tasks` given: --ntasks alone (see task_layout)
        if line.strip() == "@EXTRA_SBATCH@" and not extra:
            continue
        lines.append(line)
    rendered = "\n".join(lines) + "\n"
    unknown = sorted(set(_MARKER.findall(rendered)) - set(values))
    if unknown:
        raise LaunchError(f"template has unknown markers {unknown}; known: {sorted(values)}")
    return _MARKER.sub(lambda m: values[m.group(1)], rendered)


__all__ = [
    "RUN_DIR_ENV",
    "LaunchError",
    "SlurmTask",
    "check_run_dir",
    "check_spares",
    "default_train_command",
    "init_distributed_from_slurm",
    "job_comment",
    "launch",
    "recovery_lines",
    "render_sbatch",
    "supervise_command",
    "task_from_env",
    "task_layout",
    "template_path",
]
