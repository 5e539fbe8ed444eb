"""One line per event, from rank 0: the run's start and its resume, as the user sees them.

A training script used to print "Resuming training from snapshot at Epoch N"; once ported it
said nothing, and a user could not tell a resumed run from a fresh one. The guard's own events
are said once, by rank 0 (every rank knows the same thing), on stderr as `slurm-guard: ...`
when the script configured no logging (Python would drop an INFO line), else through the
`slurm_guard.events` logger at INFO, so a script's own logging decides where it goes.
"""

from __future__ import annotations

import logging
import sys

from slurm_guard.config import GuardConfig

logger = logging.getLogger("slurm_guard.events")


def announce(message: str) -> None:
    """Say one event line (the caller is rank 0)."""
    if not logging.getLogger().handlers and not logger.handlers:
        print(f"slurm-guard: {message}", file=sys.stderr, flush=True)
    else:
        logger.info("%s", message)


def checks_line(config: GuardConfig, world_size: int, nodes: int) -> str:
    """The checks and their cadence in one clause."""
    if config.schedule == "random":
        replay = f"replay on 1 step in {config.replay_every} (random)"
    else:
        replay = f"replay every {config.replay_every} steps"
    parts = ["finite + all-reduce checks every step"]
    if world_size > 1:
        parts += [replay, f"weight vote every {config.vote_every} steps and before every save"]
    if config.abft:
        parts.append("checked GEMMs every step")
    if config.snapshots:
        parts.append("node-local snapshots at each passing vote")
    return f"{world_size} ranks on {nodes} nodes; " + ", ".join(parts)
