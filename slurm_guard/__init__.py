"""slurm-guard: catch silent data corruption inside PyTorch DDP training on Slurm.

The public names are imported lazily: the controller, the epilog and the CLI import this package
on every job end and must not pay for importing torch.

Modules that moved keep working under their old paths (`slurm_guard.records`,
`slurm_guard.launch`, ...): importing one warns (DeprecationWarning) and hands back the module at
its new path, so a user script that imported an old path keeps running and says what to change.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurm_guard.checks.replay import Microbatches, is_replaying
    from slurm_guard.comm.errors import (
        CollectiveError,
        CollectiveMismatch,
        RankFailed,
        RanksMissing,
    )
    from slurm_guard.config import ConfigError, GuardConfig
    from slurm_guard.data import resumable
    from slurm_guard.errors import EXIT_SDC, GuardError, SilentDataCorruption
    from slurm_guard.faults import Fault
    from slurm_guard.guard import Guard, exit_on_alarm
    from slurm_guard.rundir.records import Alarm
    from slurm_guard.sharded.guard import ShardedGuard
    from slurm_guard.slurm.task import init_distributed_from_slurm

_EXPORTS = {
    "CollectiveError": "slurm_guard.comm.errors",
    "CollectiveMismatch": "slurm_guard.comm.errors",
    "RankFailed": "slurm_guard.comm.errors",
    "RanksMissing": "slurm_guard.comm.errors",
    "EXIT_SDC": "slurm_guard.errors",
    "GuardError": "slurm_guard.errors",
    "SilentDataCorruption": "slurm_guard.errors",
    "ConfigError": "slurm_guard.config",
    "GuardConfig": "slurm_guard.config",
    "Fault": "slurm_guard.faults",
    "Guard": "slurm_guard.guard",
    "ShardedGuard": "slurm_guard.sharded.guard",
    "exit_on_alarm": "slurm_guard.guard",
    "Alarm": "slurm_guard.rundir.records",
    "Microbatches": "slurm_guard.checks.replay",
    "is_replaying": "slurm_guard.checks.replay",
    "init_distributed_from_slurm": "slurm_guard.slurm.task",
    "resumable": "slurm_guard.data",
}

MOVED_MODULES = {
    "slurm_guard.launch": "slurm_guard.slurm.launch",  # before the re-layout of 2026-11
    "slurm_guard.alarm_writer": "slurm_guard.rundir.alarms",
    "slurm_guard.checkpoint": "slurm_guard.rundir.checkpoint",
    "slurm_guard.collective": "slurm_guard.comm.collective",
    "slurm_guard.evidence": "slurm_guard.diagnose.evidence",
    "slurm_guard.fingerprint_fast": "slurm_guard.fingerprint.nh",
    "slurm_guard.hooks": "slurm_guard.checks.comm_hook",
    "slurm_guard.local_launch": "slurm_guard.local.launch",
    "slurm_guard.polling": "slurm_guard.slurm.polling",
    "slurm_guard.records": "slurm_guard.rundir.records",
    "slurm_guard.recovery": "slurm_guard.rundir.recovery",
    "slurm_guard.replay": "slurm_guard.checks.replay",
    "slurm_guard.restore": "slurm_guard.rundir.restore",
    "slurm_guard.run_identity": "slurm_guard.rundir.identity",
    "slurm_guard.run_lock": "slurm_guard.rundir.lock",
    "slurm_guard.run_start": "slurm_guard.rundir.start",
    "slurm_guard.setup_checks": "slurm_guard.core.setup",
    "slurm_guard.topology": "slurm_guard.comm.topology",
    "slurm_guard.triage": "slurm_guard.checks.triage",
    "slurm_guard.verdicts": "slurm_guard.checks.verdicts",
    "slurm_guard.verification": "slurm_guard.checks.verifier",
}
"""Old module path -> new one. `slurm_guard.fingerprint`, `faults`, `sharded` and `diagnose`
became packages under their old names and export what the old modules did."""


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an import of a moved module with the module at its new path, and warns."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there (the old path will be removed)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: types.ModuleType) -> None:
        """The module at the new path is already executed."""


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())

__all__ = [
    "EXIT_SDC",
    "MOVED_MODULES",
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
    "ShardedGuard",
    "SilentDataCorruption",
    "exit_on_alarm",
    "init_distributed_from_slurm",
    "is_replaying",
    "resumable",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slurm_guard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
