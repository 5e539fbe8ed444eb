"""slurm-guard: catch silent data corruption inside PyTorch DDP training on Slurm."""

from slurm_guard.config import ConfigError, GuardConfig
from slurm_guard.errors import EXIT_SDC, GuardError, SilentDataCorruption
from slurm_guard.faults import Fault
from slurm_guard.guard import Guard, exit_on_alarm
from slurm_guard.records import Alarm

__all__ = [
    "EXIT_SDC",
    "Alarm",
    "ConfigError",
    "Fault",
    "Guard",
    "GuardConfig",
    "GuardError",
    "SilentDataCorruption",
    "exit_on_alarm",
]
