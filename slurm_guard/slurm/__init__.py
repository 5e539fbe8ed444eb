"""Everything that talks to Slurm: the one client that runs Slurm commands, its pure parsers,
and launching (submitit, sbatch templates)."""

__all__ = ["client", "dry_run", "launch", "parsers", "polling"]  # its modules, imported by path
