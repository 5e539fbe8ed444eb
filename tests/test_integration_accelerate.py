"""The Accelerate loop pattern of docs/integrations/hf.md on the real accelerate package: 3 gloo
ranks posing as 3 nodes. Skipped without accelerate unless SLURM_GUARD_REQUIRE_INTEGRATIONS=1
(CI), where its absence fails."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import slurm_guard as sg
from slurm_guard.local import run_local
from slurm_guard.rundir.records import read_ledger

HAVE = importlib.util.find_spec("accelerate") is not None
if not HAVE and os.environ.get("SLURM_GUARD_REQUIRE_INTEGRATIONS") == "1":
    raise RuntimeError("SLURM_GUARD_REQUIRE_INTEGRATIONS=1 but accelerate is missing")
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not HAVE, reason="needs the [hf] extra (accelerate)"),
]

NODES = ["node1", "node2", "node3"]


def _run(run_dir: Path, *args: Any) -> list[dict[str, Any]]:
    import accelerate_workers

    run_dir.mkdir()
    outs = run_local(accelerate_workers.accelerate_loop, 3, (str(run_dir), *args), nodes=NODES)
    assert [o.status for o in outs] == ["ok"] * 3, [o.value for o in outs]
    return [o.value for o in outs]


def test_accumulate_loop_clean_matches_plain_accelerate_and_a_fault_is_caught_on_its_node(
    tmp_path: Path,
) -> None:
    guarded = _run(tmp_path / "guarded", 6)
    plain = _run(tmp_path / "plain", 6, (), False)
    for g, p in zip(guarded, plain, strict=True):
        # accumulate()'s no_sync microbatches gave no false alarm; every step was applied
        assert g["alarm"] is None and g["optimizer_steps"] == p["optimizer_steps"] == 6
        # the same losses as Accelerate's own loop with its own clipping, up to the last bits
        # (the guard's comm hook averages in its own order)
        assert g["losses"] == pytest.approx(p["losses"], rel=1e-4)
        # AdamW turns last-bit differences of near-zero gradients into up to lr-sized steps:
        # within a fifth of one step's lr (1e-2) after 6 steps
        for a, b in zip(g["final"], p["final"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-3)
    ledger = read_ledger(tmp_path / "guarded" / "ledger.jsonl")
    assert [e.step for e in ledger if e.check == "replay" and e.passed] == [0, 2, 4]

    fault = sg.Fault(kind="grad-scale", node="node2", step=2, persistent=True)
    faulty = _run(tmp_path / "faulty", 6, (fault,))
    alarm = faulty[0]["alarm"]
    assert all(f["alarm"] == alarm for f in faulty)
    assert (alarm["step"], alarm["check"], alarm["suspect_nodes"]) == (2, "replay", ["node2"])
    assert faulty[0]["optimizer_steps"] == 2  # the faulty step's update was never applied


def test_a_loss_fn_not_divided_as_accelerator_backward_divides_is_named_in_the_alarm(
    tmp_path: Path,
) -> None:
    """The classic mistake: no gradient replays, every loss does. Not attributed to one node
    (ambiguous: by default the controller holds the job for review, drains nothing) and the
    message points at the loop."""
    out = _run(tmp_path / "undivided", 2, (), True, True)
    alarm = out[0]["alarm"]
    assert alarm["verdict"] == "ambiguous" and alarm["check"] == "replay"
    assert "accelerator.backward() divides" in alarm["message"]
