"""Run-directory records: atomic, write-once, defensive parsing, and the resume rule."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import (
    Alarm,
    LedgerEntry,
    RecordError,
    append_ledger,
    parse_alarm,
    read_alarm,
    read_ledger,
)
from slurm_guard.rundir.trust import CheckpointMeta, choose_trusted_checkpoint


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
    from slurm_guard.rundir.trust import trust_limit

    assert trust_limit(15, [0, 5, 10, 15], 1) == 15
    assert trust_limit(15, [0, 5, 10, 15], 2) == 10
    # a fault from step 7 hid from the replay at 10 and was caught at 15: trust only up to 5
    assert trust_limit(10, [0, 5, 10], 2) == 5
    assert trust_limit(0, [0], 2) is None
    assert trust_limit(None, [0, 5], 2) is None
    ckpts = [meta(5), meta(10)]
    chosen = choose_trusted_checkpoint(ckpts, alarm(last_verified_step=10), [0, 5, 10], 2)
    assert chosen == ckpts[0]


# --------------------------------------------------------------------------- fail-safe run dir


def test_alarm_ids_differ_between_attempts_of_the_same_job_restart_and_step() -> None:
    from slurm_guard.rundir.records import make_alarm_id, new_attempt_id

    attempts = {new_attempt_id() for _ in range(1000)}
    assert len(attempts) == 1000
    ids = {make_alarm_id(None, 0, a, 10, "replay") for a in list(attempts)[:2]}
    assert len(ids) == 2
    for alarm_id in ids:
        assert alarm_id.startswith("joblocal-r0-a") and alarm_id.endswith("-step10-replay")
        parse_alarm(alarm(alarm_id=alarm_id).to_json())  # a valid id for every reader


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_records_get_the_process_umask(tmp_path: Path, umask: int, mode: int) -> None:
    """mkstemp made every record 0600: a controller running as SlurmUser could not read it."""
    old = os.umask(umask)
    try:
        path = RunDir(tmp_path).write_alarm(alarm())
        append_ledger(tmp_path / "ledger.jsonl", LedgerEntry(0, "replay", True, {}, 0))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode
    assert (tmp_path / "ledger.jsonl").stat().st_mode & 0o777 == mode


def test_lost_alarm_marks_round_trip(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    rd.mark_lost_alarm("joblocal-r0-aabc-step10-replay", 5)
    rd.mark_lost_alarm("job7-r1-adef-step3-vote", None)
    got = sorted((a.alarm_id, a.trust_upto) for a in rd.lost_alarms())
    assert got == [("job7-r1-adef-step3-vote", None), ("joblocal-r0-aabc-step10-replay", 5)]


def test_lock_staleness_rule() -> None:
    from slurm_guard.rundir.lock import STALE_AFTER_S, LockHolder, stale_reason

    me = LockHolder("7", 2, "aaaa", "hostA", os.getpid())
    sleeper = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        alive_here = LockHolder("8", 0, "b", "hostA", sleeper.pid)
        assert stale_reason(alive_here, 0.0, me) is None
        assert stale_reason(alive_here, STALE_AFTER_S + 1, me) is not None  # no heartbeat
        assert "exited" in str(stale_reason(LockHolder("8", 0, "b", "hostA", dead.pid), 0, me))
        assert "this process" in str(stale_reason(LockHolder(None, 0, "b", "hostA", me.pid), 0, me))
        # an earlier incarnation of this very job, on another node: Slurm ended it
        assert stale_reason(LockHolder("7", 1, "b", "hostB", 1), 0.0, me) is not None
        # the same incarnation (a second srun in the allocation) or another job: heartbeat
        assert stale_reason(LockHolder("7", 2, "b", "hostB", 1), 0.0, me) is None
        assert stale_reason(LockHolder("9", 5, "b", "hostB", 1), 0.0, me) is None
        assert stale_reason(None, 0.0, me) is None  # unreadable lock: judged by heartbeat
        assert stale_reason(None, STALE_AFTER_S + 1, me) is not None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import socket

    from slurm_guard.rundir.layout import RunDirError
    from slurm_guard.rundir.lock import RunLock

    rd = RunDir(tmp_path)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        holder = {"job_id": "5", "restart_count": 0, "attempt": "x", "host": socket.gethostname()}
        rd.lock_file.write_text(json.dumps({**holder, "pid": sleeper.pid}))
        with pytest.raises(RunDirError, match="in use by job 5"):
            RunLock.acquire(rd, job_id="6", restart_count=0, attempt="mine")
    finally:
        sleeper.kill()
        sleeper.wait()
    with caplog.at_level("WARNING", logger="slurm_guard.rundir.lock"):
        lock = RunLock.acquire(rd, job_id="6", restart_count=0, attempt="mine")
    assert "taking over the lock" in caplog.text and "has exited" in caplog.text
    assert lock.held() and json.loads(rd.lock_file.read_text())["attempt"] == "mine"
    lock.release()
    assert not rd.lock_file.exists()


def test_identity_is_created_once_and_a_lost_one_is_refused(tmp_path: Path) -> None:
    from slurm_guard.rundir.identity import establish_identity
    from slurm_guard.rundir.layout import RunDirError
    from slurm_guard.rundir.records import atomic_write_json

    rd = RunDir(tmp_path)
    first = establish_identity(rd, job_id=None, fresh=False)
    assert establish_identity(rd, job_id="3", fresh=False) == first
    atomic_write_json(rd.run_file, {"run_id": first})
    rd.identity_file.unlink()
    with pytest.raises(RunDirError, match=r"identity\.json is gone"):
        establish_identity(rd, job_id=None, fresh=False)
    second = establish_identity(rd, job_id=None, fresh=True)
    assert second != first
    with pytest.raises(RunDirError, match="two runs"):
        establish_identity(rd, job_id=None, fresh=False)  # run.json still names the first
    rd.identity_file.write_bytes(b"{")
    with pytest.raises(RunDirError, match="cannot be read"):
        establish_identity(rd, job_id=None, fresh=False)


def test_staging_dirs_are_per_attempt_and_stale_ones_are_removed(tmp_path: Path) -> None:
    from slurm_guard.rundir.checkpoint import staging_dir

    rd = RunDir(tmp_path)
    rd.ensure()
    a, b = staging_dir(rd, 10, 0, "aaaa"), staging_dir(rd, 10, 0, "bbbb")
    assert a != b
    a.mkdir()
    (a / "meta.json").write_text("{}")
    rd.checkpoint_path(5).mkdir()
    assert rd.remove_stale_staging() == [a.name]
    assert sorted(p.name for p in rd.checkpoints_dir.iterdir()) == ["step-00000005"]


def test_resume_plan_fails_closed_and_honours_lost_alarms(tmp_path: Path) -> None:
    from slurm_guard.rundir.layout import RunDirError
    from slurm_guard.rundir.recovery import plan_resume

    rd = RunDir(tmp_path)
    rd.ensure()
    for step in (5, 10):
        rd.checkpoint_path(step).mkdir()
        meta_json = {**meta(step).__dict__, "files": {}}
        (rd.checkpoint_path(step) / "meta.json").write_text(json.dumps(meta_json))
    assert [m.step for m in plan_resume(rd).candidates] == [10, 5]
    rd.mark_lost_alarm("lost1", 5)
    assert [m.step for m in plan_resume(rd).candidates] == [5]
    rd.mark_handled("lost1", {})
    (rd.alarms_dir / "bad.json").write_bytes(b"{")
    with pytest.raises(RunDirError, match="SLURM_GUARD_RESUME=fresh"):
        plan_resume(rd)
    plan = plan_resume(rd, fresh=True)
    assert plan.candidates == [] and plan.pending_alarms == ["bad"]
    rd.mark_handled("bad", {})  # what the fresh start records
    assert [m.step for m in plan_resume(rd).candidates] == [10, 5]


def test_a_checkpoint_meta_for_another_step_is_damaged(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    rd.checkpoint_path(10).mkdir(parents=True)
    (rd.checkpoint_path(10) / "meta.json").write_text(json.dumps(meta(20).__dict__))
    scan = rd.scan_checkpoints()
    assert scan.metas == [] and "not 10" in scan.damaged[10]


def test_markers_name_the_ranks_that_do_not_see_every_marker(tmp_path: Path) -> None:
    from slurm_guard.rundir.identity import (
        markers_problem,
        markers_seen,
        prepare_markers,
        write_marker,
    )

    rd = RunDir(tmp_path)
    prepare_markers(rd, "old")
    prepare_markers(rd, "att")  # an earlier attempt's markers are removed
    assert [p.name for p in rd.markers_dir.iterdir()] == ["att"]
    for rank in (0, 2):
        assert write_marker(rd, "att", rank, "rid") is None
    assert markers_seen(rd, "att", 3) == 2
    assert write_marker(rd, "att", 1, "rid") is None
    assert markers_seen(rd, "att", 3) == 3
    assert markers_problem([3, 3, 3], ["a", "b", "c"], tmp_path) is None
    problem = str(markers_problem([3, 1, 3], ["a", "b", "c"], tmp_path))
    assert "rank 1 (b) sees 1 of 3" in problem and "not node-local" in problem


def test_the_controller_decides_every_alarm_of_a_job_id_used_twice(tmp_path: Path) -> None:
    """A reset slurmctld hands out job 100 again: its new alarm is not skipped as journaled."""
    from test_controller_unit import FakeSlurm, make_alarm

    from slurm_guard.controller.engine import Engine
    from slurm_guard.controller.policy import Policy
    from slurm_guard.controller.state import StateStore
    from slurm_guard.rundir.records import make_alarm_id, new_attempt_id

    slurm = FakeSlurm()
    slurm.add_job("100", ("node1", "node2", "node3"))
    store = StateStore(tmp_path / "state")
    engine = Engine(slurm, store, Policy())  # type: ignore[arg-type]
    decided = []
    for run in ("first", "second"):  # two jobs numbered 100, same restart count and step
        alarm_id = make_alarm_id("100", 0, new_attempt_id(), 340, "replay")
        RunDir(tmp_path / run).write_alarm(make_alarm(alarm_id=alarm_id))
        report = engine.process_job("100", tmp_path / run)
        assert alarm_id in report.decisions, report.decisions
        decided.append(alarm_id)
    assert set(store.read().alarms) == set(decided)
