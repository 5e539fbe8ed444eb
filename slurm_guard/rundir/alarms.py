"""Turning a finding into the one alarm record every rank raises, and making sure it lands.

Rank 0 alone writes; the others learn the outcome through one broadcast, so every rank raises
the very same record (id and timestamp included) and none waits on a write that failed. An
alarm that cannot be written must still limit later resumes: the lost-alarm mark does that.
Kept apart from the Guard so the alarm path takes only what it reads (run directory, topology,
the run's identity and config), not the whole training state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, NoReturn

from slurm_guard.checks.verdicts import Finding
from slurm_guard.comm.collective import Collective
from slurm_guard.comm.topology import Topology
from slurm_guard.errors import SilentDataCorruption
from slurm_guard.faults.injection import Fault
from slurm_guard.protocol import Check, Verdict
from slurm_guard.rundir.gpus import GpuIdentity
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import Alarm, LedgerEntry, append_ledger, make_alarm_id
from slurm_guard.rundir.seals import newest_located, run_id_of
from slurm_guard.rundir.trust import newest_clean, trust_limit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AlarmWriter:
    """What an alarm record names, fixed once the run directory is open and faults are known.

    The verified steps change as training goes on (and on resume), so they are arguments.
    """

    run_dir: RunDir
    comm: Collective
    topology: Topology
    rank: int
    world_size: int
    job_id: str | None
    restart_count: int
    attempt: str
    trust_replays: int
    faults: tuple[Fault, ...]

    def raise_alarm(
        self,
        finding: Finding,
        step: int,
        *,
        update_applied: bool,
        last_verified: int | None,
        verified_steps: list[int],
    ) -> NoReturn:
        """Rank 0 writes the alarm; then every rank raises the very same record (all must call)."""
        alarm = self.make(finding, step, update_applied, last_verified, verified_steps)
        ok, suffix = True, 0
        if self.rank == 0:
            ok, suffix = self.record(alarm, last_verified, verified_steps)
        written, created_us, suffix = self.comm.broadcast_ints(
            [int(ok), round(alarm.created * 1e6), suffix]
        )
        alarm_id = alarm.alarm_id if suffix == 0 else f"{alarm.alarm_id}-{suffix}"
        if not written:
            logger.error("alarm %s could not be recorded on the run directory", alarm_id)
        raise SilentDataCorruption(
            dataclasses.replace(alarm, alarm_id=alarm_id, created=created_us / 1e6)
        )

    def record(
        self, alarm: Alarm, last_verified: int | None, verified_steps: list[int]
    ) -> tuple[bool, int]:
        """Rank 0: write the alarm, retrying; if that fails, mark the run directory.

        Returns (written, suffix): an id that exists already (it cannot, short of a repeated
        attempt id) gets a numeric suffix instead of being dropped. When the alarm cannot be
        written at all, an empty `lost-alarm.<id>.upto-<S>` file makes every later resume
        trust no checkpoint after step S.
        """
        suffix, written = 0, False
        for attempt in range(4):
            record = (
                alarm
                if suffix == 0
                else dataclasses.replace(alarm, alarm_id=f"{alarm.alarm_id}-{suffix}")
            )
            try:
                path = self.run_dir.write_alarm(record)
            except FileExistsError:
                suffix += 1
                continue
            except OSError as exc:
                logger.warning("writing alarm %s failed (%s); retrying", record.alarm_id, exc)
                time.sleep(0.2 * 2**attempt)
                continue
            logger.error("alarm %s written to %s: %s", record.alarm_id, path, alarm.message)
            written = True
            break
        alarm_id = alarm.alarm_id if suffix == 0 else f"{alarm.alarm_id}-{suffix}"
        if not written:
            limit = trust_limit(last_verified, verified_steps, self.trust_replays)
            try:
                mark = self.run_dir.mark_lost_alarm(alarm_id, limit)
                logger.error(
                    "could not write alarm %s (%s); marked %s: no checkpoint after step %s "
                    "will be trusted",
                    alarm_id,
                    alarm.message,
                    mark,
                    limit,
                )
            except OSError:
                logger.exception(
                    "could not write alarm %s nor mark the run directory: do not resume "
                    "this run from a checkpoint after step %s",
                    alarm_id,
                    limit,
                )
        try:
            append_ledger(
                self.run_dir.ledger,
                LedgerEntry(
                    alarm.step, alarm.check, False, {"alarm": alarm_id}, self.restart_count
                ),
            )
        except OSError:
            logger.exception("could not append alarm %s to the ledger", alarm_id)
        return written, suffix

    def make(
        self,
        finding: Finding,
        step: int,
        update_applied: bool,
        last_verified: int | None,
        verified_steps: list[int],
    ) -> Alarm:
        suspects = finding.suspect_ranks
        nodes = sorted({self.topology.node_of(r) for r in suspects})
        hosts = sorted({self.topology.ranks[r].hostname for r in suspects})
        trusted = self.trusted_for(last_verified, verified_steps)
        verdict = Verdict(finding.verdict).value  # records hold plain strings
        return Alarm(
            alarm_id=make_alarm_id(
                self.job_id, self.restart_count, self.attempt, step, finding.check
            ),
            job_id=self.job_id,
            restart_count=self.restart_count,
            step=step,
            check=Check(finding.check).value,
            verdict=verdict,
            suspect_ranks=tuple(suspects),
            suspect_nodes=tuple(nodes),
            suspect_hosts=tuple(hosts),
            last_verified_step=last_verified,
            trusted_checkpoint=trusted,
            update_applied=update_applied,
            evidence=finding.evidence,
            message=f"step {step}: {finding.check} check: {verdict}: {finding.message}",
            world_size=self.world_size,
            created=round(time.time() * 1e6) / 1e6,
            # an injected fault was active by this step: the alarm may be the drill's, not the
            # hardware's (the controller and status show it)
            injected=any(f.step <= step for f in self.faults),
            suspect_gpus=tuple(_gpu_entry(self.topology.ranks[r].gpu) for r in suspects),
        )

    def trusted_for(self, last_verified: int | None, verified_steps: list[int]) -> str | None:
        """The checkpoint a rollback would pick as of now, so the alarm can name it to people:
        the guard's own (`step-N`) or a framework's (its absolute path, `rundir.seals`)."""
        limit = trust_limit(last_verified, verified_steps, self.trust_replays)
        if limit is None:
            return None
        best = newest_clean(self.run_dir.checkpoints(), limit)
        framework = newest_located(self.run_dir, limit, run_id_of(self.run_dir))
        if framework is not None and (best is None or framework.step > best.step):
            return str(framework.path)
        return None if best is None else self.run_dir.checkpoint_path(best.step).name


def _gpu_entry(gpu: GpuIdentity | None) -> dict[str, Any] | None:
    """A suspect rank's GPU as the alarm carries it (null on CPU)."""
    return None if gpu is None else dataclasses.asdict(gpu)
