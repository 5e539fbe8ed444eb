"""The checks of one step: what each rank measures, and how every rank reaches one verdict.

- `comm_hook`: the DDP communication hook (finite check and conservation sketch per bucket);
- `replay`: capturing a microbatch and recomputing it on another node;
- `rows`, `verifier`, `judging`: the per-step verdict row, its gather, and the decisions on it;
- `verdicts`, `consistency`: pure functions from gathered numbers to a `Finding`;
- `triage`: the suspect repeats its failing microbatch before the ranks stop.
"""

from __future__ import annotations

from slurm_guard.checks.replay import Captured, Microbatches, capture, is_replaying
from slurm_guard.checks.rows import StepResult
from slurm_guard.checks.verdicts import Finding
from slurm_guard.checks.verifier import Verifier

__all__ = [
    "Captured",
    "Finding",
    "Microbatches",
    "StepResult",
    "Verifier",
    "capture",
    "is_replaying",
]
