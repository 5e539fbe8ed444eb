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


def checks_line(
    config: GuardConfig,
    world_size: int,
    nodes: int,
    *,
    layout: str = "",
    dp_indices: int | None = None,
    replicas: int | None = None,
    update_check: bool = False,
) -> str:
    """The checks and their cadence in one clause.

    Without `layout`, the DDP guard's: every rank holds a replica, so with two or more ranks
    every check runs. A sharded layout (`layout` names it: "FSDP2 2 x TP 2") runs what it
    allows, and the line must not promise more: a replay needs 2 or more data-parallel indices
    (`dp_indices`), a vote a copy of each shard in another replica group (`replicas` >= 2),
    and the per-step reduction check is the reduce-scatter's conservation. `update_check`:
    the update check runs there instead of a vote (`sharded.update_check`).
    """
    sharded = bool(layout)
    dp = world_size if dp_indices is None else dp_indices
    copies = world_size if replicas is None else replicas
    if config.schedule == "random":
        replay = f"replay on 1 step in {config.replay_every} (random)"
    else:
        replay = f"replay every {config.replay_every} steps"
    reduction = "reduce-scatter conservation" if sharded else "all-reduce"
    if config.finite_check:
        parts = [f"finite + {reduction} checks every step"]
    else:  # the switch turns off both, in either guard
        parts = [f"no finite or {reduction} check (finite_check=False)"]
    if dp > 1:
        parts.append(replay)
    vote = "shard vote between replica groups" if sharded else "weight vote"
    if copies > 1:
        parts.append(f"{vote} every {config.vote_every} steps and before every save")
    elif sharded:
        parts.append("no vote (no replica group holds a second copy of a shard)")
        if update_check:
            parts.append(
                f"optimizer update recomputed on another node every {config.vote_every} steps"
            )
        elif dp > 1 and not config.update_check:
            parts.append("optimizer update unchecked (update_check=False)")
    if config.abft:
        parts.append("checked GEMMs every step")
    if config.snapshots:
        after = "vote" if copies > 1 or not sharded else "replay"
        parts.append(f"node-local snapshots at each passing {after}")
    where = f"{world_size} ranks on {nodes} nodes" + (f" ({layout})" if sharded else "")
    return f"{where}; " + ", ".join(parts)
