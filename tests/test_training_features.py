"""The guard under real training features: no false alarms, faults still caught (issue 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from feature_workers import features_run, poisoned_data

import slurm_guard as sg
from slurm_guard.local.launch import run_local
from slurm_guard.rundir.records import read_ledger

pytestmark = pytest.mark.distributed

NODES = ["node1", "node2", "node3"]


def _ok(outcomes: list) -> list[dict]:  # type: ignore[type-arg]
    assert [o.status for o in outcomes] == ["ok"] * len(outcomes), [o.value for o in outcomes]
    return [o.value for o in outcomes]


def test_reproducible_nan_is_numerical_not_hardware(tmp_path: Path) -> None:
    (tmp_path / "stop").mkdir()
    stop = _ok(run_local(poisoned_data, 3, args=(str(tmp_path / "stop"), "stop"), nodes=NODES))
    alarm = stop[0]["alarm"]
    assert alarm["step"] == 4 and alarm["check"] == "finite_local"
    assert alarm["verdict"] == "numerical" and alarm["suspect_nodes"] == []
    assert all(r["unchanged"] for r in stop)

    (tmp_path / "skip").mkdir()
    skip = _ok(run_local(poisoned_data, 3, args=(str(tmp_path / "skip"), "skip"), nodes=NODES))
    assert all(r["alarm"] is None and r["watched_unchanged"] for r in skip)
    skipped = [e for e in read_ledger(tmp_path / "skip" / "ledger.jsonl") if not e.passed]
    assert [(e.step, e.detail["verdict"]) for e in skipped] == [(4, "numerical")]


def test_batchnorm_frozen_unused_params_and_side_effect_hooks_raise_no_alarm(
    tmp_path: Path,
) -> None:
    (tmp_path / "verified").mkdir()
    (tmp_path / "unverified").mkdir()
    verified = _ok(run_local(features_run, 3, args=(str(tmp_path / "verified"), 1), nodes=NODES))
    plain = _ok(
        run_local(features_run, 3, args=(str(tmp_path / "unverified"), 1_000_000), nodes=NODES)
    )
    assert all(r["alarm"] is None for r in verified)
    # replays neither changed the running statistics nor the weights, bit for bit
    for a, b in zip(verified, plain, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["buffers"], b["buffers"], strict=True))
        assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"], strict=True))
    # the counting hook skipped replays: 12 steps + 1 bucket-settling pass
    assert [r["forward_calls"] for r in verified] == [13, 13, 13]
    ledger = read_ledger(tmp_path / "verified" / "ledger.jsonl")
    assert sum(e.check == "replay" and e.passed for e in ledger) == 12


def test_buffer_corrupted_on_one_rank_is_outvoted(tmp_path: Path) -> None:
    out = _ok(run_local(features_run, 3, args=(str(tmp_path), 5, 1, (), (2, 6)), nodes=NODES))
    alarm = out[0]["alarm"]
    assert alarm["step"] == 6 and alarm["check"] == "vote"
    assert alarm["suspect_ranks"] == [2]


def test_gradient_accumulation_replays_the_accumulated_gradient(tmp_path: Path) -> None:
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    clean.mkdir()
    faulty.mkdir()
    out = _ok(run_local(features_run, 3, args=(str(clean), 1, 3), nodes=NODES))
    assert all(r["alarm"] is None for r in out)
    fault = (sg.Fault("grad-scale", rank=1, step=4, persistent=True, param=3),)
    out = _ok(run_local(features_run, 3, args=(str(faulty), 5, 3, fault), nodes=NODES))
    alarm = out[0]["alarm"]
    assert (alarm["step"], alarm["check"], alarm["suspect_ranks"]) == (5, "replay", [1])
    assert all(r["unchanged"] for r in out)


def test_gradscaler_overflow_skips_are_not_alarms_but_faults_are(tmp_path: Path) -> None:
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    clean.mkdir()
    faulty.mkdir()
    out = _ok(run_local(features_run, 3, args=(str(clean), 1, 1, (), None, True), nodes=NODES))
    assert all(r["alarm"] is None for r in out)
    assert out[0]["scale"] < 2.0**127  # the scaler really did back off after overflows
    fault = (sg.Fault("nan", rank=1, step=10, persistent=True, param=3),)
    out = _ok(run_local(features_run, 3, args=(str(faulty), 1, 1, fault, None, True), nodes=NODES))
    alarm = out[0]["alarm"]
    assert (alarm["step"], alarm["verdict"], alarm["suspect_ranks"]) == (10, "sdc", [1])


def test_tolerance_mode_catches_a_10x_element_error_and_never_alarms_on_noise(
    tmp_path: Path,
) -> None:
    from feature_workers import noisy_replays

    nodes = ["node1", "node2", "node3", "node4"]
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    clean.mkdir()
    faulty.mkdir()
    out = _ok(run_local(noisy_replays, 4, args=(str(clean), 250, ()), nodes=nodes))
    assert all(r["alarm"] is None for r in out)
    replays = [e for e in read_ledger(clean / "ledger.jsonl") if e.check == "replay"]
    assert len(replays) * 4 >= 1000 and all(e.passed for e in replays)
    assert max(e.detail["max_discrepancy"] for e in replays) > 0  # the noise was really there
    assert out[0]["tolerance"] < 1e-3  # calibrated below the initial bound

    # one element of the 1000x1000 weight's gradient, 10x too large, from step 30 on rank 1
    fault = (sg.Fault("grad-scale", rank=1, step=30, persistent=True, param=2, element=12345),)
    out = _ok(run_local(noisy_replays, 4, args=(str(faulty), 40, fault), nodes=nodes))
    alarm = out[0]["alarm"]
    assert (alarm["step"], alarm["check"], alarm["suspect_ranks"]) == (30, "replay", [1])


@pytest.mark.parametrize(
    ("mode", "dtype"), [("compile", "torch.float32"), ("bf16", "torch.bfloat16")]
)
def test_compile_and_bf16_autocast_raise_no_false_alarm_and_still_catch_a_fault(
    tmp_path: Path, mode: str, dtype: str
) -> None:
    """docs/user-guide.md's rows: `torch.compile` before DDP, bf16 autocast inside loss_fn."""
    from feature_workers import compiled_or_bf16

    for name in ("clean", "faulty"):
        (tmp_path / name).mkdir()
    out = _ok(run_local(compiled_or_bf16, 3, args=(str(tmp_path), mode), nodes=NODES))
    clean, faulty = zip(*out, strict=True)
    assert all(r["alarm"] is None for r in clean) and clean[0]["dtype"] == dtype
    for r in clean[1:]:  # the replicas agree bit for bit
        assert all(torch.equal(a, b) for a, b in zip(r["final"], clean[0]["final"], strict=True))
    alarm = faulty[0]["alarm"]
    assert (alarm["step"], alarm["check"], alarm["suspect_ranks"]) == (5, "replay", [1])
    assert all(r["unchanged"] for r in faulty)
