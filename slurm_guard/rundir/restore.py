"""Carrying out a resume on every rank: try the planned checkpoints until one loads everywhere.

`recovery.py` decides what may be loaded and stays torch-light; this module does the loading,
which needs torch and the collective. Every step tried is broadcast from rank 0 and every rank
loads it under `Collective.agree`, so a checkpoint damaged on one rank (hash, fingerprint,
unreadable file) is skipped by all of them together for the next older one, and no rank ever
continues from a state another rank could not reproduce.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from slurm_guard.comm.collective import Collective
from slurm_guard.comm.errors import RankFailed
from slurm_guard.errors import GuardError
from slurm_guard.fingerprint.nh import FastFingerprinter
from slurm_guard.fingerprint.tree import Fingerprinter, as_hex
from slurm_guard.rundir import checkpoint as ckpt
from slurm_guard.rundir.layout import OVERRIDE_HINT, RunDir, fresh_start_requested
from slurm_guard.rundir.records import read_json_file
from slurm_guard.rundir.recovery import ResumePlan, ResumePoint, finish_rollback, plan_resume
from slurm_guard.rundir.resumes import CHECKPOINT, NOTHING, SNAPSHOT, ResumeNote
from slurm_guard.rundir.trust import CheckpointMeta, parse_checkpoint_meta

logger = logging.getLogger(__name__)


class SnapshotSource(Protocol):
    """Node-local snapshots a resume may prefer to checkpoints (`core.snapshots`)."""

    def resume(self, allowed: Callable[[int], bool] | None, newest_checkpoint: int) -> int:
        """Every rank resumes from the same snapshot, or none (-1); collective, never raises
        for a snapshot that is unusable (the checkpoints then decide)."""
        ...

    def discard_after(self, step: int) -> None:
        """Forget snapshots newer than the state resumed from: a rollback undid them."""
        ...


@dataclass(frozen=True)
class Resumed:
    """What every rank agreed on after the load; the rollback is recorded only afterwards."""

    step: int  # the loaded checkpoint's step, -1 when nothing was loaded
    last_verified_step: int | None  # only meaningful when something was loaded
    verified_steps: list[int]  # the newest `trust_replays` passing replays up to `step`
    point: ResumePoint | None  # rank 0's plan outcome, None on the other ranks
    source: str = NOTHING  # snapshot, checkpoint or none: what the resume record says
    path: str | None = None  # the checkpoint, or rank 0's snapshot directory


def resume_collectively(
    comm: Collective,
    run_dir: RunDir,
    rank: int,
    trust_replays: int,
    load: Callable[[int], None],
    *,
    run_id: str | None,
    refuse: Callable[[CheckpointMeta], str | None] | None = None,
    snapshots: SnapshotSource | None = None,
) -> Resumed:
    """Load the newest usable allowed checkpoint on every rank (all must call).

    `load(step)` runs on each rank and raises when the checkpoint is unusable there; it must
    not use collectives. Raises GuardError on every rank when the run directory cannot be read,
    every allowed checkpoint is damaged, or the newest one not damaged cannot be resumed here
    for a reason no older one mends: sealed by another run than `run_id` (`foreign_problem`),
    or what `refuse(meta)` (rank 0) names, such as another world size.

    With `snapshots`, the newest snapshot step that every rank holds, that the resume rule
    allows and that is at least as new as the newest allowed checkpoint is tried first; if it
    fails to load on any rank, the checkpoints are tried as without snapshots. Whatever is
    resumed from, every rank then forgets its snapshots newer than it.
    """
    plan: ResumePlan | None = None
    problem = None
    if rank == 0:
        try:
            plan = plan_resume(run_dir, trust_replays, fresh=fresh_start_requested())
        except (GuardError, OSError) as exc:
            problem = str(exc)
    comm.share_problem(problem, "resume: reading the run directory")
    chosen = -1 if snapshots is None else _resume_from_snapshot(comm, rank, plan, snapshots)
    source = (SNAPSHOT, _snapshot_path(snapshots, chosen)) if chosen >= 0 else (NOTHING, None)
    while chosen < 0:
        step = -1
        if plan is not None:
            meta = plan.next_candidate()
            problem = None if meta is None else foreign_problem(meta, run_id)
            if meta is not None and problem is None and refuse is not None:
                problem = refuse(meta)
            step = -1 if meta is None or problem is not None else meta.step
        comm.share_problem(problem, "resume: whose checkpoint")
        (step,) = comm.broadcast_ints([step])
        if step < 0:
            break
        try:
            comm.agree(functools.partial(load, step), f"resume: load step-{step:08d}")
        except RankFailed as exc:  # damaged on some rank: every rank tries the next one
            if plan is not None:
                plan.reject(step, f"rank {exc.rank} ({exc.node}): {exc.cause}")
            continue
        chosen = step
        source = (CHECKPOINT, str(run_dir.checkpoint_path(step)))
        break
    if snapshots is not None:
        snapshots.discard_after(chosen)
    problem = None
    if plan is not None and chosen < 0:
        error = plan.nothing_usable()
        problem = None if error is None else str(error)
    comm.share_problem(problem, "resume")
    point = plan.point(chosen) if plan is not None else None
    # Only the newest `trust_replays` passes can ever bound a later rollback.
    k = trust_replays
    recent = ((point.verified_steps[-k:] if point else []) + [-1] * k)[:k]
    last_verified, *passes = comm.broadcast_ints(
        [point.last_verified_step if point else -1, *recent]
    )
    return Resumed(
        step=chosen,
        last_verified_step=last_verified if last_verified >= 0 else None,
        verified_steps=sorted(s for s in passes if s >= 0),
        point=point,
        source=source[0],
        path=source[1],
    )


def _resume_from_snapshot(
    comm: Collective, rank: int, plan: ResumePlan | None, snapshots: SnapshotSource
) -> int:
    """The snapshot every rank resumed from, or -1: the trust window and the newest allowed
    checkpoint are rank 0's (its plan), what each node holds is every rank's."""
    allowed = plan.allows if plan is not None else None
    newest = max((m.step for m in plan.candidates), default=-1) if plan is not None else -1
    return snapshots.resume(allowed, newest)


def _snapshot_path(snapshots: SnapshotSource | None, step: int) -> str | None:
    """Where this rank's snapshot of `step` lives on its node, for the resume record."""
    store = getattr(snapshots, "store", None)
    where = getattr(store, "path", None)
    return str(where(step)) if callable(where) else None


