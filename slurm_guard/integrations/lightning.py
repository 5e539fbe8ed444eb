"""slurm-guard for PyTorch Lightning: `GuardCallback`, one callback for the Trainer.

    from slurm_guard.integrations.lightning import GuardCallback
    guard = GuardCallback(run_dir="/shared/runs/my-run")
    trainer = Trainer(..., strategy="ddp", callbacks=[guard, ...])

A callback is enough, though with automatic optimization the forward and backward run inside
`optimizer.step(closure)`, because Lightning's hooks fall at the right moments of that closure:

- `on_train_batch_start` sees each microbatch before its forward: `guard.capture`, and at the
  first microbatch of a step a reseed of the RNG from (seed, step, rank) (below);
- `on_before_backward` gets the loss Lightning backpropagates (the `training_step` loss divided
  by `accumulate_grad_batches`): the value a replay recomputes with `_replay_loss`;
- `on_before_optimizer_step` comes after the backward that all-reduced and before Lightning
  clips and steps: `guard.check`, which raises on an alarm;
- the update itself cannot be vetoed from a hook, so the callback wraps the torch optimizer's
  `step` (and the module's `lr_scheduler_step`): skipped when `check` says so, then
  `guard.after_update()`.

Checkpoints: `trainer.save_checkpoint` (ModelCheckpoint and OnExceptionCheckpoint call it) votes
first and seals the `.ckpt` after (`_frameworks`); top-k never deletes one the trust rule
needs (`remove`). Lightning picks the checkpoint to resume from before any callback runs, so
the callback replaces the path it is handed at the one moment it loads (`_CheckpointConnector.
_restore_modules_and_callbacks`, private, Lightning 2.5-2.6): the newest sealed checkpoint the
trust rule allows, every newer `.ckpt` moved to quarantine, and rank 0 says so in one line.

Why reseed: a Lightning `.ckpt` holds no RNG state, and Lightning draws from the global RNG when
it makes the DataLoader iterators, so without it a resumed run's dropout differs from the
uninterrupted run's. Not covered (refused): manual optimization, several optimizers, LBFGS
(closure-driven steps), a GradScaler (`precision="16-mixed"`), strategies other than DDP.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from slurm_guard.config import GuardConfig
from slurm_guard.core.session import GuardCore
from slurm_guard.errors import GuardError, SilentDataCorruption
from slurm_guard.integrations._frameworks import (
    Chosen,
    Listed,
    Requested,
    alarm_exit,
    choose_checkpoint,
    exits_on_alarm,
    finish_resume,
    held_back,
    require,
    save_sealed,
    silenced,
)
from slurm_guard.integrations._versions import restore_hook
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import RecordError
from slurm_guard.rundir.seals import located_checkpoints, read_seal

_pl: Any = require("lightning.pytorch", "lightning")
logger = logging.getLogger(__name__)

SEAL_SUFFIX = ".slurm-guard.json"
"""Beside each sealed `.ckpt`: `step=6.ckpt` -> `step=6.ckpt.slurm-guard.json`."""

UNSEALED_STEP = 1 << 62
"""The step given to a `.ckpt` without a readable seal: newer than any, so quarantined."""

_AUTO_PREFIXES = ("last", "hpc_ckpt_", "on_exception")
"""Checkpoints Lightning picks by itself ("last", SLURM's "hpc"): the guard chooses instead."""


def seal_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + SEAL_SUFFIX)


def _seal_step(checkpoint: Path) -> int:
    try:
        return read_seal(seal_path(checkpoint)).step
    except RecordError:
        return UNSEALED_STEP


