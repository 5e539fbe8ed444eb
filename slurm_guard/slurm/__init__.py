"""Everything that talks to Slurm: the one client that runs Slurm commands, its pure parsers,
and launching (submitit, sbatch templates)."""
