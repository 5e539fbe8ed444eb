"""Checked GEMMs on tensor-parallel shards, on gloo (spawned processes import this module).

The model is laid out as torchtitan lays out its Llama: `parallelize_module` with a sequence-
parallel norm, colwise projections (with and without bias), rowwise ones back, a colwise head
fed from the sequence-sharded stream, then `fully_shard` over the data-parallel mesh dimension.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slurm_guard.abft import attach
from slurm_guard.faults.injection import FaultInjector, parse_faults

DIM, HIDDEN, VOCAB = 16, 32, 24


class Mlp(nn.Module):
    """Norm, a colwise/rowwise pair with bias, one without, a head: six checked GEMMs."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.gate = nn.Linear(DIM, HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, DIM, bias=False)
        self.head_norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = x + self.down(torch.nn.functional.gelu(self.up(h)))
        h = h + self.proj(torch.tanh(self.gate(h)))
        out: torch.Tensor = self.head(self.head_norm(h))
        return out


def tp_mlp(mesh: Any) -> nn.Module:
    """The model on a ("dp", "tp") mesh: torchtitan's TP plan, then fully_shard over dp."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = Mlp()
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "gate": ColwiseParallel(input_layouts=Shard(1)),
        "proj": RowwiseParallel(output_layouts=Shard(1)),
        "head_norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(model, mesh["tp"], plan)
    if mesh["dp"].size() > 1:
        fully_shard(model, mesh=mesh["dp"])
    return model


def train(mesh: Any, checked: bool, faults: str, steps: int) -> dict[str, Any]:
    """`steps` AdamW steps of the TP (+FSDP) model; checks attached when `checked`, faults
    (SLURM_GUARD_INJECT syntax) injected through the project's FaultInjector. Returns the
    losses, the rank's final local shards and the failed checks per step."""
    model = tp_mlp(mesh)
    handle = attach(model) if checked else None
    injector = None
    if faults:
        node = os.environ.get("SLURMD_NODENAME", "")
        injector = FaultInjector(parse_faults(faults), dist.get_rank(), node, model)
    tp = mesh["tp"].size()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_index = mesh.get_local_rank("dp")
    losses, failures, worst = [], [], []
    for step in range(steps):
        if injector is not None:
            injector.step = step
        gen = torch.Generator().manual_seed(100 * step + dp_index)  # one batch per TP group
        x = torch.randn(2, 8, DIM, generator=gen)  # the residual stream is sequence-sharded:
        x = x.chunk(tp, dim=1)[mesh.get_local_rank("tp")]  # this rank's positions
        target = torch.randn(2, 8, VOCAB, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = (model(x) - target).pow(2).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        losses.append(loss.detach())
        if handle is not None:
            result = handle.collect()
            failures.append([(f.layer, f.gemm_pass) for f in handle.findings(result)])
            worst.append(-1.0 if result is None else float(result.max()))
        opt.step()
    shards = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "shards": shards, "failures": failures, "worst": worst}


def unchecked_checked_faulty(dp: int, tp: int, faults: str, steps: int = 3) -> dict[str, Any]:
    """Three trainings in one launch (spawning ranks is the slow part on CI's two cores): no
    checks, checks on a clean run, checks with `faults` injected."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    return {
        "unchecked": train(mesh, False, "", steps),
        "checked": train(mesh, True, "", steps),
        "faulty": train(mesh, True, faults, steps),
    }


def _error(fn: Any) -> str:
    """The class and message of what `fn()` raised ('' when it returned)."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def refusals() -> dict[str, Any]:
    """What is refused by name on a 1-D TP mesh: a Partial weight at attach, a product DTensor
    had to redistribute at its first checked forward, and a DTensor at every kernel entry."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from slurm_guard.kernels import abft_native, abft_triton, sketch

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    out: dict[str, Any] = {}

    partial = nn.Linear(4, 4, bias=False)
    partial.weight = nn.Parameter(DTensor.from_local(partial.weight.detach(), mesh, [Partial()]))
    out["attach"] = _error(lambda: attach(nn.Sequential(partial)))

    # a rowwise weight (Shard(1)) fed a replicated input: DTensor shards the input itself
    rowwise = nn.Linear(8, 4, bias=False)
    rowwise.weight = nn.Parameter(distribute_tensor(rowwise.weight.detach(), mesh, [Shard(1)]))
    attach(rowwise)
    x = DTensor.from_local(torch.randn(3, 8), mesh, [Replicate()])
    out["forward"] = _error(lambda: rowwise(x))

    d = distribute_tensor(torch.randn(64, 8), mesh, [Shard(0)])
    sign = torch.ones(64)
    out["kernels"] = [
        _error(lambda: abft_native.stats(abft_native.native(), d, 32, sign, None)),  # type: ignore[arg-type]
        _error(lambda: abft_native.weight_norms(abft_native.native(), d)),  # type: ignore[arg-type]
        _error(lambda: abft_triton.stats(d, 32, sign, None)),
        _error(lambda: abft_triton.weight_norms(d)),
        _error(lambda: sketch.native_check(sketch.native(), d, (1, 2))),  # type: ignore[arg-type]
    ]
    return out
