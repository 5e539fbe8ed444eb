"""Two runs in one job keep their snapshots apart, and a snapshot proves its step by the ledger.

Real gloo jobs, two ranks on one "node" (one directory standing in for its /dev/shm), in one
launch (issue 42, findings 6 and 1):
- run A, then run B in the same Slurm job id: B's snapshots must not push A's out, so A
  resumes from its own snapshot of step 10 (before: they shared `rank-<r>` directories, and A
  started over);
- run C (outside Slurm): its snapshot of step 10 is replaced by a copy of its step-5 snapshot
  whose seal says step 10 (only `step` edited: the fingerprint still checks). The ledger
  recorded another fingerprint for step 10, so that snapshot is skipped by name and C resumes
  from its real snapshot of step 5, ending bit-identical to a run that never stopped (before:
  it resumed from "step 10" with step 5's state).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from snapshot_run_workers import run_as_jobs

import slurm_guard as sg
from slurm_guard.local.launch import run_local

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NODES = ["n1", "n1"]


def _config(shm: Path) -> sg.GuardConfig:
    return sg.GuardConfig(
        replay_every=5, vote_every=5, snapshots=True, snapshot_dir=str(shm / "{node}")
    )


def _relabel(job: Path, source: int, target: int) -> None:
    """Every rank's snapshot of `target` becomes a copy of `source` whose seal says `target`."""
    for rank_dir in job.iterdir():
        aside = rank_dir / f"step-{target:08d}"
        shutil.rmtree(aside)
        shutil.copytree(rank_dir / f"step-{source:08d}", aside)
        seal_file = aside / "seal.json"
        seal = json.loads(seal_file.read_text())
        seal["step"] = target
        seal_file.write_text(json.dumps(seal))


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Runs A and B inside job 4242, C and a clean run outside Slurm, 10 steps (clean: 15);
    C's snapshot of step 10 relabeled; then A and C restarted to 15 steps."""
    tmp = tmp_path_factory.mktemp("runs")
    shm = tmp / "shm"
    runs = {name: tmp / name for name in ("a", "b", "c", "clean")}
    for path in runs.values():
        path.mkdir()
    jobs = {"a": "4242", "b": "4242", "c": None, "clean": None}

    def scenario(name: str, steps: int) -> dict[str, object]:
        config = _config(shm)
        return {"run_dir": str(runs[name]), "steps": steps, "config": config, "job": jobs[name]}

    first = run_local(
        run_as_jobs,
        2,
        args=([scenario("a", 10), scenario("b", 10), scenario("c", 10), scenario("clean", 15)],),
        nodes=NODES,
    )
    assert [o.status for o in first] == ["ok", "ok"], [o.value for o in first]
    run_c = json.loads((runs["c"] / "identity.json").read_text())["run_id"]
    _relabel(shm / "n1" / f"run-{run_c[:16]}", 5, 10)
    second = run_local(run_as_jobs, 2, args=([scenario("a", 15), scenario("c", 15)],), nodes=NODES)
    assert [o.status for o in second] == ["ok", "ok"], [o.value for o in second]
    clean = [o.value[3]["final"] for o in first]
    return {"clean": clean, "a": [o.value[0] for o in second], "c": [o.value[1] for o in second]}


def _bit_identical(clean: list[torch.Tensor], final: list[torch.Tensor]) -> bool:
    return all(bool((x == y).all()) for x, y in zip(clean, final, strict=True))


def test_two_runs_of_one_job_on_one_node_keep_their_own_snapshots(launches: dict[str, Any]) -> None:
    """Finding 6: run B of the same job does not push run A's snapshots out."""
    assert launches["a"][0]["start"] == 10, "run B's snapshots pushed run A's out"
    for rank in range(2):
        assert _bit_identical(launches["clean"][rank], launches["a"][rank]["final"]), rank


def test_a_snapshot_whose_step_the_ledger_does_not_prove_is_skipped(
    launches: dict[str, Any],
) -> None:
    """Finding 1: step-5 state relabeled as step 10 is skipped; C resumes from its real
    snapshot of step 5 and ends bit-identical to the run that never stopped."""
    assert launches["c"][0]["start"] == 5, "resumed from a snapshot the ledger does not prove"
    for rank in range(2):
        assert _bit_identical(launches["clean"][rank], launches["c"][rank]["final"]), rank
