"""The guard's loop-independent core, shared by every entry point.

`GuardCore` sets the guard up on a DDP model and runs the checks of one step in three calls
(`begin_step`, `finish_step`, `apply_update`); `checkpoints` saves a verified checkpoint and
resumes from the trusted one. `slurm_guard.Guard` is the core plus a loop of one step.
"""

from __future__ import annotations

from slurm_guard.core.checkpoints import resume, save_checkpoint
from slurm_guard.core.session import GuardCore, StepPlan

__all__ = ["GuardCore", "StepPlan", "resume", "save_checkpoint"]
