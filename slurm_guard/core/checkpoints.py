"""Saving a verified checkpoint and resuming from the trusted one, for every entry point.

Both are collective: every rank enters them in the same order, and a failure on one rank reaches
every rank as the same named error (`Collective.share_problem`), so no rank waits for another
that has given up.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from slurm_guard.core import events, stateful
from slurm_guard.errors import GuardError
from slurm_guard.fingerprint import as_hex
from slurm_guard.rundir import checkpoint as ckpt
from slurm_guard.rundir.identity import check_unchanged
from slurm_guard.rundir.restore import (
    Resumed,
    load_checkpoint,
    record_rollback,
    resume_collectively,
)
from slurm_guard.rundir.resumes import SNAPSHOT, ResumeNote
from slurm_guard.rundir.trust import CheckpointMeta

if TYPE_CHECKING:
    from slurm_guard.comm.collective import Collective
    from slurm_guard.core.session import GuardCore
    from slurm_guard.rundir.layout import RunDir

logger = logging.getLogger(__name__)


class Voting(Protocol):
    """What every guard (DDP's GuardCore, ShardedGuard) offers a save before it writes."""

    comm: Collective
    step_count: int
    voted_at: int

    def vote(self, step: int) -> None: ...


def begin_save(guard: Voting) -> int:
    """The start of every save: something to save, every rank here, the state voted on.

    Returns the step count the checkpoint stands for.
    """
    step = guard.step_count
    if step == 0:
        raise GuardError("save_checkpoint() before the first step: nothing to save yet")
    guard.comm.arrive(f"save_checkpoint() after {step} steps")
    if guard.voted_at != step:
        guard.vote(step - 1)
    return step


def save_checkpoint(core: GuardCore) -> Path:
    """Vote, then save atomically into run_dir/checkpoints/step-N (N = completed steps)."""
    step = begin_save(core)
    comm, rank = core.comm, core.rank
    # What a restart can recompute from the saved files alone (buffers as saved).
    fingerprint = as_hex(core.fingerprinter.tensors(core.state_tensors()))
    # Never into a run directory that vanished or was replaced since the start (it would
    # be silently recreated), nor after another job took the lock over.
    run_dir = core.run_dir
    problem = check_unchanged(run_dir, core.opened.stamp, core.run_id)
    lock = core.opened.lock
    if problem is None and lock is not None and not lock.held():
        problem = f"another job took over the lock {run_dir.lock_file}"
    if problem is not None:
        problem = f"checkpoint at step {step} not saved: {problem}"
    comm.share_problem(problem, "run directory check before the save")
    stage = ckpt.staging_dir(run_dir, step, core.restart_count, core.attempt)
    try:
        ckpt.write_rank_files(
            stage,
            rank,
            core.module.state_dict() if rank == 0 else None,
            core.optimizer.state_dict() if rank == 0 else None,
            core.rng_after_step,
            stateful.collect(core.stateful, core.scaler),
        )
    except Exception as exc:  # any failure must reach every rank, not hang them
        logger.exception("rank %d could not write its checkpoint files", rank)
        problem = f"checkpoint at step {step}: could not write its files ({exc})"
    try:
        comm.share_problem(problem, "checkpoint files")
    except GuardError:
        if rank == 0:
            ckpt.discard(stage)
        raise
    path = run_dir.checkpoint_path(step)
    if rank == 0:
        try:
            path = ckpt.publish(
                run_dir,
                stage,
                step=step,
                weight_fingerprint=fingerprint,
                fingerprint_seed=core.fingerprinter.seed,
                world_size=core.world_size,
                restart_count=core.restart_count,
                run_id=core.run_id,
            )
        except Exception as exc:
            logger.exception("could not publish checkpoint %s", path)
            problem = f"checkpoint at step {step} could not be published ({exc})"
            ckpt.discard(stage)
    comm.share_problem(problem, "checkpoint publish")
    core.after_save()
    return path


def stateful_problem(core: GuardCore, saved: Any, meta: CheckpointMeta) -> str | None:
    """Why this rank cannot restore the stateful objects from `meta`'s checkpoint, or None.

    The rule (docs/user-guide.md, "A checkpoint without the stateful state"): the state is
    per rank, so a checkpoint saved on another number of ranks cannot restore it; objects
    given now that the checkpoint was sealed without (before they were passed, or by an older
    slurm-guard) stop the resume naming them; a GradScaler alone is never a reason to stop
    (`stateful.scaler_restarts`).
    """
    names = list(core.stateful)
    where = f"checkpoint step-{meta.step:08d}"
    if names and meta.world_size != core.world_size:
        return (
            f"{where} was saved on {meta.world_size} ranks and this run has {core.world_size}: "
            f"the state of stateful {', '.join(repr(n) for n in names)} is saved per rank (a "
            "data loader's position differs per rank), and the guard cannot split or merge it. "
            f"Resume on {meta.world_size} ranks, or start fresh (SLURM_GUARD_RESUME=fresh)"
        )
    lacking = names if saved is None else stateful.missing(saved, core.stateful)
    if lacking:
        return (
            f"{where} has no saved state for stateful {', '.join(repr(n) for n in lacking)}: "
            "it was saved without them (before they were passed to Guard(stateful=...), or by "
            "a slurm-guard version without stateful checkpoints). Resume without them, or "
            "start fresh (SLURM_GUARD_RESUME=fresh)"
        )
    return None


def resume(core: GuardCore) -> int:
    """Load the trusted checkpoint into the core's module and optimizer; return its step.

    The rule and its failure modes are in `Guard.resume`'s docstring.
    """
    core.comm.arrive("resume()")
    problems: dict[int, str] = {}  # step -> why its stateful state cannot be restored here
    scaler_restarts: set[int] = set()
    # A restart must be the same on every rank, also on one that restored a newer checkpoint's
    # scaler state before another rank found that checkpoint damaged.
    initial_scaler = stateful.scaler_state(core.scaler)

    def restore_stateful(step: int, saved: Any, meta: CheckpointMeta) -> None:
        # Runs once the weights are proven. What is decided here is the same for every
        # checkpoint of the run (not damage), so it stops the resume instead of skipping.
        problem = stateful_problem(core, saved, meta)
        if problem is not None:
            problems[step] = problem
            return
        if meta.world_size != core.world_size:  # only a scaler: restarted on every rank,
            saved = None  # never restored on some: unequal loss scales break the average
        if stateful.scaler_restarts(saved, core.scaler):
            scaler_restarts.add(step)
            if core.scaler is not None and initial_scaler is not None:
                core.scaler.load_state_dict(initial_scaler)
        if saved is not None:
            stateful.restore(saved, core.stateful, core.scaler)

    load = functools.partial(
        load_checkpoint,
        core.run_dir,
        rank=core.rank,
        module=core.module,
        optimizer=core.optimizer,
        fingerprinter=core.fingerprinter,
        state_tensors=core.state_tensors,
    )

    rng_loaded: dict[int, dict[str, Any]] = {}  # step -> this rank's RNG right after its load

    def load_step(step: int) -> None:
        if stateful.expected(core.stateful, core.scaler):
            load(step, stateful=functools.partial(restore_stateful, step))
        else:
            load(step)
        rng_loaded[step] = ckpt.rng_state()

    resumed = resume_collectively(
        core.comm,
        core.run_dir,
        core.rank,
        core.config.trust_replays,
        load_step,
        run_id=core.run_id,
        snapshots=core.snapshots,
    )
    problem = problems.get(resumed.step)
    if resumed.step in scaler_restarts and core.rank == 0:
        logger.warning(
            "checkpoint step-%08d holds no GradScaler state for this run (saved while the "
            "scaler was disabled, by a slurm-guard version before stateful checkpoints, or on "
            "another number of ranks): the scaler restarts from its initial scale on every "
            "rank, and the resumed run is not bit-identical to an uninterrupted one",
            resumed.step,
        )
    core.comm.share_problem(problem, "resume: the stateful objects")
    core.verified_steps = resumed.verified_steps
    # A save before the first step after the resume (nanoGPT evaluates, then saves, at the
    # resumed step) must keep the checkpoint's RNG state, not the one the eval left.
    core.rng_after_step = rng_loaded.get(resumed.step)
    if resumed.step < 0:
        core.step_count = 0
        core.last_verified_step = None
    else:
        core.step_count = resumed.step
        core.last_verified_step = resumed.last_verified_step
        core.voted_at = resumed.step
    record_resume(core, resumed)
    return core.step_count


class Resuming(Protocol):
    """What every entry point that resumes offers the record of its resume: the DDP guard,
    ShardedGuard (`sharded.checkpoint.GuardState`), a framework integration's core."""

    comm: Collective
    run_dir: RunDir
    rank: int
    job_id: str | None
    restart_count: int
    attempt: str
    resume_note: ResumeNote | None


def record_resume(guard: Resuming, resumed: Resumed) -> None:
    """After every rank loaded what `resumed` names: rank 0 quarantines and marks the alarms
    handled (`record_rollback`; a failure stops every rank), then says in one line where the
    run resumed from and what was moved aside (all must call)."""
    guard.resume_note = record_rollback(
        guard.comm,
        guard.run_dir,
        resumed.point,
        guard.restart_count,
        guard.attempt,
        resumed,
        guard.job_id or "",
    )
    line = resume_line(guard.run_dir, resumed) if guard.rank == 0 else None
    if line is not None:
        events.announce(line)


def resume_line(run_dir: RunDir, resumed: Resumed) -> str | None:
    """Where the run resumed from and what was moved aside, and why, in one line (None: a
    first start, which the start line already says). Rank 0's: only it holds the plan."""
    step, point = resumed.step, resumed.point
    alarms = point.pending_alarms if point is not None else []
    if step < 0 and not alarms and not (point is not None and point.fresh):
        return None
    if step < 0:
        where = "starting at step 0 (no checkpoint to resume from)"
    elif resumed.source == SNAPSHOT:
        where = f"resumed at step {step} from the node-local snapshot of step {step}"
    else:
        where = f"resumed at step {step} from checkpoint {resumed.path}"
    if point is not None and point.fresh:
        where += " (SLURM_GUARD_RESUME=fresh)"
    moved = {
        str(r.get("alarm_id")): r.get("quarantined") or []
        for r in run_dir.resumes()
        if r.get("alarm_id") in alarms
    }
    for alarm_id in alarms:
        where += f"; after alarm {alarm_id}: {_moved_aside(moved.get(alarm_id, []), alarm_id)}"
    return where


def _moved_aside(moved: list[str], alarm_id: str) -> str:
    """The run directory's checkpoints are recorded by name (they go to quarantine/<alarm>/),
    a framework's by their new path (`<output dir>/slurm-guard-quarantine/<alarm>/...`)."""
    if not moved:
        return "no checkpoint saved after the last step the alarm trusts, nothing moved aside"
    folders: dict[str, list[str]] = {}
    for item in moved:
        path = Path(item)
        folder = f"{path.parent}/" if path.is_absolute() else f"quarantine/{alarm_id}/"
        folders.setdefault(folder, []).append(path.name)
    aside = [f"moved aside to {folder}: {', '.join(names)}" for folder, names in folders.items()]
    return "; ".join(aside) + " (saved after the last step the alarm trusts)"
