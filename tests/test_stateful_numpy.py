"""`Guard(stateful=...)` with numpy in the state (issue 34): a sampler's numpy RNG state is
saved in a form a weights_only resume loads, and a state no such load accepts stops the first
save naming its key, instead of every checkpoint turning out unusable at the resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from stateful_workers import sampled_loop, unloadable_state

from slurm_guard.local.launch import run_local

pytestmark = pytest.mark.distributed

NODES = ["node1", "node2"]


def _ok(outcomes: list) -> list[dict]:  # type: ignore[type-arg]
    assert [o.status for o in outcomes] == ["ok"] * len(outcomes), [o.value for o in outcomes]
    return [o.value for o in outcomes]


def test_a_numpy_rng_state_resumes_bit_identically(tmp_path: Path) -> None:
    clean, cut = tmp_path / "clean", tmp_path / "cut"
    full = _ok(run_local(sampled_loop, 2, args=(str(clean), 6, -1), nodes=NODES))
    _ok(run_local(sampled_loop, 2, args=(str(cut), 4, 3), nodes=NODES))  # saved after 3 steps
    resumed = _ok(run_local(sampled_loop, 2, args=(str(cut), 6, -1), nodes=NODES))
    assert [r.get("resume_error") for r in resumed] == [None, None]
    assert [r["start"] for r in resumed] == [3, 3]
    for a, b in zip(full, resumed, strict=True):
        assert (b["drawn"], b["next"]) == (a["drawn"], a["next"])  # the sampler went on
        assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"], strict=True))


def test_a_state_a_resume_could_not_load_stops_the_first_save_naming_its_key(
    tmp_path: Path,
) -> None:
    out = _ok(run_local(unloadable_state, 2, args=(str(tmp_path),), nodes=NODES))
    for r in out:
        assert r["error"] is not None
        assert "stateful['sampler'].state_dict()['order']['rng']" in r["error"]
        assert "weights_only" in r["error"]
    assert not list((tmp_path / "checkpoints").glob("step-*"))
