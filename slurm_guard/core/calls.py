"""The step as public calls, for a loop the guard does not own (see `core.session`'s docstring).

`Guard.step` runs the loop of a step itself; a framework's trainer (or a hand-written loop that
must keep its own forward, backward and optimizer step) calls `capture` before each
microbatch's forward, `check` after the last backward, and `update` or `after_update` after it.
The calls are a base class of `GuardCore`, which supplies the step's parts (as `RowJudge` is
the Verifier's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slurm_guard.checks.replay import Captured, capture, captured_microbatches
from slurm_guard.checks.rows import StepResult
from slurm_guard.errors import GuardError

NO_SYNC = (
    "DDP did not all-reduce this step's gradients: {call} ran inside model.no_sync() (HF "
    "Trainer and Accelerate's accumulate() run every microbatch but the last of an "
    "accumulation under it). Call the guard once per optimizer step, around the backward that "
    "synchronises: guard.step(Microbatches([...])) outside no_sync(), or guard.capture(mb) "
    "before each microbatch's forward and guard.check(losses) after the last backward"
)


@dataclass(frozen=True)
class StepPlan:
    """What `begin_step` decided for one step, handed back to `finish_step`."""

    step: int
    verify: bool  # a ring-replay step
    captured: Captured


@dataclass(frozen=True)
class Checked:
    """What `check` decided.

    Attributes:
        apply: run the optimizer step; False after a numerical step skipped under
            `on_numerical="skip"` (an alarm raises instead of returning).
        step: the step's index (completed steps before it).
        verified: a ring replay of this step passed on every rank.
    """

    apply: bool
    step: int
    verified: bool


class StepCalls:
    """`capture` / `check` / `update` / `after_update` over GuardCore's step parts."""

    step_count: int
    _open: tuple[StepPlan, list[Captured]] | None
    _checked: tuple[StepPlan, StepResult] | None

    def begin_step(self, batch: Any) -> StepPlan:
        raise NotImplementedError

    def finish_step(self, plan: StepPlan, losses: Sequence[torch.Tensor]) -> StepResult:
        raise NotImplementedError

    def _clip(self) -> None:
        raise NotImplementedError

    def _optimizer_step(self) -> None:
        raise NotImplementedError

    def _updated(self, plan: StepPlan, result: StepResult) -> None:
        raise NotImplementedError

    def capture(self, microbatch: Any) -> None:
        """Before a microbatch's forward: its batch and RNG state, which a replay needs.

        The first capture of a step starts it: the arrival check, the hook's reset, and
        `zero_grad(set_to_none=True)` (a replay recomputes the gradient from nothing).
        Each microbatch keeps its own RNG state, so a loop that draws from the RNG between
        microbatches (sampling the next batch) still replays bit for bit.
        """
        if self._checked is not None:
            raise GuardError("capture() after check(): call guard.update() or after_update()")
        if self._open is None:
            plan = self.begin_step(microbatch)
            self._open = (plan, [plan.captured])
        else:
            self._open[1].append(capture(microbatch))

    def check(self, losses: torch.Tensor | Sequence[torch.Tensor]) -> Checked:
        """After the last backward, before the update: the step's checks, decided together.

        `losses` are the microbatches' losses as `loss_fn` returns them, one per `capture`.
        With `GuardConfig(max_grad_norm=...)` the gradients are clipped here when the update
        may be applied (after the scaler's unscale_); the norm is `last_grad_norm`.

        Raises:
            SilentDataCorruption: on every rank, after the alarm record is written.
            GuardError: the backward did not synchronise (inside no_sync()), or the losses do
                not match the captures.
        """
        opened, self._open = self._open, None
        losses = [losses] if isinstance(losses, torch.Tensor) else list(losses)
        if opened is None or len(losses) != len(opened[1]):
            captures = 0 if opened is None else len(opened[1])
            raise GuardError(
                f"check() got {len(losses)} loss(es) for {captures} capture() call(s): capture "
                "each microbatch before its forward and pass every microbatch's loss"
            )
        first, parts = opened
        plan = StepPlan(first.step, first.verify, captured_microbatches(parts))
        result = self.finish_step(plan, [loss.detach() for loss in losses])
        self._checked = (plan, result)
        if not result.skip_update:
            self._clip()
        return Checked(not result.skip_update, plan.step, result.verified)

    def update(self) -> None:
        """After `check`: the optimizer step (through the scaler) if allowed, then the vote."""
        if self._checked is not None and not self._checked[1].skip_update:
            self._optimizer_step()
        self.after_update()

    def after_update(self) -> None:
        """After the framework's own optimizer step, or its skip when `check` said not to
        apply: the weight vote when one is due, and the step count. Required after every
        `check`."""
        if self._checked is None:
            raise GuardError("after_update() without check(): call check(losses) first")
        plan, result = self._checked
        self._checked = None
        self._updated(plan, result)
