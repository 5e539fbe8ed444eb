"""GuardConfig(abft=True) under the Guard: a wrong GEMM value on an unverified step is caught on
that step, on the rank that computed it, before any update (issue 15)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from workers import SMALL, run_scenarios

import slurm_guard as sg
from slurm_guard.local.launch import run_local
from slurm_guard.rundir.records import read_ledger

pytestmark = pytest.mark.distributed

NODES = ["node1", "node2", "node3"]


def _scenario(run_dir: Path, faults: tuple[sg.Fault, ...], steps: int) -> dict[str, object]:
    run_dir.mkdir()
    config = sg.GuardConfig(replay_every=5, vote_every=5, abft=True, faults=faults)
    return {"run_dir": str(run_dir), "steps": steps, "config": config, "model": SMALL}


def test_one_off_gemm_faults_on_unverified_steps_are_caught_on_their_step(tmp_path: Path) -> None:
    # three runs in one process group: clean, a forward fault, a weight-gradient bit flip;
    # step 3 is not a replay step (replay_every=5): without abft these are the blind spot
    forward = sg.Fault("gemm", step=3, rank=1, layer=2, gemm_pass="fwd", element=5, factor=0.05)
    flip = sg.Fault("gemm", step=2, rank=2, layer=4, gemm_pass="grad_w", flip=True, bit=28)
    scenarios = [
        _scenario(tmp_path / "clean", (), 8),
        _scenario(tmp_path / "forward", (forward,), 8),
        _scenario(tmp_path / "flip", (flip,), 8),
    ]
    outcomes = run_local(run_scenarios, 3, args=(scenarios,), nodes=NODES)
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.value for o in outcomes]

    clean = [o.value[0] for o in outcomes]
    assert all(r["alarm"] is None for r in clean)
    run = json.loads((tmp_path / "clean" / "run.json").read_text())
    assert run["config"]["abft"] is True
    assert 0.9 < run["abft_coverage"]["checked_fraction"] <= 1.0
    assert run["abft_coverage"]["checked_fraction_without_attention"] == 1.0

    for index, (fault, node, rank) in enumerate(((forward, "node2", 1), (flip, "node3", 2)), 1):
        alarms = [o.value[index]["alarm"] for o in outcomes]
        alarm = alarms[0]
        assert alarm is not None and all(a == alarm for a in alarms)  # every rank, same record
        assert alarm["step"] == fault.step
        assert (alarm["check"], alarm["verdict"]) == ("abft", "sdc")
        assert alarm["suspect_ranks"] == [rank] and alarm["suspect_nodes"] == [node]
        assert alarm["update_applied"] is False
        evidence = alarm["evidence"]
        assert evidence["pass"] == fault.gemm_pass
        assert evidence["ranks"][str(rank)]["ratio"] > 1.0
        assert evidence["ranks"][str(rank)]["replayed_on"] != rank
        # a forward fault changes the loss the replay recomputes; a weight-gradient one does not
        assert evidence["replay_confirmed"] is (fault.gemm_pass == "fwd")
        # the update of the faulty step was not applied on any rank
        for o in outcomes:
            before, after = o.value[index]["before"], o.value[index]["after"]
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        ledger = read_ledger(tmp_path / ("forward" if index == 1 else "flip") / "ledger.jsonl")
        # the failed verification, then the alarm's own entry: nothing else failed
        assert {e.check for e in ledger if not e.passed} == {"abft"}
