"""The `slurm-guard` command: one click group; each family of commands lives in its own module."""

from __future__ import annotations

import click

from slurm_guard.cli.admin import register_admin_commands
from slurm_guard.cli.evidence import register_evidence_commands
from slurm_guard.cli.run import register_run_commands


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="slurm-guard")
def main() -> None:
    """Catch silent data corruption in PyTorch DDP jobs on Slurm.

    Example:

        \b
        slurm-guard drill --local
    """


register_run_commands(main)
register_admin_commands(main)
register_evidence_commands(main)
