"""The run directory on the shared filesystem: the job side's records and the admin side's input.

This package is imported on both sides, and the controller must not import torch, so this
`__init__` exports only the torch-free parts: the layout and its readers (`layout`), the atomic
records (`records`) and the trust rule (`trust`). The job-side modules that need torch are
imported by their own path: `start` (opening a run), `lock`, `identity`, `alarms` (writing an
alarm), `checkpoint` (sealed checkpoint files), `recovery` (the resume plan) and `restore` (the
collective resume).
"""

from __future__ import annotations

from slurm_guard.rundir.layout import RunDir, RunDirError, fresh_start_requested
from slurm_guard.rundir.records import (
    Alarm,
    LedgerEntry,
    RecordError,
    atomic_write_json,
    read_alarm,
    read_json_file,
    read_ledger,
)
from slurm_guard.rundir.trust import CheckpointMeta, choose_trusted_checkpoint, trust_limit

__all__ = [
    "Alarm",
    "CheckpointMeta",
    "LedgerEntry",
    "RecordError",
    "RunDir",
    "RunDirError",
    "atomic_write_json",
    "choose_trusted_checkpoint",
    "fresh_start_requested",
    "read_alarm",
    "read_json_file",
    "read_ledger",
    "trust_limit",
]
