"""Sharded snapshots on real gloo jobs: every shard survives the loss of one node's memory.

Each rank is its own "node" with its own directory standing in for /dev/shm. A restart after a
node's memory is emptied (a spare in its place) must restore that node's shards from the copy
its peer node keeps, and train on bit-identical to a run that never stopped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from sharded_guard_workers import train, train_with_snapshots

from slurm_guard.local.launch import RankOutcome, run_local

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NODES = ["n0", "n1", "n2", "n3"]


def _values(outcomes: list[RankOutcome], status: str = "ok") -> list[Any]:
    assert [o.status for o in outcomes] == [status] * len(outcomes), [o.value for o in outcomes]
    return [json.loads(o.value) if isinstance(o.value, str) else o.value for o in outcomes]


def _steps_held(shm: Path, node: str, rank: int) -> list[int]:
    job = next((shm / node).iterdir())  # run-<run id>: no Slurm job here
    return sorted(int(p.name[5:]) for p in (job / f"rank-{rank}").iterdir())


@pytest.fixture(scope="module")
def clean_hsdp(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Each rank's final shard digest after 10 uninterrupted HSDP steps."""
    run_dir = tmp_path_factory.mktemp("clean")
    return [v["digest"] for v in _values(run_local(train, 4, args=(str(run_dir), 10), nodes=NODES))]


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_hsdp_restores_a_node_whose_snapshots_are_gone_from_its_peer_copy(
    tmp_path: Path, clean_hsdp: list[str]
) -> None:
    """HSDP 2x2, snapshots at each shard vote (every 2 steps). After 6 steps node n0's memory
    is emptied; the restart resumes from the snapshot of step 6, rank 0's shards coming from
    the copy rank 1 keeps on n1, and 10 steps end bit-identical to an uninterrupted run."""
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    run_dir.mkdir()
    first = _values(
        run_local(
            train_with_snapshots,
            4,
            args=(str(run_dir), 6, str(shm), True),
            nodes=NODES,
        )
    )
    # each node holds its rank's two newest snapshots and the copy of the previous node's rank
    assert _steps_held(shm, "n0", 0) == [4, 6]
    assert _steps_held(shm, "n1", 0) == [4, 6]  # rank 0's copy, on its peer node
    assert all(v["peer_bytes"] > 0 for v in first)
    print(f"peer copy on the wire: {first[0]['peer_bytes']} bytes per rank per snapshot")
    shutil.rmtree(shm / "n0")

    resumed = _values(
        run_local(
            train_with_snapshots,
            4,
            args=(str(run_dir), 10, str(shm), True, True),
            nodes=NODES,
        )
    )
    assert [v["start"] for v in resumed] == [6] * 4
    assert [v["restored_from_peers"] for v in resumed] == [[1], [], [], []]
    assert [v["digest"] for v in resumed] == clean_hsdp


def test_a_damaged_shard_snapshot_is_skipped_for_the_older_one(
    tmp_path: Path, clean_hsdp: list[str]
) -> None:
    """Rank 2's shards of step 6 damaged on its node and on its peer's: no rank resumes from
    step 6; every rank takes step 4 and still ends bit-identical."""
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    run_dir.mkdir()
    _values(run_local(train_with_snapshots, 4, args=(str(run_dir), 6, str(shm), True), nodes=NODES))
    for node in ("n2", "n3"):
        job = next((shm / node).iterdir())
        _flip_byte(job / "rank-2" / "step-00000006" / "weights.pt")
    resumed = _values(
        run_local(
            train_with_snapshots, 4, args=(str(run_dir), 10, str(shm), True, True), nodes=NODES
        )
    )
    assert [v["start"] for v in resumed] == [4] * 4
    assert [v["digest"] for v in resumed] == clean_hsdp


def test_pure_fsdp2_with_abft_resumes_from_a_trusted_snapshot_after_an_alarm(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """No replica and no checkpoint: a persistent GEMM fault on rank 1 from step 5 alarms at
    step 5; the snapshot of the last trust point (the state step 4 started from) is taken by
    every rank, and with node n1 replaced (its memory gone) rank 1's shards come from n2.
    Rank 0 says so in one line (the ranks' stderr is this process's)."""
    inject = {"SLURM_GUARD_INJECT": "kind=gemm,rank=1,step=5,layer=3,pass=grad_w,persistent=1"}
    (tmp_path / "clean").mkdir()
    clean = _values(
        run_local(
            train_with_snapshots,
            4,
            args=(str(tmp_path / "clean"), 8, str(tmp_path / "c"), False),
            nodes=NODES,
        )
    )
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    run_dir.mkdir()
    alarms = _values(
        run_local(
            train_with_snapshots,
            4,
            args=(str(run_dir), 8, str(shm), False),
            nodes=NODES,
            extra_env=inject,
        ),
        status="alarm",
    )
    assert (alarms[0]["step"], alarms[0]["last_verified_step"]) == (5, 4)
    assert _steps_held(shm, "n2", 1) == [2, 4]  # rank 1's copy on its peer node
    shutil.rmtree(shm / "n1")
    (start,) = [x for x in capfd.readouterr().err.splitlines() if x.endswith(f"run dir {run_dir}")]
    assert start.startswith("slurm-guard: guarding 4 ranks on 4 nodes (FSDP2 4); "), start
    assert "no vote (" in start and "node-local snapshots at each passing replay" in start, start

    resumed = _values(
        run_local(
            train_with_snapshots,
            4,
            args=(str(run_dir), 8, str(shm), False, True),
            nodes=NODES,
        )
    )
    assert [v["start"] for v in resumed] == [4] * 4  # not step 0: one step lost
    (line,) = [x for x in capfd.readouterr().err.splitlines() if "slurm-guard: resumed" in x]
    assert line == (
        "slurm-guard: resumed at step 4 from the node-local snapshot of step 4; after alarm "
        f"{alarms[0]['alarm_id']}: no checkpoint saved after the last step the alarm trusts, "
        "nothing moved aside"
    )
    assert [v["restored_from_peers"] for v in resumed] == [[], [2], [], []]
    assert [v["digest"] for v in resumed] == [v["digest"] for v in clean]
