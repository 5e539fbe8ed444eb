"""Node diagnosis: a known-answer GEMM burn-in (`burn_in`) and the evidence it leaves.

`evidence` (the diagnosis records) and `history` (what `review` shows per node) are read by the
controller, which must not import torch, so this `__init__` exports only them; the burn-in itself
(`slurm_guard.diagnose.burn_in`, torch) is imported by its own path where it runs.
"""

from __future__ import annotations

from slurm_guard.diagnose.evidence import Diagnosis, latest_diagnosis, read_diagnoses
from slurm_guard.diagnose.history import node_history, return_blockers

__all__ = ["Diagnosis", "latest_diagnosis", "node_history", "read_diagnoses", "return_blockers"]
