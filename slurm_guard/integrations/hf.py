"""slurm-guard for the HF Transformers Trainer: `GuardedTrainer`, a drop-in subclass.

    from slurm_guard.integrations.hf import GuardedTrainer      # was: Trainer
    trainer = GuardedTrainer(model=..., args=..., train_dataset=...,
                             guard_run_dir="/shared/runs/my-run")

Why a subclass and not a `TrainerCallback`: a callback gets no event before each microbatch's
forward with the microbatch in hand (a replay needs the batch and the RNG state from before
it), its first event after the last backward (`on_pre_optimizer_step`) comes after the
Trainer clipped the gradients in place (the checks must see them as the all-reduce left
them), and it cannot veto the optimizer step. The subclass changes four methods:

- `training_step`: `guard.capture(...)` before the forward, the Trainer's own loss computation
  (`compute_loss` and its gradient-accumulation scaling, `_guard_loss`), the backward, and
  `guard.check(losses)` after the backward that synchronises (the last of an accumulation;
  the others run under the Trainer's `no_sync()`). A replay on another rank runs the very same
  `_guard_loss` on the plain module, so it recomputes what this rank backpropagated;
- `_clip_grad_norm`: the guard clips (`GuardConfig.max_grad_norm`, taken from
  `TrainingArguments.max_grad_norm`) after its checks and the scaler's unscale, and the
  Trainer logs the guard's pre-clip norm, the true one;
- the optimizer's `step`: skipped when the guard says so (a numerical step under
  `on_numerical="skip"`; accelerate then reports the step as skipped, so the LR scheduler does
  not step either), then `guard.after_update()` (the vote, the step count);
- `_save_checkpoint`: a clean weight vote before the Trainer saves `checkpoint-N`, a seal
  after it (`_frameworks`), then the `save_total_limit` rotation, which never deletes the
  checkpoints the trust rule needs; `train()` resumes from the newest checkpoint the guard
  trusts (or stops, as `Guard.resume()` does, when the allowed ones are all unusable or
  another run's) and moves every newer `checkpoint-N` to
  `<output_dir>/slurm-guard-quarantine/<alarm id>/`.

Not covered (refused or unchanged): DeepSpeed, FSDP, SageMaker MP and context parallelism
(not DDP: the guard's hook needs a DistributedDataParallel model), a single process (nothing
to compare against), `sync_each_batch` accumulation, LOMO optimizers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from slurm_guard.config import GuardConfig
from slurm_guard.core.session import GuardCore
from slurm_guard.errors import GuardError
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
)
from slurm_guard.integrations._versions import check_skip_flag
from slurm_guard.rundir.layout import RunDir

_Trainer: Any = require("transformers", "hf").Trainer
logger = logging.getLogger(__name__)

SEAL_NAME = "slurm_guard.json"
"""Written into each sealed `checkpoint-N/` folder, last."""

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class GuardedTrainer(_Trainer):  # type: ignore[misc]
    """`transformers.Trainer` with slurm-guard's checks around every optimizer step.

    Args:
        guard_run_dir: the run directory, on a filesystem every node and the controller share.
        guard_config: what to check and how often; `max_grad_norm` defaults to the Trainer's
            `args.max_grad_norm` (both set and different is an error).
        guard_exit_on_alarm: turn an alarm into exit code 86 (`protocol.EXIT_SDC`), which the
            epilog reads to drain the suspect node and requeue the job. Default: under Slurm
            (`SLURM_JOB_ID` set); elsewhere the alarm is raised from `train()`.
        everything else: `transformers.Trainer`'s.
    """

    def __init__(
        self,
        *args: Any,
        guard_run_dir: str | os.PathLike[str],
        guard_config: GuardConfig | None = None,
        guard_exit_on_alarm: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        config = guard_config if guard_config is not None else GuardConfig()
        hf_norm = float(self.args.max_grad_norm or 0.0)
        if config.max_grad_norm is None and hf_norm > 0:
            config = dataclasses.replace(config, max_grad_norm=hf_norm)
        elif config.max_grad_norm is not None and hf_norm not in (0.0, config.max_grad_norm):
            raise GuardError(
                f"TrainingArguments.max_grad_norm={hf_norm} and GuardConfig.max_grad_norm="
                f"{config.max_grad_norm} disagree; set one of them (the guard clips)"
            )
        self.args.max_grad_norm = config.max_grad_norm or 0.0
        self.guard_config = config
        self.guard_run_dir = RunDir(guard_run_dir)
        self.guard: GuardCore | None = None  # made once the Trainer wrapped the model in DDP
        self._guard_exit = exits_on_alarm(guard_exit_on_alarm)
        self._guard_losses: list[torch.Tensor] = []
        self._guard_apply = True
        self._guard_chosen: Chosen | None = None

    # ---------------------------------------------------------------- train and resume

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """Train, resuming from the newest `checkpoint-N` the guard trusts.

        `resume_from_checkpoint` None, True or False: the guard chooses (a requeued job must
        never start over silently, nor load a checkpoint written after a fault; start over with
        `SLURM_GUARD_RESUME=fresh`, which moves every checkpoint to quarantine). A path: it
        must be the one the guard trusts, else GuardError.
        """
        requested = None
        if not isinstance(resume_from_checkpoint, (bool, type(None))):
            requested = Requested(
                Path(resume_from_checkpoint),
                "resume_from_checkpoint",
                "pass True (or nothing) to let the guard choose",
            )
        with alarm_exit(self._guard_exit):
            root = Path(self.args.output_dir)
            self._guard_chosen = choose_checkpoint(
                self.guard_run_dir,
                lambda: self._list_checkpoints(root),
                root,
                self.guard_config,
                requested,
            )
            path = self._guard_chosen.path
            output = super().train(str(path) if path is not None else None, *args, **kwargs)
            if self.guard is not None:  # every rank: the batch check's and the faults' last word
                self.guard.end_run()
            return output

    @staticmethod
    def _list_checkpoints(root: Path) -> list[Listed]:
        if not root.is_dir():
            return []
        found = []
        for name in os.listdir(root):
            match = _CHECKPOINT.match(name)
            if match and (root / name).is_dir():
                found.append(Listed(int(match.group(1)), root / name, root / name / SEAL_NAME))
        return found

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        model, loader = super()._prepare_for_training(*args, **kwargs)
        ddp = self.model_wrapped
        if not isinstance(ddp, DistributedDataParallel):
            raise GuardError(
                f"GuardedTrainer needs the Trainer to wrap the model in DDP, got "
                f"{type(ddp).__name__}: run 2 or more processes (torchrun, srun), without "
                "DeepSpeed or FSDP"
            )
        plugin = self.accelerator.gradient_state.plugin_kwargs
        if plugin.get("sync_each_batch", False):
            raise GuardError("GuardedTrainer does not support sync_each_batch accumulation")
        if self.guard is None:
            # the torch optimizer inside accelerate's wrapper: the one whose state replicas hold
            optimizer: torch.optim.Optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # type: ignore[assignment]
            self.guard = GuardCore(
                ddp,
                optimizer,
                self._guard_loss,
                self.guard_run_dir.root,
                self.guard_config,
                scaler=self.accelerator.scaler,
            )
            if self._guard_chosen is not None:
                finish_resume(self.guard, self._guard_chosen)
        elif self.guard.ddp is not ddp:
            raise GuardError("GuardedTrainer.train() again with a newly wrapped model")
        self._veto_optimizer_step()
        return model, loader

    def _require_guard(self) -> GuardCore:
        if self.guard is None:
            raise GuardError("the guard is made in train(); it has not started yet")
        return self.guard

    # ---------------------------------------------------------------- one step

    def _guard_loss(self, model: torch.nn.Module, micro: dict[str, Any]) -> torch.Tensor:
        """The loss `training_step` backpropagates: the real step's and a replay's (the same)."""
        n_items = micro["num_items_in_batch"]
        with self.compute_loss_context_manager():
            # a copy: compute_loss pops "labels" for label smoothing and compute_loss_func
            loss = self.compute_loss(model, dict(micro["inputs"]), num_items_in_batch=n_items)
        if self.args.n_gpu > 1:
            loss = loss.mean()
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:  # as Trainer.training_step decides
            scaled = (
                self.model_accepts_loss_kwargs and n_items is not None
            ) or self.compute_loss_func is not None
        if not scaled:
            loss = loss / micro["accumulation"]
        return loss  # type: ignore[no-any-return]

    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """One microbatch: capture, forward, backward; the checks after the syncing backward."""
        guard = self._require_guard()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        micro = {
            "inputs": self._prepare_inputs(inputs),
            "num_items_in_batch": num_items_in_batch,
            "accumulation": self.current_gradient_accumulation_steps,
        }
        guard.capture(micro)
        loss = self._guard_loss(model, micro)
        self.accelerator.backward(loss)
        loss = loss.detach()
        self._guard_losses.append(loss)
        if self.accelerator.sync_gradients:  # the backward that all-reduced
            losses, self._guard_losses = self._guard_losses, []
            self._guard_apply = guard.check(losses).apply
        return loss

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        """The guard clipped in `check`; the Trainer logs its pre-clip norm (no host sync)."""
        norm = self._require_guard().last_grad_norm
        if not self._guard_apply or norm is None:  # a skipped step: its gradients were not finite
            return torch.tensor(float("nan"))
        return norm

    def _veto_optimizer_step(self) -> None:
        optimizer = self.optimizer
        if getattr(optimizer, "_slurm_guard_veto", False):
            return
        check_skip_flag(optimizer)  # accelerate's private skip flag still works
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            guard = self._require_guard()
            result = None
            if self._guard_apply:
                optimizer._is_overflow = False  # reset by accelerate only under a GradScaler
                result = original(*args, **kwargs)
            else:  # accelerate's optimizer_step_was_skipped: the LR scheduler does not step
                optimizer._is_overflow = True
            self._guard_apply = True
            guard.after_update()
            return result

        optimizer.step = step
        optimizer._slurm_guard_veto = True

    # ---------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Vote, let the Trainer save checkpoint-N, seal it, then rotate (every rank calls this).

        The Trainer rotates (`save_total_limit`) inside its own save, before the seal, and
        knows nothing of trust: it would delete the checkpoint a rollback must load. So its
        rotation is off during the save, and `_guard_rotate` does it after the seal, holding
        back what the trust rule needs.
        """
        steps = self.state.global_step
        run_dir = Path(self._get_output_dir(trial=trial))
        folder = run_dir / f"checkpoint-{steps}"
        parent_save = super()._save_checkpoint
        limit = self.args.save_total_limit

        def save() -> None:
            self.args.save_total_limit = None
            try:
                parent_save(model, trial)
            finally:
                self.args.save_total_limit = limit

        save_sealed(self._require_guard(), "hf", steps, save, folder, folder / SEAL_NAME)
        if limit is not None and limit > 0 and self.args.should_save:
            self._guard_rotate(run_dir, limit)

    def _guard_rotate(self, run_dir: Path, limit: int) -> None:
        """The Trainer's rotation (oldest first; the newest and the best model stay), where
        the checkpoints the trust rule needs (`held_back`) stay too and do not count."""
        try:  # rank 0 alone: an error here would leave the other ranks waiting
            listed = self._list_checkpoints(run_dir)
        except OSError as exc:
            logger.warning(
                "save_total_limit: nothing rotated, %s cannot be listed (%s)", run_dir, exc
            )
            return
        keep = held_back(self._require_guard(), listed)
        best = self.state.best_model_checkpoint
        ordered = [item.path for item in sorted(listed, key=lambda item: item.step)]
        rotating = [p for p in ordered if p.resolve() not in keep]
        protected = {ordered[-1].resolve()} if ordered else set()
        if best is not None:
            protected.add(Path(best).resolve())
        excess = len(rotating) - max(limit, len(protected & {p.resolve() for p in rotating}))
        for path in rotating:
            if excess <= 0:
                break
            if path.resolve() not in protected:
                shutil.rmtree(path, ignore_errors=True)
                excess -= 1


__all__ = ["SEAL_NAME", "GuardedTrainer"]
