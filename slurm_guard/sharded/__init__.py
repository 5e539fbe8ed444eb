"""Checks for sharded data parallelism (FSDP2 `fully_shard`, HSDP on a 2-D device mesh).

Under sharding no rank holds a full replica, so the DDP guard's vote does not apply as such:
`replica_vote` compares each shard with the same shard on the other replica groups.
"""

from __future__ import annotations

from slurm_guard.sharded.vote import local_grads_finite, local_state, replica_vote

__all__ = ["local_grads_finite", "local_state", "replica_vote"]
