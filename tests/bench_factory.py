"""A user's model for `benchmarks/step_overhead.py --model bench_factory:factory`
(test_benchmarks_import.py): what `factory()` must return, at the smallest size."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def factory() -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    """(unwrapped model, its optimizer, loss_fn(model, batch), make_batch(step, rank))."""
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def make_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step * 100 + rank)
        return torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)

    return model, optimizer, loss_fn, make_batch
