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
