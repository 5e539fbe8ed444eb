"""The set-up and the records that every guard shares: `GuardCore` (DDP) and `ShardedGuard`.

Both open a guarded run in the same order on every rank: the watchdog's collective, the check
that every rank runs the same settings and model, the run directory, the kernels, the
topology, this start's attempt in the run directory, the run's fingerprint seed, the faults to
inject (agreed, so every rank knows them), the alarm writer and the checked GEMMs, then
run.json. Only the model's wrapping differs (DDP's comm hook, FSDP2's reduce-scatter), which
each guard installs after `_open_run`. Written once here, a fix to the set-up reaches both.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slurm_guard.abft import Abft
from slurm_guard.abft import attach as attach_abft
from slurm_guard.checks.replay import is_replaying
from slurm_guard.checks.verdicts import Finding
from slurm_guard.comm.collective import Collective
from slurm_guard.comm.topology import Topology, gather_rank_infos, local_rank_info
from slurm_guard.config import GuardConfig
from slurm_guard.core import events
from slurm_guard.core.batch_check import BatchRecord
from slurm_guard.core.setup import (
    agree_on_seed,
    announce_faults,
    check_same_setup,
    prepare_run_dir,
    warm_kernels,
)
from slurm_guard.errors import GuardError
from slurm_guard.faults import Fault, FaultInjector, faults_from_env
from slurm_guard.fingerprint import FastFingerprinter, Fingerprinter
from slurm_guard.kernels.warm import WarmUpReport
from slurm_guard.protocol import Check
from slurm_guard.rundir import fault_effects
from slurm_guard.rundir.alarms import AlarmWriter
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import LedgerEntry, append_ledger
from slurm_guard.rundir.resumes import ResumeNote
from slurm_guard.rundir.start import OpenedRun, open_run_dir, write_run_file

logger = logging.getLogger(__name__)


def _refuse_model_parallel_ddp(
    ddp: DistributedDataParallel, group: dist.ProcessGroup | None
) -> None:
    """DDP over tensor-parallel weights, or DDP over part of the ranks (a guard per pipeline
    stage): sg.Guard would compare different shards, or form one guard per stage that collide
    on the run directory. Local and the same on every rank, so every rank refuses."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in ddp.parameters()):
        raise GuardError(
            "DDP over DTensors (tensor parallel under DDP) is not supported: sg.Guard compares "
            "whole replicas. Shard the data-parallel dimension with fully_shard and use "
            "sg.ShardedGuard (docs/integrations/fsdp.md)"
        )
    size, world = dist.get_world_size(group), dist.get_world_size()
    if size != world:
        raise GuardError(
            f"pipeline parallel is not supported: DDP's process group holds {size} of the "
            f"{world} ranks, so the others train another part of the model (a stage) and a "
            "guard per stage would replay one stage without the others. sg.Guard guards one "
            "model replicated over every rank"
        )


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 and "\n" not in text else f"a {type(value).__name__}"


