"""In-job recovery without Slurm: the loop rule, the budget, plans, spares in the script."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slurm_guard.controller.actions import make_plan
from slurm_guard.controller.in_job import Allocation, healthy_nodes
from slurm_guard.controller.loops import apply_job_rules, budget_reason, follows_job, past_alarms
from slurm_guard.controller.policy import Decision, Outcome, Policy, PolicyError
from slurm_guard.controller.state import ALARM, IN_JOB_RESTART, PLAN, Journal
from slurm_guard.controller.supervisor import first_nodes
from slurm_guard.rundir.records import Alarm
from slurm_guard.slurm.client import training_step_argv
from slurm_guard.slurm.launch import LaunchError, render_sbatch


def alarm(alarm_id: str, node: str, step: int = 20, verdict: str = "sdc") -> Alarm:
    return Alarm(
        alarm_id=alarm_id,
        job_id="7",
        restart_count=0,
        step=step,
        check="replay",
        verdict=verdict,
        suspect_ranks=(1,),
        suspect_nodes=(node,),
        suspect_hosts=("h",),
        last_verified_step=15,
        trusted_checkpoint="step-10",
        update_applied=False,
        evidence={},
        message="m",
        world_size=3,
    )


def decided(a: Alarm, outcome: str = "act") -> dict[str, Any]:
    return {
        "type": ALARM,
        "alarm_id": a.alarm_id,
        "job_id": "7",
        "outcome": outcome,
        "verdict": a.verdict,
        "check": a.check,
        "step": a.step,
        "suspect_nodes": list(a.suspect_nodes),
        "suspect_ranks": list(a.suspect_ranks),
        "run_dir": "/r",
        "time": 100.0,
    }


ACT = Decision(Outcome.ACT, "sdc", drain_nodes=("node3",), exclude_nodes=("node3",))


def test_same_check_at_the_same_step_on_another_node_follows_the_job() -> None:
    journal = Journal([decided(alarm("a1", "node2"))])
    d = apply_job_rules(alarm("a2", "node3"), ACT, journal, "/r", Policy(), now=200.0)
    assert d.outcome is Outcome.HOLD and d.hold_kind == "loop" and d.drain_nodes == ()
    assert d.reason == (
        "slurm-guard: 2 alarms on 2 nodes at step 20: suspect software or data, not hardware"
    )


def test_a_second_node_at_another_step_is_a_second_fault_until_loop_nodes() -> None:
    first = decided(alarm("a1", "node2", step=20))
    journal = Journal([first])
    assert apply_job_rules(alarm("a2", "node3", 30), ACT, journal, "/r", Policy(), 200.0) == ACT
    journal = Journal([first, decided(alarm("a2", "node3", step=30))])
    d = apply_job_rules(alarm("a3", "node4", 40), ACT, journal, "/r", Policy(), 200.0)
    assert d.outcome is Outcome.HOLD and "3 alarms on 3 nodes at steps 20, 30, 40" in d.reason


def test_numerical_alarms_are_not_counted_and_never_held() -> None:
    journal = Journal([decided(alarm("a1", "node2", verdict="numerical"), "no_action")])
    assert past_alarms(journal, "/r") == []
    assert follows_job(alarm("a2", "node3", verdict="numerical"), [], Policy()) is None


def test_the_budget_counts_in_job_restarts_and_requeues_in_the_window() -> None:
    plan = make_plan(
        Journal([]),
        "7",
        "/r",
        ("a0",),
        drains=[],
        exclude=("node1",),
        restart_count=0,
        hold_only=False,
        auto=True,
        now=50.0,
    )
    entries = [
        {"type": PLAN, "job_id": "7", "plan": plan.to_json(), "time": 50.0},
        {"type": IN_JOB_RESTART, "job_id": "7", "left": ["node2"], "time": 90.0, "run_dir": "/r"},
        {"type": IN_JOB_RESTART, "job_id": "7", "left": ["node3"], "time": 95.0, "run_dir": "/r"},
    ]
    journal = Journal(entries)
    assert journal.restarts_since("/r", 0.0) == 3 and journal.restarts_since("/r", 60.0) == 2
    assert journal.nodes_left_by("7") == {"node2", "node3"}
    d = apply_job_rules(alarm("a9", "node4", 99), ACT, journal, "/r", Policy(), now=100.0)
    assert d.outcome is Outcome.HOLD and d.hold_kind == "budget"
    assert d.drain_nodes == ("node3",)  # the evidence stands: the node is still drained
    assert budget_reason(2, Policy()) is None
    assert "restart budget spent" in str(budget_reason(1, Policy(restart_budget=1)))


def test_plans_in_place_drain_only_and_a_requeue_without_spares_resizes() -> None:
    kw: dict[str, Any] = dict(restart_count=0, hold_only=False, auto=True, now=1.0)
    drains = [("node2", "slurm-guard: x", "a1")]
    inplace = make_plan(
        Journal([]), "7", "/r", ("a1",), drains=drains, exclude=("node2",), in_place=True, **kw
    )
    assert [a.op for a in inplace.actions] == ["drain"]
    requeue = make_plan(
        Journal([]), "7", "/r", ("a1",), drains=drains, exclude=("node2",), shrink=(3, 6), **kw
    )
    ops = [(a.op, a.args) for a in requeue.actions]
    assert ops[2] == ("exclude_resize", ("0", "3", "6", "node2"))
    assert [op for op, _ in ops[3:]] == ["release", "start"]


def test_policy_file_keys_for_the_budget() -> None:
    p = Policy.from_json({"restart_budget": 5, "restart_window_s": 60, "in_job_restarts": False})
    assert (p.restart_budget, p.restart_window_s, p.in_job_restarts) == (5, 60.0, False)
    with pytest.raises(PolicyError, match="in_job_restarts"):
        Policy.from_json({"in_job_restarts": "no"})
    with pytest.raises(PolicyError, match="loop_nodes"):
        Policy.from_json({"loop_nodes": 1})


@dataclass
class _Node:
    out_of_service: bool = False
    responding: bool = True


class _Nodes:
    def __init__(self, down: set[str]) -> None:
        self.down = down

    def node(self, name: str) -> _Node:
        return _Node(out_of_service=name in self.down)


def test_a_spare_replaces_the_convicted_node_unless_none_is_healthy() -> None:
    view = Allocation(("node1", "node2", "node3", "node4"), ("node1", "node2", "node3"), 3, 1)
    client: Any = _Nodes(set())
    assert healthy_nodes(view, {"node2"}, set(), client) == ("node1", "node3", "node4")
    assert healthy_nodes(view, {"node2"}, set(), _Nodes({"node4"})) is None  # type: ignore[arg-type]
    assert healthy_nodes(view, {"node2"}, {"node4"}, client) is None
    assert first_nodes(["node1", "node2", "node3", "node4"], 3, {"node2"}) == (
        "node1",
        "node3",
        "node4",
    )


def test_the_step_runs_on_exactly_the_chosen_nodes() -> None:
    argv = training_step_argv(["node1", "node3"], 2, ["slurm-guard", "task", "--", "x"])
    assert argv[:6] == [
        "srun",
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--nodelist=node1,node3",
        "--kill-on-bad-exit=1",
    ]


def test_the_template_asks_for_spares_and_supervises(tmp_path: Path) -> None:
    text = render_sbatch(run_dir=tmp_path / "r", nodes=3, spares=1, train_command=["t"])
    assert "#SBATCH --nodes=4\n" in text and "TRAIN_NODES=3\n" in text and "SPARES=1\n" in text
    assert 'supervise --nodes "$TRAIN_NODES" --tasks-per-node 1' in text
    plain = render_sbatch(run_dir=tmp_path / "r", nodes=3, train_command=["t"])
    assert "#SBATCH --nodes=3\n" in plain and "SPARES=0\n" in plain
    with pytest.raises(LaunchError, match="spares need tasks per node"):
        render_sbatch(run_dir=tmp_path / "r", nodes=3, tasks=4, spares=1)


def test_prometheus_counts_in_job_restarts_and_holds_by_rule() -> None:
    from slurm_guard.controller.metrics import _counts

    held = {**decided(alarm("a2", "node3"), "hold"), "hold_kind": "loop"}
    journal = Journal(
        [
            decided(alarm("a1", "node2")),
            {"type": IN_JOB_RESTART, "job_id": "7", "left": ["node2"], "time": 1.0},
            held,
        ]
    )
    counts = _counts(journal)
    assert counts["in_job_restarts"][()] == 1 and counts["holds"][("loop",)] == 1


def test_the_timeline_gives_an_in_job_restart_a_run_of_its_own(tmp_path: Path) -> None:
    """Slurm's restart count stays 0 across a restart on a spare; the report's runs must not."""
    from slurm_guard.report.timeline import read_timeline
    from slurm_guard.rundir.layout import RunDir
    from slurm_guard.rundir.records import LedgerEntry, append_ledger

    rd = RunDir(tmp_path / "run")
    rd.ensure()
    for step, when in ((5, 10.0), (10, 20.0), (15, 30.0), (15, 60.0), (20, 70.0)):
        append_ledger(rd.ledger, LedgerEntry(step, "replay", True, {"loss": 1.0}, 0, when))
    rd.write_alarm(alarm("a1", "node2", step=20))
    rd.mark_handled(
        "a1",
        {
            "alarm_id": "a1",
            "resumed_from_step": 10,
            "restart_count": 0,
            "time": 50.0,
            "quarantined": [],
        },
    )
    t = read_timeline(rd.root)
    assert [r.restart_count for r in t.rollbacks] == [1]
    assert [(c.step, c.restart_count) for c in t.checks] == [
        (5, 0),
        (10, 0),
        (15, 0),
        (15, 1),
        (20, 1),
    ]
    assert [seg[0] for seg in t.segments()] == [0, 1]


def test_engine_with_a_spent_budget_drains_the_node_and_holds_the_job(tmp_path: Path) -> None:
    import os

    from test_controller_unit import FakeSlurm, make_alarm, write_alarm

    from slurm_guard.controller.engine import Engine
    from slurm_guard.controller.state import StateStore

    slurm = FakeSlurm()
    slurm.add_job("100", ("node1", "node2", "node3"), user_id=os.getuid())
    store = StateStore(tmp_path / "state")
    write_alarm(tmp_path / "run", make_alarm("100"))
    report = Engine(slurm, store, Policy(restart_budget=0)).process_job("100", tmp_path / "run")
    assert "restart budget spent" in report.held
    done = [e["op"] for e in store.read().entries if e["type"] == "done"]
    assert done == ["drain", "requeue_hold"]  # held: no exclude, release or start
    assert slurm.jobs["100"].held
