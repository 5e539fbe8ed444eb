"""What the framework integrations share: the lazy import, the exit code on an alarm, and trust
in the framework's checkpoints.

A framework writes its own checkpoints (HF's `checkpoint-N/` folders, Lightning's `.ckpt`
files), with the state the guard's own checkpoints do not hold (LR scheduler, data position,
callbacks). The guard ties them to its trust decision instead of copying them:

- before the framework saves, the weights are voted on (a clean vote, as for the guard's own
  checkpoints); after it saved, rank 0 writes a *seal* beside the checkpoint: the step, the
  fingerprint of the state every replica holds, the run's id, each file's sha256 and the
  checkpoint's location, and records that location in the run directory (`rundir.seals`);
- the framework's rotation (HF `save_total_limit`, Lightning `save_top_k`) never deletes the
  checkpoints the trust rule needs (`held_back`);
- before the framework resumes, the resume rule of `Guard.resume()` (`rundir.recovery.
  trust_window`: alarms, ledger) picks the newest sealed checkpoint it allows, failing closed
  as the core does, and every checkpoint newer than it (sealed or not) moves to
  `<checkpoint dir>/slurm-guard-quarantine/<alarm id>/`, where no framework's "latest
  checkpoint" search looks;
- after the framework loaded it, every rank checks the fingerprint, and the rollback is
  recorded (alarms marked handled, with what moved aside) as `Guard.resume` records it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from slurm_guard.comm.collective import Collective
from slurm_guard.comm.topology import local_rank_info
from slurm_guard.config import GuardConfig
from slurm_guard.core.checkpoints import record_resume
from slurm_guard.errors import GuardError
from slurm_guard.fingerprint import as_hex
from slurm_guard.guard import exit_on_alarm
from slurm_guard.integrations._choice import (
    Listed,
    Requested,
    held_back,
    plan_choice,
    quarantine,
)
from slurm_guard.rundir.checkpoint import sha256_file
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import RecordError, atomic_write_json
from slurm_guard.rundir.recovery import ResumePoint
from slurm_guard.rundir.restore import Resumed
from slurm_guard.rundir.resumes import CHECKPOINT, NOTHING
from slurm_guard.rundir.seals import Seal, read_seal, record_location

if TYPE_CHECKING:
    from slurm_guard.core.session import GuardCore

logger = logging.getLogger(__name__)

QUARANTINE_DIR = "slurm-guard-quarantine"
"""Beside the framework's checkpoints: where the untrusted ones go, never deleted."""

__all__ = [
    "QUARANTINE_DIR",
    "Chosen",
    "Listed",
    "Requested",
    "alarm_exit",
    "choose_checkpoint",
    "exits_on_alarm",
    "finish_resume",
    "held_back",
    "quarantine",
    "read_seal",
    "require",
    "save_sealed",
    "silenced",
]


def require(module: str, extra: str) -> ModuleType:
    """Import a framework, or say which extra installs it (the base install never pulls it)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"slurm_guard.integrations.{extra} needs {module!r}, which is not installed "
            f"({exc}). Install it with: pip install 'slurm-guard[{extra}]' (pin torch to the "
            "version you have, e.g. pip install 'torch==<yours>' 'slurm-guard[...]', so pip "
            "does not replace it)"
        ) from exc


def exits_on_alarm(choice: bool | None) -> bool:
    """An integration's `exit_on_alarm` choice; None: on under Slurm (`SLURM_JOB_ID` set),
    where the epilog reads exit code 86, off elsewhere (the alarm is raised to the caller)."""
    return choice if choice is not None else bool(os.environ.get("SLURM_JOB_ID"))


def alarm_exit(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Inside it, an alarm ends the process with exit code 86 if `enabled`, else it raises."""
    return exit_on_alarm() if enabled else contextlib.nullcontext()


def _hash_files(checkpoint: Path, seal_path: Path) -> dict[str, str]:
    if checkpoint.is_file():
        return {checkpoint.name: sha256_file(checkpoint)}
    return {
        str(p.relative_to(checkpoint)): sha256_file(p)
        for p in sorted(checkpoint.rglob("*"))
        if p.is_file() and p != seal_path
    }


def state_fingerprint(core: GuardCore, seed: int | None = None) -> str:
    """The fingerprint of everything replicas hold (parameters, buffers, optimizer state)."""
    from slurm_guard.fingerprint import FastFingerprinter

    fp = core.fingerprinter
    if seed is not None and seed != fp.seed:
        fp = FastFingerprinter(seed)
    return as_hex(fp.tensors(core.state_tensors()))


def vote_before_save(core: GuardCore) -> None:
    """A clean vote on the state about to be saved (raises the vote's alarm on every rank)."""
    if core.step_count == 0:
        raise GuardError("a checkpoint before the first guarded step: nothing verified yet")
    core.comm.arrive(f"framework checkpoint after {core.step_count} steps")
    if core.voted_at != core.step_count:
        core.vote(core.step_count - 1)


def save_sealed(
    core: GuardCore,
    framework: str,
    framework_steps: int,
    save: Callable[[], None],
    checkpoint: Path,
    seal_path: Path,
) -> None:
    """Vote, let the framework write `checkpoint` with `save`, then seal it (every rank calls
    this). The framework's step count must be the guard's: a checkpoint of steps the guard did
    not check would be sealed as checked. `framework` is "hf" or "lightning"."""
    if core.step_count != framework_steps:
        raise GuardError(
            f"the guard counted {core.step_count} steps, {FRAMEWORK_NAMES[framework]} "
            f"{framework_steps}: was the guard skipped for some steps?"
        )
    vote_before_save(core)
    save()
    seal_checkpoint(core, checkpoint, seal_path, framework)
    core.after_save()


