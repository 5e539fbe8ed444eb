"""Hostile input: the run-directory readers and the controller's intake on arbitrary files.

A user's job writes the run directory; the controller (root / SlurmUser) and `resume()` read it.
Documented error types: `RecordError` for alarms and checkpoint metadata (`read_json_file`,
`parse_alarm`, `read_alarm`, `parse_checkpoint_meta`); none at all for `read_ledger` (bad lines
are skipped), `RunDir.checkpoints()` (bad metadata skipped), `read_alarm_files` (bad files are
returned as `BadAlarmFile`) and `Engine.process_job` (never raises for bad input).

The "found by fuzzing" section keeps the inputs that once crashed a reader (deep nesting, huge
integers, infinite steps) as regression tests.

The slurm-marked tests add what `tests/test_controller_slurm.py` does not already check: that a
rejected alarm is logged and journaled, and that nothing at all happens (no plan, no intent),
for an alarm file of another user naming someone else's job and for a node outside the job.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_guard.controller.engine import Engine
from slurm_guard.controller.intake import (
    find_run_dir,
    read_alarm_files,
    run_dir_from_comment,
    run_dir_job_ids,
)
from slurm_guard.controller.policy import Policy
from slurm_guard.controller.state import StateStore
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import (
    RecordError,
    parse_alarm,
    read_alarm,
    read_json_file,
    read_ledger,
)
from slurm_guard.rundir.trust import parse_checkpoint_meta

FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _expect(fn: Any, *args: Any, allowed: tuple[type[BaseException], ...] = ()) -> Any:
    try:
        return fn(*args)
    except allowed:
        return None


# A JSON document close to a real alarm/meta, with hostile values swapped in.
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
)
json_values = st.recursive(
    json_scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
    max_leaves=12,
)
ALARM = {
    "alarm_id": "a1",
    "job_id": "12",
    "restart_count": 0,
    "step": 340,
    "check": "replay",
    "verdict": "sdc",
    "suspect_ranks": [1],
    "suspect_nodes": ["node2"],
    "suspect_hosts": ["localhost"],
    "last_verified_step": 330,
    "trusted_checkpoint": None,
    "update_applied": False,
    "evidence": {},
    "message": "m",
    "world_size": 3,
    "created": 1.0,
    "schema": 1,
}
META = {
    "schema": 1,
    "step": 10,
    "weight_fingerprint": "ab",
    "clean_vote": True,
    "files": {"model.pt": "00"},
    "world_size": 3,
    "restart_count": 0,
    "created": 1.0,
    "layout": "FSDP2 3",  # a sharded checkpoint's mesh
    "coordinates": [[0, 0, 0], [0, 1, 0], [0, 2, 0]],
}


def mutated(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda key, value, drop: {k: v for k, v in {**base, key: value}.items() if k != drop},
        st.sampled_from([*sorted(base), "extra"]),
        json_values,
        st.sampled_from([None, *sorted(base)]),
    )


def _dump(obj: Any) -> bytes:
    return json.dumps(obj).encode()  # allows NaN/Infinity, as Python's json.loads does


# --------------------------------------------------------------------------- alarm reader


@FUZZ
@given(data=st.binary(max_size=2000))
def test_alarm_reader_on_arbitrary_bytes(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "a.json"
    path.write_bytes(data)
    _expect(read_alarm, path, allowed=(RecordError,))
    _expect(read_json_file, path, allowed=(RecordError,))


@FUZZ
@given(obj=mutated(ALARM))
def test_alarm_reader_on_almost_valid_alarms(tmp_path: Path, obj: dict[str, Any]) -> None:
    path = tmp_path / "a.json"
    path.write_bytes(_dump(obj))
    alarm = _expect(read_alarm, path, allowed=(RecordError,))
    if alarm is not None:  # what parses must be usable as the controller uses it
        assert "/" not in alarm.alarm_id and all(isinstance(n, str) for n in alarm.suspect_nodes)
        json.dumps(alarm.to_json())
    _expect(parse_alarm, obj, allowed=(RecordError,))


# --------------------------------------------------------------------------- ledger reader


@FUZZ
@given(
    lines=st.lists(
        st.binary(max_size=200)
        | mutated({"step": 1, "check": "replay", "passed": True, "detail": {}}).map(_dump),
        max_size=8,
    )
)
def test_ledger_reader_never_raises(tmp_path: Path, lines: list[bytes]) -> None:
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(b"\n".join(lines))
    entries = _expect(read_ledger, path)
    for e in entries or []:
        assert isinstance(e.step, int) and isinstance(e.passed, bool)


# --------------------------------------------------------------------------- checkpoint metadata


@FUZZ
@given(obj=mutated(META) | json_values)
def test_checkpoint_meta_parser(obj: Any) -> None:
    meta = _expect(parse_checkpoint_meta, obj, "meta", allowed=(RecordError,))
    if meta is not None:
        assert all("/" not in name for name in meta.files)


@FUZZ
@given(data=st.binary(max_size=500) | mutated(META).map(_dump))
def test_checkpoint_listing_skips_bad_metadata(tmp_path: Path, data: bytes) -> None:
    rd = RunDir(tmp_path / "run")
    d = rd.checkpoint_path(5)
    d.mkdir(parents=True, exist_ok=True)
    (d / "meta.json").write_bytes(data)
    _expect(rd.checkpoints)


# --------------------------------------------------------------------------- controller intake


@FUZZ
@given(data=st.binary(max_size=1000) | mutated(ALARM).map(_dump), name=st.sampled_from(["a1", "x"]))
def test_intake_returns_bad_files_instead_of_raising(
    tmp_path: Path, data: bytes, name: str
) -> None:
    run = tmp_path / "run"
    (run / "alarms").mkdir(parents=True, exist_ok=True)
    for old in (run / "alarms").iterdir():
        old.unlink()
    (run / "alarms" / f"{name}.json").write_bytes(data)
    (run / "run.json").write_bytes(data)
    result = _expect(read_alarm_files, run)
    if result is not None:
        good, bad = result
        assert len(good) + len(bad) == 1
    _expect(run_dir_job_ids, run)
    _expect(find_run_dir, "12", None, tmp_path)


@FUZZ
@given(comment=st.none() | st.text(max_size=200))
def test_job_comment_never_names_a_relative_or_dotdot_dir(comment: str | None) -> None:
    path = run_dir_from_comment(comment)
    if path is not None:
        assert path.is_absolute() and ".." not in path.parts


def test_special_files_in_alarms_are_rejected_not_followed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    alarms = run / "alarms"
    alarms.mkdir(parents=True)
    os.mkfifo(alarms / "fifo.json")  # opening a FIFO would block the controller forever
    (alarms / "dir.json").mkdir()
    (alarms / "link.json").symlink_to("/etc/shadow")
    good, bad = read_alarm_files(run)
    assert good == [] and len(bad) == 3


def test_engine_with_garbage_alarms_decides_nothing_and_does_not_raise(tmp_path: Path) -> None:
    from test_controller_unit import FakeSlurm

    slurm = FakeSlurm()
    slurm.add_job("12", ("node1", "node2", "node3"))
    run = tmp_path / "run"
    (run / "alarms").mkdir(parents=True)
    payloads = [b"", b"\xff\xfe", b"[]", b"{}", _dump({**ALARM, "schema": 99}), b"null"]
    for i, data in enumerate(payloads):
        (run / "alarms" / f"bad{i}.json").write_bytes(data)
    store = StateStore(tmp_path / "state")
    report = Engine(slurm, store, Policy()).process_job("12", run)  # type: ignore[arg-type]
    assert report.decisions == {} and len(report.problems) == len(payloads)
    assert slurm.calls == []
    journal = store.read()
    assert journal.plans == {} and len(journal.bad_files) == len(payloads)


# --------------------------------------------------------------------------- found by fuzzing


def test_deeply_nested_alarm_is_a_record_error(tmp_path: Path) -> None:
    path = tmp_path / "a1.json"
    path.write_bytes(b"[" * 100_000)
    with pytest.raises(RecordError):
        read_alarm(path)


def test_deeply_nested_alarm_does_not_crash_the_intake(tmp_path: Path) -> None:
    (tmp_path / "alarms").mkdir()
    (tmp_path / "alarms" / "a1.json").write_bytes(b"[" * 100_000)
    good, bad = read_alarm_files(tmp_path)
    assert not good and len(bad) == 1


def test_huge_integer_alarm_is_a_record_error(tmp_path: Path) -> None:
    path = tmp_path / "a1.json"
    path.write_bytes(b"1" * 5000)
    with pytest.raises(RecordError):
        read_alarm(path)


@pytest.mark.parametrize(
    "line",
    [b'{"step": Infinity, "check": "replay", "passed": true}', b"[" * 100_000],
    ids=["infinite-step", "deep-nesting"],
)
def test_ledger_line_with_infinite_step_or_deep_nesting_is_skipped(
    tmp_path: Path, line: bytes
) -> None:
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(b'{"step": 1, "check": "replay", "passed": true}\n' + line + b"\n")
    assert [e.step for e in read_ledger(path)] == [1]


def test_checkpoint_meta_with_infinite_step_is_skipped(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    rd.checkpoint_path(5).mkdir(parents=True)
    (rd.checkpoint_path(5) / "meta.json").write_bytes(_dump({**META, "step": math.inf}))
    assert rd.checkpoints() == []


# ---------------------------------------------------------------- special files, odd fields

_BOUNDED = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # the old reader ate 3 GB in 3 s
from pathlib import Path
from slurm_guard.rundir.records import LedgerEntry, append_ledger, read_ledger
path = Path(sys.argv[1])
entries = read_ledger(path)
try:
    append_ledger(path, LedgerEntry(1, "replay", True, {}, 0))
    appended = "appended"
except OSError as exc:
    appended = f"refused: {exc}"
print(len(entries), appended)
"""


