"""Run-directory records: atomic, write-once, defensive parsing, and the resume rule."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_guard.records import (
    Alarm,
    LedgerEntry,
    RecordError,
    append_ledger,
    parse_alarm,
    read_alarm,
    read_ledger,
)
from slurm_guard.rundir import CheckpointMeta, RunDir, choose_trusted_checkpoint


def alarm(**kw: object) -> Alarm:
    base: dict[str, object] = dict(
        alarm_id="job7-r0-step20-replay",
        job_id="7",
        restart_count=0,
        step=20,
        check="replay",
        verdict="sdc",
        suspect_ranks=(1,),
        suspect_nodes=("node2",),
        suspect_hosts=("h",),
        last_verified_step=15,
        trusted_checkpoint="step-00000010",
        update_applied=False,
        evidence={},
        message="m",
        world_size=3,
    )
    base.update(kw)
    return Alarm(**base)  # type: ignore[arg-type]


def meta(step: int, clean: bool = True) -> CheckpointMeta:
    return CheckpointMeta(step, "00", clean, {}, 3, 0, 0.0)


def test_alarm_round_trips_and_is_never_overwritten(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    a = alarm()
    path = rd.write_alarm(a)
    assert read_alarm(path) == a
    with pytest.raises(FileExistsError):
        rd.write_alarm(alarm(message="other"))
    assert read_alarm(path).message == "m"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp left


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda d: d.update(schema=99), "newer"),
        (lambda d: d.pop("step"), "missing field 'step'"),
        (lambda d: d.update(verdict="maybe"), "unknown verdict"),
        (lambda d: d.update(suspect_ranks=[-1]), "suspect_ranks"),
        (lambda d: d.update(alarm_id="../x"), "alarm_id"),
        (lambda d: d.update(step="20"), "'step' must be int"),
        (lambda d: d.update(update_applied=1), "update_applied"),
    ],
)
def test_bad_alarms_are_rejected_with_a_reason(mutate: object, words: str) -> None:
    d = alarm().to_json()
    mutate(d)  # type: ignore[operator]
    with pytest.raises(RecordError, match=words.replace("(", r"\(")):
        parse_alarm(d)


def test_truncated_oversized_and_symlinked_files_are_rejected(tmp_path: Path) -> None:
    good = RunDir(tmp_path).write_alarm(alarm())
    truncated = tmp_path / "t.json"
    truncated.write_bytes(good.read_bytes()[:50])
    with pytest.raises(RecordError, match="not valid JSON"):
        read_alarm(truncated)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (2 << 20))
    with pytest.raises(RecordError, match="larger than"):
        read_alarm(big)
    link = tmp_path / "link.json"
    os.symlink(good, link)
    with pytest.raises(RecordError, match="symbolic link"):
        read_alarm(link)


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=20,
    )
)
def test_alarm_parser_never_crashes_on_arbitrary_json(obj: object) -> None:
    with contextlib.suppress(RecordError):
        parse_alarm(obj)


def test_ledger_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    append_ledger(path, LedgerEntry(0, "replay", True, {}, 0))
    append_ledger(path, LedgerEntry(5, "vote", False, {}, 0))
    with open(path, "a") as f:
        f.write('{"step": 10, "che')
    entries = read_ledger(path)
    got = [(e.step, e.check, e.passed) for e in entries]
    assert got == [(0, "replay", True), (5, "vote", False)]


def test_resume_rule() -> None:
    ckpts = [meta(10), meta(20), meta(30, clean=False), meta(40)]
    assert choose_trusted_checkpoint(ckpts, None) == ckpts[3]
    # last passing replay at 25: checkpoints up to step 25 are trusted, unclean ones never
    assert choose_trusted_checkpoint(ckpts, alarm(last_verified_step=25)) == ckpts[1]
    assert choose_trusted_checkpoint(ckpts, alarm(last_verified_step=20)) == ckpts[1]
    assert choose_trusted_checkpoint(ckpts, alarm(last_verified_step=5)) is None
    assert choose_trusted_checkpoint(ckpts, alarm(last_verified_step=None)) is None


def test_checkpoint_listing_ignores_unfinished_and_malformed(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    rd.ensure()
    rd.checkpoint_path(10).mkdir()  # no meta.json: a save that never finished
    bad = rd.checkpoint_path(20)
    bad.mkdir()
    (bad / "meta.json").write_text(json.dumps({"schema": 1, "step": "x"}))
    assert rd.checkpoints() == []


def test_quarantine_moves_never_deletes(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    for step in (10, 20, 30):
        rd.checkpoint_path(step).mkdir(parents=True)
    moved = rd.quarantine_after(10, "a1")
    assert moved == ["step-00000020", "step-00000030"]
    assert sorted(p.name for p in (tmp_path / "quarantine" / "a1").iterdir()) == moved
    assert rd.checkpoint_path(10).is_dir()


def test_trust_limit_requires_that_many_passing_replays_after_the_checkpoint() -> None:
    from slurm_guard.rundir import trust_limit

    assert trust_limit(15, [0, 5, 10, 15], 1) == 15
    assert trust_limit(15, [0, 5, 10, 15], 2) == 10
    # a fault from step 7 hid from the replay at 10 and was caught at 15: trust only up to 5
    assert trust_limit(10, [0, 5, 10], 2) == 5
    assert trust_limit(0, [0], 2) is None
    assert trust_limit(None, [0, 5], 2) is None
    ckpts = [meta(5), meta(10)]
    chosen = choose_trusted_checkpoint(ckpts, alarm(last_verified_step=10), [0, 5, 10], 2)
    assert chosen == ckpts[0]
