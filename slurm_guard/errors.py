"""The guard's exceptions (the exit code lives in `protocol`; re-exported here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slurm_guard.protocol import EXIT_SDC

if TYPE_CHECKING:
    from slurm_guard.rundir.records import Alarm


__all__ = ["EXIT_SDC", "GuardError", "SilentDataCorruption"]


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
