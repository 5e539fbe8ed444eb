"""Lightning runs for tests/test_integration_lightning.py, on real gloo processes (spawned).

A small MLP LightningModule (dropout on, AdamW, a per-step LR schedule), random rows made from a
fixed seed, 3 ranks, 2 microbatches per step, 3 steps per epoch (so a checkpoint every 3 steps
falls on an epoch end, where Lightning resumes a plain DataLoader exactly): nothing downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from framework_results import listing, state_sha

import slurm_guard as sg

WIDTH, CLASSES, ROWS, BATCH, ACCUMULATION = 16, 4, 36, 2, 2
NAN_ROW = 7  # unshuffled, rank 1 reads rows 1, 4 | 7, 10: the second microbatch of step 0


def _module(dropout: float) -> Any:
    import lightning.pytorch as pl
    import torch.nn.functional as F

    class Net(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(WIDTH, 64),
                torch.nn.ReLU(),
                torch.nn.Dropout(dropout),
                torch.nn.Linear(64, CLASSES),
            )
            self.grad_norms: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            # after the guard's check and before Lightning clips: the true norm
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.grad_norms.append(
                float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            )

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=3e-2)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Net()


def _data(nan: bool) -> Any:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(ROWS, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (ROWS,), generator=g)
    if nan:
        x[NAN_ROW, 3] = float("nan")
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


def _reseed_like_the_guard() -> Any:
    """For the run without the guard: the RNG of each step as GuardCallback(reseed=True) sets it."""
    import lightning.pytorch as pl

    from slurm_guard.integrations.lightning import _step_seed

    class Reseed(pl.Callback):  # type: ignore[misc]
        base = 0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.base = torch.initial_seed()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
            if i % trainer.accumulate_grad_batches == 0:
                torch.manual_seed(_step_seed(self.base, trainer.global_step, dist.get_rank()))

    return Reseed()


def train(
    out: str,
    run_dir: str,
    max_steps: int,
    config: sg.GuardConfig | None = None,
    *,
    guarded: bool = True,
    save_every: int = 0,
    nan: bool = False,
    dropout: float = 0.1,
    exit_on_alarm: bool | None = False,
    keep_one: bool = False,
    defaults: bool = False,
    ckpt_path: str | None = None,
    two_guards: bool = False,
) -> dict[str, Any]:
    """One `trainer.fit` (resuming from what the guard trusts by itself); the final hash.

    `exit_on_alarm` is GuardCallback's: False raises the alarm to the caller, None keeps the
    callback's default (exit 86 under Slurm). Devices per node come from LOCAL_WORLD_SIZE (all
    ranks on one "node" under run_local; one a node under srun, where Lightning's
    SLURMEnvironment checks them against `--ntasks-per-node` and the node count).

    `defaults`: Lightning's default logger (CSV, `lightning_logs/version_N/`) and one
    `ModelCheckpoint(every_n_train_steps=1)` with its default folder (the logger's version)
    and `save_top_k=1`. `two_guards`: a user's mistake, two GuardCallbacks."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from slurm_guard.integrations.lightning import GuardCallback

    # run_local made the process group; Lightning reads the launcher's variables
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "1")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    model = _module(dropout)
    callbacks: list[Any] = []
    guard = None
    if guarded:  # the three lines a user adds (the import is above)
        guard = GuardCallback(run_dir, config, exit_on_alarm=exit_on_alarm)
        callbacks.append(guard)
        if two_guards:
            callbacks.append(GuardCallback(run_dir, config, exit_on_alarm=exit_on_alarm))
    else:
        callbacks.append(_reseed_like_the_guard())
    if save_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=f"{out}/checkpoints",
                every_n_train_steps=save_every,
                save_top_k=-1,
                save_last=True,
            )
        )
    if keep_one:  # after every step; top-k deletes the older .ckpt files
        callbacks.append(ModelCheckpoint(dirpath=f"{out}/top1", every_n_train_steps=1))
    if defaults:
        callbacks.append(ModelCheckpoint(every_n_train_steps=1))
    world = int(os.environ.get("WORLD_SIZE") or dist.get_world_size())  # torchrun's, or the group
    devices = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=world // devices,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=max_steps,
        accumulate_grad_batches=ACCUMULATION,
        gradient_clip_val=1.0,
        default_root_dir=out,
        callbacks=callbacks,
        logger=defaults,
        enable_checkpointing=bool(save_every) or defaults,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    exit_code = None
    try:
        trainer.fit(model, train_dataloaders=_data(nan), ckpt_path=ckpt_path)
    except SystemExit as exc:  # exit_on_alarm: the process group is gone
        exit_code = exc.code
    chosen = guard.chosen if guard is not None else None
    return {
        "sha": state_sha(model),
        "global_step": trainer.global_step,
        "resumed_from": -1 if chosen is None else chosen.step,
        "resumed_path": None if chosen is None or chosen.path is None else str(chosen.path),
        "grad_norms": model.grad_norms,
        "exit_code": exit_code,
        "lr": trainer.optimizers[0].param_groups[0]["lr"] if exit_code is None else None,
    }


