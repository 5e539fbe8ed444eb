"""`slurm-guard local -n 3 -- python script.py`: real processes, real gloo, the real exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_guard.local.script import exit_code

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "local_train.py"


def _launch(run_dir: Path, inject: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("SLURM_GUARD_INJECT", None)
    if inject is not None:
        env["SLURM_GUARD_INJECT"] = inject
    cmd = [sys.executable, "-m", "slurm_guard.cli", "local", "-n", "3", "--grace", "60"]
    cmd += ["--", sys.executable, str(SCRIPT), str(run_dir), "6"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_a_clean_run_exits_0(tmp_path: Path) -> None:
    out = _launch(tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "run.json").is_file()


def test_a_persistent_fault_on_node2_makes_the_launcher_exit_86(tmp_path: Path) -> None:
    out = _launch(tmp_path, "kind=grad-scale,node=node2,step=1,persistent=1,param=3")
    assert out.returncode == 86, out.stderr[-3000:]
    assert list((tmp_path / "alarms").glob("*.json")), "no alarm record"


def test_the_exit_code_keeps_86_and_the_first_failure() -> None:
    assert exit_code([0, 86, 1]) == 86
    assert exit_code([0, 3, 1]) == 3
    assert exit_code([0, -15, 0]) == 128 + 15
    assert exit_code([0, 0, 0]) == 0
