"""User commands that run training: the drill and its local demo."""

from __future__ import annotations

import click


def register_run_commands(group: click.Group) -> None:
    """Attach the run commands to the top-level group."""
