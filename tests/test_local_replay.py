"""Replay steps decided locally (issue 25): each replayer compares its replay with the claim its
owner sent along with the batch, and the fast path's MAX all-reduce decides; the rows are
gathered only to attribute a failure, which is then judged exactly as the row gather judges it.
Real gloo ranks, the real TinyGPT, real faults; the row gather is counted by wrapping the
guard's own collective."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from replay_workers import counted_runs

import slurm_guard as sg
from slurm_guard.checks.local_replay import (
    MAXIMA,
    compare_with_owner,
    float_bits,
    replay_passes,
)
from slurm_guard.checks.replay import Captured, pack, unpack
from slurm_guard.checks.rows import Replayed
from slurm_guard.comm.topology import Topology
from slurm_guard.local.launch import run_local
from slurm_guard.rundir.records import RankInfo, read_ledger

NODES = ["node1", "node2", "node3"]
ONE = float_bits(1.0)


def _scenario(run_dir: Path, steps: int, **config: Any) -> dict[str, Any]:
    run_dir.mkdir()
    return {"run_dir": str(run_dir), "steps": steps, "config": sg.GuardConfig(**config)}


def _passing_maxima() -> list[int]:
    return [ONE, ~ONE, float_bits(0.5), 77, ~77, 0, 0, float_bits(0.0)]


def test_the_decision_passes_only_a_step_the_row_gather_would_pass() -> None:
    totals, world, bound = [0.0, 0.0, 3.0, 3.0], 3, 1e-12
    assert replay_passes(totals, _passing_maxima(), world, bound)
    for index, value in ((4, ~78), (5, 1), (6, 1), (2, float_bits(2.0)), (1, ~(ONE + 1))):
        maxima = _passing_maxima()
        maxima[index] = value  # averaged gradients differ / raised / disagrees / GEMM / sketch
        assert not replay_passes(totals, maxima, world, bound), index
    assert not replay_passes([1.0, 0.0, 3.0, 3.0], _passing_maxima(), world, bound)  # NaN
    assert not replay_passes(totals, _passing_maxima()[: MAXIMA - 1], world, bound)


def test_the_replayer_compares_with_the_claim_that_came_with_the_batch() -> None:
    claim = torch.tensor([ONE, 12345], dtype=torch.int64)
    sent = Captured(
        batch={"x": torch.arange(3)}, cpu_rng=torch.get_rng_state(), cuda_rng=None, claim=claim
    )
    received = unpack(pack(sent), torch.device("cpu"))
    assert received.claim is not None and received.claim.tolist() == [ONE, 12345]
    assert compare_with_owner(received, Replayed(ONE, 12345), 0.0) == (False, 0.0)
    assert compare_with_owner(received, Replayed(ONE, 12346), 0.0)[0]
    assert compare_with_owner(received, Replayed(ONE + 1, 12345), 0.0)[0]
    assert compare_with_owner(received, Replayed(ONE, 12345, failed=True), 0.0)[0]
    # no claim (an owner that did not send one): fail closed, the rows decide
    bare = unpack(
        pack(Captured(batch=None, cpu_rng=torch.get_rng_state(), cuda_rng=None)),
        torch.device("cpu"),
    )
    assert compare_with_owner(bare, Replayed(ONE, 12345), 0.0)[0]
    # tolerance mode: the replay's distance from the owner's reference against the tolerance
    tolerant = Captured(
        batch=None, cpu_rng=torch.get_rng_state(), cuda_rng=None, reference=torch.zeros(3)
    )
    assert compare_with_owner(tolerant, Replayed(0, float_bits(1e-4)), 1e-3) == (False, 1e-4)
    assert compare_with_owner(tolerant, Replayed(0, float_bits(1e-2)), 1e-3) == (True, 1e-2)


def test_ring_pairs_are_this_ranks_two_pairs_of_the_full_ring() -> None:
    ranks = [RankInfo(rank=r, node=f"n{r // 4}", hostname="h") for r in range(64)]
    t = Topology.build(ranks)
    full = [(o, t.replayer[o]) for o in range(64)]
    for rank in range(64):
        assert sorted(t.ring_pairs(rank)) == sorted(p for p in full if rank in p)
        assert t.replayer[t.owner_of(rank)] == rank


@pytest.mark.distributed
def test_a_passing_replay_step_gathers_no_rows(tmp_path: Path) -> None:
    """From fast_path_world ranks on a clean replay step enters no row gather (exact and
    tolerance mode), and the ledger still records each pass; below it, the rows as before."""
    scenarios = [
        _scenario(tmp_path / name, 5, replay_every=2, vote_every=1000, **config)
        for name, config in (
            ("local-exact", {"fast_path_world": 1}),
            ("local-tolerant", {"fast_path_world": 1, "deterministic": False}),
            ("rows", {}),
        )
    ]
    outcomes = run_local(counted_runs, 3, args=(scenarios,), nodes=NODES)
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.value for o in outcomes]
    for o in outcomes:
        exact, tolerant, rows = o.value
        for local in (exact, tolerant):
            assert local["alarm"] is None
            assert local["gathers"] == [0, 0, 0, 0, 0]
            assert (local["local_replays"], local["fast_steps"]) == (3, 2)
        assert rows["alarm"] is None and rows["gathers"] == [1] * 5
        assert rows["local_replays"] == 0
    for sc, tolerant in zip(scenarios[:2], (False, True), strict=True):
        passes = [
            e for e in read_ledger(Path(sc["run_dir"]) / "ledger.jsonl") if e.check == "replay"
        ]
        assert [(e.step, e.passed, e.detail["comparisons"]) for e in passes] == [
            (0, True, 3),
            (2, True, 3),
            (4, True, 3),
        ]
        assert ("max_discrepancy" in passes[0].detail) is tolerant


@pytest.mark.distributed
def test_a_failing_replay_step_is_attributed_as_the_row_gather_attributes_it(
    tmp_path: Path,
) -> None:
    """The same faults on replay steps, decided by the rows (fast_path_world=32, the default
    at 3 ranks) and locally (1): the same alarm. A persistent fault fails two comparisons; a
    one-off fault on the owner's step fails one, which a third rank settles; a NaN is triaged
    with the ring's own replays; tolerance mode compares distances."""
    faults = {
        "persistent": ({"faults": (sg.Fault("grad-scale", rank=1, step=2, persistent=True),)}),
        "one-off": ({"faults": (sg.Fault("grad-scale", rank=1, step=2, param=3),)}),
        "nan": ({"faults": (sg.Fault("nan", rank=2, step=2),)}),
        "tolerant": (
            {
                "deterministic": False,
                "faults": (sg.Fault("grad-scale", rank=1, step=2, persistent=True, param=2),),
            }
        ),
    }
    scenarios = [
        _scenario(
            tmp_path / f"{name}-{world}",
            4,
            replay_every=2,
            vote_every=1000,
            fast_path_world=world,
            **config,
        )
        for name, config in faults.items()
        for world in (32, 1)
    ]
    outcomes = run_local(counted_runs, 3, args=(scenarios,), nodes=NODES)
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.value for o in outcomes]
    keys = ("step", "check", "verdict", "suspect_ranks", "suspect_nodes")
    for o in outcomes:
        for i, name in enumerate(faults):
            rows, local = o.value[2 * i], o.value[2 * i + 1]
            assert rows["alarm"] is not None and local["alarm"] is not None, name
            assert rows["alarm"]["step"] == 2, name
            assert {k: local["alarm"][k] for k in keys} == {k: rows["alarm"][k] for k in keys}
            # the clean replay at step 0 passed locally; step 2's decision then gathered rows
            assert local["local_replays"] == 1 and local["gathers"][0] == 0, name
            assert local["gathers"][2] >= 1, name
    alarms = [outcomes[0].value[2 * i]["alarm"] for i in range(len(faults))]
    assert [(a["check"], a["suspect_ranks"]) for a in alarms[:2]] == [("replay", [1])] * 2
    assert "third" in alarms[1]["evidence"]  # the single failed comparison was settled
    assert (alarms[2]["check"], alarms[2]["suspect_ranks"]) == ("finite_local", [2])
    assert (alarms[3]["check"], alarms[3]["suspect_ranks"]) == ("replay", [1])
