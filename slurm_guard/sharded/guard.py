"""ShardedGuard: the Guard's interface for a model wrapped with FSDP2's `fully_shard`.

The same calls as `Guard` (`step`, or `capture` / `check` / `update` for a loop the user
keeps; `save_checkpoint`, `resume`, `exit_on_alarm`), the same run directory, alarm records
and resume rule, so the controller and the epilog handle a sharded job unchanged. What the
checks are, and which of them a 1-D (FSDP2) or 2-D (HSDP) mesh allows, is in
docs/integrations/fsdp.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from slurm_guard.abft import Abft
from slurm_guard.abft import attach as attach_abft
from slurm_guard.checks.replay import LossFn, Microbatches, capture, is_replaying
from slurm_guard.checks.rows import StepResult
from slurm_guard.checks.verdicts import Finding, bits_to_float
from slurm_guard.comm.collective import Collective
from slurm_guard.comm.topology import Topology, gather_rank_infos, local_rank_info
from slurm_guard.config import GuardConfig
from slurm_guard.core import decide
from slurm_guard.core.calls import StepCalls, StepPlan
from slurm_guard.core.setup import (
    agree_on_seed,
    check_same_setup,
    prepare_run_dir,
    warm_kernels,
)
from slurm_guard.errors import GuardError
from slurm_guard.faults import Fault, FaultInjector, faults_from_env
from slurm_guard.faults.injection import BACKWARD_KINDS, flip_bit
from slurm_guard.fingerprint import FastFingerprinter, Fingerprinter
from slurm_guard.protocol import Check
from slurm_guard.rundir.alarms import AlarmWriter
from slurm_guard.rundir.checkpoint import rng_state
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import LedgerEntry, append_ledger
from slurm_guard.rundir.start import open_run_dir, write_run_file
from slurm_guard.sharded import checkpoint
from slurm_guard.sharded.hooks import ReduceScatterState, fsdp_modules, install
from slurm_guard.sharded.replay import Mesh
from slurm_guard.sharded.verifier import ShardedVerifier
from slurm_guard.sharded.vote import local_state, shard

logger = logging.getLogger(__name__)

HOOK_KINDS = ("activation", "gemm")  # faults the shared injector applies through module hooks


def _mesh(model: nn.Module) -> Mesh:
    """The parameters' device mesh as global ranks: (replicate, shard) or one shard dimension."""
    param = next(p for p in model.parameters())
    device_mesh = getattr(param, "device_mesh", None)
    if device_mesh is None:
        raise GuardError("ShardedGuard: the model's parameters are not DTensors (no fully_shard?)")
    ranks = device_mesh.mesh.tolist()
    if device_mesh.ndim == 1:
        return Mesh((tuple(ranks),))
    if device_mesh.ndim == 2:
        return Mesh(tuple(tuple(row) for row in ranks))
    raise GuardError(
        f"ShardedGuard supports 1-D (FSDP) and 2-D (HSDP) meshes, not {device_mesh.ndim}-D"
    )


