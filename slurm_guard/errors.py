"""The guard's exceptions and its process exit code."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slurm_guard.records import Alarm

EXIT_SDC = 86
"""Exit status of a rank stopped by the guard. The sbatch template and the controller read it.

Chosen outside the range Python, the shell and Slurm use themselves (1, 2, 126-165), so that
"stopped by slurm-guard" can never be confused with an ordinary crash or a signal.
"""


class GuardError(RuntimeError):
    """The guard cannot run as configured (bad model, bad run directory, bad config)."""


class SilentDataCorruption(RuntimeError):
    """Raised on every rank when a check fails, after the alarm record is on disk.

    The suspect update was not applied (unless `alarm.update_applied` says otherwise: a weight
    vote judges an update after the fact; rolling back to the trusted checkpoint undoes it).
    """

    def __init__(self, alarm: Alarm) -> None:
        super().__init__(alarm.message)
        self.alarm = alarm
