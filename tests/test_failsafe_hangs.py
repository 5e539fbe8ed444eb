"""Fail-safe: no rank hangs, and nothing that cannot be verified is trusted (issue 11).

Each distributed test runs 3 real gloo processes in which one rank misbehaves the way a careless
user or a sick node does. Before these checks every one of them hung until the process group's
timeout (or aborted gloo with "collective mismatch"); now every rank must stop with the same
named error within 60 s. `run_local`'s own timeout kills the processes if a regression hangs, so
the suite cannot hang with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from failsafe_workers import (
    agree_on_failure,
    checkpoint_on_rank_zero_only,
    injected_from_env,
    mismatched_settings,
    p2p_on_subgroup,
    rank_that_sleeps,
    replay_that_raises,
    single_rank_nan,
)

import slurm_guard as sg
from slurm_guard.config import ConfigError
from slurm_guard.local.launch import RankOutcome, run_local

NODES = ["node1", "node2", "node3"]
HARD_TIMEOUT = 150.0  # run_local kills the ranks after this: a regression fails, never hangs
WITHIN = 60.0  # every rank must have stopped this long after building its Guard


def _stopped_alike(outcomes: list[RankOutcome], error: str) -> list[dict[str, Any]]:
    """Every rank ran to an error of type `error`, the same message everywhere, within 60 s."""
    assert [o.status for o in outcomes] == ["ok"] * len(outcomes), [o.value for o in outcomes]
    values = [o.value for o in outcomes]
    assert [v["error"] for v in values] == [error] * len(values), values
    assert len({v["message"] for v in values}) == 1, [v["message"] for v in values]
    assert all(v["elapsed"] < WITHIN for v in values), [v["elapsed"] for v in values]
    return values


@pytest.mark.distributed
def test_mismatched_settings_are_named_at_construction(tmp_path: Path) -> None:
    outcomes = run_local(
        mismatched_settings, 3, args=(str(tmp_path), 1), nodes=NODES, timeout=HARD_TIMEOUT
    )
    message = _stopped_alike(outcomes, "ConfigError")[0]["message"]
    assert "rank 1:" in message and "rank 0:" in message
    for field in ("replay_every", "deterministic", "schedule", "settle_buckets", "finite_check"):
        assert field in message, (field, message)
    assert "replay_every=6 (rank 0: 5)" in message
    assert "rank 2" not in message  # rank 2 agrees with rank 0


@pytest.mark.distributed
def test_checkpoint_on_rank_zero_only_is_a_named_mismatch(tmp_path: Path) -> None:
    outcomes = run_local(
        checkpoint_on_rank_zero_only, 3, args=(str(tmp_path),), nodes=NODES, timeout=HARD_TIMEOUT
    )
    message = _stopped_alike(outcomes, "CollectiveMismatch")[0]["message"]
    assert "rank(s) 0 in 'save_checkpoint() after 3 steps'" in message, message
    assert "rank(s) 1, 2 in 'step 3'" in message, message


@pytest.mark.distributed
def test_rank_that_does_not_arrive_is_named_by_every_rank(tmp_path: Path) -> None:
    outcomes = run_local(
        rank_that_sleeps, 3, args=(str(tmp_path), 2, 12.0, 5.0), nodes=NODES, timeout=HARD_TIMEOUT
    )
    values = _stopped_alike(outcomes, "RanksMissing")
    message = values[0]["message"]
    assert "rank(s) 2 did not reach 'step 3'" in message, message
    assert "rank 2 (node3) last at 'step 2'" in message, message
    assert "watchdog_seconds" in message
    # rank 1 gave up after the 5 s watchdog, long before the sleeper woke (12 s) or the
    # backend's timeout (120 s); rank 0, which hosts the store, waited for the sleeper to read why
    assert values[1]["waited"] < 12.0, values
    assert values[0]["waited"] < 12.0 + 30.0 and values[2]["waited"] >= 12.0, values


@pytest.mark.distributed
def test_replay_that_raises_on_one_rank_stops_every_rank_with_its_cause(tmp_path: Path) -> None:
    outcomes = run_local(
        replay_that_raises, 3, args=(str(tmp_path), 1), nodes=NODES, timeout=HARD_TIMEOUT
    )
    message = _stopped_alike(outcomes, "RankFailed")[0]["message"]
    assert message.startswith("step 0: the replay of rank 0's microbatch failed on rank 1 (node2)")
    assert "MemoryError: CUDA out of memory (simulated) in the replay" in message


@pytest.mark.distributed
def test_agree_raises_the_same_error_on_every_rank() -> None:
    outcomes = run_local(agree_on_failure, 3, args=(2,), nodes=NODES, timeout=HARD_TIMEOUT)
    message = _stopped_alike(outcomes, "RankFailed")[0]["message"]
    assert message.startswith(
        "checkpoint files failed on rank 2 (node3): TypeError: torch.save could not pickle"
    ), message


@pytest.mark.distributed
def test_point_to_point_on_a_subgroup_reaches_group_ranks() -> None:
    outcomes = run_local(p2p_on_subgroup, 3, nodes=NODES, timeout=HARD_TIMEOUT)
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.value for o in outcomes]
    values = [o.value for o in outcomes]
    assert values[0] == {"member": False}
    # each member holds what the other member sent: its group rank
    assert values[1] == {"member": True, "group_rank": 0, "got": [1.0, 1.0]}
    assert values[2] == {"member": True, "group_rank": 1, "got": [0.0, 0.0]}


@pytest.mark.distributed
def test_world_size_one_nan_is_not_blamed_on_hardware(tmp_path: Path) -> None:
    (outcome,) = run_local(single_rank_nan, 1, args=(str(tmp_path),), nodes=["solo"])
    assert outcome.status == "ok", outcome.value
    alarm = outcome.value["alarm"]
    assert alarm is not None and alarm["step"] == 2 and alarm["check"] == "finite_local"
    assert alarm["verdict"] == "ambiguous", alarm["message"]
    assert alarm["suspect_nodes"] == []
    assert alarm["evidence"]["not_replayed"] == [0]
    assert alarm["injected"] is True
    warnings = [line for line in outcome.value["logs"] if line.startswith("slurm-guard at world")]
    assert len(warnings) == 1 and "NaN/Inf" in warnings[0], outcome.value["logs"]


@pytest.mark.distributed
def test_injected_faults_are_logged_recorded_and_marked(tmp_path: Path) -> None:
    env = {"SLURM_GUARD_INJECT": "kind=grad-scale,rank=1,step=2,persistent=1,param=10"}
    outcomes = run_local(
        injected_from_env, 3, args=(str(tmp_path),), nodes=NODES, extra_env=env, timeout=300
    )
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.value for o in outcomes]
    for o in outcomes:
        assert o.value["alarm"] is not None and o.value["alarm"]["injected"] is True
        announced = [line for line in o.value["logs"] if "fault injection is ON" in line]
        if o.rank == 0:  # once, from rank 0: every rank knows the same agreed list
            assert len(announced) == 1 and "1 from SLURM_GUARD_INJECT" in announced[0], o.value
        else:
            assert announced == [], o.value
    run_json = outcomes[0].value["run_json"]
    assert run_json["injected_faults"] == ["grad-scale on rank 1, persistent from step 2"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("deterministic", "false"),
        ("finite_check", "no"),
        ("settle_buckets", 1),
        ("trust_replays", 1.5),
        ("calibration_replays", 2.0),
        ("faults", "kind=nan"),
        ("faults", ("kind=nan,rank=1,step=2",)),
        ("watchdog_seconds", "300"),
        ("watchdog_seconds", -1),
        ("fast_path_world", 0),
        ("fast_path_world", 2.0),
        ("fast_path_world", True),
    ],
)
def test_config_values_of_the_wrong_type_are_refused(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"GuardConfig.{field}"):
        sg.GuardConfig(**{field: value})


def test_config_accepts_the_right_types() -> None:
    config = sg.GuardConfig(
        deterministic=False,
        finite_check=True,
        trust_replays=1,
        faults=(sg.Fault("nan", rank=1, step=2),),
        watchdog_seconds=0,
    )
    assert config.summary()["watchdog_seconds"] == 0


def test_node_fault_on_a_single_host_run_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 13: under single-host torchrun every rank is on one node, so a node fault hits
    every replica alike and no replay or vote can see it."""
    from slurm_guard.comm.topology import Topology
    from slurm_guard.core.setup import announce_faults
    from slurm_guard.rundir.records import RankInfo

    one_host = Topology.build([RankInfo(r, "box", "box") for r in range(3)])
    three = Topology.build([RankInfo(r, f"n{r}", f"n{r}") for r in range(3)])
    node_fault = (sg.Fault("grad-scale", node="box", step=3, persistent=True),)
    with caplog.at_level("WARNING", logger="slurm_guard"):
        announce_faults(node_fault, one_host, 0, 1)
    assert "hosts every rank" in caplog.text and "1 from SLURM_GUARD_INJECT" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="slurm_guard"):
        announce_faults((sg.Fault("grad-scale", node="n1", step=3),), three, 0, 0)
        announce_faults((sg.Fault("grad-scale", rank=1, step=3),), one_host, 0, 0)
    assert "fault injection is ON" in caplog.text and "hosts every rank" not in caplog.text


