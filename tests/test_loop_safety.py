"""The safety bugs of issue 23: what real training loops (nanoGPT) did to the guard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loop_workers import disabled_scaler_nan, eval_then_save

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
