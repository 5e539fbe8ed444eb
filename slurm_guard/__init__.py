"""slurm-guard: catch silent data corruption inside PyTorch DDP training on Slurm.

The public names are imported lazily: the controller, the epilog and the CLI import this package
on every job end and must not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurm_guard.collective import CollectiveError, CollectiveMismatch, RankFailed, RanksMissing
    from slurm_guard.config import ConfigError, GuardConfig
    from slurm_guard.errors import EXIT_SDC, GuardError, SilentDataCorruption
    from slurm_guard.faults import Fault
    from slurm_guard.guard import Guard, exit_on_alarm
    from slurm_guard.records import Alarm
    from slurm_guard.replay import Microbatches, is_replaying

_EXPORTS = {
    "CollectiveError": "slurm_guard.collective",
    "CollectiveMismatch": "slurm_guard.collective",
    "RankFailed": "slurm_guard.collective",
    "RanksMissing": "slurm_guard.collective",
    "EXIT_SDC": "slurm_guard.errors",
    "GuardError": "slurm_guard.errors",
    "SilentDataCorruption": "slurm_guard.errors",
    "ConfigError": "slurm_guard.config",
    "GuardConfig": "slurm_guard.config",
    "Fault": "slurm_guard.faults",
    "Guard": "slurm_guard.guard",
    "exit_on_alarm": "slurm_guard.guard",
    "Alarm": "slurm_guard.records",
    "Microbatches": "slurm_guard.replay",
    "is_replaying": "slurm_guard.replay",
}

__all__ = [
    "EXIT_SDC",
    "Alarm",
    "CollectiveError",
    "CollectiveMismatch",
    "ConfigError",
    "Fault",
    "Guard",
    "GuardConfig",
    "GuardError",
    "Microbatches",
    "RankFailed",
    "RanksMissing",
    "SilentDataCorruption",
    "exit_on_alarm",
    "is_replaying",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slurm_guard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