def foreign_problem(meta: CheckpointMeta, run_id: str | None) -> str | None:
    """Why a checkpoint sealed by another run must not be resumed from, or None.

    Its fingerprint verifies under its own seed, so without this a checkpoint copied in from
    another run's directory would be loaded as if this run had saved it, and this run's alarms
    and ledger would vouch for weights they never saw. Not skipped for an older one either:
    files of two runs in one checkpoints/ is the mix `rundir.identity` refuses at start. A seal
    without a run id (slurm-guard before run ids) cannot be compared and is taken as it is.
    """
    if meta.run_id is None or run_id is None or meta.run_id == run_id:
        return None
    return (
        f"checkpoint step-{meta.step:08d} was sealed by run {meta.run_id[:16]}, not by this "
        f"run ({run_id[:16]}, identity.json): it was copied from another run's directory, and "
        "that run's checks, not this one's, vouch for it. Move it out of checkpoints/ (resume "
        f"the other run from its own directory). {OVERRIDE_HINT}"
    )


def record_rollback(
    comm: Collective,
    run_dir: RunDir,
    point: ResumePoint | None,
    restart_count: int,
    attempt: str,
    resumed: Resumed | None = None,
    job_id: str = "",
) -> ResumeNote | None:
    """Rank 0 quarantines and marks alarms handled; a failure there stops every rank.

    With `resumed`, rank 0 also writes what this start resumed from (`rundir.resumes`) and
    returns the note, which the guard completes after its first step.
    """
    problem = None
    note = None
    if resumed is not None and point is not None:
        note = ResumeNote.resumed(
            run_dir.root, job_id, restart_count, resumed.source, point_step(resumed), resumed.path
        )
    if point is not None:
        try:
            finish_rollback(run_dir, point, restart_count, attempt)
        except (GuardError, OSError) as exc:
            problem = f"could not record the rollback ({exc})"
    comm.share_problem(problem, "resume: recording the rollback")
    return note


def point_step(resumed: Resumed) -> int | None:
    return resumed.step if resumed.step >= 0 else None


def load_checkpoint(
    run_dir: RunDir,
    step: int,
    rank: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    fingerprinter: Fingerprinter,
    state_tensors: Callable[[], list[torch.Tensor]],
    stateful: Callable[[Any, CheckpointMeta], None] | None = None,
) -> None:
    """Load checkpoint `step` on this rank; raise if it is unusable here (no collectives).

    `stateful` receives this rank's saved stateful state (None: none saved for this rank) and
    the checkpoint's meta once the weights are proven: the objects are never restored from a
    checkpoint whose weights fail their fingerprint.
    """
    meta_path = run_dir.checkpoint_path(step) / "meta.json"
    meta = parse_checkpoint_meta(read_json_file(meta_path), str(meta_path))
    state = ckpt.load(run_dir, meta, rank, stateful=stateful is not None)
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if state["rng"] is not None:
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"]["cuda"])
    # Verify under the seed the checkpoint was sealed with: a run directory whose run.json
    # was lost or replaced must not make a good checkpoint look corrupt.
    seed = meta.fingerprint_seed
    checker = fingerprinter if seed in (None, fingerprinter.seed) else FastFingerprinter(seed)
    fingerprint = as_hex(checker.tensors(state_tensors()))
    if fingerprint != meta.weight_fingerprint:
        raise GuardError(
            f"the loaded state does not reproduce the recorded weight fingerprint "
            f"({fingerprint} != {meta.weight_fingerprint})"
        )
    if stateful is not None:
        stateful(state["stateful"], meta)
