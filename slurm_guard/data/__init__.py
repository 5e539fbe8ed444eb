"""The data side of a guarded loop: `resumable`, the epoch loop that a resume can re-enter."""

from __future__ import annotations

from slurm_guard.data.resumable import resumable

__all__ = ["resumable"]
