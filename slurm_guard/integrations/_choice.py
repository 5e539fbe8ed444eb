"""Rank 0's choice of the framework checkpoint to resume from, and what rotation must keep.

The rule is `Guard.resume()`'s (`rundir.recovery.trust_window`, failing closed the same way);
this module applies it to checkpoints the framework wrote where its user said, each with a
seal beside it (`rundir.seals`). No collectives here: `_frameworks.choose_checkpoint` runs it
on rank 0 and shares the outcome.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_guard.errors import GuardError
from slurm_guard.rundir.checkpoint import sha256_file
from slurm_guard.rundir.layout import OVERRIDE_HINT, RunDir, fresh_start_requested
from slurm_guard.rundir.records import RecordError
from slurm_guard.rundir.recovery import ResumePoint, trust_window
from slurm_guard.rundir.seals import Seal, read_seal, resume_order, run_id_of

if TYPE_CHECKING:
    from slurm_guard.core.session import GuardCore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listed:
    """One checkpoint the framework wrote: its step, its path and where its seal goes."""

    step: int
    path: Path
    seal: Path


def _files_problem(checkpoint: Path, seal_path: Path, seal: Seal) -> str | None:
    base = checkpoint.parent if checkpoint.is_file() else checkpoint
    for rel, digest in seal.files.items():
        path = base / rel
        if not path.is_file():
            return f"{rel} is missing"
        if sha256_file(path) != digest:
            return f"{rel} changed since it was sealed"
    return None


def held_back(core: GuardCore, listed: Sequence[Listed]) -> set[Path]:
    """The checkpoints the framework's rotation must not delete (resolved paths).

    The one a rollback would load now (the newest sealed at or before the `trust_replays`-th
    newest passing replay), and the ones the next passes will make trusted (the newest at or
    before each of the newest `trust_replays` passes): without them a rotation that keeps
    only the newest few would always be ahead of the trust rule, and every rollback would
    find nothing it may load.
    """
    passes = set(core.verified_steps)
    if core.last_verified_step is not None:
        passes.add(core.last_verified_step)
    recent = sorted(passes)[-max(core.config.trust_replays, 1) :]
    ours = [item for item in sorted(listed, key=resume_order) if _sealed_by(item, core.run_id)]
    keep = set()
    for limit in recent:
        best = next((item for item in ours if item.step <= limit), None)
        if best is not None:
            keep.add(best.path.resolve())
    return keep


def _sealed_by(item: Listed, run_id: str) -> bool:
    try:
        seal = read_seal(item.seal)
    except RecordError:
        return False
    return seal.run_id == run_id and seal.step == item.step


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


def _unusable(item: Listed, run_id: str | None) -> tuple[str | None, str | None]:
    """(why `item` cannot be loaded, why it is another run's); (None, None): it can be.

    A checkpoint without a seal file is neither: a save that never finished (the seal is
    written last) or one the guard did not vote on. It is never loaded, and moves aside.
    """
    if not item.seal.exists():
        return "not sealed", None
    try:
        seal = read_seal(item.seal)
    except RecordError as exc:
        return str(exc), None
    if seal.step != item.step:
        return f"its seal says step {seal.step}", None
    if seal.run_id != run_id:
        ours = "a new run, no identity.json yet" if run_id is None else run_id[:16]
        return None, (
            f"{item.path.name} was sealed by run {seal.run_id[:16]}, not by this run "
            f"({ours}): another guard run directory's checks vouch for it, not this run's. "
            "Give this run its own output directory, or resume the other run with its own "
            f"run directory. {OVERRIDE_HINT} (in {item.path.parent})"
        )
    return _files_problem(item.path, item.seal, seal), None


def plan_choice(
    run_dir: RunDir,
    listed: Sequence[Listed],
    trust_replays: int,
    quarantine_root: Path,
    requested: Requested | None,
) -> tuple[Listed | None, ResumePoint]:
    """Rank 0: the newest trusted checkpoint; everything newer moves to quarantine.

    The rule of `Guard.resume()`: the trust window allows a step; of the allowed checkpoints
    the newest usable one wins; allowed checkpoints that exist but are all unusable (damaged,
    unreadable seal) are an error, and so is one sealed by another run. None was ever saved:
    a fresh start.
    """
    fresh = fresh_start_requested()
    window = trust_window(run_dir, trust_replays, fresh=fresh)
    run_id = run_id_of(run_dir)
    chosen: Listed | None = None
    unusable: list[tuple[Path, str]] = []
    for item in sorted(listed, key=resume_order):
        if fresh or not window.allows(item.step):
            continue
        problem, foreign = _unusable(item, run_id)
        if foreign is not None:
            raise GuardError(foreign)
        if problem is None:
            chosen = item
            break
        logger.warning("not resuming from %s: %s", item.path, problem)
        if problem != "not sealed":
            unusable.append((item.path, problem))
    if chosen is None and unusable:
        named = "; ".join(f"{path.name}: {problem[:80]}" for path, problem in unusable[:3])
        raise GuardError(
            f"all {len(unusable)} checkpoints the resume rule allows are unusable ({named}); "
            "nothing was loaded. Restore one from a backup, or move the damaged ones aside to "
            f"resume from an older one. {OVERRIDE_HINT} (in {unusable[0][0].parent})"
        )
    if requested is not None and (
        chosen is None or chosen.path.resolve() != requested.path.resolve()
    ):
        trusted = chosen.path if chosen is not None else "none (start from step 0)"
        raise GuardError(
            f"{requested.argument}={requested.path} is not the checkpoint slurm-guard trusts "
            f"({trusted}); {requested.instead}"
        )
    step = chosen.step if chosen is not None else -1
    tag = window.pending_alarms[0] if window.pending_alarms else f"untrusted-{int(time.time())}"
    if fresh:
        tag = f"fresh-start-{int(time.time())}"
    moved = []
    for item in listed:
        if item.step > step or fresh:
            moved.append(str(quarantine(item, quarantine_root / tag)))
    if moved:
        logger.warning("moved %s to %s", ", ".join(moved), quarantine_root / tag)
    passes = sorted({s for s in window.verified if s <= step})
    point = ResumePoint(step, max(passes, default=-1), window.pending_alarms, passes, fresh, moved)
    return chosen, point


@dataclass(frozen=True)
class Requested:
    """A checkpoint the user named, in the framework's words for the error if it is not the
    trusted one."""

    path: Path
    argument: str  # "resume_from_checkpoint", "ckpt_path"
    instead: str  # what to pass to let the guard choose
