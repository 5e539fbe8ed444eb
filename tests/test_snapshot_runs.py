"""Two runs in one job keep their snapshots apart, and a snapshot proves its step by the ledger.

Real gloo jobs, two ranks on one "node" (one directory standing in for its /dev/shm), inside
one Slurm job id (issue 42, findings 6 and 1):
- run A, then run B in the same job: B's snapshots must not push A's out, so A resumes from its
  own snapshot of step 10 (before: the two shared `rank-<r>` directories, and A started over);
- run C's snapshot of step 10 is replaced by a copy of its step-5 snapshot whose seal says step
  10 (only `step` edited: the fingerprint still checks). The ledger recorded another fingerprint
  for step 10, so that snapshot is skipped by name and C resumes from its real snapshot of step
  5, ending bit-identical to a run that never stopped (before: it resumed from "step 10" with
  step 5's state).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from workers import run_scenarios

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


def test_two_runs_of_one_job_keep_their_snapshots_and_a_relabeled_one_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # every run below is a run of one job
    shm = tmp_path / "shm"
    runs = {name: tmp_path / name for name in ("a", "b", "c", "clean")}
    for path in runs.values():
        path.mkdir()

    def scenario(name: str, steps: int) -> dict[str, object]:
        return {"run_dir": str(runs[name]), "steps": steps, "config": _config(shm)}

    first = run_local(
        run_scenarios,
        2,
        args=([scenario("a", 10), scenario("b", 10), scenario("c", 10), scenario("clean", 15)],),
        nodes=NODES,
    )
    clean = [o.value[3]["final"] for o in first]
    identity = json.loads((runs["c"] / "identity.json").read_text())
    job_c = shm / "n1" / f"4242-{identity['run_id'][:16]}"
    assert job_c.is_dir(), sorted(p.name for p in (shm / "n1").iterdir())
    _relabel(job_c, 5, 10)

    restart = [scenario("a", 15), scenario("c", 15)]
    second = run_local(run_scenarios, 2, args=(restart,), nodes=NODES)
    a, c = 0, 1
    assert second[0].value[a]["start"] == 10, "run B's snapshots pushed run A's out"
    assert second[0].value[c]["start"] == 5, "resumed from a snapshot the ledger does not prove"
    for rank in range(2):
        for index in (a, c):
            final = second[rank].value[index]["final"]
            same = all(bool((x == y).all()) for x, y in zip(clean[rank], final, strict=True))
            assert same, f"rank {rank}, run {'ac'[index]}: not bit-identical to the clean run"
    assert isinstance(clean[0][0], torch.Tensor)