class ShardedGuard(StepCalls):
    """Guarded FSDP2 / HSDP training. The arguments are `Guard`'s, for a `fully_shard` model.

    Args:
        model: the root module wrapped with `fully_shard` (each block first, then the root),
            on a 1-D mesh (FSDP2) or a 2-D (replicate, shard) mesh (HSDP).
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
        if not dist.is_initialized():
            raise GuardError("torch.distributed is not initialized; call init_process_group first")
        fsdp_modules(model)  # raises unless fully_shard wrapped the root
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
        self.mesh = _mesh(model)
        if self.mesh.shards < 2:  # the same on every rank: no collective is left waiting
            raise GuardError(
                f"ShardedGuard needs 2 or more shards per replica group, not a {self.mesh.replicas}"
                "x1 mesh: with one shard FSDP2 skips the reduce-scatter whose input the guard "
                "checks. Replication alone is data parallelism: use DDP and sg.Guard"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        me = local_rank_info(self.rank)
        self.comm = Collective(None, me.node, self.config.watchdog_seconds)
        self.job_id = os.environ.get("SLURM_JOB_ID")
        self.restart_count = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.comm.arrive("ShardedGuard() set-up")
        mesh_field = {"mesh (replicas x shards)": repr((self.mesh.replicas, self.mesh.shards))}
        check_same_setup(self.comm, self.config, self.params, mesh_field)
        prepare_run_dir(self.comm, self.run_dir.root)
        self.kernels = warm_kernels(self.comm, None, self.params)  # no DDP buckets under FSDP
        self.topology = Topology.build(gather_rank_infos(me, comm=self.comm))
        self.opened = open_run_dir(
            self.comm,
            self.run_dir,
            self.rank,
            self.world_size,
            self.topology,
            job_id=self.job_id,
            restart_count=self.restart_count,
        )
        self.attempt = self.opened.attempt
        self.run_id: str | None = self.opened.run_id
        seed = agree_on_seed(self.comm, self.config, self.run_dir)
        self.fingerprinter: Fingerprinter = FastFingerprinter(seed)
        self.faults: tuple[Fault, ...] = self.comm.agree(
            lambda: self._supported(self.config.faults + faults_from_env()),
            "fault injection settings (GuardConfig.faults, SLURM_GUARD_INJECT)",
        )
        mine = [f for f in self.faults if f.targets(self.rank, me.node)]
        hooked = tuple(f for f in mine if f.kind in HOOK_KINDS)
        self.injector = FaultInjector(hooked, self.rank, me.node, model)
        self._grad_faults = [f for f in mine if f.kind in BACKWARD_KINDS]
        self._weight_faults = [f for f in mine if f.kind == "weight-bitflip"]
        self._reduction_faults = [f for f in mine if f.kind == "allreduce"]
        self.alarm_writer = AlarmWriter(
            run_dir=self.run_dir,
            comm=self.comm,
            topology=self.topology,
            rank=self.rank,
            world_size=self.world_size,
            job_id=self.job_id,
            restart_count=self.restart_count,
            attempt=self.attempt,
            trust_replays=self.config.trust_replays,
            faults=self.faults,
        )
        self.abft: Abft | None = None
        if self.config.abft:  # after the injector, whose gemm faults wrap the same layers
            config = self.config
            self.abft = attach_abft(model, margin=config.abft_margin, block=config.abft_block)
            self.abft.set_suspended(is_replaying)  # a replay judges another rank's step
        self.rs_state = ReduceScatterState(
            self.fingerprinter,
            corrupt=self._corrupt_gradient,
            corrupt_output=self._corrupt_reduction if self._reduction_faults else None,
        )
        install(model, self.rs_state)
        self.verifier = ShardedVerifier(
            comm=self.comm,
            topology=self.topology,
            mesh=self.mesh,
            model=model,
            loss_fn=loss_fn,
            state=self.rs_state,
            injector=self.injector,
            config=self.config,
            ledger=self._ledger,
            abft=self.abft,
        )
        self.step_count = 0
        self.voted_at = -1
        self.last_verified_step: int | None = None
        self.verified_steps: list[int] = []
        self.rng_after_step: dict[str, torch.Tensor] | None = None
        self._open = None
        self._checked = None
        problem = None
        if self.rank == 0:
            try:
                write_run_file(
                    self.run_dir,
                    self.opened,
                    seed=self.fingerprinter.seed,
                    job_id=self.job_id,
                    restart_count=self.restart_count,
                    world_size=self.world_size,
                    topology=self.topology,
                    config=self.config,
                    faults=self.faults,
                    abft_coverage=None,
                    started=time.time(),
                )
            except Exception as exc:  # any failure must reach every rank too
                logger.exception("could not write %s", self.run_dir.run_file)
                problem = f"cannot write {self.run_dir.run_file} ({exc})"
        self.comm.share_problem(problem, "run.json")

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
                flat = chunk.view(-1)
                i = fault.element % flat.numel()
                flat[i] = flat[i] * fault.factor + fault.factor

    def _corrupt_gradient(self, buffer: torch.Tensor, call: int) -> None:
        """A gradient fault hits this rank's unreduced gradient of reduce-scatter `param`."""
        for fault in self._grad_faults:
            if call == fault.param and self.injector.active(fault):
                flat = buffer.view(-1)
                i = fault.element % flat.numel()
                if fault.kind == "grad-scale":
                    flat[i] = flat[i] * fault.factor
                elif fault.kind == "grad-bitflip":
                    flip_bit(buffer, i, fault.bit)
                else:
                    flat[i] = float("nan") if fault.kind == "nan" else float("inf")

    def _flip_weights(self) -> None:
        with torch.no_grad():
            for fault in self._weight_faults:
                if self.injector.active(fault):
                    local = shard(self.params[fault.param % len(self.params)])
                    flip_bit(local, fault.element % local.numel(), fault.bit)

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
        verify = self.mesh.replicas > 1 and self.config.is_replay_step(step, seed)
        captured = capture(batch)
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
        result = self.verifier.check_step(plan.step, losses[0], plan.captured, plan.verify, grads)
        if result.verified:
            self.last_verified_step = plan.step
            self.verified_steps.append(plan.step)
        if result.finding is not None:
            self.alarm(result.finding, plan.step, update_applied=False)
        return result

    def _clip(self) -> None:
        if self.config.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
            self.last_grad_norm = norm.detach()

    def _optimizer_step(self) -> None:
        self.optimizer.step()

    def _updated(self, plan: StepPlan, result: StepResult) -> None:
        if not result.skip_update:
            self._flip_weights()
            if self.mesh.replicas > 1 and self.config.is_vote_step(plan.step):
                self.vote(plan.step)
        self.step_count = plan.step + 1
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
        """The shard vote on the state after `step`'s update (nothing to compare without
        replica groups: FSDP2 alone keeps one copy of each shard)."""
        if self.mesh.replicas > 1:
            finding = self.verifier.vote(step, self.shard_fingerprint())
            if finding is not None:
                self.alarm(finding, step, update_applied=True)
        self.voted_at = step + 1

    def alarm(self, finding: Finding, step: int, *, update_applied: bool) -> NoReturn:
        self.alarm_writer.raise_alarm(
            finding,
            step,
            update_applied=update_applied,
            last_verified=self.last_verified_step,
            verified_steps=self.verified_steps,
        )

    def _ledger(self, step: int, check: Check, passed: bool, detail: dict[str, object]) -> None:
        if self.rank != 0:
            return
        try:
            append_ledger(
                self.run_dir.ledger, LedgerEntry(step, check, passed, detail, self.restart_count)
            )
        except OSError:
            logger.exception("could not append to the ledger")

    # ---------------------------------------------------------------- checkpoints

    def save_checkpoint(self, if_: bool | None = None) -> Path | None:
        """Shard vote, then a sealed DCP save into run_dir/checkpoints/step-N (all ranks)."""
        if if_ is not None and not self.agree_on(bool(if_), src=0):
            return None
        return checkpoint.save_checkpoint(self)

    def resume(self) -> int:
        """Load the trusted DCP checkpoint (the DDP guard's rule); the step to start from."""
        return checkpoint.resume(self)

    def agree_on(self, value: Any, src: int = 0) -> Any:
        """Rank `src`'s value on every rank (see `Guard.agree_on`)."""
        return decide.agree_on(self.comm, value, src)
