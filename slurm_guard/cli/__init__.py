"""The `slurm-guard` command: thin click commands over the library, one module per family."""

from slurm_guard.cli.main import main

__all__ = ["main"]
