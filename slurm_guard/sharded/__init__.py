"""The guard for sharded data parallelism (FSDP2 `fully_shard`, HSDP on a 2-D device mesh).

`ShardedGuard` (in `guard`) has the Guard's interface; its parts each do one job: `hooks` (the
checked reduce-scatter), `replay` (a shard group recomputes another replica group's step),
`verdict` (the row and the pure decisions), `verifier` (the collective rounds), `vote` (the
shard-by-shard state fingerprints) and `checkpoint` (sealed DCP checkpoints). The guard itself
is imported lazily (`slurm_guard.ShardedGuard`), so the vote does not pull in FSDP.
"""

from __future__ import annotations

# First: a torch without FSDP2 is refused here by name (fsdp_api), before any other import.
from slurm_guard.sharded import fsdp_api  # noqa: F401  # isort: skip
from slurm_guard.sharded.vote import local_grads_finite, local_state, replica_vote

__all__ = ["local_grads_finite", "local_state", "replica_vote"]
