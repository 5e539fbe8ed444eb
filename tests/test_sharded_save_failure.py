"""A DCP save that fails on one rank stops every rank at once, with the same named error.

Real gloo processes under ShardedGuard; the failure is real on one rank only. A rank left
waiting inside DCP's own exchange would end with gloo's timeout (120 s here) or the hang
watch's RanksMissing (600 s here) instead: the assertions on the message tell those apart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sharded_save_workers import save_fails_on_one_rank

from slurm_guard.local.launch import run_local


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("how", "rank", "cause"),
    [
        ("writer", 1, "No space left on device (injected on this rank)"),
        ("numpy", 0, "Numpy is not available"),
    ],
)
def test_a_save_failing_on_one_rank_stops_every_rank_with_its_cause(
    tmp_path: Path, how: str, rank: int, cause: str
) -> None:
    outcomes = run_local(save_fails_on_one_rank, 2, args=(str(tmp_path), rank, how))
    for o in outcomes:
        assert o.status == "error", (o.rank, o.status, o.value)
        assert "RankFailed" in o.value, o.value
        assert cause in o.value, o.value
        assert "Timed out" not in o.value and "RanksMissing" not in o.value, o.value
    assert not list((tmp_path / "checkpoints").glob("step-*")), "nothing may be published"
