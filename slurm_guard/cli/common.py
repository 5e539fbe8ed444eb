"""What the operator commands share: the Slurm client and engine they act through, error
handling that turns library errors into a message with a next step (or a JSON object under
--json), and plain-text tables whose cells are escaped (they come from files users write).

Tests pass a SlurmClient through `ctx.obj["slurm_client"]`.
"""

from __future__ import annotations

import getpass
import json
import os
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from slurm_guard.controller.policy import Policy, PolicyError
from slurm_guard.controller.state import StateError, StateStore

if TYPE_CHECKING:
    from slurm_guard.controller.engine import Engine
    from slurm_guard.controller.report import JobReport
    from slurm_guard.slurm.client import SlurmClient

F = TypeVar("F", bound=Callable[..., Any])


def slurm_client(ctx: click.Context) -> SlurmClient:
    obj = ctx.find_root().obj
    if isinstance(obj, dict) and obj.get("slurm_client") is not None:
        client: SlurmClient = obj["slurm_client"]
        return client
    from slurm_guard.slurm.client import default_client

    return default_client()


def make_engine(ctx: click.Context, state_dir: Path, dry_run: bool) -> Engine:
    from slurm_guard.controller.engine import Engine

    store = StateStore(state_dir)
    try:
        if not dry_run:
            store.ensure()
        policy = Policy.load(state_dir)
    except (StateError, PolicyError) as exc:
        raise click.ClickException(str(exc)) from None
    return Engine(slurm_client(ctx), store, policy, dry_run=dry_run)


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


def handle_errors(f: F) -> F:
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


def usable_dir(path: Path, what: str, *, must_exist: bool = False) -> None:
    """Refuse, naming the path, a directory that is a file, lies below a file, or is missing
    (`must_exist`); a missing one whose nearest existing parent is a directory is fine
    otherwise (it is created when needed)."""
    try:
        if path.exists():
            if not path.is_dir():
                raise click.ClickException(f"{what} {path} is a file, not a directory")
            return
        if must_exist:
            raise click.ClickException(f"{what} {path} does not exist")
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise click.ClickException(
                f"{what} {path} cannot be created: {parent} is a file, not a directory"
            )
    except OSError as exc:
        raise click.ClickException(f"{what} {path}: {exc.strerror or exc}") from None


def admin_name() -> str:
    return os.environ.get("SUDO_USER") or getpass.getuser()


def print_reports(reports: list[JobReport], as_json: bool) -> None:
    from slurm_guard.controller.report import summarize

    if as_json:
        click.echo(json.dumps(summarize(reports), indent=2, sort_keys=True))
        return
    for report in reports:
        for line in report.lines():
            click.echo(line)


def safe(value: Any) -> str:
    from slurm_guard.controller.views import printable

    return printable("-" if value is None else value)


def table(rows: list[list[Any]], headers: list[str]) -> str:
    """Columns padded to width; every cell escaped (cells come from files users write)."""
    cells = [[safe(c) for c in r] for r in rows]
    widths = [max(len(c) for c in col) for col in zip(headers, *cells, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def field(label: str, *values: Any) -> None:
    click.echo(f"{label + ':':<21}{''.join(safe(v) for v in values)}")


def names(values: Any) -> str:
    return ",".join(str(v) for v in values) if isinstance(values, list) and values else "-"
