"""The guard's loop-independent core, shared by every entry point.

`GuardCore` sets the guard up on a DDP model and runs the checks of one step in three calls
(`begin_step`, `finish_step`, `apply_update`), and for a loop it does not own as public calls
(`calls`: `capture` before each microbatch's forward, `check` after the last backward,
`update` or `after_update` after it); `checkpoints` saves a verified checkpoint and
resumes from the trusted one. `slurm_guard.Guard` is the core plus a loop of one step.
"""

from __future__ import annotations

from slurm_guard.core.calls import Checked, StepPlan
from slurm_guard.core.checkpoints import resume, save_checkpoint
from slurm_guard.core.session import GuardCore

__all__ = ["Checked", "GuardCore", "StepPlan", "resume", "save_checkpoint"]