FRAMEWORK_NAMES = {"hf": "the Trainer", "lightning": "Lightning"}


def seal_checkpoint(core: GuardCore, checkpoint: Path, seal_path: Path, framework: str) -> None:
    """After the framework saved `checkpoint` on every rank: rank 0 seals it and records its
    location in the run directory (all must call)."""
    fingerprint = state_fingerprint(core)
    core.comm.barrier(f"seal {checkpoint.name}")  # every rank's files are written
    problem = None
    if core.rank == 0:
        try:
            seal = Seal(
                core.step_count,
                fingerprint,
                core.fingerprinter.seed,
                core.run_id,
                _hash_files(checkpoint, seal_path),
                str(checkpoint.absolute()),
            )
            sealed = seal.as_json(core.restart_count, core.world_size)
            atomic_write_json(seal_path, sealed)
            record_location(core.run_dir, sealed, seal_path, framework)
        except (OSError, RecordError, GuardError) as exc:
            problem = f"could not seal {checkpoint} ({exc})"
    core.comm.share_problem(problem, "sealing the framework's checkpoint")


@dataclass(frozen=True)
class Chosen:
    """What every rank agreed to resume from, before the framework loads it."""

    path: Path | None  # None: start from step 0
    step: int  # -1 with no checkpoint
    last_verified_step: int | None
    verified_steps: list[int]
    seal: Seal | None
    point: ResumePoint | None  # rank 0's, for the rollback record; None elsewhere


def choose_checkpoint(
    run_dir: RunDir,
    list_checkpoints: Callable[[], Sequence[Listed]],
    output_root: Path,
    config: GuardConfig,
    requested: Requested | None = None,
) -> Chosen:
    """Every rank: the checkpoint the framework may resume from (rank 0 decides, all agree);
    the newer ones move to `<output_root>/slurm-guard-quarantine/`.

    Runs before the guard's core exists (the framework loads before it wraps the model), on
    the default process group. Raises GuardError on every rank when the run directory cannot
    be read, every allowed checkpoint is unusable, one is another run's, or `requested` is
    not the trusted checkpoint (`_choice.plan_choice`).
    """
    trust_replays = config.trust_replays
    import torch.distributed as dist

    if not dist.is_initialized():
        raise GuardError("torch.distributed is not initialized: the guard needs a DDP run")
    comm = Collective(None, local_rank_info(dist.get_rank()).node, config.watchdog_seconds)
    item: Listed | None = None
    point: ResumePoint | None = None
    problem = None
    if comm.rank == 0:
        try:
            quarantine_root = output_root / QUARANTINE_DIR
            item, point = plan_choice(
                run_dir, list_checkpoints(), trust_replays, quarantine_root, requested
            )
        except (GuardError, OSError) as exc:
            problem = str(exc)
    comm.share_problem(problem, "resume: choosing the framework's checkpoint")
    path = broadcast_text(comm, str(item.path) if item is not None else "")
    seal_path = broadcast_text(comm, str(item.seal) if item is not None else "")
    k = max(trust_replays, 1)
    recent = ((point.verified_steps[-k:] if point else []) + [-1] * k)[:k]
    step, last, *passes = comm.broadcast_ints(
        [point.step if point else -1, point.last_verified_step if point else -1, *recent]
    )
    seal = None
    if path:
        seal = comm.agree(lambda: read_seal(Path(seal_path)), "resume: reading the seal")
    return Chosen(
        Path(path) if path else None,
        step,
        last if last >= 0 else None,
        sorted(s for s in passes if s >= 0),
        seal,
        point,
    )


@contextlib.contextmanager
def silenced(obj: Any, names: Sequence[str]) -> Iterator[None]:
    """The methods `names` of `obj` as no-ops meanwhile (instance attributes, put back after):
    a replay must not log another rank's values, nor start a collective doing so."""
    saved = {name: obj.__dict__[name] for name in names if name in obj.__dict__}
    for name in names:
        setattr(obj, name, lambda *a, **k: None)
    try:
        yield
    finally:
        for name in names:
            if name in saved:
                setattr(obj, name, saved[name])
            else:
                del obj.__dict__[name]


def broadcast_text(comm: Collective, text: str) -> str:
    """Rank 0's text on every rank, as integers through `Collective.broadcast_ints`."""
    data = text.encode() if comm.rank == 0 else b""
    (size,) = comm.broadcast_ints([len(data)])
    if size == 0:
        return ""
    values = comm.broadcast_ints(list(data) if comm.rank == 0 else [0] * size)
    return bytes(values).decode()


def finish_resume(core: GuardCore, chosen: Chosen) -> None:
    """After the framework loaded `chosen`: check its fingerprint, then record the rollback."""
    seal = chosen.seal

    def check() -> None:
        if seal is None:
            return
        found = state_fingerprint(core, seal.fingerprint_seed)
        if found != seal.weight_fingerprint:
            raise GuardError(
                f"{chosen.path}: the loaded state does not reproduce the sealed fingerprint "
                f"({found} != {seal.weight_fingerprint}); move it aside and restart"
            )

    core.comm.agree(check, "resume: the loaded checkpoint's fingerprint")
    if chosen.step >= 0:
        core.step_count = chosen.step
        core.voted_at = chosen.step
        core.last_verified_step = chosen.last_verified_step
    core.verified_steps = list(chosen.verified_steps)
    loaded = chosen.path is not None and chosen.step >= 0
    resumed = Resumed(
        chosen.step,
        chosen.last_verified_step,
        core.verified_steps,
        chosen.point,
        CHECKPOINT if loaded else NOTHING,
        str(chosen.path) if loaded else None,
    )
    record_resume(core, resumed)  # and rank 0's resume line, as Guard.resume says it
