"""`slurm-guard review` without Slurm, with Slurm 24.11's leftover reasons, and hostile alarms.

The controller state comes from the real engine acting on a real alarm file, against
`DryRunSlurm` holding the cluster's facts (no cluster needed); review then runs through the CLI
with a Slurm client that cannot reach anything (SLURM_CONF pointing nowhere), or with
DryRunSlurm showing node states as Slurm 22.05 and 24.11 print them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from slurm_guard.cli import main
from slurm_guard.controller.engine import Engine
from slurm_guard.controller.policy import Policy, foreign_node
from slurm_guard.controller.state import StateStore
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import Alarm
from slurm_guard.slurm.dry_run import DryRunSlurm
from slurm_guard.slurm.parsers import JobInfo, NodeInfo

JOB = "100"
NODES = ("node1", "node2", "node3")
NO_SLURM = {"SLURM_CONF": "/nonexistent/slurm.conf"}


def alarm(message: str = "replay mismatch", **kw: Any) -> Alarm:
    values: dict[str, Any] = dict(
        alarm_id=f"job{JOB}-r0-step340-replay",
        job_id=JOB,
        restart_count=0,
        step=340,
        check="replay",
        verdict="sdc",
        suspect_ranks=(1,),
        suspect_nodes=("node2",),
        suspect_hosts=("localhost",),
        last_verified_step=330,
        trusted_checkpoint=None,
        update_applied=False,
        evidence={"loss": [1.0, 1.5]},
        message=message,
        world_size=3,
        created=time.time(),
    )
    values.update(kw)
    return Alarm(**values)


def node(name: str, states: set[str], reason: str | None = None) -> NodeInfo:
    return NodeInfo(name, frozenset(states), reason, "root" if reason else None, "127.0.0.1", "h")


def cluster(nodes: list[NodeInfo] | None = None) -> DryRunSlurm:
    job = JobInfo(
        job_id=JOB,
        state="FAILED",
        reason="NonZeroExitCode",
        nodes=NODES,
        user="u",
        user_id=os.getuid(),
        restart_count=0,
        exit_code=86,
        exit_signal=0,
        excluded_nodes=(),
        work_dir="/tmp",
        name="train",
        requeue=True,
        held=False,
    )
    return DryRunSlurm(None, jobs=[job], nodes=nodes or [node(n, {"IDLE"}) for n in NODES])


@pytest.fixture
def handled(tmp_path: Path) -> tuple[StateStore, DryRunSlurm, Path]:
    """A state dir in which the real engine drained node2 for a real alarm file."""
    run_dir = tmp_path / "run"
    RunDir(run_dir).ensure()
    RunDir(run_dir).write_alarm(alarm())
    store, slurm = StateStore(tmp_path / "state"), cluster()
    report = Engine(slurm, store, Policy()).process_job(JOB, run_dir, allocation=NODES)
    assert report.decisions and slurm.node("node2").drained, report.lines()
    return store, slurm, run_dir


def review(*args: str, client: Any = None) -> Result:
    obj = {"slurm_client": client} if client is not None else None
    return CliRunner().invoke(main, ["review", *args], obj=obj, env=NO_SLURM)


def test_review_without_slurm_shows_what_the_journal_holds(
    handled: tuple[StateStore, DryRunSlurm, Path],
) -> None:
    store, _, _ = handled
    text = review("--state-dir", str(store.root))
    assert text.exit_code == 0, text.output
    first = text.output.splitlines()[0]
    assert first.startswith("Slurm is unreachable") and "Slurm refused" not in text.output
    assert "node2" in text.output and "journal: drained" in text.output
    assert "scontrol: error" not in text.output  # no raw stderr
    view = json.loads(review("--state-dir", str(store.root), "--json").output)
    assert view["slurm"]["reachable"] is False
    assert [n["node"] for n in view["nodes"]] == ["node2"]
    assert view["nodes"][0]["jobs"] == [JOB]


def test_review_without_slurm_forgets_a_returned_node(
    handled: tuple[StateStore, DryRunSlurm, Path],
) -> None:
    store, slurm, _ = handled
    Engine(slurm, store, Policy()).return_node("node2", "diag passed", "admin")
    view = json.loads(review("--state-dir", str(store.root), "--json").output)
    assert view["nodes"] == []


def test_review_json_errors_are_json(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "journal.jsonl").mkdir(parents=True)  # unreadable as a journal
    result = review("--state-dir", str(state), "--json")
    assert result.exit_code == 1, result.output
    assert "journal.jsonl" in json.loads(result.output)["error"]
    plain = review("--state-dir", str(state))
    assert plain.exit_code == 1 and "Traceback" not in plain.output


def test_review_subcommand_takes_state_dir_after_it(
    handled: tuple[StateStore, DryRunSlurm, Path],
) -> None:
    store, slurm, _ = handled
    result = review(
        "return", "node2", "--reason", "diag ok", "--state-dir", str(store.root), client=slurm
    )
    assert result.exit_code == 0, result.output
    assert not slurm.node("node2").drained


# ---------------------------------------------------------------------- Slurm 24.11 reasons


def test_a_resumed_node_with_a_leftover_reason_is_not_listed(
    handled: tuple[StateStore, DryRunSlurm, Path],
) -> None:
    store, _, _ = handled
    reason = f"slurm-guard: job {JOB} step 340 check replay alarm job{JOB}-r0-step340-replay"
    # 24.11 after `scontrol update State=RESUME`: IDLE, reason still printed.
    resumed = cluster([node("node1", {"IDLE"}), node("node2", {"IDLE"}, reason)])
    view = json.loads(review("--state-dir", str(store.root), "--json", client=resumed).output)
    assert view["nodes"] == []
    drained = cluster([node("node1", {"IDLE"}), node("node2", {"IDLE", "DRAIN"}, reason)])
    view = json.loads(review("--state-dir", str(store.root), "--json", client=drained).output)
    assert [n["node"] for n in view["nodes"]] == ["node2"]


def test_foreign_node_only_while_the_reason_is_in_force() -> None:
    maintenance = "PSU swap 2026-10-01"
    assert not foreign_node(node("n", {"IDLE"}, maintenance))  # 24.11 leftover after RESUME
    assert foreign_node(node("n", {"IDLE", "DRAIN"}, maintenance))
    assert foreign_node(node("n", {"DOWN", "NOT_RESPONDING"}, "Not responding"))
    assert not foreign_node(node("n", {"MIXED", "DRAIN"}, "slurm-guard: job 1"))
    assert not foreign_node(node("n", {"IDLE"}))


def test_the_controller_drains_a_node_whose_old_reason_outlived_its_resume(
    tmp_path: Path,
) -> None:
    """On 24.11 a node an admin once drained and resumed keeps the admin's reason. An alarm
    naming it must still drain it (22.05 does), not leave it in service for other jobs."""
    run_dir = tmp_path / "run"
    RunDir(run_dir).ensure()
    RunDir(run_dir).write_alarm(alarm())
    old = node("node2", {"IDLE"}, "maintenance: PSU swap")
    slurm = cluster([node("node1", {"IDLE"}), old, node("node3", {"IDLE"})])
    report = Engine(slurm, StateStore(tmp_path / "state"), Policy()).process_job(
        JOB, run_dir, allocation=NODES
    )
    assert slurm.node("node2").drained, report.lines()
    assert not any("left untouched" in line for line in report.lines())
    # The same node while the admin's drain is in force is left alone.
    slurm = cluster(
        [node("node1", {"IDLE"}), dataclasses.replace(old, states=frozenset({"IDLE", "DRAIN"}))]
    )
    report = Engine(slurm, StateStore(tmp_path / "state2"), Policy()).process_job(
        JOB, run_dir, allocation=NODES
    )
    assert slurm.node("node2").reason == "maintenance: PSU swap", report.lines()


# ---------------------------------------------------------------------- hostile content


def test_control_characters_in_alarms_never_reach_the_terminal(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    RunDir(run_dir).ensure()
    hostile = alarm(
        "\x1b[2J\x1b[31mcleared\nFAKE LINE: all clear",
        evidence={"note": "\x1b]0;pwned\x07\r\nFAKE LINE: evidence"},
    )
    RunDir(run_dir).write_alarm(hostile)
    store, slurm = StateStore(tmp_path / "state"), cluster()
    Engine(slurm, store, Policy()).process_job(JOB, run_dir, allocation=NODES)
    for result in (
        review("--state-dir", str(store.root), client=slurm),
        review("--state-dir", str(store.root)),  # offline: from the journal
        CliRunner().invoke(
            main, ["status", str(run_dir), "--state-dir", str(store.root)], env=NO_SLURM
        ),
    ):
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.output and "\x07" not in result.output
        assert "\r" not in result.output
        lines = result.output.splitlines()
        assert not any(line.lstrip().startswith("FAKE LINE") for line in lines), result.output


def test_status_without_run_json_takes_the_job_from_the_alarm(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    RunDir(run_dir).ensure()
    RunDir(run_dir).write_alarm(alarm())
    result = CliRunner().invoke(
        main,
        ["status", str(run_dir), "--state-dir", str(tmp_path / "s"), "--json"],
        obj={"slurm_client": cluster()},
    )
    assert result.exit_code == 0, result.output
    view = json.loads(result.output)
    assert view["job_id"] == JOB and view["job"]["state"] == "FAILED"
    assert "no such file" in view["run"]["error"]
    text = CliRunner().invoke(
        main, ["status", str(run_dir), "--state-dir", str(tmp_path / "s")], env=NO_SLURM
    )
    assert "latest checkpoint:   none" in text.output, text.output


def test_status_says_a_restart_would_stop_on_an_unreadable_alarm(tmp_path: Path) -> None:
    """The guard refuses to resume past an alarm it cannot read (fail closed); status must not
    name a trusted checkpoint the guard would never load."""
    run_dir = tmp_path / "run"
    RunDir(run_dir).ensure()
    path = RunDir(run_dir).write_alarm(alarm())
    obj = json.loads(path.read_text())
    path.unlink()
    path.write_text(json.dumps({**obj, "schema": 99}))
    result = CliRunner().invoke(
        main, ["status", str(run_dir), "--state-dir", str(tmp_path / "s"), "--json"], env=NO_SLURM
    )
    assert result.exit_code == 0, result.output
    view = json.loads(result.output)
    assert view["trusted_checkpoint"] is None
    assert "cannot be used" in view["resume_blocked"]


def test_return_refuses_a_node_already_in_service_whatever_its_leftover_reason(
    tmp_path: Path,
) -> None:
    from slurm_guard.controller.report import EngineError

    reason = f"slurm-guard: job {JOB} step 340 check replay alarm a1"
    slurm = cluster([node("node2", {"IDLE"}, reason)])  # 24.11, after an earlier return
    engine = Engine(slurm, StateStore(tmp_path / "state"), Policy())
    with pytest.raises(EngineError, match="in service"):
        engine.return_node("node2", "diag ok", "admin")
    with pytest.raises(EngineError, match="in service"):
        engine.retire_node("node2", "bad", "admin")
    assert slurm.changes == []
