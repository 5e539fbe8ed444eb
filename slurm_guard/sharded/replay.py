"""Cross-replica-group replay: a whole shard group recomputes another replica group's step.

Under HSDP no rank can recompute a microbatch alone: the forward needs the full parameters,
which FSDP all-gathers within the shard group. So replica group A replays group B's step
together: rank (A, j) receives the batch and RNG state of rank (B, j') and the shard group runs
forward and backward on the received batches. The unreduced local gradient that reaches the
reduce-scatter depends only on the parameters and the batch, not on which rank computed it, so
rank (A, j)'s reduce-scatter input must reproduce rank (B, j')'s bit for bit.

The replay must not disturb training (what the research in docs/integrations/fsdp.md showed
on torch 2.13): with `set_requires_all_reduce(False)` FSDP reduce-scatters within the shard
group but writes no `.grad`, and `reset_iter_state()` on the root discards the partial result
it would otherwise add into the next real backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from slurm_guard.checks.replay import Captured, LossFn, preserved_state, replaying, set_rng
from slurm_guard.checks.rows import loss_bits
from slurm_guard.fingerprint.tree import as_int
from slurm_guard.sharded.hooks import ReduceScatterState


@dataclass(frozen=True)
class Mesh:
    """The 2-D layout as global ranks: `ranks[i][j]` is replica group i's shard rank j."""

    ranks: tuple[tuple[int, ...], ...]

    @property
    def replicas(self) -> int:
        return len(self.ranks)

    @property
    def shards(self) -> int:
        return len(self.ranks[0])

    def coordinate(self, rank: int) -> tuple[int, int]:
        for i, row in enumerate(self.ranks):
            if rank in row:
                return i, row.index(rank)
        raise ValueError(f"rank {rank} is not in the mesh")

    def pairs(self, replica_shift: int, shard_shift: int) -> list[tuple[int, int]]:
        """(owner, replayer) for every rank: the owner at (i, j) is replayed by the rank at
        (i - replica_shift, j - shard_shift), so each shard group replays one other group."""
        r, s = self.replicas, self.shards
        return [
            (self.ranks[i][j], self.ranks[(i - replica_shift) % r][(j - shard_shift) % s])
            for i in range(r)
            for j in range(s)
        ]

    def settling_shifts(self) -> tuple[int, int] | None:
        """A second round that gives every disputed microbatch a third opinion: another replica
        group where there is a third one, else another shard position of the same group."""
        if self.replicas >= 3:
            return 2, 0
        if self.shards >= 2:
            return 1, 1
        return None


@dataclass(frozen=True)
class ReplayValues:
    """What this rank's replay of someone's step produced, as the verdict row carries it."""

    owner: int = -1
    loss: int = 0
    grad: int = 0
    nonfinite: bool = False
    failed: bool = False


def replay_step(
    model: nn.Module,
    loss_fn: LossFn,
    captured: Captured,
    owner: int,
    state: ReduceScatterState,
    on_failure: Callable[[Exception], None],
) -> ReplayValues:
    """Forward and backward of `owner`'s step with this shard group, leaving training as it was.

    Every rank of the shard group must call it together (the forward all-gathers). An exception
    from the user's loss_fn is reported through `on_failure` and the row's failed slot; a shard
    peer already inside an all-gather is then left to the watchdog (see docs/integrations/fsdp.md).
    """
    assert isinstance(model, FSDPModule)
    model.set_requires_all_reduce(False)
    state.reset(fingerprint=True)
    try:
        with preserved_state(model), replaying():
            set_rng(captured.cpu_rng, captured.cuda_rng)
            loss = loss_fn(model, captured.batch)
            loss.backward()  # type: ignore[no-untyped-call]
        grad = as_int(state.input_fingerprint())
        nonfinite = bool(state.nonfinite(loss.device).item()) or not bool(
            torch.isfinite(loss.detach()).item()
        )
        return ReplayValues(owner, loss_bits(loss), grad, nonfinite)
    except Exception as exc:
        on_failure(exc)
        return ReplayValues(owner, failed=True)
    finally:
        model.reset_iter_state()  # drop the partial reduce output FSDP keeps for HSDP
        model.set_requires_all_reduce(True)
        state.reset(fingerprint=False)
