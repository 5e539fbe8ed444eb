"""docs/cli.md must name every command, so the reference cannot drift from `--help`."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from slurm_guard.cli import main

CLI_DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def command_paths(group: click.Group, prefix: str = "slurm-guard") -> list[str]:
    paths = []
    for name, command in sorted(group.commands.items()):
        path = f"{prefix} {name}"
        paths.append(path)
        if isinstance(command, click.Group):
            paths += command_paths(command, path)
    return paths


@pytest.mark.parametrize("path", command_paths(main))
def test_every_command_is_documented(path: str) -> None:
    assert f"`{path}" in CLI_DOC.read_text(), f"document `{path}` in docs/cli.md"


@pytest.mark.parametrize("path", command_paths(main))
def test_every_command_help_has_an_example(path: str) -> None:
    args = [*path.split()[1:], "--help"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "Example:" in result.output, f"`{path} --help` needs an Example:"
