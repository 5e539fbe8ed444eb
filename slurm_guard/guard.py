"""The Guard: a DDP training step with silent-data-corruption checks around it.

One `guard.step(batch)` is forward, backward, the checks, and the optimizer step only if every
check passed. Checks are decided collectively (`verification.py`): every rank gathers the same few
numbers and reaches the same verdict, so no rank hangs or continues while another stops.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slurm_guard import checkpoint as ckpt
from slurm_guard.abft import Abft, measure_coverage
from slurm_guard.abft import attach as attach_abft
from slurm_guard.alarm_writer import AlarmWriter
from slurm_guard.collective import Collective
from slurm_guard.config import GuardConfig
from slurm_guard.errors import EXIT_SDC, GuardError, SilentDataCorruption
from slurm_guard.faults import Fault, FaultInjector, faults_from_env
from slurm_guard.fingerprint import Fingerprinter, as_hex, as_int
from slurm_guard.fingerprint_fast import FastFingerprinter
from slurm_guard.hooks import HookState, SignVectors, guard_comm_hook
from slurm_guard.protocol import Check
from slurm_guard.records import LedgerEntry, RecordError, append_ledger, read_json_file
from slurm_guard.replay import (
    Captured,
    LossFn,
    Microbatches,
    ReplayOutput,
    capture,
    combined_loss,
    is_replaying,
    preserved_state,
    recompute,
)
from slurm_guard.restore import load_checkpoint, record_rollback, resume_collectively
from slurm_guard.run_identity import check_unchanged
from slurm_guard.run_lock import RunLock
from slurm_guard.run_start import open_run_dir, write_run_file
from slurm_guard.rundir import RunDir
from slurm_guard.setup_checks import announce_faults, check_same_setup, warn_small_world
from slurm_guard.topology import Topology, gather_rank_infos, local_rank_info
from slurm_guard.triage import triage_alarm
from slurm_guard.verdicts import Finding, bits_to_float
from slurm_guard.verification import Verifier

logger = logging.getLogger(__name__)


def check_run_dir(path: Path) -> None:
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as exc:
        raise GuardError(
            f"run directory {path} cannot be accessed ({exc.strerror}); every rank and the "
            "controller must be able to read and write it"
        ) from None
    if not exists:
        raise GuardError(
            f"run directory {path} does not exist; create it on a filesystem shared by all "
            "nodes (not node-local disk) and pass its path"
        )
    if not is_dir:
        raise GuardError(f"run directory {path} is not a directory")
    probe = path / f".write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise GuardError(
            f"run directory {path} is not writable ({exc.strerror}); alarms and checkpoints go "
            "there: fix its permissions or choose another directory"
        ) from None


class Guard:
    """Guarded DDP training. See the README for the five lines a training loop needs.

    Args:
        model: the DDP-wrapped model; the guard registers its communication hook on it.
        optimizer: the optimizer over the model's parameters; the guard steps and zeroes it.
        loss_fn: `loss_fn(model, batch) -> scalar tensor`, called with the DDP model for the
            step and with the plain module for replays.
        run_dir: a directory on a filesystem shared by every node and by the controller.
        config: what to check and how often.
        scaler: the GradScaler for mixed precision, if any. The guard scales the loss, steps
            through the scaler, and treats its overflow skips (non-finite gradients that a
            replay on another node reproduces) as expected, not as alarms.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        run_dir: str | os.PathLike[str],
        config: GuardConfig | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise GuardError(
                f"Guard needs a DistributedDataParallel model, got {type(model).__name__}; wrap "
                "it first: model = torch.nn.parallel.DistributedDataParallel(model)"
            )
        if not dist.is_initialized():
            raise GuardError("torch.distributed is not initialized; call init_process_group first")
        if not callable(loss_fn):
            raise GuardError("loss_fn must be callable as loss_fn(model, batch) -> scalar tensor")
        self.config = config if config is not None else GuardConfig()
        self.run_dir = RunDir(run_dir)
        self.ddp = model
        self.module: nn.Module = model.module
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scaler = scaler
        self.group: dist.ProcessGroup | None = model.process_group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        me = local_rank_info(self.rank)
        # Every collective of the guard goes through self.comm (device, agreement, watchdog).
        self.comm = Collective(self.group, me.node, self.config.watchdog_seconds)
        self.comm_device = self.comm.device
        self.job_id = os.environ.get("SLURM_JOB_ID")
        self.restart_count = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.comm.arrive("Guard() set-up")
        check_same_setup(self.comm, self.config, self.params)
        if not self.params:
            raise GuardError("the model has no trainable parameters: there is nothing to guard")
        self.comm.agree(lambda: check_run_dir(self.run_dir.root), "run directory check")
        self.topology = Topology.build(gather_rank_infos(me, comm=self.comm))
        warn_small_world(self.topology, self.rank)
        self._open_run_dir()
        # NH first level (native kernel where a C compiler is found, the same values in torch
        # ops elsewhere), then the multilinear tree of fingerprint.py.
        self.fingerprinter: Fingerprinter = FastFingerprinter(self._agree_on_seed())
        faults: tuple[Fault, ...] = self.comm.agree(
            lambda: self.config.faults + faults_from_env(),
            "fault injection settings (GuardConfig.faults, SLURM_GUARD_INJECT)",
        )
        self.faults = faults
        self.injector = FaultInjector(faults, self.rank, me.node, self.module)
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
            faults=faults,
        )
        # Checked GEMMs: after the injector, whose gemm faults wrap the same layers unchecked.
        self.abft: Abft | None = None
        self.abft_coverage: dict[str, object] | None = None  # measured in the settling pass
        if self.config.abft:
            config = self.config
            self.abft = attach_abft(self.module, margin=config.abft_margin, block=config.abft_block)
            self.abft.set_suspended(is_replaying)  # a replay judges another rank's step
        announce_faults(faults, self.topology, self.rank, len(faults) - len(self.config.faults))
        self.hook = HookState(
            group=self.group,
            world_size=self.world_size,
            fingerprinter=self.fingerprinter,
            signs=SignVectors(self.fingerprinter.seed),
            param_index={id(p): i for i, p in enumerate(self.params)},
            corrupt_reduced=(
                self.injector.corrupt_reduced if self.injector.corrupts_reduction else None
            ),
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
            scaler_active=scaler is not None,
            abft=self.abft,
        )
        self._buffer_fingerprint: torch.Tensor | None = None
        self._snapshot_due = False
        if (
            getattr(model, "broadcast_buffers", False)
            and next(self.module.buffers(), None) is not None
        ):
            self.module.register_forward_pre_hook(self._snapshot_buffers)
        self.step_count = 0
        self.last_verified_step: int | None = None
        self.verified_steps: list[int] = []  # passing replays since the resumed checkpoint
        self._settled = not self.config.settle_buckets
        self._voted_at = -1  # step_count right after the last clean vote
        unwritten = None
        self._started = time.time()
        if self.rank == 0:
            try:
                self._write_run_file()
            except OSError as exc:
                unwritten = f"cannot write {self.run_dir.run_file} ({exc.strerror})"
            except Exception as exc:  # any other failure must reach every rank too
                logger.exception("could not write %s", self.run_dir.run_file)
                unwritten = f"cannot write {self.run_dir.run_file} ({type(exc).__name__}: {exc})"
        self.comm.share_problem(unwritten, "run.json")

    # ---------------------------------------------------------------- set-up helpers

    def _agree_on_seed(self) -> int:
        """The fingerprint seed: per run (not per job start), so checkpoints stay verifiable."""
        seed = 0
        if self.rank == 0:
            seed = self.config.seed if self.config.seed is not None else secrets.randbits(62)
            with contextlib.suppress(RecordError, KeyError, TypeError, ValueError):
                seed = int(read_json_file(self.run_dir.run_file)["seed"])
        return self.comm.broadcast_ints([seed])[0]

    def _open_run_dir(self) -> None:
        """Before the seed and the checks: everything after writes into this directory."""
        opened = open_run_dir(
            self.comm,
            self.run_dir,
            self.rank,
            self.world_size,
            self.topology,
            job_id=self.job_id,
            restart_count=self.restart_count,
        )
        self._opened = opened
        self.attempt = opened.attempt
        self._lock: RunLock | None = opened.lock
        self.run_id = opened.run_id
        self._stamp = opened.stamp

    def _write_run_file(self) -> None:
        write_run_file(
            self.run_dir,
            self._opened,
            seed=self.fingerprinter.seed,
            job_id=self.job_id,
            restart_count=self.restart_count,
            world_size=self.world_size,
            topology=self.topology,
            config=self.config,
            faults=self.faults,
            abft_coverage=self.abft_coverage,
            started=self._started,
        )

    # ---------------------------------------------------------------- training

    def _settle_buckets(self, batch: Any) -> None:
        """One discarded forward/backward so DDP rebuilds its buckets before the first real step.

        DDP re-lays out its buckets after the first backward, and gloo sums an element in an
        order that depends on its position in the bucket; without this, a resumed run's first
        step differs from the uninterrupted run's in the last bits.
        """
        first = batch[0] if isinstance(batch, Microbatches) else batch
        self.hook.active = False
        try:
            with preserved_state(self.module):
                if self.abft is None:
                    self._scaled(self._loss(first)).backward()  # type: ignore[no-untyped-call]
                else:  # the same pass, counted: which share of the matmul FLOPs is checked
                    coverage = measure_coverage(
                        self.module, lambda: self._scaled(self._loss(first))
                    )
                    self.abft_coverage = coverage.as_dict()
        finally:
            self.hook.active = True
            self.optimizer.zero_grad(set_to_none=True)
        self._settled = True
        if self.abft_coverage is not None and self.rank == 0:
            try:
                self._write_run_file()  # run.json now says what the checks cover
            except OSError:
                logger.exception("could not record the checked-GEMM coverage in run.json")

    def _loss(self, batch: Any) -> torch.Tensor:
        loss = self.loss_fn(self.ddp, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
            raise GuardError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}{shape}; "
                "reduce the loss (e.g. .mean()) inside loss_fn"
            )
        return loss

    def step(self, batch: Any) -> float:
        """Forward, backward, checks and, only if they pass, the optimizer step.

        Returns:
            The step's loss as a Python float (the mean over microbatches for `Microbatches`).
            It is taken from the verdict row every rank gathers anyway, so returning it costs
            no device-to-host copy of its own (on CUDA, one copy per step in all).

        Raises:
            SilentDataCorruption: on every rank, after the alarm record is written; the update
                of this step is not applied (a vote alarm judges an update already applied).
        """
        step = self.step_count
        # Every rank must be here, at this step, before the first collective of the step (the
        # DDP all-reduce in backward): a rank stuck elsewhere is named instead of waited for.
        self.comm.arrive(f"step {step}")
        if not self._settled:
            self._settle_buckets(batch)
        if self.abft is not None:
            self.abft.reset()
        self.injector.step = step
        verify = self.config.is_replay_step(step, self.fingerprinter.seed) and self.world_size > 1
        captured = capture(batch)
        self._snapshot_due = True
        self.optimizer.zero_grad(set_to_none=True)
        exact = self.config.deterministic
        self.hook.reset(fingerprint_local=verify and exact, sketch_local=verify and not exact)
        micro = list(batch) if isinstance(batch, Microbatches) else [batch]
        losses = []
        for i, microbatch in enumerate(micro):
            # accumulate locally, reduce once: DDP's hook (and ours) runs on the last backward
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                loss = self._loss(microbatch)
                self._scaled(loss).backward()  # type: ignore[no-untyped-call]
            losses.append(loss.detach())
        step_loss = combined_loss(losses)
        result = self.verifier.check_step(step, step_loss, captured, verify)
        if result.verified:
            self.last_verified_step = step
            self.verified_steps.append(step)
        if result.finding is not None:
            # the suspect repeats the failing microbatch first: persistent or transient
            finding = triage_alarm(self.verifier, result.finding, captured, step)
            self._alarm(finding, step, update_applied=False)
        if not result.skip_update:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)  # skips the update itself on an overflow
                self.scaler.update()
            else:
                self.optimizer.step()
            self.injector.after_update()
            if self.config.is_vote_step(step):
                self._vote(step)
        self.step_count = step + 1
        # OWN_LOSS of this rank's gathered row: `combined_loss` in float64 (the sum over
        # microbatches), read with the verdicts instead of a float(loss) sync per step
        return bits_to_float(self.verifier.last_loss_bits) / len(losses)

    def _replay(self, captured: Captured) -> ReplayOutput:
        """Recompute another rank's step here (faults that hit this rank's replays apply)."""
        with self.injector.replay():
            scale = self.scaler.scale if self.scaler is not None else None
            return recompute(self.module, self.loss_fn, captured, self.params, scale)

    def _ledger(self, step: int, check: Check, passed: bool, detail: dict[str, object]) -> None:
        if self.rank != 0:
            return
        try:
            append_ledger(
                self.run_dir.ledger, LedgerEntry(step, check, passed, detail, self.restart_count)
            )
        except OSError:
            logger.exception("could not append to the ledger")

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def _snapshot_buffers(self, _module: nn.Module, _args: Any) -> None:
        """Forward pre-hook: fingerprint the buffers as DDP just broadcast them.

        Buffers are replicated only at that moment: the forward pass then updates each rank's
        running statistics from its own microbatch, so after the update they differ by design.
        Only the step's first forward counts: under no_sync() DDP broadcasts for that one alone.
        """
        if self._snapshot_due and not is_replaying():
            self._buffer_fingerprint = self.fingerprinter.tensors(list(self.module.buffers()))
            self._snapshot_due = False

    def vote_fingerprint(self) -> torch.Tensor:
        """Parameters and optimizer state now; buffers as broadcast at this step's forward."""
        parts = [self.fingerprinter.tensors(self.state_tensors(buffers=False))]
        if self._buffer_fingerprint is not None:
            parts.append(self._buffer_fingerprint)
        return self.fingerprinter.combine(parts)

    def state_tensors(self, buffers: bool = True) -> list[torch.Tensor]:
        """Everything replicas must hold identically: parameters, buffers, optimizer state."""
        out = [t.detach() for t in self.module.parameters()]
        if buffers:
            out += [t.detach() for t in self.module.buffers()]
        state = self.optimizer.state_dict()["state"]
        for key in sorted(state):
            for name in sorted(state[key]):
                value = state[key][name]
                out.append(value if isinstance(value, torch.Tensor) else torch.tensor(value))
        return out

    def _vote(self, step: int) -> None:
        """Weight-fingerprint vote on the state after `step`'s update."""
        finding = self.verifier.vote(step, self.vote_fingerprint())
        if finding is not None:
            self._alarm(finding, step, update_applied=True)
        self._voted_at = step + 1

    def save_checkpoint(self) -> Path:
        """Vote, then save atomically into run_dir/checkpoints/step-N (N = completed steps)."""
        step = self.step_count
        if step == 0:
            raise GuardError("save_checkpoint() before the first step: nothing to save yet")
        self.comm.arrive(f"save_checkpoint() after {step} steps")
        if self._voted_at != step:
            self._vote(step - 1)
        # What a restart can recompute from the saved files alone (buffers as saved).
        fingerprint = as_hex(self.fingerprinter.tensors(self.state_tensors()))
        # Never into a run directory that vanished or was replaced since the start (it would
        # be silently recreated), nor after another job took the lock over.
        problem = check_unchanged(self.run_dir, self._stamp, self.run_id)
        if problem is None and self._lock is not None and not self._lock.held():
            problem = f"another job took over the lock {self.run_dir.lock_file}"
        if problem is not None:
            problem = f"checkpoint at step {step} not saved: {problem}"
        self.comm.share_problem(problem, "run directory check before the save")
        stage = ckpt.staging_dir(self.run_dir, step, self.restart_count, self.attempt)
        try:
            ckpt.write_rank_files(
                stage,
                self.rank,
                self.module.state_dict() if self.rank == 0 else None,
                self.optimizer.state_dict() if self.rank == 0 else None,
            )
        except Exception as exc:  # any failure must reach every rank, not hang them
            logger.exception("rank %d could not write its checkpoint files", self.rank)
            problem = f"checkpoint at step {step}: could not write its files ({exc})"
        try:
            self.comm.share_problem(problem, "checkpoint files")
        except GuardError:
            if self.rank == 0:
                ckpt.discard(stage)
            raise
        path = self.run_dir.checkpoint_path(step)
        if self.rank == 0:
            try:
                path = ckpt.publish(
                    self.run_dir,
                    stage,
                    step=step,
                    weight_fingerprint=fingerprint,
                    fingerprint_seed=self.fingerprinter.seed,
                    world_size=self.world_size,
                    restart_count=self.restart_count,
                    run_id=self.run_id,
                )
            except Exception as exc:
                logger.exception("could not publish checkpoint %s", path)
                problem = f"checkpoint at step {step} could not be published ({exc})"
                ckpt.discard(stage)
        self.comm.share_problem(problem, "checkpoint publish")
        return path

    # ---------------------------------------------------------------- alarms and recovery

    def _alarm(self, finding: Finding, step: int, *, update_applied: bool) -> NoReturn:
        """Rank 0 writes the alarm; then every rank raises the very same record."""
        self.alarm_writer.raise_alarm(
            finding,
            step,
            update_applied=update_applied,
            last_verified=self.last_verified_step,
            verified_steps=self.verified_steps,
        )

    def resume(self) -> int:
        """Load the trusted checkpoint; return the step to start from (0 on a fresh run).

        After an alarm, the trusted checkpoint is the newest clean one that `trust_replays`
        passing replays followed before the alarm; newer checkpoints are moved to
        quarantine/<alarm_id>/ and the alarm is marked handled, so a later restart does not roll
        back again. A checkpoint that fails to load on any rank (hash, fingerprint, unreadable
        file) is skipped for the next older one. Raises GuardError on every rank when what the
        rule needs cannot be read, or when every allowed checkpoint is damaged; the message
        names the override (`SLURM_GUARD_RESUME=fresh`).
        """
        self.comm.arrive("resume()")
        load = functools.partial(
            load_checkpoint,
            self.run_dir,
            rank=self.rank,
            module=self.module,
            optimizer=self.optimizer,
            fingerprinter=self.fingerprinter,
            state_tensors=self.state_tensors,
        )
        resumed = resume_collectively(
            self.comm, self.run_dir, self.rank, self.config.trust_replays, load
        )
        self.verified_steps = resumed.verified_steps
        if resumed.step < 0:
            self.step_count = 0
            self.last_verified_step = None
        else:
            self.step_count = resumed.step
            self.last_verified_step = resumed.last_verified_step
            self._voted_at = resumed.step
        record_rollback(self.comm, self.run_dir, resumed.point, self.restart_count, self.attempt)
        return self.step_count


@contextlib.contextmanager
def exit_on_alarm() -> Iterator[None]:
    """Turn an alarm into the guard's exit code, which the sbatch template and controller read."""
    try:
        yield
    except SilentDataCorruption as exc:
        logger.error("stopped by slurm-guard: %s", exc)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(EXIT_SDC)


__all__ = ["Guard", "as_int", "exit_on_alarm"]
