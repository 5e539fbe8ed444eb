"""The sharded variant of the example job: the tiny Llama under HSDP, for the sharded drill.

`python -m slurm_guard.examples.train --sharded` (or `TrainSettings(sharded=True)`) trains the
torchtitan-shaped model of `examples.tiny_llama` on a 2-D mesh of 2 replica groups x world/2
shards under `ShardedGuard`; the loop, the events, the checkpoints and `result.json` are the
DDP job's (`examples.train`). Two replica groups are the least that lets one shard group
recompute another's step, and what a 4-rank drill can afford.

The only thing that differs in `result.json` is the weight hash: each rank holds different
shards, so each hashes its own and the hashes are gathered in rank order and hashed again. Two
runs on the same mesh are then equal iff every shard is bit-identical.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from slurm_guard.config import GuardConfig
from slurm_guard.errors import GuardError
from slurm_guard.examples.tiny_llama import (
    LlamaConfig,
    TinyLlama,
    next_token_loss,
    shard_model,
    shard_model_tp,
)
from slurm_guard.sharded.guard import ShardedGuard

SHARDED_MODEL = LlamaConfig(vocab=32, dim=16, heads=2, hidden=32, layers=1)
"""Small enough for four ranks on two CPU cores in seconds; still embedding, a block, a head."""

TOKENS = 9  # tokens per sequence: 8 predicted from the ones before


@dataclass(frozen=True)
class ShardedJob:
    """The guard, and the data that each (step, rank) trains on, which a resume reproduces."""

    guard: ShardedGuard
    seed: int
    batch_size: int
    device: torch.device
    tp: int = 1  # tensor-parallel degree: a TP group trains on its data-parallel index's batch

    def batch(self, step: int, rank: int) -> torch.Tensor:
        index = rank // self.tp
        gen = torch.Generator().manual_seed(1_000_003 * self.seed + 1000 * step + index)
        tokens = torch.randint(0, SHARDED_MODEL.vocab, (self.batch_size, TOKENS), generator=gen)
        return tokens.to(self.device)


def build_sharded_job(
    run_dir: Path,
    config: GuardConfig,
    *,
    seed: int,
    lr: float,
    batch_size: int,
    device: torch.device,
    tp: int = 1,
) -> ShardedJob:
    """Mesh, model, optimizer and guard on an initialized process group (collective).

    `tp` > 1: FSDP2 + TP instead of HSDP, torchtitan's way: the TP plan on `mesh["tp"]`
    (consecutive ranks, so a TP group shares a node), `fully_shard` over `mesh["dp"]`.
    """
    world = dist.get_world_size()
    if tp > 1:
        if world % tp or world // tp < 2:
            raise GuardError(f"FSDP2 + TP {tp} needs a multiple of {tp} ranks, >= {2 * tp}")
        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(seed)
        model = shard_model_tp(TinyLlama(SHARDED_MODEL).to(device), mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        guard = ShardedGuard(model, optimizer, next_token_loss, run_dir, config)
        return ShardedJob(guard, seed, batch_size, device, tp)
    if world < 4 or world % 2:
        raise GuardError(
            f"the sharded example runs HSDP as 2 replica groups x world/2 shards: it needs an "
            f"even number of ranks >= 4, not {world}"
        )
    mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(seed)
    model = shard_model(TinyLlama(SHARDED_MODEL).to(device), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    guard = ShardedGuard(model, optimizer, next_token_loss, run_dir, config)
    return ShardedJob(guard, seed, batch_size, device)


def gathered_sha256(local_hex: str, device: torch.device) -> str:
    """sha256 over every rank's sha256 in rank order, the same on every rank (collective).

    Through a uint8 tensor, not an object collective: those need numpy to unpickle.
    """
    mine = torch.tensor(list(bytes.fromhex(local_hex)), dtype=torch.uint8, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    digest = hashlib.sha256()
    for row in rows:
        digest.update(bytes(row.cpu().tolist()))
    return digest.hexdigest()
