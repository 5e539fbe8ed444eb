"""Resuming from node-local snapshots on real gloo jobs: later than a checkpoint, never wrong.

Each run keeps its snapshots in a directory per "node", standing in for that node's /dev/shm.
Two ranks share node n1, so the second one restores the weights from the first one's snapshot.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from framework_results import status_json
from workers import run_scenarios

import slurm_guard as sg
from slurm_guard.local.launch import run_local

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NODES = ["n1", "n1", "n2", "n3"]
DENSE_WEIGHT = 10


def _config(shm: Path, *faults: sg.Fault) -> sg.GuardConfig:
    return sg.GuardConfig(
        replay_every=5,
        vote_every=5,
        trust_replays=1,
        snapshots=True,
        snapshot_dir=str(shm / "{node}"),
        faults=faults,
    )


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(bool((x == y).all()) for x, y in zip(a, b, strict=True))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_restart_resumes_from_the_newest_allowed_snapshot_and_never_from_a_wrong_one(
    tmp_path: Path,
) -> None:
    fault = sg.Fault("grad-scale", rank=2, step=17, persistent=True, param=DENSE_WEIGHT)
    runs: dict[str, dict[str, Any]] = {}
    for name in ("clean", "snapshot", "damaged", "forged", "spare"):
        (tmp_path / name).mkdir()
        faults = () if name == "clean" else (fault,)
        runs[name] = {
            "run_dir": str(tmp_path / name),
            "steps": 30,
            "checkpoint_every": 10,
            "config": _config(tmp_path / f"shm-{name}", *faults),
        }
    first = run_local(run_scenarios, 4, args=(list(runs.values()),), nodes=NODES)
    clean = [o.value[0]["final"] for o in first]
    for index in (1, 2, 3, 4):
        alarm = first[0].value[index]["alarm"]
        assert alarm["step"] == 20 and alarm["last_verified_step"] == 15
    # what an operator sees before the restart: the snapshot next to the trusted checkpoint
    view = status_json(tmp_path / "snapshot", tmp_path / "state")
    assert view["trusted_checkpoint"] == 10 and view["snapshot_in_memory"] == 15
    job = next((tmp_path / "shm-damaged" / "n1").iterdir())  # run-<run id>: no Slurm job here
    # snapshots after the votes of steps 15 and 20 are kept; 20 holds the fault's update
    assert sorted(p.name for p in (job / "rank-1").iterdir()) == ["step-00000015", "step-00000020"]
    _flip_byte(job / "rank-1" / "step-00000015" / "own.pt")
    # node n1's seals edited to claim another state than n2 and n3 hold
    for rank in (0, 1):
        seal_file = next((tmp_path / "shm-forged" / "n1").iterdir()) / f"rank-{rank}"
        seal_file = seal_file / "step-00000015" / "seal.json"
        seal = json.loads(seal_file.read_text())
        fingerprint = seal["weight_fingerprint"]
        seal["weight_fingerprint"] = ("1" if fingerprint[0] == "0" else "0") + fingerprint[1:]
        seal_file.write_text(json.dumps(seal))
    # node n3's memory is empty, as on a spare that joined after an in-job restart
    shutil.rmtree(tmp_path / "shm-spare" / "n3")

    restart = [
        {**runs[name], "config": _config(tmp_path / f"shm-{name}")}
        for name in ("snapshot", "damaged", "forged", "spare")
    ]
    second = run_local(run_scenarios, 4, args=(restart,), nodes=NODES)
    snapshot, damaged, forged, spare = range(4)
    # the snapshot of step 15, not the checkpoint of step 10: five steps fewer lost
    assert second[0].value[snapshot]["start"] == 15
    assert all(o.value[snapshot]["restored_from_peers"] == [] for o in second)
    # rank 1's copy is damaged: it takes the weights from rank 0 and its own RNG state from the
    # copy rank 2 (node n2) keeps; rank 3's node has nothing: rank 0 keeps its copy
    assert second[0].value[damaged]["start"] == 15
    assert second[1].value[damaged]["restored_from_peers"] == [0, 2]
    assert second[0].value[spare]["start"] == 15
    assert second[3].value[spare]["restored_from_peers"] == [0]
    # node n1 claims another state than n2 and n3: no snapshot is used, and every rank falls
    # back to the checkpoint
    assert second[0].value[forged]["start"] == 10
    for rank in range(4):
        for index in (snapshot, damaged, forged, spare):
            resumed = second[rank].value[index]["final"]
            assert _same(clean[rank], resumed), f"rank {rank}, run {index}: not bit-identical"
    assert status_json(tmp_path / "snapshot", tmp_path / "state")["snapshot_in_memory"] == 30
    # the snapshot of step 20 came from the rolled-back past: gone, and replaced by the rerun
    job = next((tmp_path / "shm-snapshot" / "n1").iterdir())
    assert sorted(p.name for p in (job / "rank-0").iterdir()) == ["step-00000025", "step-00000030"]
