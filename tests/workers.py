"""Training functions that tests run on real gloo processes (importable: processes are spawned)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import slurm_guard as sg
from slurm_guard.examples.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss, make_batch


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train_tiny_gpt(
    run_dir: str,
    steps: int,
    config: sg.GuardConfig | None = None,
    checkpoint_every: int = 0,
    cfg: TinyGPTConfig | None = None,
) -> dict[str, Any]:
    """Guarded training; on an alarm, report weights before and after the alarm step."""
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    guard = sg.Guard(ddp, opt, lm_loss, run_dir, config=config)
    start = guard.resume()
    rank = dist.get_rank()
    losses = []
    before: list[torch.Tensor] = []
    try:
        for step in range(start, steps):
            before = weights(model)
            losses.append(guard.step(make_batch(step, rank, cfg)))
            if checkpoint_every and (step + 1) % checkpoint_every == 0:
                guard.save_checkpoint()
    except sg.SilentDataCorruption as exc:
        return {
            "alarm": exc.alarm.to_json(),
            "before": before,
            "after": weights(model),
            "start": start,
            "losses": losses,
        }
    return {"alarm": None, "final": weights(model), "start": start, "losses": losses}
