"""ShardedGuard: the Guard's interface for a model wrapped with FSDP2's `fully_shard`.

The same calls as `Guard` (`step`, or `capture` / `check` / `update` for a loop the user
keeps; `save_checkpoint`, `resume`, `exit_on_alarm`), the same run directory, alarm records
and resume rule, so the controller and the epilog handle a sharded job unchanged. What the
checks are, and which of them each layout (FSDP2, HSDP, either with tensor parallel) allows,
is in docs/integrations/fsdp.md; where each rank sits is `sharded.layout`'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slurm_guard.checks.replay import LossFn, Microbatches, capture
from slurm_guard.checks.rows import StepResult
from slurm_guard.checks.verdicts import bits_to_float
from slurm_guard.config import GuardConfig
from slurm_guard.core import decide, events
from slurm_guard.core.base import GuardBase, check_arguments
from slurm_guard.core.calls import StepCalls, StepPlan
from slurm_guard.core.snapshot_proof import STARTED_FROM
from slurm_guard.errors import GuardError
from slurm_guard.faults import Fault
from slurm_guard.faults.injection import (
    BACKWARD_KINDS,
    corrupt_gradient,
    flip_element,
    scale_and_shift,
)
from slurm_guard.fingerprint.tree import as_hex
from slurm_guard.protocol import Check
from slurm_guard.rundir.checkpoint import rng_state
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.trust import TRUST_POINT
from slurm_guard.sharded import checkpoint, snapshots
from slurm_guard.sharded.hooks import ReduceScatterState, fsdp_modules, install
from slurm_guard.sharded.layout import derive, refuse_pipeline_stage
from slurm_guard.sharded.update_check import UpdateCheck, unsupported
from slurm_guard.sharded.verifier import ShardedVerifier
from slurm_guard.sharded.vote import local_state, shard

HOOK_KINDS = ("activation", "gemm")  # faults the shared injector applies through module hooks


class ShardedGuard(GuardBase, StepCalls):
    """Guarded FSDP2 / HSDP training. The arguments are `Guard`'s, for a `fully_shard` model.

    Args:
        model: the root module wrapped with `fully_shard` (each block first, then the root),
            on a 1-D mesh (FSDP2) or a 2-D (replicate, shard) mesh (HSDP), optionally after a
            tensor-parallel plan on its own mesh dimension (torchtitan's `apply_tp`).
        optimizer: the optimizer over the model's (sharded) parameters.
        loss_fn: `loss_fn(model, batch) -> scalar tensor`, called for the step and for replays.
        run_dir: a directory on a filesystem shared by every node and by the controller.
        config: what to check and how often (`GuardConfig`; `abft=True` checks every Linear).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        run_dir: str | os.PathLike[str],
        config: GuardConfig | None = None,
    ) -> None:
        check_arguments("ShardedGuard", optimizer, loss_fn, run_dir, config)
        if not dist.is_initialized():
            raise GuardError("torch.distributed is not initialized; call init_process_group first")
        refuse_pipeline_stage(model)
        units = fsdp_modules(model)  # raises unless fully_shard wrapped the root
        self.config = config if config is not None else GuardConfig()
        if not self.config.deterministic:
            raise GuardError(
                "ShardedGuard compares replays exactly: GuardConfig(deterministic=False) is not "
                "supported under FSDP yet (docs/integrations/fsdp.md)"
            )
        self.run_dir = RunDir(run_dir)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        # Every refusal here is local and the same on every rank: no collective is left waiting.
        self.layout = derive(model, units, dist.get_world_size())
        if self.layout.shards < 2:
            raise GuardError(
                f"ShardedGuard needs 2 or more shards per replica group, not a "
                f"{self.layout.replicas}x1 mesh: with one shard FSDP2 skips the reduce-scatter "
                "whose input the guard checks. Replication alone is data parallelism: use DDP "
                "and sg.Guard"
            )
        mesh_field = {"layout": self.layout.describe(), "ranks": repr(self.layout.grid)}
        if self.config.update_check:
            # each rank decides from its own optimizer whether the update check runs (a step
            # hook on one rank only): agreed here, or the ranks' exchanges would not pair up
            mesh_field["update_check"] = unsupported(optimizer) or "recomputable"
        self._open_run(
            group=None,
            module=model,
            ddp=None,  # no DDP buckets under FSDP
            label="ShardedGuard()",
            setup_fields=mesh_field,
            allowed_faults=self._supported,
        )
        mine = [f for f in self.faults if f.targets(self.rank, self.node)]
        self._wire_checks(model, hooked=HOOK_KINDS)
        self._grad_faults = [f for f in mine if f.kind in BACKWARD_KINDS]
        self._weight_faults = [f for f in mine if f.kind == "weight-bitflip"]
        self._reduction_faults = [f for f in mine if f.kind == "allreduce"]
        self.rs_state = ReduceScatterState(
            self.fingerprinter,
            corrupt=self._corrupt_gradient,
            corrupt_output=self._corrupt_reduction if self._reduction_faults else None,
        )
        install(model, self.rs_state)
        self.verifier = ShardedVerifier(
            comm=self.comm,
            topology=self.topology,
            layout=self.layout,
            model=model,
            loss_fn=loss_fn,
            state=self.rs_state,
            injector=self.injector,
            config=self.config,
            ledger=self._ledger,
            abft=self.abft,
        )
        self.update_check = UpdateCheck(
            comm=self.comm,
            topology=self.topology,
            layout=self.layout,
            shifts=(self.verifier.first_shift, self.verifier.settling_shift),
            model=model,
            optimizer=optimizer,
            fingerprinter=self.fingerprinter,
            ledger=self._ledger,
            config=self.config,
        )
        self.step_count = 0
        self.voted_at = -1
        self.rng_after_step: dict[str, torch.Tensor] | None = None
        self._open = None
        self._checked = None
        self._rng_at_begin: dict[str, torch.Tensor] | None = None  # a checked step's RNG
        self._trust_points = self.layout.replicas == 1 and self.abft is not None
        # No copy to vote on (FSDP2, FSDP2 + TP): snapshots follow the checked steps instead.
        self._snap_at_checks = self.layout.replicas == 1 and (
            self._trust_points or self.layout.dp_indices >= 2
        )
        # Verified shards in node-local memory, copied to a peer node (GuardConfig.snapshots).
        self.snapshots = snapshots.attach(self) if self.config.snapshots else None
        self._record_start()

    def _checks_line(self) -> str:
        """The start line names the layout and only the checks it allows (the vote needs
        replica groups, a replay two data-parallel indices)."""
        return events.checks_line(
            self.config,
            self.world_size,
            len(self.topology.nodes),
            layout=self.layout.describe(),
            dp_indices=self.layout.dp_indices,
            replicas=self.layout.replicas,
            update_check=self.update_check.active,
        )

    def _run_file_layout(self) -> dict[str, Any]:
        """The mesh and the first replay round's pairs (none below 2 data-parallel indices:
        each rank then replays nobody, `replayer[r] == r`), as run.json records them."""
        replayer = list(range(self.world_size))
        if self.verifier.first_shift is not None:
            for owner, rank in self.layout.pairs(self.verifier.first_shift):
                replayer[owner] = rank
        return {
            "replayer": replayer,
            "layout": {
                "describe": self.layout.describe(),
                "coordinates": self.layout.coordinates(),
            },
        }

    @staticmethod
    def _supported(faults: tuple[Fault, ...]) -> tuple[Fault, ...]:
        supported = (*HOOK_KINDS, *BACKWARD_KINDS, "weight-bitflip", "allreduce")
        for fault in faults:
            if fault.kind not in supported:
                raise GuardError(f"fault kind {fault.kind!r} is not available under ShardedGuard")
        return faults

    # ---------------------------------------------------------------- faults (tests, drills)

    def _corrupt_reduction(self, chunk: torch.Tensor, call: int) -> None:
        """An `allreduce` fault: a wrong value in this rank's output of reduce-scatter `param`."""
        for fault in self._reduction_faults:
            if call == fault.param and self.injector.active(fault):
                self.injector.apply(fault, chunk, scale_and_shift)

    def _corrupt_gradient(self, buffer: torch.Tensor, call: int) -> None:
        """A gradient fault hits this rank's unreduced gradient of reduce-scatter `param`."""
        for fault in self._grad_faults:
            if call == fault.param and self.injector.active(fault):
                self.injector.apply(fault, buffer, corrupt_gradient)

    def _flip_weights(self) -> None:
        with torch.no_grad():
            for fault in self._weight_faults:
                if self.injector.active(fault):
                    local = shard(self.params[fault.param % len(self.params)])
                    self.injector.apply(fault, local, flip_element)

    # ---------------------------------------------------------------- one step

    def loss(self, batch: Any) -> torch.Tensor:
        loss = self.loss_fn(self.model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise GuardError("loss_fn must return a scalar tensor; reduce it inside loss_fn")
        return loss

    def step(self, batch: Any) -> float:
        """Forward, backward, checks and, only if they pass, the optimizer step; the loss.

        Raises:
            SilentDataCorruption: on every rank, after the alarm record is written.
        """
        plan = self.begin_step(batch)
        loss = self.loss(batch)
        loss.backward()  # type: ignore[no-untyped-call]
        result = self.finish_step(plan, [loss.detach()])
        if not result.skip_update:
            self._clip()
            self._optimizer_step()
        self._updated(plan, result)
        return bits_to_float(self.verifier.last_loss_bits)

    def begin_step(self, batch: Any) -> StepPlan:
        if isinstance(batch, Microbatches):
            raise GuardError("ShardedGuard takes one batch per step (no Microbatches yet)")
        step = self.step_count
        self.comm.arm(f"step {step}")  # the hang watch: no store request on the step path
        if self.abft is not None:
            self.abft.reset()
        self.injector.step = step
        seed = self.fingerprinter.seed
        verify_due = self.config.is_replay_step(step, seed)
        verify = self.layout.dp_indices > 1 and verify_due
        # a snapshot of this step's start may follow its checks: the RNG it restores
        snap = self.snapshots is not None and self._snap_at_checks and verify_due
        self._rng_at_begin = rng_state() if snap else None
        captured = capture(batch)
        if verify:
            self.note_batch(step, batch)
        self.optimizer.zero_grad(set_to_none=True)
        self.rs_state.reset(fingerprint=verify)
        return StepPlan(step, verify, captured)

    def finish_step(self, plan: StepPlan, losses: Sequence[torch.Tensor]) -> StepResult:
        if len(losses) != 1:
            raise GuardError("ShardedGuard takes one batch per step (no Microbatches yet)")
        if not self.rs_state.sums:  # the same on every rank: before any collective
            raise GuardError(
                "FSDP did not reduce-scatter this step's gradients (set_requires_gradient_sync"
                "(False)?): call the guard around the backward that synchronises"
            )
        grads = [shard(p.grad) for p in self.params if p.grad is not None]
        # the state this step started from, where a snapshot of it may follow the checks: its
        # fingerprint goes into the ledger entry that proves the snapshot (`snapshot_proof`)
        lanes = self.shard_fingerprint() if self._rng_at_begin is not None else None
        result = self.verifier.check_step(
            plan.step, losses[0], plan.captured, plan.verify, grads, started_from=lanes
        )
        trusted = result.finding is None and self._trust_point(plan.step, lanes)
        if result.verified or trusted:
            self.last_verified_step = plan.step
            self.verified_steps.append(plan.step)
        if result.finding is not None:
            self.alarm(result.finding, plan.step, update_applied=False)
        checked = trusted or (result.verified and self._snap_at_checks)
        if checked and result.finding is None and lanes is not None:
            # the state this checked step started from, before the update changes it
            self._snapshot(plan.step, lanes, self._rng_at_begin)
        if self.snapshots is not None:
            self.snapshots.fence()  # the snapshot in flight has read the shards the update writes
        return result

    def _trust_point(self, step: int, started_from: torch.Tensor | None) -> bool:
        """Pure FSDP2 with `abft=True`: no replica to replay against, so at the replay cadence a
        step whose checked GEMMs, conservation and finite checks passed counts toward trust
        (recorded in the ledger; docs/integrations/fsdp.md, "Trust without replicas").
        `started_from`: rank 0's shards as the step began, recorded for the snapshot of them."""
        if not self._trust_points:
            return False
        if not self.config.is_replay_step(step, self.fingerprinter.seed):
            return False
        detail: dict[str, object] = {TRUST_POINT: "GEMMs, conservation, finite checks passed"}
        if started_from is not None and self.rank == 0:
            detail[STARTED_FROM] = as_hex(started_from)
        self._ledger(step, Check.ABFT, True, detail)
        return True

    def _clip(self) -> None:
        if self.config.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
            self.last_grad_norm = norm.detach()

    def _optimizer_step(self) -> None:
        # the inputs as the optimizer takes them: after clipping, before the step changes them
        self.update_check.send(self.step_count)
        self.optimizer.step()

    def _updated(self, plan: StepPlan, result: StepResult) -> None:
        if not result.skip_update:
            self._flip_weights()
            due = self.layout.replicas > 1 or self.update_check.pending
            if due and self.config.is_vote_step(plan.step):
                self.vote(plan.step)
        self.step_count = plan.step + 1
        self._first_step_done()
        self.comm.disarm()  # user code until the next step is not watched
        self.rng_after_step = rng_state()

    # ---------------------------------------------------------------- vote, alarms, records

    def shard_fingerprint(self) -> torch.Tensor:
        """This rank's parameter and optimizer-state shards, fingerprinted (lanes, no host read)."""
        return self.fingerprinter.tensors(local_state(self.model, self.optimizer))

    def state_tensors(self) -> list[torch.Tensor]:
        """This rank's shards of what the replica groups hold alike (for `result.json`)."""
        return local_state(self.model, self.optimizer)

    def vote(self, step: int) -> None:
        """The shard vote on the state after `step`'s update; without replica groups (FSDP2
        alone keeps one copy of each shard) the update check, where `step`'s inputs were sent."""
        if self.layout.replicas > 1:
            lanes = self.shard_fingerprint()
            finding = self.verifier.vote(step, lanes)
            if finding is not None:
                self.alarm(finding, step, update_applied=True)
            if self.snapshots is not None:
                self._snapshot(step + 1, lanes)
        elif self.update_check.pending:
            finding = self.update_check.check(step, self.shard_fingerprint())
            if finding is not None:
                self.alarm(finding, step, update_applied=True)
        self.voted_at = step + 1

    def _snapshot(
        self, steps_done: int, lanes: torch.Tensor, rng: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Snapshot the verified shards after `steps_done` steps (all ranks, off the path)."""
        assert self.snapshots is not None
        if rng is None:
            # An RNG drawn between a step and a save (an eval) is not the state to restore.
            between_steps = steps_done == self.step_count and self.rng_after_step is not None
            rng = self.rng_after_step if between_steps and self.rng_after_step else rng_state()
        self.snapshots.take(steps_done, lanes, rng)

    # ---------------------------------------------------------------- checkpoints

    def save_checkpoint(self, if_: bool | None = None) -> Path | None:
        """Shard vote, then a sealed DCP save into run_dir/checkpoints/step-N (all ranks)."""
        if if_ is not None and not self.agree_on(bool(if_), src=0):
            return None
        path = checkpoint.save_checkpoint(self)
        self.after_save()
        return path

    def resume(self) -> int:
        """Load the trusted DCP checkpoint (the DDP guard's rule); the step to start from."""
        return checkpoint.resume(self)

    def agree_on(self, value: Any, src: int = 0) -> Any:
        """Rank `src`'s value on every rank (see `Guard.agree_on`)."""
        return decide.agree_on(self.comm, value, src)
