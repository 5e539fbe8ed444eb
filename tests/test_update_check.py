"""The update check's recomputation, in one process: what it rebuilds must be bit-identical to
the optimizer's own step (its launches across ranks: tests/test_sharded_layouts.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from slurm_guard.fingerprint.tree import Fingerprinter, as_int
from slurm_guard.sharded.snapshot_state import flatten, unflatten
from slurm_guard.sharded.update_check import implementation, recompute, unsupported, update_inputs
from slurm_guard.sharded.vote import local_state

CPU = torch.device("cpu")


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 2))
    model[3].weight.requires_grad_(False)  # a parameter without a gradient
    return model


def _backward(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    model.zero_grad(set_to_none=True)
    model(torch.randn(4, 6, generator=gen)).square().sum().backward()  # type: ignore[no-untyped-call]


OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = {
    "adamw": lambda g: torch.optim.AdamW(g, lr=1e-2),
    "adamw-foreach": lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=True),
    "adam-fused": lambda g: torch.optim.Adam(g, lr=1e-2, fused=True),
    "sgd-nesterov": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=0.1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_shadow_step_is_bit_identical_to_the_optimizers_own(name: str) -> None:
    """Two groups with their own hyperparameters, a parameter without a gradient and one the
    optimizer does not hold (model[0].bias); state from an earlier step; inputs through the
    same flat bytes the wire carries."""
    model = _model()
    groups = [
        {"params": [model[0].weight, model[2].weight, model[2].bias]},
        {"params": [model[3].weight, model[3].bias], "weight_decay": 0.5},
    ]
    optimizer = OPTIMIZERS[name](groups)
    fingerprinter = Fingerprinter(7)
    for step in range(3):
        _backward(model, step)
        layout, flat = flatten(update_inputs(model, optimizer), CPU)
        flat = flat.clone()  # what arrives: a copy, not the owner's tensors
        optimizer.step()
        own = as_int(fingerprinter.tensors(local_state(model, optimizer)))
        shadow = as_int(recompute(unflatten(layout, flat), type(optimizer), fingerprinter))
        assert shadow == own, (name, step)
    # and it is a check: a bit flipped in the owner's shard after the update is seen
    _backward(model, 9)
    layout, flat = flatten(update_inputs(model, optimizer), CPU)
    optimizer.step()
    with torch.no_grad():
        model[2].weight.view(-1)[3:4].view(torch.int32).bitwise_xor_(1 << 20)
    own = as_int(fingerprinter.tensors(local_state(model, optimizer)))
    assert as_int(recompute(unflatten(layout, flat.clone()), type(optimizer), fingerprinter)) != own


def test_the_implementation_is_the_one_the_optimizer_picks() -> None:
    """On CPU torch.optim's default is the single-tensor loop; an explicit choice is kept."""
    model = _model()
    _backward(model, 0)
    default = torch.optim.AdamW(model.parameters())
    assert implementation(default.param_groups[0]) == {"foreach": False, "fused": False}
    foreach = torch.optim.SGD(model.parameters(), foreach=True)
    assert implementation(foreach.param_groups[0]) == {"foreach": True, "fused": False}
    fused = torch.optim.Adam(model.parameters(), fused=True)
    assert implementation(fused.param_groups[0]) == {"foreach": False, "fused": True}


class Custom(torch.optim.SGD):
    """Not torch.optim's own: its step may do anything."""


def test_what_cannot_be_recomputed_is_named() -> None:
    params = list(_model().parameters())
    assert unsupported(torch.optim.AdamW(params)) is None
    said = unsupported(torch.optim.LBFGS(params))
    assert said is not None and "LBFGS" in said
    said = unsupported(Custom(params, lr=0.1))
    assert said is not None and "Custom" in said
    hooked = torch.optim.SGD(params, lr=0.1)
    hooked.register_step_post_hook(lambda *_: None)
    said = unsupported(hooked)
    assert said is not None and "step hooks" in said
    scheduled = torch.optim.SGD(params, lr=0.1)
    scheduled.param_groups[0]["scale"] = lambda x: x
    said = unsupported(scheduled)
    assert said is not None and "param_groups[0]['scale'] is a function" in said
