"""Every command's --help shows its examples exactly as written, and docs/cli.md shows them too.

click rewraps help paragraphs to the terminal width, which once turned two example lines into one
broken command and split `epilog`'s example before `--dry-run`. An example block is therefore one
paragraph after click's no-rewrap marker (a line holding only \\b), at one indentation in every
command; these tests read the blocks from the docstrings and look for each line, unchanged, in
the rendered help at a narrow and a wide terminal.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from slurm_guard.cli import main

CLI_DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
INDENT = 4  # example lines sit 4 spaces deeper than the docstring's text


def commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            out += commands(command, (*prefix, name))
        else:
            out.append((*prefix, name))
    return out


def command_at(path: tuple[str, ...]) -> click.Command:
    command: click.Command = main
    for name in path:
        assert isinstance(command, click.Group)
        command = command.commands[name]
    return command


def example_block(command: click.Command) -> list[str]:
    """The lines after `Example:` as written in the docstring (relative indentation kept)."""
    lines = inspect.cleandoc(command.help or "").splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() in ("Example:", "Examples:"))
    body = lines[start + 1 :]
    while body and not body[0].strip():
        body.pop(0)
    assert body and body[0] == " " * INDENT + "\b", f"{command.name}: examples follow \\b"
    block = []
    for line in body[1:]:
        if not line.strip():
            break
        block.append(line)
    rest = [line for line in body[1 + len(block) :] if line.strip()]
    assert not rest, f"{command.name}: example lines after a blank line get rewrapped: {rest}"
    pad = " " * INDENT
    assert all(line.startswith(pad) for line in block), f"{command.name}: indent examples by 4"
    return [line[INDENT:] for line in block]


PATHS = commands(main)


def shown_block(path: tuple[str, ...], width: int) -> tuple[str, list[str]]:
    """The example block as --help prints it: (its left margin, the lines without it)."""
    block = example_block(command_at(path))
    result = CliRunner().invoke(main, [*path, "--help"], terminal_width=width)
    assert result.exit_code == 0, result.output
    shown = result.output.splitlines()
    first = next(i for i, line in enumerate(shown) if line.strip() == block[0].strip())
    margin = shown[first][: len(shown[first]) - len(shown[first].lstrip())]
    lines = shown[first : first + len(block)]
    return margin, [
        line[len(margin) :].rstrip() if line.startswith(margin) else line for line in lines
    ]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "slurm-guard")
@pytest.mark.parametrize("width", [60, 200])
def test_examples_appear_verbatim_in_help(path: tuple[str, ...], width: int) -> None:
    block = example_block(command_at(path))
    _, shown = shown_block(path, width)
    assert shown == [line.rstrip() for line in block], (
        f"`{' '.join(path)} --help` at width {width} changed the example"
    )


def test_examples_have_one_margin_in_every_command() -> None:
    margins = {" ".join(path) or "slurm-guard": len(shown_block(path, 80)[0]) for path in PATHS}
    assert len(set(margins.values())) == 1, margins


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "slurm-guard")
def test_examples_are_in_the_command_reference(path: tuple[str, ...]) -> None:
    doc = CLI_DOC.read_text().splitlines()
    for line in example_block(command_at(path)):
        assert line.rstrip() in doc, f"docs/cli.md lacks the example line {line.strip()!r}"


def test_help_of_every_command_renders_without_rewrapping_a_long_example() -> None:
    """A guard for the test itself: without \\b click does rewrap, so the check can fail."""

    @click.command()
    def cmd() -> None:
        """Do it.

        Example:

            slurm-guard epilog --state-dir /var/lib/slurm-guard --dry-run --and-more-options
        """

    out = CliRunner().invoke(cmd, ["--help"], terminal_width=60).output
    assert (
        "    slurm-guard epilog --state-dir /var/lib/slurm-guard --dry-run --and-more-options"
        not in (out)
    )
