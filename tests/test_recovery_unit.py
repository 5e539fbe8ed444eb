"""Recoveries without Slurm (issue 42, findings 7-11): the rules, the resume record, settling.

The Slurm side of each is in test_recovery_slurm.py; these pin the pure rules and the records.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_controller_unit import ALLOC, FakeSlurm
from test_in_job_unit import ACT, alarm, decided

from slurm_guard.controller.engine import Engine
from slurm_guard.controller.loops import apply_job_rules, triage_convicts
from slurm_guard.controller.policy import Outcome, Policy
from slurm_guard.controller.state import BUDGET_RESET, IN_JOB_RESTART, Journal, StateStore
from slurm_guard.controller.status_view import in_job_restarts
from slurm_guard.rundir.records import RecordError
from slurm_guard.rundir.resumes import ResumeNote, ResumeRecord, read_resume, read_resumes

TRIAGE = {"reproduced": 3, "runs": 3, "suspect_node": "node4", "suspect": 2}


def triaged(alarm_id: str, node: str, rank: int, reproduced: int = 3) -> Any:
    a = alarm(alarm_id, node)
    evidence = {"triage": {**TRIAGE, "reproduced": reproduced, "suspect_node": node}}
    return dataclasses.replace(a, suspect_ranks=(rank,), evidence=evidence)


def test_triage_on_one_node_convicts_it_although_check_and_step_repeat() -> None:
    """Finding 7: node2 (rank 1) at step 20, then the spare node4 (rank 2) at step 20 again."""
    journal = Journal([decided(alarm("a1", "node2"))])
    spare = triaged("a2", "node4", rank=2)
    assert triage_convicts(spare) == "node4"
    assert apply_job_rules(spare, ACT, journal, "/r", Policy(), now=200.0) == ACT
    # no reproduction: the evidence names no node, the loop rule holds the job
    weak = triaged("a2", "node4", rank=2, reproduced=0)
    held = apply_job_rules(weak, ACT, journal, "/r", Policy(), now=200.0)
    assert held.outcome is Outcome.HOLD and held.hold_kind == "loop"


def test_the_same_computation_failing_on_another_node_follows_the_job_despite_triage() -> None:
    """rank 1's microbatch at step 20 fails on node2, then on node3: the job, not a node."""
    journal = Journal([decided(alarm("a1", "node2"))])
    again = triaged("a2", "node3", rank=1)
    d = apply_job_rules(again, ACT, journal, "/r", Policy(), now=200.0)
    assert d.outcome is Outcome.HOLD and d.hold_kind == "loop"


def test_budget_and_loop_rule_count_the_run_across_job_ids_until_reset() -> None:
    """Finding 11: a resubmitted job (another id, same run dir) gets no fresh budget."""
    restart = {"type": IN_JOB_RESTART, "job_id": "7", "plan_id": "p", "run_dir": "/r/"}
    first = {**decided(alarm("a1", "node2")), "job_id": "7", "run_dir": "/r/./"}
    journal = Journal([{**restart, "time": 90.0}, first])
    later = dataclasses.replace(alarm("b1", "node3"), job_id="8")
    policy = Policy(restart_budget=1)
    d = apply_job_rules(later, ACT, journal, "/r", policy, now=200.0)
    assert d.outcome is Outcome.HOLD and d.hold_kind == "loop"  # same check, step 20, new node
    later = dataclasses.replace(later, step=40)
    d = apply_job_rules(later, ACT, journal, "/r", policy, now=200.0)
    assert d.outcome is Outcome.HOLD and d.hold_kind == "budget", d
    assert apply_job_rules(later, ACT, journal, "/other", policy, now=200.0) == ACT
    reset = {"type": BUDGET_RESET, "run_dir": "/r", "time": 150.0}
    journal = Journal([*journal.entries, reset])
    assert journal.restarts_since("/r", 0.0) == 0
    assert apply_job_rules(later, ACT, journal, "/r", policy, now=200.0) == ACT


def test_a_resume_record_is_written_at_resume_and_completed_at_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_GUARD_ATTEMPT", "1")
    note = ResumeNote.resumed(tmp_path, "42", 0, "snapshot", 15, "/dev/shm/x/step-15")
    record = read_resume(tmp_path, "42", 0, 1)
    assert record is not None and (record.source, record.step) == ("snapshot", 15)
    assert record.first_step_at is None
    note.first_step()
    note.first_step()  # once
    (done,) = read_resumes(tmp_path)
    assert done.first_step_at is not None and done.attempt == 1
    assert json.loads(note.path.read_text())["schema"] == 1
    with pytest.raises(RecordError, match="schema"):
        ResumeRecord.parse({**json.loads(note.path.read_text()), "schema": 99}, "x")
    with pytest.raises(RecordError, match="source"):
        ResumeRecord.parse({**json.loads(note.path.read_text()), "source": "guess"}, "x")


