"""Where a restart is expected to resume from, before the training command starts.

Only an expectation, journaled with the in-job restart's plan: the newest snapshot rank 0
noted (`snapshots.json`) that the resume rule allows, if it is at least as new as the trusted
checkpoint (the nodes may no longer hold it), else the trusted checkpoint (the guard's resume
rule, restated torch-free in `status_view.resume_preview`). What a start really loaded is the
guard's own record (`rundir.resumes`), which `status`, the journal (`restart_done`) and the
report read; this module never stands in for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slurm_guard.rundir.resumes import CHECKPOINT, SNAPSHOT
from slurm_guard.rundir.resumes import NOTHING as NONE  # the run starts from step 0 or refuses


@dataclass(frozen=True)
class ResumeSource:
    """What a restart would load: its kind, the step, and a line saying why."""

    kind: str
    step: int | None
    detail: str


def pick_resume_source(run_dir: Path) -> ResumeSource:
    """The source a restart of the run in `run_dir` would load now."""
    from slurm_guard.controller.status_view import resume_preview, trust_replays_of
    from slurm_guard.rundir.layout import RunDir

    rd = RunDir(run_dir)
    info = rd.run_info()
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    preview = resume_preview(rd, trust_replays_of(config if isinstance(config, dict) else {}))
    if preview.get("blocked"):
        return ResumeSource(NONE, None, str(preview["blocked"]))
    step = preview.get("trusted_checkpoint")
    snap = preview.get("snapshot")
    if isinstance(snap, int) and (not isinstance(step, int) or snap >= step):
        return ResumeSource(SNAPSHOT, snap, f"node-local snapshot {snap}, if the nodes hold it")
    if isinstance(step, int):
        return ResumeSource(CHECKPOINT, step, f"trusted checkpoint step-{step}")
    return ResumeSource(NONE, None, "no trusted checkpoint: the guard's resume rule decides")
