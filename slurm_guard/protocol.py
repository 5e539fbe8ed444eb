"""What the training job and the admin side agree on, defined once.

The job writes records and exits with a code; the controller, the epilog and the CLI read them
back, often from another installation of slurm-guard on another host. Every constant both sides
must share lives here, so neither side imports the other to learn it. Standard library only: the
controller imports this on every job end and must not pay for torch.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

EXIT_SDC = 86
"""The exit code of a rank stopped by the guard (`exit_on_alarm`).

Chosen outside the range Python, the shell and Slurm use themselves (1, 2, 126-165), so that
"stopped by slurm-guard" can never be confused with an ordinary crash or a signal.
"""

COMMENT_KEY = "slurm-guard:run_dir="
"""Prefix of the job comment that names a guarded job's run directory."""

REASON_PREFIX = "slurm-guard:"
"""Every drain reason the controller writes starts with this; it never touches other reasons."""

DEFAULT_STATE_DIR = Path("/var/lib/slurm-guard")
"""Where the controller keeps its journal, policy and locks unless told otherwise."""

ALARM_SCHEMA = 1
LEDGER_SCHEMA = 1
CHECKPOINT_SCHEMA = 1
RUN_SCHEMA = 1
SNAPSHOT_SCHEMA = 2  # 2: the vote's fingerprint, weights.pt proven by it (not hashed)
RESUME_SCHEMA = 1
FAULT_EFFECTS_SCHEMA = 1
"""Record schema versions. A reader refuses a record newer than it understands."""


class Verdict(str, Enum):
    """What a failed check means; the values are the strings alarm records carry."""

    SDC = "sdc"  # hardware: a strict majority or a replay names the faulty rank or node
    AMBIGUOUS = "ambiguous"  # something is wrong, but nothing can say where (or no replay ran)
    NUMERICAL = "numerical"  # reproduced on another node: the data or the model, not hardware

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Check(str, Enum):
    """The checks that can raise an alarm; the values are the strings alarm records carry."""

    FINITE_LOCAL = "finite_local"
    FINITE_REDUCED = "finite_reduced"
    REPLAY = "replay"
    VOTE = "vote"
    UPDATE = "update"  # a shard's optimizer step recomputed on another node (FSDP2, no replica)
    CONSERVATION = "conservation"
    REDUCED_CONSISTENCY = "reduced_consistency"
    ABFT = "abft"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
