"""Options several commands share, defined once so that name, default and help cannot drift.

Each decorator may sit on a group and on its subcommands: `slurm-guard review --state-dir D
return NODE` and `slurm-guard review return NODE --state-dir D` mean the same. A subcommand's
value given on its own command line wins; otherwise a value given on the command line of an
enclosing group is taken, before the environment variable and the default.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, overload

import click
from click.core import ParameterSource

from slurm_guard.protocol import DEFAULT_STATE_DIR

F = TypeVar("F", bound=Callable[..., Any])

STATE_DIR_ENV = "SLURM_GUARD_STATE_DIR"
RUNS_ROOT_ENV = "SLURM_GUARD_RUNS_ROOT"

STATE_DIR_HELP = (
    "Controller state: journal, lock, pending jobs, policy.json; never inside a run directory. "
    f"Default: {DEFAULT_STATE_DIR} where you can write it (the site's controller: the epilog, "
    "the watcher and in-job recovery share it), else your own ~/.local/state/slurm-guard "
    "($XDG_STATE_HOME/slurm-guard), which a plain user's in-job recovery can write."
)
STATE_DIR_DEFAULT_TEXT = f"{DEFAULT_STATE_DIR} if writable, else ~/.local/state/slurm-guard"


def default_state_dir() -> Path:
    """The one default rule: the controller's directory where this user can write it (or
    create it), else the user's own state directory, so a plain user's `submit`, `recover` and
    `supervise` work without an admin's directory and without a flag."""
    admin = DEFAULT_STATE_DIR
    if os.access(admin, os.W_OK | os.X_OK) or (
        not admin.exists() and os.access(admin.parent, os.W_OK | os.X_OK)
    ):
        return admin
    home = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(home) / "slurm-guard"


def _resolve_state_dir(_ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path:
    return default_state_dir() if value is None else value


RUNS_ROOT_HELP = (
    "Directory holding the run directories (searched one or two levels below), for jobs "
    "without a slurm-guard job comment."
)
DRY_RUN_HELP = "Show what would change in the cluster; change nothing."
JSON_HELP = "Machine-readable output."


class _SharedOption(click.Option):
    """An option that, when not given on its own command line, takes the value given on an
    enclosing group's command line (before its environment variable and default)."""

    def consume_value(
        self, ctx: click.Context, opts: Mapping[str, Any]
    ) -> tuple[Any, ParameterSource]:
        value, source = super().consume_value(ctx, opts)
        if source is ParameterSource.COMMANDLINE or self.name is None:
            return value, source
        parent = ctx.parent
        while parent is not None:
            if (
                self.name in parent.params
                and parent.get_parameter_source(self.name) is ParameterSource.COMMANDLINE
            ):
                return parent.params[self.name], ParameterSource.COMMANDLINE
            parent = parent.parent
        return value, source


def state_dir_option(f: F) -> F:
    """`--state-dir` (env SLURM_GUARD_STATE_DIR), default `default_state_dir()`."""
    return click.option(
        "--state-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        envvar=STATE_DIR_ENV,
        show_default=STATE_DIR_DEFAULT_TEXT,
        show_envvar=True,
        cls=_SharedOption,
        callback=_resolve_state_dir,
        help=STATE_DIR_HELP,
    )(f)


def job_run_dir_option(f: F) -> F:
    """`--run-dir` (env SLURM_GUARD_RUN_DIR, which the sbatch template sets for its steps)."""
    return click.option(
        "--run-dir",
        type=click.Path(file_okay=False, path_type=Path),
        envvar="SLURM_GUARD_RUN_DIR",
        required=True,
        help="The job's run directory (default: $SLURM_GUARD_RUN_DIR).",
    )(f)


def runs_root_option(*, required: bool = False, exists: bool = False) -> Callable[[F], F]:
    """`--runs-root` (env SLURM_GUARD_RUNS_ROOT); `exists` for commands that scan it."""

    def decorate(f: F) -> F:
        return click.option(
            "--runs-root",
            type=click.Path(exists=exists, file_okay=False, path_type=Path),
            default=None,
            envvar=RUNS_ROOT_ENV,
            show_envvar=True,
            required=required,
            cls=_SharedOption,
            help=RUNS_ROOT_HELP,
        )(f)

    return decorate


@overload
def dry_run_option(f: F, *, help: str = ...) -> F: ...
@overload
def dry_run_option(f: None = None, *, help: str = ...) -> Callable[[F], F]: ...
def dry_run_option(f: F | None = None, *, help: str = DRY_RUN_HELP) -> F | Callable[[F], F]:
    """`--dry-run`; `help` only where the command's dry run means more (submit prints)."""
    decorate = click.option("--dry-run", is_flag=True, cls=_SharedOption, help=help)
    return decorate if f is None else decorate(f)


@overload
def json_option(f: F, *, help: str = ...) -> F: ...
@overload
def json_option(f: None = None, *, help: str = ...) -> Callable[[F], F]: ...
def json_option(f: F | None = None, *, help: str = JSON_HELP) -> F | Callable[[F], F]:
    """`--json` (parameter `as_json`); `help` only where the output is more than JSON."""
    decorate = click.option("--json", "as_json", is_flag=True, cls=_SharedOption, help=help)
    return decorate if f is None else decorate(f)
