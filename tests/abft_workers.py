"""Checked GEMMs under FSDP2 on gloo (spawned processes import this module)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slurm_guard.abft import PASSES, attach


class Conv1D(nn.Module):
    """The addmm layer of HuggingFace GPT-2 (transformers.pytorch_utils.Conv1D), same semantics,
    so the Conv1D path is tested even where transformers is not installed."""

    def __init__(self, nf: int, nx: int, bias: bool = True) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.view(-1, x.size(-1))
        out = x2 @ self.weight if self.bias is None else torch.addmm(self.bias, x2, self.weight)
        return out.view(*x.shape[:-1], self.nf)


def two_layers(kind: str, k: int, p: int, bias: bool) -> nn.Module:
    """Two checkable layers (nn.Linear or Conv1D, k -> p -> 9), a tanh between, seeded by shape."""
    torch.manual_seed(k * 1000 + p)
    if kind == "linear":
        return nn.Sequential(nn.Linear(k, p, bias=bias), nn.Tanh(), nn.Linear(p, 9, bias=bias))
    return nn.Sequential(Conv1D(p, k, bias=bias), nn.Tanh(), Conv1D(9, p, bias=bias))


# (kind, tokens, in, out, bias, block): ragged and even shapes for both layer kinds
LAYER_SHAPES = [
    ("linear", 64, 32, 48, True, 32),
    ("linear", 70, 33, 47, False, 32),
    ("linear", 5, 7, 3, True, 32),
    ("linear", 45, 40, 70, True, 8),
    ("conv1d", 64, 32, 48, True, 32),
    ("conv1d", 70, 33, 47, False, 32),
    ("conv1d", 45, 40, 70, True, 8),
    ("conv1d", 300, 128, 96, True, 32),
]


def one_step_ratios(
    model: nn.Module, x: torch.Tensor, block: int, fault: tuple[int, float] | None = None
) -> tuple[list[list[float]], list[Any]]:
    """(worst ratio per layer and pass, every check's result) of one forward and backward with
    fresh checks; fault = (element, error) added to layer 0's product of every pass."""
    handle = attach(model, block=block)
    if fault is not None:
        for which in PASSES:
            handle.inject(0, which, lambda t: t.view(-1)[fault[0] % t.numel()].add_(fault[1]))
    model(x.clone().requires_grad_()).sin().sum().backward()  # type: ignore[no-untyped-call]
    results = [r for s in handle.sites for _, r in s.results]
    worst = handle.collect()
    handle.detach()
    model.zero_grad(set_to_none=True)
    assert worst is not None
    return worst.tolist(), results


def zero_blocks_pass_and_non_finite_products_fail(kind: str) -> list[type]:
    """A zero block has a zero residual and, without bias, a zero rounding bound: 0 / 0 must not
    become a false alarm; a NaN or Inf in any product must fail its check. Returns the types of
    the clean step's results (which path ran)."""
    model = two_layers(kind, 16, 24, False)
    x = torch.randn(96, 16)
    x[32:64] = 0  # one whole zero block in the forward
    x = x.requires_grad_()
    handle = attach(model)
    y = model(x)
    mask = torch.ones_like(y)
    mask[:32] = 0  # zero gradient rows: a whole zero block in the backward
    (y * mask).sum().backward()  # type: ignore[no-untyped-call]
    kinds = [type(r) for s in handle.sites for _, r in s.results]
    assert handle.findings(handle.collect()) == []
    for bad in (float("nan"), float("inf")):
        for which in PASSES:
            handle.inject(1, which, lambda t, v=bad: t.view(-1)[3].fill_(v))
        model(x).sum().backward()  # type: ignore[no-untyped-call]
        findings = handle.findings(handle.collect())
        # layer 2's three products fail; the NaN/Inf also reaches layer 0's gradients
        assert {("2", w) for w in PASSES} <= {(f.layer, f.gemm_pass) for f in findings}
        assert all(math.isinf(f.ratio) for f in findings), findings
        handle.sites[1].injectors.clear()
    handle.detach()
    return kinds


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
