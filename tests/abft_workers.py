"""Checked GEMMs under FSDP2 on gloo (spawned processes import this module)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slurm_guard.abft import attach


def fsdp_run(
    replicas: int, shards: int, fault_rank: int, fault_step: int, steps: int = 4
) -> dict[str, Any]:
    """Train a small model sharded with fully_shard (HSDP mesh, as tests/sharded_workers.py),
    checks attached; on `fault_rank` one weight-gradient element of layer 1 is 10x too large at
    `fault_step`. Returns the failed checks seen per step on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
    )
    handle = attach(model)
    rank = dist.get_rank()
    step_now = [-1]

    def corrupt(out: torch.Tensor) -> None:
        if rank == fault_rank and step_now[0] == fault_step:
            out.view(-1)[3] *= 10.0

    handle.inject(2, "grad_w", corrupt)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    failures = []
    worst = []
    for step in range(steps):
        step_now[0] = step
        gen = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(48, 8, generator=gen)
        opt.zero_grad(set_to_none=True)
        for micro in x.chunk(2):  # gradient accumulation over two microbatches
            model(micro).pow(2).mean().backward()
        result = handle.collect()
        failures.append([(f.layer, f.gemm_pass) for f in handle.findings(result)])
        worst.append(float(result.max()) if result is not None else -1.0)
        opt.step()
    return {"failures": failures, "worst": worst, "names": handle.names}