def _step_seed(base: int, step: int, rank: int) -> int:
    digest = hashlib.blake2b(f"{base}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _loss_of(output: Any) -> torch.Tensor:
    """The loss in a `training_step` output, as Lightning's ClosureResult reads it."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise GuardError("training_step must return the loss, or a dict with a 'loss' tensor")
    return loss


class GuardCallback(_pl.Callback):  # type: ignore[misc]
    """slurm-guard's checks around every optimizer step of a Lightning DDP run.

    Args:
        run_dir: the run directory, on a filesystem every node and the controller share.
        guard_config: what to check and how often. Clipping stays Lightning's
            (`Trainer(gradient_clip_val=...)`, which runs after the guard's checks), so
            `max_grad_norm` must be None.
        exit_on_alarm: turn an alarm into exit code 86 (`protocol.EXIT_SDC`), which the epilog
            reads to drain the suspect node and requeue the job. Default: under Slurm
            (`SLURM_JOB_ID` set); elsewhere `trainer.fit` raises the alarm.
        reseed: reseed torch's RNG at the start of every step from (the seed at fit start,
            step, rank), so that a resumed run draws what the uninterrupted run drew.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        guard_config: GuardConfig | None = None,
        *,
        exit_on_alarm: bool | None = None,
        reseed: bool = True,
    ) -> None:
        config = guard_config if guard_config is not None else GuardConfig()
        if config.max_grad_norm is not None:
            raise GuardError(
                "GuardCallback: leave GuardConfig.max_grad_norm unset and clip with "
                "Trainer(gradient_clip_val=...): Lightning clips after the guard's checks"
            )
        self.guard_config = config
        self.run_dir = RunDir(run_dir)
        self.guard: GuardCore | None = None  # made at on_train_start, once the state is loaded
        self.exit_on_alarm = exits_on_alarm(exit_on_alarm)
        self.reseed = reseed
        self.chosen: Chosen | None = None  # what the resume loaded (None: not resumed by fit)
        self._base_seed = 0
        self._trainer: Any = None
        self._losses: list[torch.Tensor] = []
        self._captured = 0  # microbatches captured in the open step
        self._apply = True
        self._skipped = False  # the last update was skipped: so is its scheduler step
        self._pending = False  # check() ran, after_update() not yet
        self._restore: list[tuple[Any, str, Any]] = []  # instance attributes to put back
        self._spared: set[Path] = set()  # .ckpt Lightning's top-k deleted but trust needs
        self._remove: Any = None

    # ---------------------------------------------------------------- set-up and resume

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        if not isinstance(trainer.strategy, _pl.strategies.DDPStrategy):
            raise GuardError(
                f"GuardCallback needs Lightning's DDP strategy, got "
                f"{type(trainer.strategy).__name__}: Trainer(strategy='ddp', devices=...)"
            )
        if not pl_module.automatic_optimization:
            raise GuardError("GuardCallback supports automatic optimization only")
        guards = [c for c in trainer.callbacks if isinstance(c, GuardCallback)]
        if len(guards) > 1:
            raise GuardError(
                f"Trainer(callbacks=...) holds {len(guards)} GuardCallbacks: give it one (each "
                "would register its own DDP communication hook and check every step again)"
            )
        connector, original = restore_hook(trainer)

        def restore(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
            self.chosen = self._choose(trainer, checkpoint_path)
            path = self.chosen.path
            original(str(path) if path is not None else None, weights_only)

        self._patch(connector, "_restore_modules_and_callbacks", restore)
        saver = trainer.save_checkpoint
        self._patch(trainer, "save_checkpoint", lambda *a, **k: self._save(saver, *a, **k))
        remover = trainer.strategy.remove_checkpoint

        def remove(filepath: Any) -> None:
            """ModelCheckpoint's top-k deletes a `.ckpt` (rank 0): its seal goes with it, and
            one the trust rule needs stays (`_frameworks.held_back`) until it is not needed."""
            if trainer.is_global_zero and self.guard is not None:
                path = Path(filepath).resolve()
                keep = self._held_back()
                if keep is None or path in keep:
                    self._spared.add(path)
                    return
            remover(filepath)
            if trainer.is_global_zero:
                seal_path(Path(filepath)).unlink(missing_ok=True)

        self._remove = remove
        self._patch(trainer.strategy, "remove_checkpoint", remove)

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        self._restore.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, value)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for obj, name, old in reversed(self._restore):
            if old is None:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, old)
        self._restore = []

    def _choose(self, trainer: Any, selected: Any) -> Chosen:
        """Every rank: the checkpoint to load instead of the one Lightning selected."""
        requested = None
        if selected and not Path(selected).name.startswith(_AUTO_PREFIXES):
            # the user's own path: it must be the trusted one
            requested = Requested(
                Path(selected),
                "ckpt_path",
                "call trainer.fit without ckpt_path (or with ckpt_path='last') to let the "
                "guard choose",
            )
        root = Path(trainer.default_root_dir)
        return choose_checkpoint(
            self.run_dir,
            lambda: self._list_checkpoints(trainer, self.run_dir),
            root,
            self.guard_config,
            requested,
        )

    @staticmethod
    def _list_checkpoints(trainer: Any, run_dir: RunDir) -> list[Listed]:
        """Every `.ckpt` in the checkpoint callbacks' folders and default_root_dir (SLURM's),
        and every sealed one the run directory records (`rundir.seals`): a rerun's default
        logger writes to `version_1/`, the sealed ones lie in `version_0/`."""
        folders = {Path(trainer.default_root_dir)}
        for callback in trainer.checkpoint_callbacks:
            if getattr(callback, "dirpath", None):
                folders.add(Path(callback.dirpath))
        found = {}
        for folder in sorted(folders):
            if folder.is_dir():
                for path in sorted(folder.glob("*.ckpt")):
                    found[path.resolve()] = Listed(_seal_step(path), path, seal_path(path))
        for item in located_checkpoints(run_dir):
            where = item.path.resolve()
            if item.framework == "lightning" and where not in found and item.path.is_file():
                found[where] = Listed(item.step, item.path, item.seal_path)
        return list(found.values())

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """The state is loaded (weights and optimizer): make the core, check the resume."""
        ddp = trainer.strategy.model
        if not isinstance(ddp, DistributedDataParallel):
            raise GuardError("GuardCallback: the strategy did not wrap the model in DDP")
        if len(trainer.optimizers) != 1:
            raise GuardError("GuardCallback supports exactly one optimizer")
        optimizer = trainer.optimizers[0]
        if isinstance(optimizer, torch.optim.LBFGS):
            raise GuardError("GuardCallback does not support LBFGS (its step runs the closure)")
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise GuardError(
                "GuardCallback does not support a GradScaler (precision='16-mixed') yet; "
                "use precision='bf16-mixed' or 32"
            )
        if self.guard is not None:
            raise GuardError("GuardCallback: one callback per fit (make a new one)")
        self._base_seed = torch.initial_seed()
        self.guard = GuardCore(
            ddp, optimizer, self._replay_loss, self.run_dir.root, self.guard_config
        )
        if self.chosen is not None:
            finish_resume(self.guard, self.chosen)
        if self.guard.step_count != trainer.global_step:
            raise GuardError(
                f"the guard resumed at step {self.guard.step_count}, Lightning at "
                f"{trainer.global_step}: resume only from checkpoints the guard sealed"
            )
        self._veto(optimizer, pl_module)

    def _require(self) -> GuardCore:
        if self.guard is None:
            raise GuardError("the guard is made at on_train_start; it has not started yet")
        return self.guard

    # ---------------------------------------------------------------- one step

    def _replay_loss(self, module: torch.nn.Module, micro: dict[str, Any]) -> torch.Tensor:
        """The loss Lightning backpropagates: `training_step` divided by the accumulation.

        `module` is the DDP model (the guard's one discarded pass that settles DDP's buckets)
        or the plain LightningModule (a replay). `self.log` is silenced meanwhile: a replay's
        loss is another rank's, and a `sync_dist` log would start a collective.
        """
        trainer = self._trainer
        pl_module = trainer.lightning_module
        with silenced(pl_module, ("log", "log_dict")):
            if isinstance(module, DistributedDataParallel):
                output = trainer.strategy.training_step(micro["batch"], micro["batch_idx"])
            else:
                with trainer.precision_plugin.train_step_context():
                    output = pl_module.training_step(micro["batch"], micro["batch_idx"])
        # the very division of Lightning's ClosureResult, so the bits match
        accumulation: int = trainer.accumulate_grad_batches
        return _loss_of(output) / accumulation

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        guard = self._require()
        if self._captured == 0:  # the first microbatch of a step
            self._skipped = False
            if self.reseed:
                torch.manual_seed(_step_seed(self._base_seed, guard.step_count, guard.rank))
        guard.capture({"batch": batch, "batch_idx": batch_idx})
        self._captured += 1

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """After the backward that all-reduced, before Lightning clips and steps."""
        losses, self._losses = self._losses, []
        self._captured = 0
        self._pending = True
        self._apply = self._require().check(losses).apply

    def _veto(self, optimizer: torch.optim.Optimizer, pl_module: Any) -> None:
        step = optimizer.step
        schedule = pl_module.lr_scheduler_step

        def guarded_step(closure: Any = None) -> Any:
            result = closure() if closure is not None else None  # forward, backward, check
            if self._apply:
                step()
            self._skipped = not self._apply
            self._apply = True
            self._after_update()
            return result

        def guarded_schedule(*args: Any, **kwargs: Any) -> Any:
            return None if self._skipped else schedule(*args, **kwargs)

        # torch's LR schedulers warn about a step() replaced after them unless it says so (a
        # private marker, torch 2.13-2.14): should it move, only that warning comes back
        guarded_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        self._patch(optimizer, "step", guarded_step)
        self._patch(pl_module, "lr_scheduler_step", guarded_schedule)

    def _after_update(self) -> None:
        if self._pending:
            self._pending = False
            self._require().after_update()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._after_update()  # a precision plugin that did not call optimizer.step

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """A clean end of fit, every rank: `exit_on_alarm`'s end (batch check, faults' effects)."""
        self._require().end_run()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """An alarm ends the process with exit code 86 when `exit_on_alarm` is on."""
        if self.exit_on_alarm and isinstance(exception, SilentDataCorruption):
            with alarm_exit(True):
                raise exception

    # ---------------------------------------------------------------- checkpoints

    def _save(
        self,
        save: Any,
        filepath: Any,
        weights_only: bool | None = None,
        storage_options: Any = None,
    ) -> None:
        """Vote, let Lightning write the `.ckpt`, then seal it (every rank calls this).

        Not sealed, so never resumed from: saves before the first guarded step, weights-only
        saves, SLURM's `hpc_ckpt_*` (written from a signal handler at any point of a step,
        where the vote's collective could meet another rank's all-reduce), and saves inside a
        step (microbatches captured, the update not done): a `.ckpt` holds no accumulated
        gradients, so a resume from it would lose them. ModelCheckpoint writes one after every
        resume: its `every_n_train_steps` test passes again after the first microbatch of the
        resumed step, as the count of its last save is not in the `.ckpt`.
        """
        path = Path(filepath)
        guard = self.guard
        inside_step = bool(self._captured or self._pending)
        unsealed = weights_only or path.name.startswith("hpc_ckpt_") or inside_step
        if guard is None or guard.step_count == 0 or unsealed:
            save(filepath, weights_only, storage_options)
            return
        steps = self._trainer.global_step
        write = functools.partial(save, filepath, weights_only, storage_options)
        save_sealed(guard, "lightning", steps, write, path, seal_path(path))
        self._release_spared()

    def _held_back(self) -> set[Path] | None:
        """Rank 0 (no collectives): what top-k must not delete; None (keep every `.ckpt`)
        when that cannot be read, as a deleted checkpoint the trust rule needs is lost."""
        assert self.guard is not None
        try:
            return held_back(self.guard, self._list_checkpoints(self._trainer, self.run_dir))
        except (GuardError, OSError) as exc:
            logger.warning("top-k deletes no .ckpt now: %s", exc)
            return None

    def _release_spared(self) -> None:
        """Rank 0: delete the `.ckpt` held back from top-k that the trust rule needs no more."""
        if not self._spared or not self._trainer.is_global_zero or self.guard is None:
            return
        keep = self._held_back()
        for path in sorted(self._spared - (keep if keep is not None else self._spared)):
            self._spared.discard(path)
            self._remove(str(path))


__all__ = ["SEAL_SUFFIX", "GuardCallback"]
