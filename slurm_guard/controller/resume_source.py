"""Where a restart resumes from, as the controller sees it before the training command starts.

One question, one place: the in-job restart records it, and `status` shows it. Today the only
source is the trusted checkpoint (by the guard's resume rule, restated torch-free in
`status_view.resume_preview`). Verified snapshots in node memory (issue 32) become a second
kind here: `pick_resume_source` then prefers the newest trusted snapshot and falls back to the
checkpoint, and its callers need not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CHECKPOINT = "checkpoint"
NONE = "none"  # nothing trusted: the run starts from step 0 or refuses, by the guard's rule


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
    if isinstance(step, int):
        return ResumeSource(CHECKPOINT, step, f"trusted checkpoint step-{step}")
    return ResumeSource(NONE, None, "no trusted checkpoint: the guard's resume rule decides")
