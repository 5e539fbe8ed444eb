"""What a resume refuses by name instead of loading or calling damaged, on real gloo jobs.

A checkpoint copied in from another run (the DDP Guard and the ShardedGuard) and a sharded
checkpoint resumed on another number of ranks: each is one named error on every rank, with the
override, never a resume from weights this run's checks did not vouch for.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from rundir_workers import CONFIG, run_cases
from sharded_guard_workers import train_resumed, train_resumed_fsdp, train_saving

from slurm_guard.local.launch import RankOutcome, run_local

pytestmark = pytest.mark.distributed


def _results(outcomes: list[RankOutcome]) -> list[list[dict[str, Any]]]:
    """results[case][rank]."""
    assert all(o.status == "ok" for o in outcomes), [(o.status, o.value) for o in outcomes]
    return [list(case) for case in zip(*(o.value for o in outcomes), strict=True)]


def _last_line(traceback: str) -> str:
    """The raised error as a rank's traceback ends with it."""
    return traceback.strip().splitlines()[-1]


def _swap_in(source: Path, target: Path, step: str) -> None:
    """Replace `target`'s checkpoint with `source`'s of the same step, as a careless copy does."""
    shutil.rmtree(target / "checkpoints" / step)
    shutil.copytree(source / "checkpoints" / step, target / "checkpoints" / step)


def test_a_checkpoint_copied_from_another_run_is_refused_by_name(tmp_path: Path) -> None:
    """Before: the second run resumed from the first run's step-5 (it verifies under its seed)."""
    a, b = tmp_path / "a", tmp_path / "b"
    case = {"steps": 6, "checkpoint_every": 5, "config": CONFIG, "resume": False}
    _results(run_local(run_cases, 2, args=([{**case, "run_dir": str(d)} for d in (a, b)],)))
    _swap_in(a, b, "step-00000005")
    again = {"run_dir": str(b), "steps": 6, "config": CONFIG}
    fresh = {**again, "env": {"SLURM_GUARD_RESUME": "fresh"}}
    refused, restarted = _results(run_local(run_cases, 2, args=([again, fresh],)))
    errors = {r.get("error") for r in refused}
    assert len(errors) == 1, errors  # the same error on every rank
    error = str(errors.pop())
    assert "step-00000005 was sealed by run" in error and "SLURM_GUARD_RESUME=fresh" in error
    assert [r["start"] for r in restarted] == [0, 0]


def test_a_sharded_checkpoint_from_another_run_is_refused_by_name(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        outcomes = run_local(train_saving, 4, args=(str(d), 3, 3))
        assert [o.status for o in outcomes] == ["ok"] * 4, [o.value for o in outcomes]
    _swap_in(a, b, "step-00000003")
    outcomes = run_local(train_resumed, 4, args=(str(b), 4))
    assert [o.status for o in outcomes] == ["error"] * 4, [o.value for o in outcomes]
    errors = {_last_line(o.value) for o in outcomes}
    assert len(errors) == 1, errors  # the same error on every rank
    assert "step-00000003 was sealed by run" in errors.pop()


def test_a_sharded_resume_on_another_world_size_says_how_many_ranks(tmp_path: Path) -> None:
    """Before: "all 1 checkpoints ... are damaged ... Restore one from a backup"."""
    outcomes = run_local(train_saving, 4, args=(str(tmp_path), 3, 3))
    assert [o.status for o in outcomes] == ["ok"] * 4, [o.value for o in outcomes]
    outcomes = run_local(train_resumed_fsdp, 2, args=(str(tmp_path), 4))
    assert [o.status for o in outcomes] == ["error"] * 2, [o.value for o in outcomes]
    errors = {_last_line(o.value) for o in outcomes}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert "Resume on 4 ranks" in error and "damaged" not in error and "backup" not in error
