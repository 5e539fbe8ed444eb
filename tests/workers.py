"""Training functions that tests run on real gloo processes (importable: processes are spawned)."""

from __future__ import annotations

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
    snapshots = getattr(guard, "snapshots", None)
    return {
        "alarm": None,
        "final": weights(model),
        "start": start,
        "losses": losses,
        "restored_from_peers": snapshots.restored_from_peers if snapshots else [],
    }


SMALL = TinyGPTConfig(vocab=32, context=8, width=16, heads=2, layers=1, dropout=0.1)


def run_scenarios(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several independent guarded trainings in one process group (spawning is the slow part).

    Each scenario: run_dir, steps, config; optional checkpoint_every. A fresh model, DDP wrapper
    and Guard per scenario.
    """
    results = []
    for sc in scenarios:
        results.append(
            train_tiny_gpt(
                sc["run_dir"],
                sc["steps"],
                sc["config"],
                sc.get("checkpoint_every", 0),
                sc.get("model", SMALL),
            )
        )
        dist.barrier()
    return results


def bad_loss(run_dir: str) -> str:
    """A loss_fn that returns a vector must be refused before any update."""
    torch.manual_seed(0)
    ddp = DDP(TinyGPT(SMALL))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def per_token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(batch["tokens"]).mean(dim=-1)

    guard = sg.Guard(ddp, opt, per_token_loss, run_dir)
    before = weights(ddp.module)
    try:
        guard.step(make_batch(0, dist.get_rank(), SMALL))
    except sg.GuardError as exc:
        unchanged = all(
            bool((a == b).all()) for a, b in zip(before, weights(ddp.module), strict=True)
        )
        return f"{exc} | unchanged={unchanged}"
    return "no error"


def exchange_payloads() -> dict[int, bytes]:
    """Rank 0 sends rank 1 nothing (an empty payload) and rank 2 its bytes; every rank calls."""
    from slurm_guard.comm.collective import Collective
    from slurm_guard.core.snapshot_peers import exchange_bytes

    rank = dist.get_rank()
    comm = Collective(None, f"n{rank}", 0)
    sends = {1: b"", 2: bytes(range(256)) * 3} if rank == 0 else {}
    return exchange_bytes(comm, sends, [0] if rank else [], "test exchange")