def clean_and_nan(root: str) -> dict[str, Any]:
    """A clean 9-step run, the same run without the guard, and a run with a NaN sample."""
    config = sg.GuardConfig(replay_every=3, schedule="fixed")
    clean = train(f"{root}/clean-out", f"{root}/clean-run", 9, config, save_every=3, keep_one=True)
    plain = train(f"{root}/plain-out", f"{root}/plain-run", 9, guarded=False)
    try:
        train(f"{root}/nan-out", f"{root}/nan-run", 3, config, nan=True)
        nan: Any = None
    except sg.SilentDataCorruption as exc:
        nan = exc.alarm.to_json()
    return {"clean": clean, "plain": plain, "nan": nan}


def faulty(root: str) -> dict[str, Any]:
    """A persistent gradient fault on node3 from step 4; a checkpoint every 3 steps; exit 86."""
    fault = sg.Fault(kind="grad-scale", node="node3", step=4, persistent=True)
    config = sg.GuardConfig(replay_every=3, schedule="fixed", trust_replays=1, faults=(fault,))
    return train(
        f"{root}/fault-out", f"{root}/fault-run", 9, config, save_every=3, exit_on_alarm=True
    )


NO_CHANGE_FAULT = sg.Fault(kind="grad-scale", node="node2", step=5, factor=1.0)
"""Rides along in `resumed`: changes no value (training stays bit-identical), so the end of
the run must say `changed no value` (the integration's end_run)."""


def resumed(root: str) -> dict[str, Any]:
    """The requeued job (without the faulty node): resumes from what the guard trusts, with
    `trust_replays=1` the `.ckpt` of step 3 (the passing replay at 3 vouches for it; the
    default 2 would trust only a start from step 0, which would hide a resume that is not
    bit-identical)."""
    config = sg.GuardConfig(
        replay_every=3, schedule="fixed", trust_replays=1, faults=(NO_CHANGE_FAULT,)
    )
    return train(f"{root}/fault-out", f"{root}/fault-run", 9, config, save_every=3)


def defaults_faulty(root: str) -> dict[str, Any]:
    """Lightning's defaults (issue 34): the CSV logger's version_0/checkpoints, save_top_k=1
    with a save after every step; a persistent fault on node3 from step 4, caught at 6. The
    replay at 3 vouches for step 3's .ckpt, which top-k would delete at the next save."""
    fault = sg.Fault(kind="grad-scale", node="node3", step=4, persistent=True)
    config = sg.GuardConfig(replay_every=3, schedule="fixed", trust_replays=1, faults=(fault,))
    out, run = f"{root}/def-out", f"{root}/def-run"
    return train(out, run, 9, config, defaults=True, exit_on_alarm=True)


def defaults_resumed(root: str) -> dict[str, Any]:
    """The rerun: its logger is version_1, the trusted .ckpt lies in version_0."""
    config = sg.GuardConfig(replay_every=3, schedule="fixed", trust_replays=1)
    return train(f"{root}/def-out", f"{root}/def-run", 9, config, defaults=True)


def refused(root: str) -> dict[str, Any]:
    """What a resume refuses, each an error on every rank: two GuardCallbacks, a ckpt_path the
    guard does not trust, another run's seals, every allowed .ckpt damaged."""
    config = sg.GuardConfig(replay_every=3, schedule="fixed", trust_replays=1)
    out, run = f"{root}/out", f"{root}/run"
    errors: dict[str, Any] = {}

    def attempt(case: str, *args: Any, **kwargs: Any) -> None:
        try:
            train(*args, **kwargs)
            errors[case] = None
        except sg.GuardError as exc:
            errors[case] = str(exc)

    attempt("two_guards", out, run, 3, config, two_guards=True)
    train(out, run, 6, config, save_every=3)  # sealed: step 3, step 6 and last.ckpt
    early = f"{out}/checkpoints/epoch=0-step=3.ckpt"
    attempt("ckpt_path", out, run, 9, config, save_every=3, ckpt_path=early)
    attempt("foreign", out, f"{root}/other-run", 9, config, save_every=3)
    if dist.get_rank() == 0:
        for ckpt in Path(out, "checkpoints").glob("*.ckpt"):
            data = bytearray(ckpt.read_bytes())
            data[-10] ^= 1
            ckpt.write_bytes(bytes(data))
    dist.barrier()
    attempt("damaged", out, run, 9, config, save_every=3)
    errors["left"] = checkpoints(out)
    return errors


def checkpoints(path: str) -> list[str]:
    return listing(path, "*.ckpt")
