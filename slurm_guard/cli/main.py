"""The `slurm-guard` command: one click group; each family of commands lives in its own module."""

from __future__ import annotations

import os
import warnings

import click

from slurm_guard.cli.admin import register_admin_commands
from slurm_guard.cli.evidence import register_evidence_commands
from slurm_guard.cli.run import register_run_commands

NUMPY_WARNING = "Failed to initialize NumPy"
"""torch's import-time warning where numpy is missing; slurm-guard never needs numpy."""


def _quiet_numpy_warning() -> None:
    """Silence that warning here and in the processes the drill spawns (they inherit the
    environment). In a fresh venv with only torch it otherwise prints once per rank and looks
    like a failure, though nothing is wrong."""
    warnings.filterwarnings("ignore", message=NUMPY_WARNING)
    rule = f"ignore:{NUMPY_WARNING}"
    current = os.environ.get("PYTHONWARNINGS", "")
    if rule not in current:
        os.environ["PYTHONWARNINGS"] = f"{current},{rule}" if current else rule


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="slurm-guard")
def main() -> None:
    """Catch silent data corruption in PyTorch DDP jobs on Slurm.

    Example:

        \b
        slurm-guard drill --local
    """
    _quiet_numpy_warning()


register_run_commands(main)
register_admin_commands(main)
register_evidence_commands(main)
