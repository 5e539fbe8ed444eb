"""Training functions for the tests of loops the guard does not own (spawned processes import
this module): `capture` / `check` / `update`, the nanoGPT-style loop of issue 23."""

from __future__ import annotations

import contextlib
import logging
import math
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


class Position:
    """A data loader's position in miniature: the batches a rank has consumed so far."""

    def __init__(self) -> None:
        self.consumed = 0

    def next_batch(self, rank: int) -> dict[str, torch.Tensor]:
        """The batch of this rank at this position: the data order is seeded by the position."""
        gen = torch.Generator().manual_seed(1000 * rank + self.consumed)
        self.consumed += 1
        start = torch.randint(0, SMALL.vocab, (4, 1), generator=gen)
        seq = (start + 3 * torch.arange(SMALL.context + 1) + rank) % SMALL.vocab
        return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = int(state["consumed"])


def warmup_cosine(step: int, warmup: int = 3, total: int = 12) -> float:
    """nanoGPT's learning-rate schedule as a LambdaLR factor: linear warmup, cosine decay."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def scheduled_loop(
    run_dir: str,
    steps: int,
    faults: tuple[sg.Fault, ...] = (),
    save_every: int = 3,
    more_stateful: bool = False,
) -> dict[str, Any]:
    """Eval, save, train with a LambdaLR schedule and a stateful data position, both handed to
    the guard as `stateful`; stops at an alarm. Resumes from the run directory first."""
    torch.manual_seed(0)
    model = TinyGPT(SMALL)  # dropout: the RNG state matters too
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    data = Position()
    rank = dist.get_rank()
    config = sg.GuardConfig(replay_every=2, vote_every=2, faults=faults)
    stateful: dict[str, Any] = {"lr_scheduler": sched, "data": data}
    if more_stateful:
        stateful["ema"] = Position()  # given now, never saved
    guard = sg.Guard(ddp, opt, lm_loss, run_dir, config=config, stateful=stateful)
    torch.manual_seed(100 + rank)
    try:
        start = guard.resume()
    except sg.GuardError as exc:
        return {"resume_error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {"start": start, "losses": {}, "alarm": None}
    try:
        for step in range(start, steps):
            if step % save_every == 0 and step > 0:
                model.eval()
                with torch.no_grad():
                    lm_loss(model, _sample(rank))  # the eval draws from the global RNG
                model.train()
                guard.save_checkpoint()
            out["losses"][step] = guard.step(data.next_batch(rank))
            sched.step()
    except sg.SilentDataCorruption as exc:
        out["alarm"] = exc.alarm.to_json()
    out["final"] = weights(model)
    out["last_lr"] = sched.get_last_lr()
    out["consumed"] = data.consumed
    return out


def rank0_decides(run_dir: str) -> dict[str, Any]:
    """Every rank sees a different validation loss; only rank 0's "improved" may decide."""
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    rank = dist.get_rank()
    guard = sg.Guard(ddp, opt, lm_loss, run_dir, config=sg.GuardConfig(replay_every=2))
    data = Position()
    # rank 0 improves at steps 0, 2, 3; the others at other steps: left to each rank, the
    # ranks would save at different steps and stop with CollectiveMismatch
    vals = {
        0: [5.0, 6.0, 4.0, 3.0, 7.0],
        1: [5.0, 4.0, 6.0, 6.0, 3.0],
        2: [1.0, 2.0, 3.0, 0.5, 9.0],
    }
    best = float("inf")
    saved: list[int] = []
    out: dict[str, Any] = {"error": None}
    try:
        for step, val in enumerate(vals[rank]):
            guard.step(data.next_batch(rank))
            improved = val < best
            best = min(best, val)
            if guard.save_checkpoint(if_=improved) is not None:
                saved.append(step)
        out["dict"] = guard.agree_on({"rank": rank, "best": best}, src=2)
        try:
            guard.agree_on(float("nan") if rank == 1 else 0, src=1)  # not JSON: fails everywhere
        except sg.GuardError as exc:
            out["nan"] = type(exc).__name__
    except sg.GuardError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["saved"] = saved
    return out


def step_inside_no_sync(run_dir: str, only_rank: int | None = None) -> dict[str, Any]:
    """The user's own `ddp.no_sync()` around `guard.step()` (as an accumulation loop written
    for plain DDP would have it): a usage mistake, never an SDC alarm. With `only_rank`, that
    rank alone is inside no_sync() (a rank-dependent branch)."""
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    rank = dist.get_rank()
    config = sg.GuardConfig(replay_every=1, watchdog_seconds=20)
    guard = sg.Guard(ddp, opt, lm_loss, run_dir, config=config)
    out: dict[str, Any] = {"error": None, "alarm": None}
    before = weights(model)
    try:
        guard.step(_sample(rank))  # one good step first: the guard is in use
        before = weights(model)
        inside = only_rank is None or rank == only_rank
        with ddp.no_sync() if inside else contextlib.nullcontext():
            guard.step(_sample(rank))
    except sg.SilentDataCorruption as exc:
        out["alarm"] = exc.alarm.to_json()
    except sg.GuardError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["unchanged"] = all(
        bool((a == b).all()) for a, b in zip(before, weights(model), strict=True)
    )
    out["steps"] = guard.step_count
    return out


class _Records(logging.Handler):
    """The guard's log messages in this process, for a test to read back."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def scaler_and_data(
    run_dir: str, steps: int, scaler_on: bool | None, with_data: bool
) -> dict[str, Any]:
    """Resume, then train and save every 2 steps with an (enabled or disabled) GradScaler and/or
    a stateful data position: for the rule on checkpoints that lack their stateful state."""
    records = _Records()
    logging.getLogger("slurm_guard").addHandler(records)
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    rank = dist.get_rank()
    scaler = None if scaler_on is None else torch.amp.GradScaler("cpu", enabled=scaler_on)
    data = Position()
    guard = sg.Guard(
        ddp, opt, lm_loss, run_dir, config=sg.GuardConfig(replay_every=2), scaler=scaler,
        stateful={"data": data} if with_data else None,
    )  # fmt: skip
    out: dict[str, Any] = {"resume_error": None, "warnings": records.messages}
    try:
        out["start"] = guard.resume()
    except sg.GuardError as exc:
        out["resume_error"] = f"{type(exc).__name__}: {exc}"
        return out
    for step in range(out["start"], steps):
        if step % 2 == 0 and step > 0:
            guard.save_checkpoint()
        guard.step(data.next_batch(rank))
    out["consumed"] = data.consumed
    return out
