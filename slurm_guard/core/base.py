"""The set-up and the records that every guard shares: `GuardCore` (DDP) and `ShardedGuard`.

Both open a guarded run in the same order on every rank: the watchdog's collective, the check
that every rank runs the same settings and model, the run directory, the kernels, the
topology, this start's attempt in the run directory, the run's fingerprint seed, the faults to
inject (agreed, so every rank knows them), the alarm writer and the checked GEMMs, then
run.json. Only the model's wrapping differs (DDP's comm hook, FSDP2's reduce-scatter), which
each guard installs after `_open_run`. Written once here, a fix to the set-up reaches both.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

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
from slurm_guard.rundir.alarms import AlarmWriter
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import LedgerEntry, append_ledger
from slurm_guard.rundir.start import OpenedRun, open_run_dir, write_run_file

logger = logging.getLogger(__name__)


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

    def _wire_checks(self, module: nn.Module, injected: Sequence[Fault]) -> None:
        """The fault injector (hooks on `module` for the `injected` faults), the alarm writer
        and the checked GEMMs, in that order: the injector's gemm faults wrap the same layers
        unchecked, so the checks must come after them."""
        self.injector = FaultInjector(tuple(injected), self.rank, self.node, module)
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
        )

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
        self.alarm_writer.raise_alarm(
            finding,
            step,
            update_applied=update_applied,
            last_verified=self.last_verified_step,
            verified_steps=self.verified_steps,
        )