def _restart(store: StateStore, run_dir: Path, job_id: str = "100") -> None:
    store.ensure()
    store.append(
        IN_JOB_RESTART,
        job_id=job_id,
        plan_id=f"job{job_id}-r0-p0",
        alarm_ids=["a1"],
        alarm_time=1.0,
        attempt=1,
        restart_count=0,
        left=["node2"],
        joined=["node4"],
        nodes=["node1", "node3", "node4"],
        train_nodes=3,
        tasks_per_node=1,
        spares=0,
        resume_source="checkpoint",
        resume_step=10,
        run_dir=str(run_dir),
    )


def test_a_restart_that_never_ran_is_completed_by_a_requeue_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 8: the supervisor died after journaling the restart; the job ended FAILED."""
    slurm, store, run_dir = FakeSlurm(), StateStore(tmp_path / "state"), tmp_path / "run"
    slurm.add_job("100", ALLOC, user_id=os.getuid(), state="RUNNING")
    _restart(store, run_dir)  # its alarm a1 decided (act) before the journal line
    Engine(slurm, store, Policy()).process_job("100", run_dir)
    assert slurm.calls == []  # the supervisor lives: its step may still start
    (row,) = in_job_restarts(store.read(), "100", run_dir)
    assert row["state"] == "pending" and row["resume_step"] is None
    slurm.jobs["100"] = dataclasses.replace(slurm.jobs["100"], state="FAILED")
    Engine(slurm, store, Policy()).process_job("100", run_dir)
    Engine(slurm, store, Policy()).retry_pending()
    ops = [c[0] for c in slurm.calls]
    assert ops == ["requeue_hold", "exclude", "release", "start"], slurm.calls
    assert slurm.jobs["100"].excluded_nodes == ("node2",)
    (row,) = in_job_restarts(store.read(), "100", run_dir)
    assert row["state"] == "failed" and row["completed_by"]


def test_a_restart_whose_first_step_ran_is_journaled_done_with_the_real_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slurm, store, run_dir = FakeSlurm(), StateStore(tmp_path / "state"), tmp_path / "run"
    slurm.add_job("100", ALLOC, user_id=os.getuid(), state="FAILED")
    _restart(store, run_dir)  # its alarm a1 decided (act) before the journal line
    monkeypatch.setenv("SLURM_GUARD_ATTEMPT", "1")
    ResumeNote.resumed(run_dir, "100", 0, "snapshot", 15, None).first_step()
    Engine(slurm, store, Policy()).process_job("100", run_dir)
    assert slurm.calls == []
    (done,) = [e for e in store.read().entries if e["type"] == "restart_done"]
    assert (done["resume_source"], done["resume_step"]) == ("snapshot", 15)
    (row,) = in_job_restarts(store.read(), "100", run_dir)
    assert (row["state"], row["resume_source"], row["resume_step"]) == ("done", "snapshot", 15)
    assert row["planned_resume_step"] == 10


def test_the_report_names_what_a_rollback_loaded(tmp_path: Path) -> None:
    """Finding 9: the report reads the guard's record, not a guess."""
    from test_report import T0, faulty_run

    from slurm_guard.report import write_report
    from slurm_guard.rundir.records import atomic_write_json
    from slurm_guard.rundir.resumes import resumes_dir

    run = faulty_run(tmp_path)
    record = ResumeRecord("77", 1, 0, "checkpoint", 10, str(run / "checkpoints"), T0 + 59.9)
    atomic_write_json(resumes_dir(run) / f"{record.name}.json", dataclasses.asdict(record))
    write_report(run, tmp_path / "report.html")
    # the words status uses too (report.timeline.resume_phrase), with what was loaded
    assert (
        "restart 1 from step 10 (checkpoint) after alarm" in (tmp_path / "report.html").read_text()
    )


def test_a_restart_keeps_the_snapshot_steps_noted_before_it(tmp_path: Path) -> None:
    """Finding 9: snapshots.json is seeded from the earlier start of the same job."""
    from slurm_guard.core.snapshots import _noted_before
    from slurm_guard.rundir.records import atomic_write_json

    index = tmp_path / "snapshots.json"
    atomic_write_json(index, {"schema": 1, "steps": [5, 10, 15], "written": 1.0, "job": "42"})
    assert _noted_before(index, "42") == [10, 15]
    assert _noted_before(index, "43") == []  # another job's nodes hold none of them
    index.write_text("[1]")
    assert _noted_before(index, "42") == []
