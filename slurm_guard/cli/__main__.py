"""``python -m slurm_guard.cli``: the same as the `slurm-guard` command."""

from slurm_guard.cli.main import main

main()
