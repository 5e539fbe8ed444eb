"""What the framework integrations share: the lazy import, the exit code on an alarm, and trust
in the framework's checkpoints.

A framework writes its own checkpoints (HF's `checkpoint-N/` folders, Lightning's `.ckpt`
files), with the state the guard's own checkpoints do not hold (LR scheduler, data position,
callbacks). The guard ties them to its trust decision instead of copying them:

- before the framework saves, the weights are voted on (a clean vote, as for the guard's own
  checkpoints); after it saved, rank 0 writes a *seal* beside the checkpoint: the step, the
  fingerprint of the state every replica holds, the run's id, and each file's sha256;
- before the framework resumes, the resume rule of `rundir.recovery.trust_window` (alarms,
  ledger) picks the newest sealed checkpoint it allows, and every checkpoint newer than it
  (sealed or not) moves to `<checkpoint dir>/slurm-guard-quarantine/<alarm id>/`, where no
  framework's "latest checkpoint" search looks;
- after the framework loaded it, every rank checks the fingerprint, and the rollback is
  recorded (alarms marked handled) as `Guard.resume` records it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from slurm_guard.comm.collective import Collective
from slurm_guard.comm.topology import local_rank_info
from slurm_guard.config import GuardConfig
from slurm_guard.errors import GuardError
from slurm_guard.fingerprint import as_hex
from slurm_guard.guard import exit_on_alarm
from slurm_guard.rundir.checkpoint import sha256_file
from slurm_guard.rundir.layout import RunDir, fresh_start_requested
from slurm_guard.rundir.records import RecordError, atomic_write_json, read_json_file
from slurm_guard.rundir.recovery import ResumePoint, trust_window
from slurm_guard.rundir.restore import record_rollback

if TYPE_CHECKING:
    from slurm_guard.core.session import GuardCore

logger = logging.getLogger(__name__)

SEAL_SCHEMA = 1
QUARANTINE_DIR = "slurm-guard-quarantine"
"""Beside the framework's checkpoints: where the untrusted ones go, never deleted."""


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


@dataclass(frozen=True)
class Seal:
    """What the guard vouches for about one framework checkpoint."""

    step: int
    weight_fingerprint: str
    fingerprint_seed: int
    run_id: str
    files: dict[str, str]  # path relative to the checkpoint -> sha256

    def as_json(self, restart_count: int, world_size: int) -> dict[str, Any]:
        return {
            "schema": SEAL_SCHEMA,
            "step": self.step,
            "clean_vote": True,
            "weight_fingerprint": self.weight_fingerprint,
            "fingerprint_seed": self.fingerprint_seed,
            "run_id": self.run_id,
            "files": self.files,
            "restart_count": restart_count,
            "world_size": world_size,
            "created": time.time(),
        }


def read_seal(path: Path) -> Seal:
    obj = read_json_file(path)
    if not isinstance(obj, dict) or obj.get("schema") != SEAL_SCHEMA:
        raise RecordError(f"{path}: not a slurm-guard seal of schema {SEAL_SCHEMA}")
    if obj.get("clean_vote") is not True:
        raise RecordError(f"{path}: saved without a clean weight vote")
    try:
        files = {str(k): str(v) for k, v in dict(obj["files"]).items()}
        return Seal(
            int(obj["step"]),
            str(obj["weight_fingerprint"]),
            int(obj["fingerprint_seed"]),
            str(obj["run_id"]),
            files,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"{path}: malformed seal ({exc})") from None


def _hash_files(checkpoint: Path, seal_path: Path) -> dict[str, str]:
    if checkpoint.is_file():
        return {checkpoint.name: sha256_file(checkpoint)}
    return {
        str(p.relative_to(checkpoint)): sha256_file(p)
        for p in sorted(checkpoint.rglob("*"))
        if p.is_file() and p != seal_path
    }


