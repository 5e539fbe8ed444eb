"""`slurm-guard report`: a run's story on one self-contained HTML page.

Reads only the run directory (no Slurm, no controller state): a user can run it on their own
run. The controller never imports this package; matplotlib is an optional extra.
"""

from __future__ import annotations

from pathlib import Path

from slurm_guard.report.events import record_loss
from slurm_guard.report.html import render_page
from slurm_guard.report.plot import matplotlib_available, svg_figure
from slurm_guard.report.timeline import ReportError, Timeline, read_timeline
from slurm_guard.rundir.records import atomic_write_bytes

__all__ = [
    "ReportError",
    "Timeline",
    "matplotlib_available",
    "read_timeline",
    "record_loss",
    "write_report",
]


def write_report(run_dir: Path, out: Path) -> Timeline:
    """Write the page for `run_dir` to `out` atomically; return what it was built from."""
    timeline = read_timeline(run_dir)
    page = render_page(timeline, svg_figure(timeline))
    atomic_write_bytes(Path(out), page.encode("utf-8"))
    return timeline