@pytest.mark.parametrize("kind", ["symlink-to-dev-zero", "fifo"])
def test_a_ledger_that_is_not_a_regular_file_is_refused_without_hanging(
    tmp_path: Path, kind: str
) -> None:
    """Before: /dev/zero ate memory until MemoryError; a FIFO blocked the reader forever."""
    import subprocess
    import sys

    path = tmp_path / "ledger.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    try:
        out = subprocess.run(
            [sys.executable, "-c", _BOUNDED, str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading a {kind} ledger hangs")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("0 refused"), out.stdout
    assert "ignoring ledger" in out.stderr or out.stderr == "", out.stderr[-500:]


def test_a_huge_ledger_is_read_from_its_tail_only(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    line = json.dumps({"step": 1, "check": "replay", "passed": True}) + "\n"
    path.write_text(line * 1000 + json.dumps({"step": 2, "check": "vote", "passed": True}) + "\n")
    got = read_ledger(path, max_bytes=10 * len(line))
    assert 1 <= len(got) <= 10 and got[-1].step == 2


@pytest.mark.parametrize(
    "run",
    [
        {"config": [1, 2], "started": "yesterday", "job_id": 5, "restart_count": "x"},
        {"config": {"faults": [{"deep": [1]}], "x": {"y": 1}}, "started": 1e400},
        [1, 2],
        "just a string",
    ],
)
def test_odd_run_json_fields_give_no_traceback(tmp_path: Path, run: Any) -> None:
    rd = RunDir(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps(run))
    info = rd.run_info()
    if "error" not in info:
        assert isinstance(info["config"], dict)
        assert info["started"] is None or isinstance(info["started"], float)
        assert info["job_id"] is None or isinstance(info["job_id"], str)
        json.dumps(info)


@FUZZ
@given(obj=mutated({"alarm_id": "a1", "resumed_from_step": 5, "quarantined": [], "time": 1.0}))
def test_odd_handled_records_give_no_traceback(tmp_path: Path, obj: dict[str, Any]) -> None:
    rd = RunDir(tmp_path / "run")
    rd.handled_dir.mkdir(parents=True, exist_ok=True)
    (rd.handled_dir / "a1.json").write_bytes(_dump(obj))
    (rd.handled_dir / "a2.json").write_text(json.dumps({"time": "yesterday", "quarantined": 7}))
    for r in rd.resumes():
        assert r["time"] is None or isinstance(r["time"], float)
        assert all(isinstance(q, str) for q in r["quarantined"])
        json.dumps(r)


# --------------------------------------------------------------------------- real cluster


@pytest.mark.slurm
def test_foreign_users_alarm_naming_another_users_job_is_rejected_logged_and_inert(
    idle_slurm_cluster: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """User B (uid 65534) writes, in a run dir found under the runs root, an alarm naming A's
    job (root's) and A's node: rejected by owner, logged, journaled, no plan and no action.
    A second alarm of A's own, naming a node outside A's allocation: the same."""
    from test_controller_slurm import alarm, reasons, submit, wait_finished

    from slurm_guard.slurm.client import CommandSlurmClient

    client = CommandSlurmClient(env=idle_slurm_cluster.env())
    job_id, own_run = submit(client, tmp_path)
    wait_finished(client, job_id)
    info = client.job(job_id)
    assert info is not None
    outside = sorted(set(idle_slurm_cluster.node_names) - set(info.nodes))[0]
    foreign_run = tmp_path / "runs" / "userB"
    RunDir(foreign_run).ensure()
    RunDir(foreign_run).write_alarm(alarm(job_id, node=sorted(info.nodes)[0], alarm_id="b1"))
    os.chown(RunDir(foreign_run).alarm_path("b1"), 65534, 65534)
    RunDir(own_run).write_alarm(alarm(job_id, node=outside, alarm_id="a-outside"))

    store = StateStore(tmp_path / "state")
    engine = Engine(client, store, Policy())
    with caplog.at_level(logging.WARNING, logger="slurm_guard.controller.engine"):
        found, how = find_run_dir(job_id, None, tmp_path / "runs")  # the watcher's fallback
        assert found == foreign_run, how
        r1 = engine.process_job(job_id, foreign_run)
        r2 = engine.process_job(job_id, own_run)
    assert r1.decisions["b1"][0] == "rejected" and "owned by uid 65534" in r1.decisions["b1"][1]
    assert r2.decisions["a-outside"][0] == "rejected"
    assert f"{outside} not in job" in r2.decisions["a-outside"][1]
    logged = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "b1: rejected" in logged and "a-outside: rejected" in logged
    journal = store.read()
    assert {a: e["outcome"] for a, e in journal.alarms.items()} == {
        "b1": "rejected",
        "a-outside": "rejected",
    }
    assert journal.plans == {} and journal.intents == set()
    info = client.job(job_id)
    assert info is not None and info.restart_count == 0 and not info.held
    assert not any((r or "").startswith("slurm-guard:") for r in reasons(client).values())
    # a rerun decides nothing again
    assert engine.process_job(job_id, foreign_run).decisions == {}