def _files_problem(checkpoint: Path, seal_path: Path, seal: Seal) -> str | None:
    base = checkpoint.parent if checkpoint.is_file() else checkpoint
    for rel, digest in seal.files.items():
        path = base / rel
        if not path.is_file():
            return f"{path} is missing"
        if sha256_file(path) != digest:
            return f"{path} changed since it was sealed"
    return None


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
    not check would be sealed as checked."""
    if core.step_count != framework_steps:
        raise GuardError(
            f"the guard counted {core.step_count} steps, {framework} {framework_steps}: "
            "was the guard skipped for some steps?"
        )
    vote_before_save(core)
    save()
    seal_checkpoint(core, checkpoint, seal_path)


def seal_checkpoint(core: GuardCore, checkpoint: Path, seal_path: Path) -> None:
    """After the framework saved `checkpoint` on every rank: rank 0 seals it (all must call)."""
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
            )
            atomic_write_json(seal_path, seal.as_json(core.restart_count, core.world_size))
        except (OSError, RecordError) as exc:
            problem = f"could not seal {checkpoint} ({exc})"
    core.comm.share_problem(problem, "sealing the framework's checkpoint")


@dataclass(frozen=True)
class Listed:
    """One checkpoint the framework wrote: its step, its path and where its seal goes."""

    step: int
    path: Path
    seal: Path


@dataclass(frozen=True)
class Chosen:
    """What every rank agreed to resume from, before the framework loads it."""

    path: Path | None  # None: start from step 0
    step: int  # -1 with no checkpoint
    last_verified_step: int | None
    verified_steps: list[int]
    seal: Seal | None
    point: ResumePoint | None  # rank 0's, for the rollback record; None elsewhere


def _run_id(run_dir: RunDir) -> str | None:
    try:
        obj = read_json_file(run_dir.identity_file)
    except RecordError:
        return None
    return obj.get("run_id") if isinstance(obj, dict) else None


def quarantine(item: Listed, target: Path) -> Path:
    """Move a checkpoint and its seal into `target`; the checkpoint's new path.

    Never over a file already there: two checkpoint folders may hold the same names (two
    Lightning ModelCheckpoints' `last.ckpt`), and quarantine never deletes. A clash gets a
    numbered prefix, the same for the checkpoint and its seal, so they stay a pair.
    """
    target.mkdir(parents=True, exist_ok=True)
    paths = (item.path, item.seal)
    prefix, n = "", 0
    while any((target / (prefix + p.name)).exists() for p in paths if p.exists()):
        n += 1
        prefix = f"{n}-"
    for path in paths:
        if path.exists():  # an HF seal lies inside its folder and has moved with it
            os.replace(path, target / (prefix + path.name))
    return target / (prefix + item.path.name)


def _plan(
    run_dir: RunDir,
    listed: Sequence[Listed],
    trust_replays: int,
    quarantine_root: Path,
    requested: Path | None,
) -> tuple[Listed | None, ResumePoint]:
    """Rank 0: the newest trusted checkpoint; everything newer moves to quarantine."""
    fresh = fresh_start_requested()
    window = trust_window(run_dir, trust_replays, fresh=fresh)
    run_id = _run_id(run_dir)
    chosen: Listed | None = None
    for item in sorted(listed, key=lambda x: -x.step):
        if fresh or not window.allows(item.step):
            continue
        try:
            seal = read_seal(item.seal)
        except RecordError as exc:
            logger.warning("not resuming from %s: %s", item.path, exc)
            continue
        problem = _files_problem(item.path, item.seal, seal)
        if seal.step != item.step:
            problem = f"its seal says step {seal.step}"
        elif seal.run_id != run_id:
            problem = f"sealed by run {seal.run_id[:16]}, not this run directory's"
        if problem is None:
            chosen = item
            break
        logger.warning("not resuming from %s: %s", item.path, problem)
    if requested is not None and (chosen is None or chosen.path.resolve() != requested.resolve()):
        trusted = chosen.path if chosen is not None else "none (start from step 0)"
        raise GuardError(
            f"resume_from_checkpoint={requested} is not the checkpoint slurm-guard trusts "
            f"({trusted}); pass True (or nothing) to let the guard choose"
        )
    step = chosen.step if chosen is not None else -1
    tag = window.pending_alarms[0] if window.pending_alarms else f"untrusted-{int(time.time())}"
    if fresh:
        tag = f"fresh-start-{int(time.time())}"
    moved = []
    for item in listed:
        if item.step > step or fresh:
            moved.append(quarantine(item, quarantine_root / tag).name)
    if moved:
        logger.warning("moved %s to %s", ", ".join(moved), quarantine_root / tag)
    passes = sorted({s for s in window.verified if s <= step})
    point = ResumePoint(step, max(passes, default=-1), window.pending_alarms, passes, fresh)
    return chosen, point


def choose_checkpoint(
    run_dir: RunDir,
    list_checkpoints: Callable[[], Sequence[Listed]],
    output_root: Path,
    config: GuardConfig,
    requested: Path | None = None,
) -> Chosen:
    """Every rank: the checkpoint the framework may resume from (rank 0 decides, all agree);
    the newer ones move to `<output_root>/slurm-guard-quarantine/`.

    Runs before the guard's core exists (the framework loads before it wraps the model), on
    the default process group. Raises GuardError on every rank when the run directory cannot
    be read or `requested` is not the trusted checkpoint.
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
            item, point = _plan(
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
    record_rollback(core.comm, core.run_dir, chosen.point, core.restart_count, core.attempt)
