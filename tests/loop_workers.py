"""Training functions for the tests of loops the guard does not own (spawned processes import
this module): `capture` / `check` / `update`, the nanoGPT-style loop of issue 23."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from workers import SMALL, weights

import slurm_guard as sg
from slurm_guard.examples.tiny_gpt import TinyGPT, lm_loss


def _sample(rank: int) -> dict[str, torch.Tensor]:
    """A batch drawn from the *global* RNG, between microbatches, as nanoGPT's get_batch does."""
    start = torch.randint(0, SMALL.vocab, (4, 1))
    seq = (start + 3 * torch.arange(SMALL.context + 1) + rank) % SMALL.vocab
    return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}


def capture_loop(
    run_dir: str,
    steps: int,
    accumulate: int,
    faults: tuple[sg.Fault, ...] = (),
    own_step: bool = False,
    misuse_no_sync: bool = False,
) -> dict[str, Any]:
    """A loop that keeps its own forward, backward and (with own_step) optimizer step."""
    torch.manual_seed(0)
    model = TinyGPT(SMALL)  # dropout 0.1: a replay needs each microbatch's own RNG state
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    rank = dist.get_rank()
    config = sg.GuardConfig(replay_every=1, vote_every=2, faults=faults, max_grad_norm=0.5)
    guard = sg.Guard(ddp, opt, lm_loss, run_dir, config=config)
    torch.manual_seed(100 + rank)
    out: dict[str, Any] = {"alarm": None, "error": None, "norms": [], "losses": []}
    before: list[torch.Tensor] = []
    try:
        for _ in range(steps):
            before = weights(model)
            losses = []
            for k in range(accumulate):
                mb = _sample(rank)
                guard.capture(mb)
                last = k == accumulate - 1 and not misuse_no_sync
                with contextlib.nullcontext() if last else ddp.no_sync():
                    loss = lm_loss(ddp, mb)
                    loss.backward()  # type: ignore[no-untyped-call]
                losses.append(loss)
            checked = guard.check(losses)
            assert guard.last_grad_norm is not None
            out["norms"].append(float(guard.last_grad_norm))
            out["losses"].append(float(sum(loss.detach() for loss in losses)))
            if own_step:
                if checked.apply:
                    opt.step()
                opt.zero_grad(set_to_none=True)
                guard.after_update()
            else:
                guard.update()
    except sg.SilentDataCorruption as exc:
        out["alarm"] = exc.alarm.to_json()
        out["unchanged"] = all(
            bool((a == b).all()) for a, b in zip(before, weights(model), strict=True)
        )
    except sg.GuardError as exc:
        out["error"] = str(exc)
    out["final"] = weights(model)
    return out


def disabled_scaler_nan(run_dir: str) -> dict[str, Any]:
    """nanoGPT's GradScaler(enabled=(dtype == 'float16')) on CPU/bf16: a disabled scaler, and
    an inf sample on rank 1 at step 3. The update must not be applied."""
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    rank = dist.get_rank()

    def loss_fn(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return lm_loss(m, batch) * batch["scale"]

    scaler = torch.amp.GradScaler("cpu", enabled=False)
    config = sg.GuardConfig(replay_every=5, vote_every=5)
    guard = sg.Guard(ddp, opt, loss_fn, run_dir, config=config, scaler=scaler)
    out: dict[str, Any] = {"alarm": None}
    before = weights(model)
    try:
        for step in range(6):
            before = weights(model)
            batch = _sample(rank)
            batch["scale"] = torch.tensor(float("inf") if (rank, step) == (1, 3) else 1.0)
            guard.step(batch)
    except sg.SilentDataCorruption as exc:
        out["alarm"] = exc.alarm.to_json()
    out["unchanged"] = all(
        bool((a == b).all()) for a, b in zip(before, weights(model), strict=True)
    )
    out["finite"] = all(bool(torch.isfinite(w).all()) for w in weights(model))
    return out


def eval_then_save(run_dir: str, stop_after: int, steps: int = 7) -> dict[str, Any]:
    """nanoGPT's order: evaluate (drawing from the global RNG), save, then train; batches
    from the global RNG. Stops after `stop_after` steps (an interruption) or runs to `steps`."""
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    rank = dist.get_rank()
    guard = sg.Guard(ddp, opt, lm_loss, run_dir, config=sg.GuardConfig(replay_every=2))
    torch.manual_seed(100 + rank)
    start = guard.resume()
    losses: dict[int, float] = {}
    for step in range(start, min(steps, stop_after)):
        if step % 2 == 0 and step > 0:
            model.eval()
            with torch.no_grad():
                lm_loss(model, _sample(rank))  # the eval's batch draws from the global RNG
            model.train()
            guard.save_checkpoint()
        losses[step] = guard.step(_sample(rank))
    return {"start": start, "losses": losses, "final": weights(model)}
