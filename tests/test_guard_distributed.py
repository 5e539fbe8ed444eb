"""The guard on real multi-process gloo jobs: every fault kind caught, attributed, not applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from workers import run_scenarios

import slurm_guard as sg
from slurm_guard.faults.injection import BACKWARD_KINDS, KINDS
from slurm_guard.local.launch import RankOutcome, run_local
from slurm_guard.rundir.records import read_ledger

pytestmark = pytest.mark.distributed

REPLAY_EVERY = 5
VOTE_EVERY = 5
FAULTY_RANK = 1
DENSE_WEIGHT = 10  # parameter index of a dense layer: its gradient is never all zeros

TOPOLOGIES = {
    "4 nodes": ["node1", "node2", "node3", "node4"],
    "3 nodes": ["node1", "node2", "node3"],
    "1 node x 3": ["node1", "node1", "node1"],
}


def expected_detection(kind: str, onset: int, persistent: bool) -> int:
    """The first verification at or after the onset that can see this kind of fault."""
    if kind in ("nan", "inf"):
        return onset  # the finite check runs on every step
    next_replay = -(-onset // REPLAY_EVERY) * REPLAY_EVERY
    if kind == "weight-bitflip":
        # the flip lands after the onset step's update: the vote after that update sees it,
        # a replay only from the next step on
        next_vote = next(
            s for s in range(onset, onset + VOTE_EVERY + 1) if (s + 1) % VOTE_EVERY == 0
        )
        later_replay = next(
            s for s in range(onset + 1, onset + REPLAY_EVERY + 2) if s % REPLAY_EVERY == 0
        )
        return min(next_vote, later_replay)
    return next_replay


# The injection kinds of the guard issue; "allreduce", "replay-noise", "gemm" and "diagnose-gemm"
# have their own tests (see test_every_fault_kind_has_a_detection_test).
MATRIX_KINDS = ("grad-scale", "grad-bitflip", "nan", "inf", "activation", "weight-bitflip")


def fault_matrix(tmp_path: Path) -> list[dict[str, Any]]:
    scenarios = []
    for kind in MATRIX_KINDS:
        for persistent in (True, False):
            # persistent faults start between verifications; one-off faults must hit a verified
            # step to be visible at all (DESIGN.md: what no check catches)
            onset = 7 if persistent else 10
            fault = sg.Fault(
                kind, rank=FAULTY_RANK, step=onset, persistent=persistent, param=DENSE_WEIGHT
            )
            run_dir = tmp_path / f"{kind}-{'persistent' if persistent else 'oneoff'}"
            run_dir.mkdir()
            scenarios.append(
                {
                    "run_dir": str(run_dir),
                    "steps": 17,
                    "config": sg.GuardConfig(
                        replay_every=REPLAY_EVERY, vote_every=VOTE_EVERY, faults=(fault,)
                    ),
                    "kind": kind,
                    "persistent": persistent,
                    "onset": onset,
                }
            )
    return scenarios


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(bool((x == y).all()) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_every_fault_kind_is_caught_at_first_verification(tmp_path: Path, topology: str) -> None:
    nodes = TOPOLOGIES[topology]
    scenarios = fault_matrix(tmp_path)
    outcomes = run_local(run_scenarios, len(nodes), args=(scenarios,), nodes=nodes)
    assert all(o.status == "ok" for o in outcomes), [o.value for o in outcomes if o.status != "ok"]
    for index, sc in enumerate(scenarios):
        label = f"{sc['kind']} {'persistent' if sc['persistent'] else 'one-off'}"
        per_rank = [o.value[index] for o in outcomes]
        alarm = per_rank[0]["alarm"]
        assert alarm is not None, f"{label}: not detected"
        # every rank stopped on the same alarm
        assert all(r["alarm"] == alarm for r in per_rank), label
        assert alarm["step"] == expected_detection(sc["kind"], sc["onset"], sc["persistent"]), label
        assert alarm["verdict"] == "sdc", (label, alarm["message"])
        assert alarm["suspect_ranks"] == [FAULTY_RANK], (label, alarm["message"])
        assert alarm["suspect_nodes"] == [nodes[FAULTY_RANK]], label
        if alarm["check"] == "vote":
            assert alarm["update_applied"] is True, label
        else:
            assert alarm["update_applied"] is False, label
            for rank, r in enumerate(per_rank):
                assert _same(r["before"], r["after"]), f"{label}: rank {rank} applied the update"
        files = list((Path(sc["run_dir"]) / "alarms").glob("*.json"))
        assert [f.stem for f in files] == [alarm["alarm_id"]], label


def test_two_nodes_detect_but_cannot_attribute(tmp_path: Path) -> None:
    fault = sg.Fault("grad-scale", rank=1, step=3, persistent=True, param=DENSE_WEIGHT)
    scenario = {
        "run_dir": str(tmp_path),
        "steps": 8,
        "config": sg.GuardConfig(replay_every=REPLAY_EVERY, faults=(fault,)),
    }
    outcomes = run_local(run_scenarios, 2, args=([scenario],), nodes=["node1", "node2"])
    alarm = outcomes[0].value[0]["alarm"]
    assert alarm["step"] == 5 and alarm["check"] == "replay"
    assert alarm["verdict"] == "ambiguous"
    assert sorted(alarm["suspect_ranks"]) == [0, 1]


def test_clean_training_raises_no_alarm_over_hundreds_of_checks(tmp_path: Path) -> None:
    steps = 150
    scenario = {
        "run_dir": str(tmp_path),
        "steps": steps,
        "config": sg.GuardConfig(replay_every=1, vote_every=1),
    }
    outcomes = run_local(run_scenarios, 3, args=([scenario],), nodes=["n1", "n2", "n3"])
    assert [o.status for o in outcomes] == ["ok"] * 3
    assert all(o.value[0]["alarm"] is None for o in outcomes)
    ledger = read_ledger(tmp_path / "ledger.jsonl")
    replays = [e for e in ledger if e.check == "replay"]
    votes = [e for e in ledger if e.check == "vote"]
    assert len(replays) == steps and len(votes) == steps
    assert all(e.passed for e in ledger)
    assert not list((tmp_path / "alarms").iterdir())
    losses = outcomes[0].value[0]["losses"]
    assert sum(losses[-10:]) < sum(losses[:10])  # it really trained


def _finals(outcomes: list[RankOutcome]) -> list[list[torch.Tensor]]:
    return [o.value[0]["final"] for o in outcomes]


def test_resume_after_alarm_matches_uninterrupted_run_bit_for_bit(tmp_path: Path) -> None:
    nodes = ["n1", "n2", "n3"]
    config = sg.GuardConfig(replay_every=REPLAY_EVERY, vote_every=VOTE_EVERY)
    clean_dir, faulty_dir = tmp_path / "clean", tmp_path / "faulty"
    clean_dir.mkdir()
    faulty_dir.mkdir()
    fault = sg.Fault("grad-scale", rank=1, step=17, persistent=True, param=DENSE_WEIGHT)
    runs = [
        {"run_dir": str(clean_dir), "steps": 30, "config": config, "checkpoint_every": 10},
        {
            "run_dir": str(faulty_dir),
            "steps": 30,
            "checkpoint_every": 10,
            "config": sg.GuardConfig(
                replay_every=REPLAY_EVERY, vote_every=VOTE_EVERY, faults=(fault,)
            ),
        },
    ]
    first = run_local(run_scenarios, 3, args=(runs,), nodes=nodes)
    alarm = first[0].value[1]["alarm"]
    assert alarm["step"] == 20 and alarm["last_verified_step"] == 15
    assert alarm["trusted_checkpoint"] == "step-00000010"

    restart = [{"run_dir": str(faulty_dir), "steps": 30, "config": config, "checkpoint_every": 10}]
    second = run_local(run_scenarios, 3, args=(restart,), nodes=nodes)
    assert second[0].value[0]["start"] == 10
    clean_finals = [o.value[0]["final"] for o in first]
    for rank, (a, b) in enumerate(zip(clean_finals, _finals(second), strict=True)):
        assert _same(a, b), f"rank {rank}: resumed run differs from the uninterrupted run"
    # the checkpoint taken after the fault's onset was moved aside, never deleted
    assert (faulty_dir / "quarantine" / alarm["alarm_id"] / "step-00000020").is_dir()
    assert (faulty_dir / "handled" / f"{alarm['alarm_id']}.json").is_file()

    # a later restart does not roll back again
    third = run_local(run_scenarios, 3, args=(restart,), nodes=nodes)
    assert third[0].value[0]["start"] == 30


def test_corrupt_checkpoint_is_skipped_never_loaded(tmp_path: Path) -> None:
    nodes = ["n1", "n2", "n3"]
    config = sg.GuardConfig(replay_every=REPLAY_EVERY, vote_every=VOTE_EVERY)
    run = {"run_dir": str(tmp_path), "steps": 20, "config": config, "checkpoint_every": 10}
    run_local(run_scenarios, 3, args=([run],), nodes=nodes)
    model_file = tmp_path / "checkpoints" / "step-00000020" / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:100])  # a torn write
    (tmp_path / "checkpoints" / "step-00000030").mkdir()  # a save that never finished
    (tmp_path / "run.json").unlink()  # a new fingerprint seed: checkpoints keep their own
    again = {"run_dir": str(tmp_path), "steps": 20, "config": config}
    out = run_local(run_scenarios, 3, args=([again],), nodes=nodes)
    assert out[0].value[0]["start"] == 10


def test_loss_that_is_not_a_scalar_is_refused_before_any_update(tmp_path: Path) -> None:
    from workers import bad_loss

    outcomes = run_local(bad_loss, 2, args=(str(tmp_path),), nodes=["a", "b"])
    for o in outcomes:
        assert o.status == "ok"
        assert "scalar" in o.value and "unchanged=True" in o.value


def test_every_fault_kind_has_a_detection_test() -> None:
    assert set(BACKWARD_KINDS) < set(MATRIX_KINDS)
    # allreduce, replay-noise: test_blind_spots.py, test_training_features.py; gemm:
    # test_abft.py, test_abft_guard.py; diagnose-gemm: test_diagnose.py
    assert set(KINDS) == {*MATRIX_KINDS, "allreduce", "replay-noise", "gemm", "diagnose-gemm"}


def test_collectives_use_the_backend_device_and_one_host_read_per_step(tmp_path: Path) -> None:
    """The device check declared (SLURM_GUARD_CHECK_DEVICE's context-manager form) through a
    verified step with ring replay and vote: every collective tensor on the device gloo needs,
    one device-to-host copy of the gathered rows per round (two on vote steps), and a declared
    device that does not match is refused, not silently used."""
    from failsafe_workers import checked_devices

    outcomes = run_local(checked_devices, 3, args=(str(tmp_path), "cpu"), nodes=["a", "b", "c"])
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.value for o in outcomes]
    for o in outcomes:
        assert o.value["error"] is None, o.value["message"]
        # steps 0, 2: replay + verdict gather; steps 1, 3: verdict gather + vote
        assert o.value["value"] == {"reads": [1, 2, 1, 2], "device": "cpu"}
    replays = [e for e in read_ledger(tmp_path / "ledger.jsonl") if e.check == "replay"]
    assert [(e.step, e.passed) for e in replays] == [(0, True), (2, True)]

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    refused = run_local(checked_devices, 3, args=(str(wrong), "cuda"), nodes=["a", "b", "c"])
    for o in refused:
        assert o.status == "ok" and o.value["error"] == "DeviceCheckError", o.value
        assert "needs cuda tensors" in o.value["message"]


@pytest.mark.parametrize("fast_path_world", [32, 1], ids=["row-gather", "fast-path"])
def test_a_plain_step_reads_only_the_verdict_row_and_returns_the_loss(
    tmp_path: Path, fast_path_world: int
) -> None:
    """Every conversion of a tensor to Python values inside guard.step (a device-to-host copy on
    CUDA), counted: a step without replay or vote makes exactly one, the verdict read (there
    the fast path's sums and maxima, which also carry this rank's loss), and the loss it
    returns comes from that read (no float(loss) of its own), bit-equal to what the loss
    function computed. Replay and vote steps read more (fingerprints, the replay's exchange),
    listed so that a new read anywhere shows up here. The plain step also makes no tensor from
    Python values (on CUDA a blocking upload, which waits for the whole backward)."""
    from failsafe_workers import step_host_reads

    outcomes = run_local(
        step_host_reads, 3, args=(str(tmp_path), fast_path_world), nodes=["a", "b", "c"]
    )
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.value for o in outcomes]
    for o in outcomes:
        assert o.value["error"] is None, o.value["message"]
        replay_step, plain_step, vote_step = o.value["value"]["sites"]
        assert plain_step == ["collective.py:_read"]
        # and uploads nothing: its constant row fields were made once, at the replay step
        assert o.value["value"]["uploads"][1] == [], o.value["value"]["uploads"]
        # the verdict row, then the vote's gathered fingerprints (not the fingerprint alone)
        assert vote_step == ["collective.py:_read", "collective.py:_read"]
        assert not [s for s in replay_step if s.startswith("guard.py")], replay_step
        assert o.value["value"]["loss_exact"] == [True, True, True]
        # the steps without a replay skip the row gather on the fast path, the vote the
        # fingerprint gather (its one read is then the all-reduce's)
        assert o.value["value"]["fast_steps"] == (2 if fast_path_world == 1 else 0)
        assert o.value["value"]["fast_votes"] == (1 if fast_path_world == 1 else 0)