@pytest.mark.distributed
@pytest.mark.parametrize("fast_path_world", [32, 1], ids=["row-gather", "fast-path"])
def test_a_step_makes_no_store_request(tmp_path: Path, fast_path_world: int) -> None:
    """Issue 25: rank 0's TCPStore served 4 round trips per rank per step (the per-step arrival
    check), O(W) serially at rank 0. Counted through a store wrapped around the process group's
    (the hang watch's own connections are clones of it, so they count too): a plain step, a
    replay step and a vote step make no request at all; Guard() and save_checkpoint() keep
    their store rounds."""
    from failsafe_workers import store_requests_per_step

    outcomes = run_local(
        store_requests_per_step, 3, args=(str(tmp_path), fast_path_world), nodes=NODES
    )
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.value for o in outcomes]
    for o in outcomes:
        assert o.value["error"] is None, o.value["message"]
        value = o.value["value"]
        assert value["steps"] == [0, 0, 0, 0], value
        assert value["setup"] > 0 and value["save"] > 0, value


@pytest.mark.distributed
def test_a_rank_finalizing_when_the_store_host_exits_ends_cleanly(tmp_path: Path) -> None:
    """Seen in CI (exit 134 after a clean run): rank 1's hang-watch listener sat in the
    TCPStore's C++ wait while its interpreter finalized; rank 0, the store's host, exited, the
    wait returned into the finalizing interpreter and the thread's forced unwind aborted the
    process. Now every rank ends its own listener at exit (its own wake key). Rank 1 here takes
    4 s to finalize, long after rank 0 has gone."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent / "local_train.py"
    cmd = [sys.executable, "-m", "slurm_guard.cli", "local", "-n", "2", "--"]
    cmd += [sys.executable, str(script), str(tmp_path), "3", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=HARD_TIMEOUT)
    assert "terminate called" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.distributed
def test_the_store_host_leaves_after_the_other_ranks_on_a_clean_exit(tmp_path: Path) -> None:
    """Seen in CI under the README's command: rank 0, the store's host, exited first, the other
    ranks' hang-watch listeners lost their connection mid-wait, and torch printed a C++ stack
    trace on a clean run. Rank 1 here exits 2 s after the others."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent / "local_train.py"
    cmd = [sys.executable, "-m", "slurm_guard.cli", "local", "-n", "2", "--"]
    cmd += [sys.executable, str(script), str(tmp_path), "3", "1", "slow-exit"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=HARD_TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Failed to recv" not in out.stderr, out.stderr[-3000:]
