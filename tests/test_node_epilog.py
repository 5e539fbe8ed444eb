"""The per-node Epilog frees exactly the finished job's snapshots, and never fails the node.

The script itself, run as Slurm runs it (environment variables, no arguments) on real files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "epilog" / "slurm-guard-node-epilog.sh"
# What the site sets in /etc/default/slurm-guard, and what Slurm gives every epilog.
SITE = {
    "SLURM_GUARD_PYTHON": sys.executable,
    "PYTHONPATH": str(ROOT),
    "SLURM_GUARD_DEFAULTS": "/nonexistent",
    "SLURM_JOB_UID": str(os.geteuid()),
}


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(SCRIPT)], env={**SITE, **env}, capture_output=True, text=True, check=False
    )


def test_it_removes_the_finished_job_s_snapshots_and_nothing_else(tmp_path: Path) -> None:
    for job in ("41", "42"):
        (tmp_path / "node2" / job / "rank-0" / "step-00000010").mkdir(parents=True)
    env = {"SLURM_JOB_ID": "41", "SLURMD_NODENAME": "node2"}
    done = _run({**env, "SLURM_GUARD_SNAPSHOT_DIR": str(tmp_path / "{node}")})
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "node2" / "41").exists() and (tmp_path / "node2" / "42").is_dir()
    assert _run({**env, "SLURM_GUARD_SNAPSHOT_DIR": str(tmp_path / "node2")}).returncode == 0


def test_a_job_id_that_would_leave_the_directory_removes_nothing(tmp_path: Path) -> None:
    (tmp_path / "keep").mkdir()
    for job in ("..", "../keep", "", "a b"):
        done = _run({"SLURM_JOB_ID": job, "SLURM_GUARD_SNAPSHOT_DIR": str(tmp_path / "x")})
        assert done.returncode == 0 and "nothing removed" in done.stderr, (job, done.stderr)
    assert (tmp_path / "keep").is_dir()
