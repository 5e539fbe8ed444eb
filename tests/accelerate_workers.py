"""A loop written with HF Accelerate, guarded with capture/check (docs/integrations/hf.md), for
tests/test_integration_accelerate.py; run on real gloo processes (spawned).

Accelerate's own `accumulate()` decides which microbatches synchronise; the guard is called
once per optimizer step, after the backward for which `accelerator.sync_gradients` is True.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from workers import SMALL, weights

import slurm_guard as sg
from slurm_guard.examples.tiny_gpt import TinyGPT, lm_loss

ACCUMULATION = 2


def _batches(rank: int, steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(50 + rank)
    out = []
    for _ in range(steps * ACCUMULATION):
        start = torch.randint(0, SMALL.vocab, (4, 1), generator=g)
        seq = (start + 3 * torch.arange(SMALL.context + 1) + rank) % SMALL.vocab
        out.append({"tokens": seq[:, :-1], "targets": seq[:, 1:]})
    return out


def accelerate_loop(
    run_dir: str,
    steps: int,
    faults: tuple[sg.Fault, ...] = (),
    guarded: bool = True,
    undivided: bool = False,
) -> dict[str, Any]:
    """The loop of docs/integrations/hf.md "Accelerate, in a loop you write". `undivided`: the
    mistake of handing the guard the loss function as it is, not divided as
    `accelerator.backward` divides it."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    model = TinyGPT(SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    rank = dist.get_rank()

    def backpropagated(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """What accelerator.backward() backpropagates, and so what a replay must recompute."""
        return lm_loss(model, mb) / accelerator.gradient_accumulation_steps

    config = sg.GuardConfig(replay_every=2, schedule="fixed", faults=faults, max_grad_norm=0.5)
    loss_fn = lm_loss if undivided else backpropagated
    guard = sg.Guard(model, opt.optimizer, loss_fn, run_dir, config=config) if guarded else None
    torch.manual_seed(100 + rank)
    out: dict[str, Any] = {"alarm": None, "losses": [], "optimizer_steps": 0}
    losses: list[torch.Tensor] = []
    try:
        for mb in _batches(rank, steps):
            with accelerator.accumulate(model):
                if guard is not None:
                    guard.capture(mb)  # 1: before the forward
                loss = lm_loss(model, mb)
                accelerator.backward(loss)  # divides by gradient_accumulation_steps
                divided = loss.detach() / accelerator.gradient_accumulation_steps
                losses.append(loss.detach() if undivided else divided)
                if accelerator.sync_gradients:
                    if guard is None:
                        accelerator.clip_grad_norm_(model.parameters(), 0.5)
                        apply = True
                    else:
                        apply = guard.check(losses).apply  # 2: raises on an alarm; clips
                    if apply:
                        opt.step()
                        out["optimizer_steps"] += 1
                    opt.zero_grad(set_to_none=True)
                    if guard is not None:
                        guard.after_update()  # 3: the vote when due, the step count
                    out["losses"].append(float(sum(losses)))
                    losses = []
    except sg.SilentDataCorruption as exc:
        out["alarm"] = exc.alarm.to_json()
    out["final"] = weights(accelerator.unwrap_model(model))
    return out
