"""Training functions for the training-feature tests (spawned processes import this module)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from workers import SMALL, weights

import slurm_guard as sg
from slurm_guard.examples.tiny_gpt import TinyGPT, lm_loss, make_batch


def _train(
    guard: sg.Guard, batches: Any, steps: int, model: nn.Module, watch_step: int = -1
) -> dict[str, Any]:
    before: list[torch.Tensor] = []
    out: dict[str, Any] = {"alarm": None}
    try:
        for step in range(steps):
            before = weights(model)
            guard.step(batches(step))
            if step == watch_step:
                out["watched_unchanged"] = all(
                    bool((a == b).all()) for a, b in zip(before, weights(model), strict=True)
                )
    except sg.SilentDataCorruption as exc:
        out["alarm"] = exc.alarm.to_json()
        out["unchanged"] = all(
            bool((a == b).all()) for a, b in zip(before, weights(model), strict=True)
        )
    out["final"] = weights(model)
    out["buffers"] = [b.detach().clone() for b in model.buffers()]
    return out


def poisoned_data(run_dir: str, on_numerical: str) -> dict[str, Any]:
    """Rank 1's batch at step 4 makes the loss NaN: a data problem, not a hardware one."""
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    rank = dist.get_rank()

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return lm_loss(m, batch) * batch["scale"]

    def batches(step: int) -> dict[str, torch.Tensor]:
        b = make_batch(step, rank, SMALL)
        b["scale"] = torch.tensor(float("nan") if (rank, step) == (1, 4) else 1.0)
        return b

    config = sg.GuardConfig(replay_every=5, vote_every=5, on_numerical=on_numerical)
    guard = sg.Guard(ddp, opt, loss_fn, run_dir, config=config)
    return _train(guard, batches, 8, model, watch_step=4)


class BatchNormNet(nn.Module):
    """Buffers (BatchNorm running stats), a frozen layer, a layer unused in forward, dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 16)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(32, 4)
        self.unused = nn.Linear(4, 4)
        self.forward_calls = 0
        self.register_forward_hook(self._count)

    def _count(self, _m: nn.Module, _i: Any, _o: Any) -> None:
        if not sg.is_replaying():  # a side effect outside tensors: skipped during replays
            self.forward_calls += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.body(self.frozen(x)))
        return out


def mse(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


def net_batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7919 * step + rank)
    return {"x": torch.randn(16, 8, generator=gen), "y": torch.randn(16, 4, generator=gen)}


def features_run(
    run_dir: str,
    replay_every: int,
    accumulate: int = 1,
    faults: tuple[sg.Fault, ...] = (),
    corrupt_buffer: tuple[int, int] | None = None,
    amp: bool = False,
) -> dict[str, Any]:
    """BatchNorm + frozen + unused parameters, optional accumulation, GradScaler, buffer fault."""
    torch.manual_seed(0)
    model = BatchNormNet()
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.05)
    rank = dist.get_rank()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127) if amp else None
    loss_fn = mse
    if amp:

        def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                # x16 with a 2^127 initial scale: the first steps overflow, as they do in
                # real mixed-precision training while the scaler finds its level
                return mse(m, batch) * 16

    def batches(step: int) -> Any:
        if accumulate == 1:
            return net_batch(step, rank)
        return sg.Microbatches(net_batch(step * 100 + k, rank) for k in range(accumulate))

    config = sg.GuardConfig(replay_every=replay_every, vote_every=1, faults=faults)
    guard = sg.Guard(ddp, opt, loss_fn, run_dir, config=config, scaler=scaler)
    if corrupt_buffer is not None and rank == corrupt_buffer[0]:
        at = corrupt_buffer[1]

        def corrupt(_m: nn.Module, _a: Any) -> None:
            # after DDP's buffer broadcast, before the guard's snapshot: a bad receive
            if guard.step_count == at and not sg.is_replaying():
                model.body[1].running_mean[0] += 1.0

        model.register_forward_pre_hook(corrupt, prepend=True)
    out = _train(guard, batches, 12, model)
    out["forward_calls"] = model.forward_calls
    out["scale"] = float(scaler.get_scale()) if scaler is not None else None
    return out


def noisy_replays(run_dir: str, steps: int, faults: tuple[sg.Fault, ...]) -> dict[str, Any]:
    """Tolerance mode with a 1e6-element layer; replays carry noise like non-deterministic GPUs."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 1000), nn.Tanh(), nn.Linear(1000, 1000), nn.Tanh(), nn.Linear(1000, 8)
    )
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    rank = dist.get_rank()
    noise = tuple(
        sg.Fault("replay-noise", rank=r, step=0, persistent=True, factor=1e-5)
        for r in range(dist.get_world_size())
    )
    config = sg.GuardConfig(
        replay_every=1, vote_every=50, deterministic=False, faults=noise + faults
    )
    guard = sg.Guard(ddp, opt, mse, run_dir, config=config)

    def batches(step: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(7919 * step + rank)
        return {"x": torch.randn(8, 64, generator=gen), "y": torch.randn(8, 8, generator=gen)}

    out = _train(guard, batches, steps, model)
    out["tolerance"] = guard.verifier.tolerance()
    return out


def compiled_or_bf16(root: str, mode: str) -> list[dict[str, Any]]:
    """The user guide's `torch.compile` and bf16 autocast rows: a clean run, then a run with a
    persistent wrong gradient on rank 1 from step 4, in one process group.

    `compile`: `torch.compile` on the module before DDP (backend `aot_eager`: dynamo's graph
    capture and AOT autograd, which is what meets DDP and the guard's hooks, without building
    C++ on two CPU cores). `bf16`: the forward under `torch.autocast(dtype=torch.bfloat16)`
    inside `loss_fn`, no GradScaler (bf16 needs none).
    """
    rank = dist.get_rank()
    out = []
    faults_of = {"clean": (), "faulty": (sg.Fault("grad-scale", rank=1, step=4, persistent=True),)}
    for name, faults in faults_of.items():
        torch.manual_seed(0)
        module: nn.Module = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        if mode == "compile":
            module = torch.compile(module, backend="aot_eager")  # type: ignore[assignment]
        ddp = DDP(module)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        seen: list[torch.dtype] = []  # the dtype the model computed in

        def loss_fn(
            m: nn.Module, batch: dict[str, torch.Tensor], seen: list[torch.dtype] = seen
        ) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
                y = m(batch["x"])
            seen.append(y.dtype)
            return nn.functional.mse_loss(y.float(), batch["y"])

        config = sg.GuardConfig(replay_every=5, vote_every=5, faults=faults)
        guard = sg.Guard(ddp, opt, loss_fn, f"{root}/{name}", config=config)
        result = _train(guard, lambda step: net_batch(step, rank), 8, module)
        result["dtype"] = str(seen[-1])
        out.append(result)
        dist.barrier()
    return out
