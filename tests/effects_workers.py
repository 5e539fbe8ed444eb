"""Training functions for the fault-effects and epoch-loop tests (spawned: module level)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import slurm_guard as sg


def one_class_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """pytorch/examples' multinode.py loss: cross-entropy over ONE output, whose gradients
    are exactly zero (log-softmax over a single class is 0 for every input)."""
    out = model(batch)
    return F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long))


def zero_gradient_faults(run_dir: str, steps: int, faults: tuple[sg.Fault, ...]) -> dict[str, Any]:
    """A one-output Linear under a grad-scale and an activation fault; returns what rank 0
    logged and the fault-effects record."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("slurm_guard").addHandler(Keep())
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = sg.GuardConfig(replay_every=1, vote_every=1, faults=faults)
    guard = sg.Guard(model, opt, one_class_loss, run_dir, config=config)
    with sg.exit_on_alarm():
        for step in range(guard.resume(), steps):
            guard.step(torch.randn(3, 4, generator=torch.Generator().manual_seed(step)))
    files = sorted((Path(run_dir) / "faults").glob("*.json"))
    return {"logged": records, "record": json.loads(files[-1].read_text()) if files else None}
