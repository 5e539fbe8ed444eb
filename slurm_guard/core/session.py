"""The guard's loop-independent core: set-up, the checks of one step, the vote, the alarm.

Every entry point shares it: `Guard.step` for users who hand the guard their loop, and the ones
for loops the guard does not own (a framework's trainer, a sharded model). A step is three calls
in a fixed order on every rank:

    plan = core.begin_step(batch)        # arrival, capture for replay, hook reset
    ... forward and backward of each microbatch, the last one outside no_sync() ...
    result = core.finish_step(plan, losses)  # the collective checks; raises on an alarm
    core.apply_update(plan, result)       # the optimizer step only if every check passed

For a loop the user or a framework owns, the same step as public calls, per microbatch:

    for mb in microbatches:
        guard.capture(mb)                 # before its forward: batch and RNG state for a replay
        loss = loss_fn(model, mb)         # the framework's forward; the last backward synced
        scaled(loss).backward()           # (all but the last under model.no_sync())
        losses.append(loss)
    checked = guard.check(losses)         # the checks; raises SilentDataCorruption on an alarm
    guard.update()                        # or: if checked.apply: optimizer.step(); then
                                          #     guard.after_update()

The first `capture` of a step starts it (arrival, the hook's reset) and zeroes the gradients
(`zero_grad(set_to_none=True)`, as `Guard.step` does): a replay recomputes the step's gradient
from nothing, so a gradient left over from before the step would be an alarm, and a framework
that zeroes after its update loses nothing. `check` needs each microbatch's loss as `loss_fn`
returns it (the value a replay recomputes), and clips with `GuardConfig(max_grad_norm=...)`
after the checks passed and the scaler unscaled: the norm is `guard.last_grad_norm`, a 0-dim
tensor on the device, identical on every rank (no host sync). `after_update` (or `update`,
which steps the optimizer itself) must follow every `check`, applied or not: it runs the vote
when one is due and counts the step.

Saving and resuming are `core.checkpoints`; both take a core.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slurm_guard.abft import measure_coverage
from slurm_guard.checks.comm_hook import HookState, SignVectors, guard_comm_hook
from slurm_guard.checks.replay import (
    Captured,
    LossFn,
    Microbatches,
    ReplayOutput,
    capture,
    combined_loss,
    preserved_state,
    recompute,
)
from slurm_guard.checks.rows import StepResult
from slurm_guard.checks.triage import triage_alarm
from slurm_guard.checks.verifier import Verifier
from slurm_guard.config import GuardConfig
from slurm_guard.core import snapshots as node_snapshots
from slurm_guard.core.base import GuardBase, check_arguments
from slurm_guard.core.calls import NO_SYNC, StepCalls, StepPlan
from slurm_guard.core.setup import warn_small_world
from slurm_guard.core.state import ReplicatedState
from slurm_guard.core.stateful import Stateful, check_stateful
from slurm_guard.core.stateful import setup_fields as stateful_fields
from slurm_guard.errors import GuardError
from slurm_guard.rundir.checkpoint import rng_state
from slurm_guard.rundir.layout import RunDir

logger = logging.getLogger(__name__)


class GuardCore(GuardBase, StepCalls):
    """Guarded DDP training without the loop: see the module docstring for the order of calls.

    Args are `Guard`'s (the DDP model, its optimizer, `loss_fn(model, batch)`, the shared run
    directory, the config and an optional GradScaler).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        run_dir: str | os.PathLike[str],
        config: GuardConfig | None = None,
        scaler: torch.amp.GradScaler | None = None,
        stateful: Mapping[str, Stateful] | None = None,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise GuardError(
                f"Guard needs a DistributedDataParallel model, got {type(model).__name__}; wrap "
                "it first: model = torch.nn.parallel.DistributedDataParallel(model)"
            )
        check_arguments(
            "Guard",
            optimizer,
            loss_fn,
            run_dir,
            config,
            scaler=(scaler, (torch.amp.GradScaler, type(None))),
            stateful=(stateful, (Mapping, type(None))),
        )
        if not dist.is_initialized():
            raise GuardError("torch.distributed is not initialized; call init_process_group first")
        self.config = config if config is not None else GuardConfig()
        self.run_dir = RunDir(run_dir)
        self.ddp = model
        self.module: nn.Module = model.module
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scaler = scaler
        self.stateful = check_stateful(stateful)  # saved per rank in every checkpoint
        self.group: dist.ProcessGroup | None = model.process_group
        self._open_run(
            group=self.group,
            module=self.module,
            ddp=model,
            label="Guard()",
            setup_fields=stateful_fields(self.stateful, scaler),
        )
        self.comm_device = self.comm.device
        warn_small_world(self.topology, self.rank)
        self._wire_checks(self.module)
        self.hook = HookState(
            group=self.group,
            world_size=self.world_size,
            fingerprinter=self.fingerprinter,
            signs=SignVectors(self.fingerprinter.seed),
            param_index={id(p): i for i, p in enumerate(self.params)},
            corrupt_reduced=(
                self.injector.corrupt_reduced if self.injector.corrupts_reduction else None
            ),
            watch=self.comm.watch,
        )
        model.register_comm_hook(self.hook, guard_comm_hook)
        self.verifier = Verifier(
            comm=self.comm,
            topology=self.topology,
            fingerprinter=self.fingerprinter,
            hook=self.hook,
            replay=self._replay,
            config=self.config,
            ledger=self._ledger,
            params=self.params,
            # a disabled scaler (GradScaler(enabled=False): bf16, CPU) never skips an update
            scaler_active=scaler is not None and scaler.is_enabled(),
            abft=self.abft,
        )
        self.replicated = ReplicatedState(
            self.module,
            optimizer,
            self.fingerprinter,
            broadcast_buffers=getattr(model, "broadcast_buffers", False),
        )
        self.step_count = 0
        self.rng_after_step: dict[str, torch.Tensor] | None = None  # see _updated
        self.last_grad_norm: torch.Tensor | None = None  # the clip's norm, on the device
        self._open: tuple[StepPlan, list[Captured]] | None = None  # capture() .. check()
        self._checked: tuple[StepPlan, StepResult] | None = None  # check() .. after_update()
        self._settled = not self.config.settle_buckets
        self.voted_at = -1  # step_count right after the last clean vote
        # Verified state in node-local memory after each passing vote (GuardConfig.snapshots).
        self.snapshots = node_snapshots.attach(self) if self.config.snapshots else None
        self._record_start()

    # ---------------------------------------------------------------- set-up helpers

    def _settle_buckets(self, batch: Any) -> None:
        """One discarded forward/backward so DDP rebuilds its buckets before the first real step.

        DDP re-lays out its buckets after the first backward, and gloo sums an element in an
        order that depends on its position in the bucket; without this, a resumed run's first
        step differs from the uninterrupted run's in the last bits.
        """
        first = batch[0] if isinstance(batch, Microbatches) else batch
        self.hook.active = False
        # Inside a framework's no_sync() (the HF Trainer's first microbatch) DDP would record no
        # gradient order from this pass, and a resumed run's first step would keep the old layout.
        sync, self.ddp.require_backward_grad_sync = self.ddp.require_backward_grad_sync, True
        try:
            with preserved_state(self.module):
                if self.abft is None:
                    self.scaled(self.loss(first)).backward()  # type: ignore[no-untyped-call]
                else:  # the same pass, counted: which share of the matmul FLOPs is checked
                    coverage = measure_coverage(self.module, lambda: self.scaled(self.loss(first)))
                    self.abft_coverage = coverage.as_dict()
        finally:
            self.ddp.require_backward_grad_sync = sync
            self.hook.active = True
            self.optimizer.zero_grad(set_to_none=True)
        self._settled = True
        if self.abft_coverage is not None and self.rank == 0:
            try:
                self._write_run_file()  # run.json now says what the checks cover
            except OSError:
                logger.exception("could not record the checked-GEMM coverage in run.json")

    # ---------------------------------------------------------------- one step

    def loss(self, batch: Any) -> torch.Tensor:
        """`loss_fn` on the DDP model, checked to be a scalar tensor."""
        loss = self.loss_fn(self.ddp, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
            raise GuardError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}{shape}; "
                "reduce the loss (e.g. .mean()) inside loss_fn"
            )
        return loss

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as backward() must see it (scaled under a GradScaler)."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def begin_step(self, batch: Any) -> StepPlan:
        """Before the step's first forward: arrival, capture for a replay, fresh gradients."""
        step = self.step_count
        # No store request: the hang watch names a rank stuck elsewhere if the step's
        # collectives wait longer than watchdog_seconds, and the step's tag travels with them.
        self.comm.arm(f"step {step}")
        if not self._settled:
            self._settle_buckets(batch)
        if self.abft is not None:
            self.abft.reset()
        self.injector.step = step
        verify = self.config.is_replay_step(step, self.fingerprinter.seed) and self.world_size > 1
        captured = capture(batch)
        if verify:
            self.note_batch(step, batch)
        self.replicated.snapshot_due = True
        self.optimizer.zero_grad(set_to_none=True)
        exact = self.config.deterministic
        self.hook.reset(fingerprint_local=verify and exact, sketch_local=verify and not exact)
        return StepPlan(step, verify, captured)

    def finish_step(self, plan: StepPlan, losses: Sequence[torch.Tensor]) -> StepResult:
        """After the last backward: every check of the step, decided together by every rank.

        Raises:
            SilentDataCorruption: on every rank, after the alarm record is written.
        """
        if self.hook.buckets == 0:  # every rank sees it: none reaches a collective mismatched
            raise GuardError(NO_SYNC.format(call="the step's last backward"))
        step_loss = combined_loss(losses)
        result = self.verifier.check_step(plan.step, step_loss, plan.captured, plan.verify)
        if result.verified:
            self.last_verified_step = plan.step
            self.verified_steps.append(plan.step)
        if result.finding is not None:
            # the suspect repeats the failing microbatch first: persistent or transient
            finding = triage_alarm(self.verifier, result.finding, plan.captured, plan.step)
            self.alarm(finding, plan.step, update_applied=False)
        if self.snapshots is not None:
            # Before any update, by the guard or a framework: the snapshot in flight has read
            # the state (a wait on the device, no host sync).
            self.snapshots.fence()
        return result

    def apply_update(self, plan: StepPlan, result: StepResult) -> None:
        """The optimizer step if the checks allow it, then the vote when one is due."""
        if not result.skip_update:
            self._clip()
            self._optimizer_step()
        self._updated(plan, result)

    def _clip(self) -> None:
        """`max_grad_norm`: after the checks and the scaler's unscale, before the update."""
        if self.config.max_grad_norm is None:
            return
        if self.scaler is not None and self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)  # scaler.step then does not unscale again
        # on the averaged gradients, so the norm is the same on every rank; no host read
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.last_grad_norm = norm.detach()

    def _optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the update itself on an overflow
            self.scaler.update()
        else:
            self.optimizer.step()

    def _updated(self, plan: StepPlan, result: StepResult) -> None:
        if not result.skip_update:
            self.injector.after_update()
            if self.config.is_vote_step(plan.step):
                self.vote(plan.step)
        self.step_count = plan.step + 1
        self._first_step_done()
        self.comm.disarm()  # every entry point: user code until the next step is not watched
        # what a checkpoint saves: an eval or logging between this step and the save draws
        # from the RNG again after a resume, so the restored state must be the one before it
        self.rng_after_step = rng_state()

    def _replay(self, captured: Captured) -> ReplayOutput:
        """Recompute another rank's step here (faults that hit this rank's replays apply)."""
        with self.injector.replay():
            scale = self.scaler.scale if self.scaler is not None else None
            return recompute(self.module, self.loss_fn, captured, self.params, scale)

    # ---------------------------------------------------------------- the vote and alarms

    def state_tensors(self, buffers: bool = True) -> list[torch.Tensor]:
        """Everything replicas must hold identically: parameters, buffers, optimizer state."""
        return self.replicated.tensors(buffers)

    def vote_fingerprint(self) -> torch.Tensor:
        """Parameters and optimizer state now; buffers as broadcast at this step's forward."""
        return self.replicated.vote_fingerprint()

    def vote(self, step: int) -> None:
        """Weight-fingerprint vote on the state after `step`'s update."""
        fingerprint = self.vote_fingerprint()
        finding = self.verifier.vote(step, fingerprint)
        if finding is not None:
            self.alarm(finding, step, update_applied=True)
        self.voted_at = step + 1
        if self.snapshots is not None:  # sealed with the vote's fingerprint, not a second one
            node_snapshots.take(self, self.snapshots, step + 1, fingerprint)
