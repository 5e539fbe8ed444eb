"""Training functions for tests/test_triage.py (importable: the processes are spawned)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from workers import SMALL

import slurm_guard as sg
from slurm_guard.examples.tiny_gpt import TinyGPT, lm_loss, make_batch

FAULTY = 1
ALARM_STEP = 10


def triage_raises(run_dir: str) -> dict[str, Any] | None:
    """A persistent fault on rank 1, whose loss_fn raises on its second replay at the alarm step:
    the step's own replay passes through, the triage's first repeat raises (out of memory, say).
    Returns the alarm every rank raised."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    rank = dist.get_rank()
    state = {"step": -1, "replays": 0}

    def loss_fn(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if sg.is_replaying() and rank == FAULTY and state["step"] == ALARM_STEP:
            state["replays"] += 1
            if state["replays"] > 1:
                raise RuntimeError("CUDA out of memory (a test's stand-in)")
        return lm_loss(m, batch)

    fault = sg.Fault("grad-scale", rank=FAULTY, step=7, persistent=True, param=10)
    config = sg.GuardConfig(replay_every=5, vote_every=5, faults=(fault,))
    guard = sg.Guard(ddp, opt, loss_fn, run_dir, config=config)
    try:
        for step in range(ALARM_STEP + 2):
            state["step"] = step
            guard.step(make_batch(step, rank, SMALL))
    except sg.SilentDataCorruption as exc:
        return exc.alarm.to_json()
    return None
