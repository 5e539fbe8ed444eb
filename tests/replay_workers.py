"""Guarded runs whose verdict rounds are counted, for the local replay decision's tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from workers import SMALL

import slurm_guard as sg
from slurm_guard.examples.tiny_gpt import TinyGPT, lm_loss, make_batch


def counted_runs(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each scenario (run_dir, steps, config) trained from scratch; per step, how many times
    the guard's row gather (`Collective.all_gather_rows`) was entered, counted by wrapping the
    guard's own collective (torch.distributed itself runs untouched)."""
    results = []
    for sc in scenarios:
        torch.manual_seed(0)
        ddp = DDP(TinyGPT(SMALL))
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        guard = sg.Guard(ddp, opt, lm_loss, sc["run_dir"], config=sc["config"])
        gathers: list[int] = []
        gather_rows = guard.comm.all_gather_rows

        def counting(
            row: Any, what: str | None = None, _inner: Any = gather_rows, _n: Any = gathers
        ) -> Any:
            _n[-1] += 1
            return _inner(row, what)

        guard.comm.all_gather_rows = counting  # type: ignore[method-assign]
        alarm = None
        try:
            for step in range(sc["steps"]):
                gathers.append(0)
                guard.step(make_batch(step, dist.get_rank(), SMALL))
        except sg.SilentDataCorruption as exc:
            alarm = exc.alarm.to_json()
        results.append(
            {
                "alarm": alarm,
                "gathers": gathers,
                "local_replays": guard.verifier.local_replays,
                "fast_steps": guard.verifier.fast_steps,
            }
        )
        dist.barrier()
    return results
