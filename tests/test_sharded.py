"""Sharded training (HSDP on FSDP2): shard-by-shard vote across replica groups (issue 5)."""

from __future__ import annotations

import pytest
from sharded_workers import hsdp_run

from slurm_guard.local.launch import run_local

pytestmark = pytest.mark.distributed


def test_hsdp_replica_vote_finds_the_corrupted_shard() -> None:
    # 3 replica groups x 2 shards; rank 3 = replica 1, shard 1
    outcomes = run_local(hsdp_run, 6, args=(3, 2, 3), nodes=[f"n{i}" for i in range(6)])
    assert [o.status for o in outcomes] == ["ok"] * 6, [o.value for o in outcomes]
    for rank, o in enumerate(outcomes):
        findings = o.value["findings"]
        assert findings[:2] == [None, None]  # clean steps: shards agree across replicas
        assert all(o.value["finite"])
        if rank % 2 == 1:  # shard 1's replicas: ranks 1, 3, 5
            assert findings[2] == ("sdc", (3,))
        else:  # shard 0 is untouched
            assert findings[2] is None
