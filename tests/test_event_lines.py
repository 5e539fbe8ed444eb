"""One line per event, from rank 0 (issue 43): real ranks under `slurm-guard local -n 3`, their
stderr captured and counted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("events_script.py")


def _launch(run_dir: Path, mode: str, inject: str = "") -> tuple[int, str]:
    env = {**os.environ, "SLURM_GUARD_INJECT": inject}
    launcher = [sys.executable, "-m", "slurm_guard.cli", "local", "-n", "3", "--"]
    proc = subprocess.run(
        [*launcher, sys.executable, str(SCRIPT), str(run_dir), mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_start_alarm_and_resume_say_one_line_each_from_rank_0(tmp_path: Path) -> None:
    code, out = _launch(tmp_path, "train", "kind=grad-scale,node=node2,step=5,persistent=1")
    assert code == 86, out
    assert out.count("slurm-guard: guarding 3 ranks on 3 nodes") == 1, out
    assert "replay every 2 steps" in out and f"run dir {tmp_path}" in out
    assert out.count("fault injection is ON") == 1, out
    assert out.count("stopped by slurm-guard") == 1, out
    assert "Traceback" not in out, out
    code, out = _launch(tmp_path, "train")
    assert code == 0, out
    resumed = [line for line in out.splitlines() if "slurm-guard: resumed at step" in line]
    assert len(resumed) == 1, out
    assert "from checkpoint" in resumed[0] and "moved aside to quarantine/" in resumed[0], out
    assert "step-00000006" in resumed[0], resumed


def test_a_rank_0_only_save_shows_the_named_error_alone(tmp_path: Path) -> None:
    """Today `RuntimeError: Unable to cast ...` came first, and each rank repeated the rest."""
    code, out = _launch(tmp_path, "rank0-save")
    assert code != 0, out
    assert "Unable to cast" not in out and "Traceback" not in out, out
    assert out.count("CollectiveMismatch") == 1, out
    assert "never e.g. `if rank == 0: guard.save_checkpoint()`" in out


def test_the_resume_line_names_where_each_checkpoint_was_moved(tmp_path: Path) -> None:
    """The run directory's checkpoints go to quarantine/<alarm>/ (recorded by name), a
    framework's to <output dir>/slurm-guard-quarantine/<alarm>/ (recorded by path): the line
    must name the folder each went to, and the checkpoint the framework loaded."""
    from slurm_guard.core.checkpoints import resume_line
    from slurm_guard.rundir.layout import RunDir
    from slurm_guard.rundir.recovery import ResumePoint
    from slurm_guard.rundir.restore import Resumed

    run_dir = RunDir(tmp_path / "run")
    run_dir.handled_dir.mkdir(parents=True)
    aside = tmp_path / "out" / "slurm-guard-quarantine" / "a1"
    moved = ["step-00000006", str(aside / "checkpoint-4"), str(aside / "checkpoint-5")]
    run_dir.mark_handled("a1", {"alarm_id": "a1", "quarantined": moved})
    point = ResumePoint(3, 3, ["a1"], [3])
    loaded = str(tmp_path / "out" / "checkpoint-3")
    line = resume_line(run_dir, Resumed(3, 3, [3], point, "checkpoint", loaded))
    assert line == (
        f"resumed at step 3 from checkpoint {loaded}; after alarm a1: moved aside to "
        f"quarantine/a1/: step-00000006; moved aside to {aside}/: checkpoint-4, checkpoint-5 "
        "(saved after the last step the alarm trusts)"
    )
    snapshot = resume_line(run_dir, Resumed(3, 3, [3], ResumePoint(3, 3), "snapshot", "/shm/x"))
    assert snapshot == "resumed at step 3 from the node-local snapshot of step 3"
    assert resume_line(run_dir, Resumed(-1, None, [], ResumePoint(-1, -1))) is None  # first start
