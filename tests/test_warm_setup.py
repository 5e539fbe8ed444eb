"""Kernels are warmed in `Guard()`, never at a step (issue 25): real gloo ranks, the real
compiler behind a logging wrapper ($CC: a script that logs its arguments and execs gcc), an
empty kernel cache. Construction runs each library's compile once for all the ranks of the
node; the first steps, the first replay and the first vote compile nothing more. Without a
working compiler the guard trains on the torch versions (no exception). A warm-up that raises
on one rank (a damaged library in its node's cache) stops every rank with the same error."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from warm_workers import GCC, compiles_around_setup, logging_compiler, warm_up_fails_on_one_rank

from slurm_guard.core.setup import bucket_numels
from slurm_guard.local.launch import run_local

SOURCES = ("bucket_check.c", "nh_fingerprint.c", "abft_check.c")
STEPS = 4  # replay_every=2, vote_every=2: replays at steps 0 and 2, votes after steps 1 and 3


def _env(tmp_path: Path, cc: str) -> dict[str, str]:
    return {"CC": cc, "SLURM_GUARD_CACHE": str(tmp_path / "cache"), "SLURM_GUARD_NATIVE": "1"}


@pytest.mark.distributed
@pytest.mark.skipif(GCC is None, reason="needs gcc for the logging compiler wrapper")
def test_guard_construction_compiles_once_per_node_and_steps_compile_nothing(
    tmp_path: Path,
) -> None:
    cc, log = logging_compiler(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    outcomes = run_local(
        compiles_around_setup,
        3,
        args=(str(run_dir), str(log), STEPS),
        nodes=["node1", "node2", "node3"],
        extra_env=_env(tmp_path, str(cc)),
    )
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.value for o in outcomes]
    lines = log.read_text().splitlines()
    per_source = Counter(next((s for s in SOURCES if s in ln), "other") for ln in lines)
    assert per_source == Counter(dict.fromkeys(SOURCES, 1)), lines  # 3 ranks -> 1 gcc each
    for o in outcomes:
        assert o.value["after_setup"] == len(SOURCES), o.value  # all built inside Guard()
        assert o.value["after_steps"] == len(SOURCES), o.value  # steps, replay, vote: none
        assert set(o.value["native"].values()) <= {"built", "cached"}, o.value
        assert o.value["verified"] == [0, 2] and o.value["voted_at"] == STEPS, o.value
        # DDP's own bucket (bytes / 4): the tiny model's whole gradient, then each parameter
        assert o.value["buckets"][0] == sum(o.value["buckets"][1:]), o.value
    built = Counter(how for o in outcomes for how in o.value["native"].values())
    assert built == {"built": 3, "cached": 6}  # one builder per library, the others waited


@pytest.mark.distributed
def test_without_a_working_compiler_guard_trains_on_the_torch_versions(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    outcomes = run_local(
        compiles_around_setup,
        2,
        args=(str(run_dir), str(tmp_path / "none.log"), STEPS),
        nodes=["node1", "node2"],
        extra_env=_env(tmp_path, "/bin/false"),
    )
    assert [o.status for o in outcomes] == ["ok"] * 2, [o.value for o in outcomes]
    for o in outcomes:
        assert o.value["native"] == dict.fromkeys(SOURCES, "torch"), o.value
        assert o.value["verified"] == [0, 2], o.value


@pytest.mark.distributed
@pytest.mark.skipif(GCC is None, reason="needs gcc to build the damaged library")
def test_a_warm_up_failure_on_one_rank_stops_every_rank_with_the_same_error(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    outcomes = run_local(
        warm_up_fails_on_one_rank,
        3,
        args=(str(run_dir), str(tmp_path / "bad-cache")),
        nodes=["node1", "node2", "node3"],
        extra_env={"CC": str(GCC), "SLURM_GUARD_CACHE": str(tmp_path / "cache")},
    )
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.value for o in outcomes]
    messages = {o.value for o in outcomes}
    assert len(messages) == 1, messages  # the very same error on every rank
    (message,) = messages
    assert message.startswith("RankFailed: kernel warm-up"), message
    assert "rank 1 (node2)" in message and "sg_check" in message, message


def test_without_ddp_the_buckets_are_one_of_the_whole_gradient() -> None:
    params = [torch.zeros(3, 4), torch.zeros(5)]
    assert bucket_numels(None, params) == [17, 12, 5]  # then each gradient (the replay's check)
