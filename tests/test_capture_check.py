"""`capture` / `check` / `update`: the guard's step for a loop it does not own (issue 23)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loop_workers import capture_loop

import slurm_guard as sg
from slurm_guard.local.launch import run_local
from slurm_guard.rundir.records import read_ledger

pytestmark = pytest.mark.distributed

NODES = ["node1", "node2", "node3"]


def _ok(outcomes: list) -> list[dict]:  # type: ignore[type-arg]
    assert [o.status for o in outcomes] == ["ok"] * len(outcomes), [o.value for o in outcomes]
    return [o.value for o in outcomes]


def test_own_loop_with_rng_between_microbatches_replays_clean_and_catches_a_fault(
    tmp_path: Path,
) -> None:
    """Dropout plus batches drawn from the global RNG between microbatches: every step is
    replayed and passes (each microbatch replays with its own RNG state); the loop's own
    optimizer step gives the same weights as `guard.update()`; a persistent fault is caught."""
    runs = {name: tmp_path / name for name in ("update", "own", "faulty")}
    for path in runs.values():
        path.mkdir()
    update = _ok(run_local(capture_loop, 3, args=(str(runs["update"]), 6, 3), nodes=NODES))
    own = _ok(run_local(capture_loop, 3, args=(str(runs["own"]), 6, 3, (), True), nodes=NODES))
    for out in update + own:
        assert out["alarm"] is None and out["error"] is None
    ledger = read_ledger(runs["update"] / "ledger.jsonl")
    assert sum(e.check == "replay" and e.passed for e in ledger) == 6
    assert not [e for e in ledger if not e.passed]
    # the clip's norm is the same on every rank, and clipping did happen (max_grad_norm 0.5)
    assert update[0]["norms"] == update[1]["norms"] == update[2]["norms"]
    assert max(update[0]["norms"]) > 0.5
    for a, b in zip(update, own, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"], strict=True))
        assert a["losses"] == b["losses"]

    fault = (sg.Fault("grad-scale", rank=1, step=3, persistent=True, param=3),)
    out = _ok(run_local(capture_loop, 3, args=(str(runs["faulty"]), 6, 3, fault), nodes=NODES))
    alarm = out[0]["alarm"]
    assert (alarm["step"], alarm["check"], alarm["suspect_ranks"]) == (3, "replay", [1])
    assert all(r["unchanged"] for r in out)


def test_check_after_a_backward_inside_no_sync_is_a_usage_error_not_an_alarm(
    tmp_path: Path,
) -> None:
    out = _ok(run_local(capture_loop, 3, args=(str(tmp_path), 2, 2, (), False, True), nodes=NODES))
    assert all(r["alarm"] is None for r in out)
    assert all("no_sync()" in r["error"] for r in out)
    assert not list((tmp_path / "alarms").glob("*.json"))
