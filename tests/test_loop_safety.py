"""The safety bugs of issue 23: what real training loops (nanoGPT) did to the guard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loop_workers import (
    disabled_scaler_nan,
    eval_then_save,
    rank0_decides,
    scaler_and_data,
    scheduled_loop,
    step_inside_no_sync,
)

import slurm_guard as sg
from slurm_guard.local.launch import run_local

pytestmark = pytest.mark.distributed

NODES = ["node1", "node2", "node3"]


def _ok(outcomes: list) -> list[dict]:  # type: ignore[type-arg]
    assert [o.status for o in outcomes] == ["ok"] * len(outcomes), [o.value for o in outcomes]
    return [o.value for o in outcomes]


def test_a_disabled_gradscaler_does_not_let_a_nan_update_through(tmp_path: Path) -> None:
    out = _ok(run_local(disabled_scaler_nan, 3, args=(str(tmp_path),), nodes=NODES))
    alarm = out[0]["alarm"]
    assert alarm is not None, "the inf sample's update was applied"
    assert (alarm["step"], alarm["verdict"]) == (3, "numerical")
    assert all(r["unchanged"] and r["finite"] for r in out)


def test_resume_is_bit_identical_when_the_loop_evaluates_before_it_saves(tmp_path: Path) -> None:
    clean, cut = tmp_path / "clean", tmp_path / "cut"
    clean.mkdir()
    cut.mkdir()
    full = _ok(run_local(eval_then_save, 3, args=(str(clean), 99), nodes=NODES))
    _ok(run_local(eval_then_save, 3, args=(str(cut), 5), nodes=NODES))  # saved at 2 and 4
    resumed = _ok(run_local(eval_then_save, 3, args=(str(cut), 99), nodes=NODES))
    assert resumed[0]["start"] == 4
    for a, b in zip(full, resumed, strict=True):
        assert {s: a["losses"][s] for s in b["losses"]} == b["losses"]
        assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"], strict=True))


def test_a_save_right_after_a_resume_keeps_the_checkpoints_rng_state(tmp_path: Path) -> None:
    # The second run resumes at 4 and, nanoGPT's order, evaluates and saves step 4 again before
    # its first step: that save must hold the RNG state step 4's checkpoint held, not the one
    # the eval left, or the third run (resuming from it) draws different batches.
    clean, cut = tmp_path / "clean", tmp_path / "cut"
    clean.mkdir()
    cut.mkdir()
    full = _ok(run_local(eval_then_save, 3, args=(str(clean), 99), nodes=NODES))
    _ok(run_local(eval_then_save, 3, args=(str(cut), 5), nodes=NODES))  # saved at 2 and 4
    again = _ok(run_local(eval_then_save, 3, args=(str(cut), 5), nodes=NODES))  # saves 4 again
    assert again[0]["start"] == 4
    resumed = _ok(run_local(eval_then_save, 3, args=(str(cut), 99), nodes=NODES))
    assert resumed[0]["start"] == 4
    for a, b in zip(full, resumed, strict=True):
        assert {s: a["losses"][s] for s in b["losses"]} == b["losses"]
        assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"], strict=True))


def test_guard_step_inside_the_users_no_sync_is_a_usage_error_not_an_alarm(
    tmp_path: Path,
) -> None:
    out = _ok(run_local(step_inside_no_sync, 3, args=(str(tmp_path),), nodes=NODES))
    for r in out:
        assert r["alarm"] is None
        assert r["error"] is not None and r["error"].startswith("GuardError"), r["error"]
        assert "no_sync()" in r["error"] and "guard.step(Microbatches(" in r["error"]
        assert r["unchanged"] and r["steps"] == 1
    assert not list((tmp_path / "alarms").glob("*.json")), "an SDC alarm was written"


def test_guard_step_inside_no_sync_on_one_rank_only_stops_every_rank(tmp_path: Path) -> None:
    # Rank 1 raises before any collective; the others must not wait for it past the watchdog.
    out = _ok(run_local(step_inside_no_sync, 3, args=(str(tmp_path), 1), nodes=NODES))
    assert out[1]["error"].startswith("GuardError") and "no_sync()" in out[1]["error"]
    for r in (out[0], out[2]):
        assert r["error"] is not None and r["error"].startswith("RanksMissing"), r["error"]
        assert "rank 1" in r["error"] or "ranks [1]" in r["error"], r["error"]
    assert all(r["alarm"] is None and r["unchanged"] for r in out)
    assert not list((tmp_path / "alarms").glob("*.json")), "an SDC alarm was written"


FAULT = (sg.Fault("grad-scale", rank=1, step=7, persistent=True, param=3),)


def test_resume_after_an_alarm_restores_the_schedule_and_the_data_position(
    tmp_path: Path,
) -> None:
    clean, hit = tmp_path / "clean", tmp_path / "hit"
    clean.mkdir()
    hit.mkdir()
    full = _ok(run_local(scheduled_loop, 3, args=(str(clean), 12), nodes=NODES))
    faulty = _ok(run_local(scheduled_loop, 3, args=(str(hit), 12, FAULT), nodes=NODES))
    assert faulty[0]["alarm"] is not None, "the persistent fault was not caught"
    resumed = _ok(run_local(scheduled_loop, 3, args=(str(hit), 12), nodes=NODES))
    assert 0 < resumed[0]["start"] <= 7, resumed[0]["start"]
    for a, b in zip(full, resumed, strict=True):
        assert b["alarm"] is None
        assert {s: a["losses"][s] for s in b["losses"]} == b["losses"]
        assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"], strict=True))
        assert a["last_lr"] == b["last_lr"]
        assert a["consumed"] == b["consumed"] == 12


def test_a_tampered_stateful_file_makes_resume_skip_that_checkpoint(tmp_path: Path) -> None:
    _ok(run_local(scheduled_loop, 3, args=(str(tmp_path), 10), nodes=NODES))  # saves 3, 6, 9
    newest = tmp_path / "checkpoints" / "step-00000009"
    victim = newest / "stateful-rank-1.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    resumed = _ok(run_local(scheduled_loop, 3, args=(str(tmp_path), 10), nodes=NODES))
    assert resumed[0]["start"] == 6
    assert all(r["consumed"] == 10 for r in resumed)


def test_rank_0_alone_decides_whether_every_rank_saves(tmp_path: Path) -> None:
    out = _ok(run_local(rank0_decides, 3, args=(str(tmp_path),), nodes=NODES))
    assert [r["error"] for r in out] == [None] * 3
    assert [r["saved"] for r in out] == [[0, 2, 3]] * 3  # rank 0's improvements
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == [
        "step-00000001",
        "step-00000003",
        "step-00000004",
    ]
    assert [r["dict"] for r in out] == [{"rank": 2, "best": 0.5}] * 3
    assert [r["nan"] for r in out] == ["RankFailed"] * 3


def test_a_stateful_name_the_checkpoint_lacks_stops_the_resume_naming_it(tmp_path: Path) -> None:
    _ok(run_local(scheduled_loop, 3, args=(str(tmp_path), 4), nodes=NODES))  # saves step 3
    out = _ok(run_local(scheduled_loop, 3, args=(str(tmp_path), 4, (), 3, True), nodes=NODES))
    errors = [r.get("resume_error") for r in out]
    assert all(e is not None and "'ema'" in e and "step-00000003" in e for e in errors), errors


def test_a_checkpoint_sealed_without_scaler_state_resumes_with_the_scaler_restarted(
    tmp_path: Path,
) -> None:
    # As an earlier slurm-guard wrote them: no stateful-rank-<r>.pt in the seal at all.
    _ok(run_local(scaler_and_data, 3, args=(str(tmp_path), 3, None, False), nodes=NODES))
    assert not list((tmp_path / "checkpoints" / "step-00000002").glob("stateful-*"))
    out = _ok(run_local(scaler_and_data, 3, args=(str(tmp_path), 5, True, False), nodes=NODES))
    assert [r["resume_error"] for r in out] == [None] * 3
    assert [r["start"] for r in out] == [2] * 3
    assert any("restarts from its initial scale" in w for w in out[0]["warnings"]), out[0]
    # saved at 4 with the scaler's state now; a seal that lists a file that is gone is damaged
    (tmp_path / "checkpoints" / "step-00000004" / "stateful-rank-1.pt").unlink()
    out = _ok(run_local(scaler_and_data, 3, args=(str(tmp_path), 5, True, False), nodes=NODES))
    assert [r["start"] for r in out] == [2] * 3


def test_a_resume_on_more_ranks_than_saved_stops_naming_the_world_sizes(tmp_path: Path) -> None:
    _ok(run_local(scaler_and_data, 3, args=(str(tmp_path), 3, None, True), nodes=NODES))
    out = _ok(
        run_local(scaler_and_data, 4, args=(str(tmp_path), 5, None, True), nodes=[*NODES, "node4"])
    )
    for r in out:
        error = r["resume_error"]
        assert error is not None and "saved on 3 ranks and this run has 4" in error, error
        assert "'data'" in error and "Resume on 3 ranks" in error
