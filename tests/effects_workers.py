"""Training functions for the fault-effects and epoch-loop tests (spawned: module level)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import slurm_guard as sg


def _logged() -> list[str]:
    """Every message the guard logs in this process from now on."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("slurm_guard").addHandler(Keep())
    return records


def one_class_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """pytorch/examples' multinode.py loss: cross-entropy over ONE output, whose gradients
    are exactly zero (log-softmax over a single class is 0 for every input)."""
    out = model(batch)
    return F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long))


def zero_gradient_faults(run_dir: str, steps: int, faults: tuple[sg.Fault, ...]) -> dict[str, Any]:
    """A one-output Linear under a grad-scale and an activation fault; returns what rank 0
    logged and the fault-effects record."""
    records = _logged()
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


class Points(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """39 samples, each made from its index; `unseeded` adds noise from an unseeded source,
    as a dataset that draws random data at start without a seed does."""

    def __init__(self, unseeded: bool = False) -> None:
        self.noise = random.Random() if unseeded else None  # seeded from the OS: differs per start

    def __len__(self) -> int:
        return 39

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(6, generator=g), torch.randn(2, generator=g)
        if self.noise is not None:
            x = x + self.noise.random()
        return x, y


def dropout_loss(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def epoch_loop(
    run_dir: str,
    steps: int,
    workers: int,
    drop_last: bool,
    faults: tuple[sg.Fault, ...] = (),
    unseeded: bool = False,
) -> dict[str, Any]:
    """The README's loop: epochs over a DataLoader with DistributedSampler(shuffle=True), a
    model with dropout, a save at every epoch end and every 3 steps; returns the final
    weights, the steps seen and what rank 0 logged."""
    logged = _logged()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2)
    )
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    sampler: DistributedSampler[int] = DistributedSampler(Points(unseeded), shuffle=True, seed=3)
    loader = DataLoader(
        Points(unseeded), batch_size=3, sampler=sampler, num_workers=workers, drop_last=drop_last
    )
    config = sg.GuardConfig(
        replay_every=1, vote_every=1, trust_replays=1, triage_seconds=2.0, faults=faults
    )
    guard = sg.Guard(ddp, opt, dropout_loss, run_dir, config=config)
    start = guard.resume()
    seen = []
    alarm = None
    try:
        with sg.exit_on_alarm():
            for step, batch in sg.resumable(loader, start, steps=steps):
                seen.append(step)
                guard.step(batch)
                if (step + 1) % len(loader) == 0 or (step + 1) % 3 == 0:
                    guard.save_checkpoint()
    except SystemExit:
        alarm = "exit"
    return {
        "start": start,
        "seen": seen,
        "alarm": alarm,
        "per_epoch": len(loader),
        "final": [p.detach().clone() for p in model.parameters()],
        "logged": logged,
    }