def check_arguments(
    label: str,
    optimizer: object,
    loss_fn: object,
    run_dir: object,
    config: object,
    **optional: tuple[object, type | tuple[type, ...]],
) -> None:
    """Refuse a wrong-typed argument by name before anything else runs (the same on every
    rank, so no collective is left waiting): `Guard(..., run_dir=None)` says what run_dir must
    be instead of failing inside pathlib. `optional`: name -> (value, accepted types)."""
    expected: dict[str, tuple[object, type | tuple[type, ...], str]] = {
        "optimizer": (optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer"),
        "run_dir": (run_dir, (str, os.PathLike), "a path (str or os.PathLike)"),
        "config": (config, (GuardConfig, type(None)), "a slurm_guard.GuardConfig or None"),
    }
    for name, (value, types) in optional.items():
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        expected[name] = (value, types, names.replace("NoneType", "None"))
    for name, (value, types, what) in expected.items():
        if not isinstance(value, types) or (name == "run_dir" and not str(value).strip()):
            raise GuardError(f"{label}: {name} must be {what}, got {_shown(value)}")
    if not callable(loss_fn):
        raise GuardError(
            f"{label}: loss_fn must be callable as loss_fn(model, batch) -> scalar tensor, "
            f"got {_shown(loss_fn)}"
        )


_LIVE: weakref.WeakValueDictionary[int, GuardBase] = weakref.WeakValueDictionary()
_opened = itertools.count()


def live_guards() -> list[GuardBase]:
    """Guards of this process whose run has not ended, oldest first: the same order on every
    rank, since ending one may be collective (`exit_on_alarm` ends them on a clean exit)."""
    return [_LIVE[k] for k in sorted(_LIVE) if k in _LIVE]


class GuardBase:
    """What a guard holds once `_open_run` and `_wire_checks` ran, and the records it writes."""

    config: GuardConfig
    run_dir: RunDir
    comm: Collective
    rank: int
    world_size: int
    node: str
    job_id: str | None
    restart_count: int
    params: list[nn.Parameter]
    kernels: WarmUpReport
    topology: Topology
    opened: OpenedRun
    attempt: str
    run_id: str
    fingerprinter: Fingerprinter
    faults: tuple[Fault, ...]
    injector: FaultInjector
    alarm_writer: AlarmWriter
    abft: Abft | None
    abft_coverage: dict[str, object] | None
    last_verified_step: int | None
    verified_steps: list[int]
    step_count: int
    batches: BatchRecord | None
    resume_note: ResumeNote | None = None  # rank 0, after a resume: completed at the first step

    def _first_step_done(self) -> None:
        """After every completed step: the first one after a resume completes its record."""
        if self.resume_note is not None:
            self.resume_note.first_step()
            self.resume_note = None

    def _open_run(
        self,
        *,
        group: dist.ProcessGroup | None,
        module: nn.Module,
        ddp: DistributedDataParallel | None,
        label: str,
        setup_fields: Mapping[str, str],
        allowed_faults: Callable[[tuple[Fault, ...]], tuple[Fault, ...]] = lambda f: f,
    ) -> None:
        """Everything up to the faults, collectively; raises the same error on every rank.

        `setup_fields`: more fields every rank must agree on (`check_same_setup`);
        `allowed_faults` raises for a fault this guard cannot inject.
        """
        if ddp is not None:
            _refuse_model_parallel_ddp(ddp, group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # the device the model computes on: its GPU is named in run.json and in alarms
        me = local_rank_info(self.rank, next((p.device for p in module.parameters()), None))
        self.node = me.node
        # Every collective of the guard goes through self.comm (device, agreement, watchdog).
        self.comm = Collective(group, me.node, self.config.watchdog_seconds)
        self.job_id = os.environ.get("SLURM_JOB_ID")
        self.restart_count = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.comm.arrive(f"{label} set-up")
        check_same_setup(self.comm, self.config, self.params, setup_fields)
        if not self.params:
            raise GuardError("the model has no trainable parameters: there is nothing to guard")
        prepare_run_dir(self.comm, self.run_dir.root)
        self.kernels = warm_kernels(self.comm, ddp, self.params)  # once per node, not at step 9
        self.topology = Topology.build(gather_rank_infos(me, comm=self.comm))
        # Before the seed and the checks: everything after writes into this directory.
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
        self.run_id = self.opened.run_id
        # NH first level (the C kernel warmed above, or torch ops), then the multilinear tree
        seed = agree_on_seed(self.comm, self.config, self.run_dir)
        self.fingerprinter = FastFingerprinter(seed)
        self.faults = self.comm.agree(
            lambda: allowed_faults(self.config.faults + faults_from_env()),
            "fault injection settings (GuardConfig.faults, SLURM_GUARD_INJECT)",
        )
        self.abft_coverage = None  # measured where the guard runs a settling pass
        self.last_verified_step = None
        self.verified_steps = []  # passing replays since the resumed checkpoint
        self._started = time.time()
        # rank 0's batch fingerprints on verification steps: does a resume see the same data?
        self.batches = None
        if self.rank == 0:
            self.batches = BatchRecord(self.run_dir.root, self.fingerprinter, self.attempt)

    def _wire_checks(self, module: nn.Module, hooked: Collection[str] | None = None) -> None:
        """The fault injector (hooks on `module` for the faults of the `hooked` kinds; None:
        all), the alarm writer and the checked GEMMs, in that order: the injector's gemm
        faults wrap the same layers unchecked, so the checks must come after them."""
        self.injector = FaultInjector(self.faults, self.rank, self.node, module, hooked)
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
        self.abft = None
        if self.config.abft:
            config = self.config
            self.abft = attach_abft(module, margin=config.abft_margin, block=config.abft_block)
            self.abft.set_suspended(is_replaying)  # a replay judges another rank's step
        from_env = len(self.faults) - len(self.config.faults)
        announce_faults(self.faults, self.topology, self.rank, from_env)
        self._live_key = next(_opened)
        _LIVE[self._live_key] = self

    def record_fault_effects(self, *, final: bool) -> list[str]:
        """What the injected faults changed, gathered from every rank (one small all-gather,
        only when faults are injected: every rank knows the same list) and written by rank 0
        to faults/<attempt>.json. Returns the `changed no value` warnings (rank 0's list;
        empty on the others). Every rank must call it, at the same point."""
        if not self.faults:
            return []
        rows = self.comm.all_gather_rows(self.injector.effects(), "injected faults' effects")
        if self.rank != 0:
            return []
        described = [
            {
                "spec": f.spec(),
                "describe": f.describe(),
                "kind": f.kind,
                "step": f.step,
                "persistent": f.persistent,
                "factor": f.factor,
                "target": f"rank {f.rank}" if f.rank is not None else str(f.node),
            }
            for f in self.faults
        ]
        nodes = [self.topology.node_of(r) for r in range(self.world_size)]
        rec = fault_effects.record(
            described,
            rows,
            nodes,
            attempt=self.attempt,
            restart_count=self.restart_count,
            job_id=self.job_id,
            steps_done=self.step_count,
            final=final,
        )
        try:
            fault_effects.write(self.run_dir.root, rec)
        except OSError as exc:
            logger.warning("could not record the injected faults' effects: %s", exc)
        return fault_effects.warnings_of(rec)

    def note_batch(self, step: int, batch: Any) -> None:
        """On a verification step: rank 0 fingerprints the batch (on the device; read later)."""
        if self.batches is not None:
            self.batches.note(step, batch)

    def after_save(self) -> None:
        """After every checkpoint a guard seals (its own, DCP's, a framework's; all ranks):
        the faults' effects so far, for status while the run goes on, and the batch
        fingerprints, so a resume from this checkpoint can tell whether it sees the same data."""
        self.record_fault_effects(final=False)
        self.read_batches()

    def read_batches(self) -> None:
        """Rank 0 records the pending batch fingerprints; warns if a resume sees other data."""
        if self.batches is not None:
            for warning in self.batches.flush():
                logger.warning("%s", warning)

    def end_run(self) -> None:
        """The end of a run that stopped without an alarm (`exit_on_alarm`'s clean exit):
        records the faults' effects; rank 0 warns once per fault that changed no value."""
        _LIVE.pop(getattr(self, "_live_key", -1), None)
        self.read_batches()
        for warning in self.record_fault_effects(final=True):
            logger.warning("%s", warning)

    # ---------------------------------------------------------------- records

    def _write_run_file(self) -> None:
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
            abft_coverage=self.abft_coverage,
            started=self._started,
            **self._run_file_layout(),
        )

    def _run_file_layout(self) -> dict[str, Any]:
        """run.json's `replayer` and `layout` where they are not the DDP ring's (ShardedGuard)."""
        return {}

    def _record_start(self) -> None:
        """Rank 0 writes run.json; a failure stops every rank with the same error."""
        unwritten = None
        if self.rank == 0:
            try:
                self._write_run_file()
            except OSError as exc:
                unwritten = f"cannot write {self.run_dir.run_file} ({exc.strerror})"
            except Exception as exc:  # any other failure must reach every rank too
                logger.exception("could not write %s", self.run_dir.run_file)
                unwritten = f"cannot write {self.run_dir.run_file} ({type(exc).__name__}: {exc})"
        self.comm.share_problem(unwritten, "run.json")
        if self.rank == 0:
            events.announce(f"guarding {self._checks_line()}; run dir {self.run_dir.root}")

    def _checks_line(self) -> str:
        """The start line's checks (DDP: every rank a replica; ShardedGuard names its layout)."""
        return events.checks_line(self.config, self.world_size, len(self.topology.nodes))

    def _ledger(self, step: int, check: Check, passed: bool, detail: dict[str, object]) -> None:
        if self.rank != 0:
            return
        try:
            append_ledger(
                self.run_dir.ledger, LedgerEntry(step, check, passed, detail, self.restart_count)
            )
        except OSError:
            logger.exception("could not append to the ledger")

    def alarm(self, finding: Finding, step: int, *, update_applied: bool) -> NoReturn:
        """Rank 0 writes the alarm; then every rank raises the very same record."""
        self.read_batches()
        self.alarm_writer.raise_alarm(
            finding,
            step,
            update_applied=update_applied,
            last_verified=self.last_verified_step,
            verified_steps=self.verified_steps,
        )
