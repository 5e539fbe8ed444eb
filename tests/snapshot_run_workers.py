"""Guarded trainings of several runs, each inside its own Slurm job id or none (one launch).

`tests/test_snapshot_runs.py`: two runs of one job on one node, and a run outside Slurm.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from workers import SMALL, train_tiny_gpt


def run_as_jobs(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each scenario: run_dir, steps, config, and job (SLURM_JOB_ID while it runs, or None)."""
    results = []
    for sc in scenarios:
        if sc.get("job"):
            os.environ["SLURM_JOB_ID"] = sc["job"]
        else:
            os.environ.pop("SLURM_JOB_ID", None)
        results.append(train_tiny_gpt(sc["run_dir"], sc["steps"], sc["config"], 0, SMALL))
        dist.barrier()
    return results
