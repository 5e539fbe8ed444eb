"""HSDP training on gloo for the sharded checks (spawned processes import this module)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slurm_guard.fingerprint.tree import Fingerprinter
from slurm_guard.sharded.vote import local_grads_finite, replica_vote


def hsdp_run(replicas: int, shards: int, corrupt_rank: int, steps: int = 4) -> dict[str, Any]:
    """Train a small model under HSDP; on `corrupt_rank` flip a weight shard after step 2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fingerprinter = Fingerprinter(seed=99)
    group = mesh.get_group("replicate")
    rank = dist.get_rank()
    findings = []
    finite = []
    replica_index = mesh.get_local_rank("replicate")
    for step in range(steps):
        gen = torch.Generator().manual_seed(step * 100 + replica_index)
        x = torch.randn(4, 8, generator=gen)
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        finite.append(local_grads_finite(model))
        opt.step()
        if step == 2 and rank == corrupt_rank:
            with torch.no_grad():
                next(model.parameters()).to_local().view(-1)[0] += 1e-3
        finding = replica_vote(model, opt, group, fingerprinter)
        findings.append(None if finding is None else (finding.verdict, finding.suspect_ranks))
    return {"findings": findings, "finite": finite}
