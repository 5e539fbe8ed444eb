"""A guarded loop as a user writes one for `slurm-guard local` (no Slurm job id, every start
restart count 0), recording its loss for the report (test_status_report_agree.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import slurm_guard as sg
from slurm_guard.examples.tiny_gpt import TinyGPT, TinyGPTConfig, lm_loss, make_batch
from slurm_guard.report import record_loss

SMALL = TinyGPTConfig(vocab=32, context=8, width=16, heads=2, layers=1, dropout=0.0)


def train_recording_loss(run_dir: str, steps: int) -> dict[str, Any]:
    """Replays and votes every 5 steps, a checkpoint every 5; faults from SLURM_GUARD_INJECT."""
    torch.manual_seed(0)
    ddp = DDP(TinyGPT(SMALL))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    config = sg.GuardConfig(replay_every=5, vote_every=5)
    guard = sg.Guard(ddp, opt, lm_loss, run_dir, config=config)
    start = guard.resume()
    rank = dist.get_rank()
    try:
        for step in range(start, steps):
            loss = guard.step(make_batch(step, rank, SMALL))
            if rank == 0:
                record_loss(run_dir, step + 1, loss)
            if (step + 1) % 5 == 0:
                guard.save_checkpoint()
    except sg.SilentDataCorruption as exc:
        return {"start": start, "alarm": exc.alarm.to_json()}
    return {"start": start, "alarm": None}
