"""Software fault injection: the faults the guard's checks must catch, on demand.

Part of the product, not only of the tests: drills and campaigns inject a wrong gradient, a bit
flip or a NaN on one node (`SLURM_GUARD_INJECT` or `GuardConfig(faults=...)`) and show that the
guard names that node. Every injected fault is logged at start and marked in the alarm it causes.
"""

from __future__ import annotations

from slurm_guard.faults.injection import (
    BACKWARD_KINDS,
    ENV_VAR,
    KINDS,
    Fault,
    FaultInjector,
    faults_from_env,
    parse_faults,
)

__all__ = [
    "BACKWARD_KINDS",
    "ENV_VAR",
    "KINDS",
    "Fault",
    "FaultInjector",
    "faults_from_env",
    "parse_faults",
]
