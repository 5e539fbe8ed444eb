"""The controller's Prometheus textfile: parsed back with prometheus_client's own parser, and
every number checked against what the controller did in a scenario (the journal, the fake
Slurm's calls) rather than against the code that computed it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families
from test_controller_unit import ALLOC, FakeSlurm, engine, make_alarm, write_alarm

from slurm_guard.controller.engine import Engine
from slurm_guard.controller.metrics import render, update_metrics, write_metrics
from slurm_guard.controller.policy import Policy, PolicyError
from slurm_guard.controller.state import StateStore
from slurm_guard.controller.watch import scan_once
from slurm_guard.diagnose.evidence import CaseResult, Diagnosis, record_diagnosis


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the file, keyed by name and sorted labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(values: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in values.items() if n == name)


def diagnosis(node: str, passed: bool) -> Diagnosis:
    case = CaseResult(
        case="fp32-n8-s0",
        device_index=0,
        precision="fp32",
        size=8,
        seed=0,
        digest="0" * 64,
        repeats=2,
        mismatches=0 if passed else 1,
        first_mismatch=None if passed else {"repeat": 1},
        checksum_ok=True,
        checksum_excess=0.1,
    )
    return Diagnosis(node, "h", {"kind": "cpu"}, "k", (case,), (), (), 1.0, 2.0)


def scenario(
    tmp_path: Path, metrics_file: str | None = None
) -> tuple[FakeSlurm, StateStore, Policy]:
    """Four jobs through the watcher: an sdc drain, an sdc stopped by the circuit breaker and
    then approved, a numerical alarm, an ambiguous hold; one unreadable alarm file; a node
    returned by an admin; two diagnoses."""
    slurm = FakeSlurm(nodes=5)
    store = StateStore(tmp_path / "state")
    policy = Policy(max_drains=1, window_s=3600, metrics_file=metrics_file)
    runs = tmp_path / "runs"
    jobs = {
        "101": make_alarm("101", "a-sdc", nodes=("node2",)),
        "102": make_alarm("102", "a-breaker", nodes=("node3",), check="vote"),
        "103": make_alarm("103", "a-num", verdict="numerical", check="finite_local"),
        "104": make_alarm("104", "a-amb", verdict="ambiguous", nodes=("node1", "node2")),
    }
    for job_id, alarm in jobs.items():
        slurm.add_job(job_id, ALLOC, user_id=os.getuid())
        write_alarm(runs / f"run{job_id}", alarm)
    (runs / "run101" / "alarms" / "junk.json").write_bytes(b"{not json")
    eng = engine(slurm, store, policy)
    for job_id in jobs:  # in order, so that the breaker sees job 101's drain first
        eng.process_job(job_id, runs / f"run{job_id}")
    assert scan_once(eng, runs) == []  # nothing left undecided
    eng.approve("a-breaker", "replay evidence is clear", "admin")
    record_diagnosis(store.root, diagnosis("node2", True))
    record_diagnosis(store.root, diagnosis("node3", False))
    eng.return_node("node2", "dcgmi diag passed", "admin")
    return slurm, store, policy


def test_metrics_match_the_controller_state_after_a_scenario(tmp_path: Path) -> None:
    """The controller itself writes the file (policy.json's metrics_file) after every pass."""
    path = tmp_path / "textfile" / "slurm_guard.prom"
    slurm, store, _policy = scenario(tmp_path, str(path))
    values = samples(path.read_text())

    # alarms by verdict, check and decision: exactly the four the controller decided
    alarms = {
        dict(labels)["verdict"] + "/" + dict(labels)["check"] + "/" + dict(labels)["outcome"]: v
        for (name, labels), v in values.items()
        if name == "slurm_guard_alarms_total"
    }
    assert alarms == {
        "sdc/replay/act": 1,
        "sdc/vote/await_approval": 1,
        "numerical/finite_local/no_action": 1,
        "ambiguous/replay/hold": 1,
    }
    # drains and requeues as the fake Slurm saw them
    assert total(values, "slurm_guard_drains_total") == slurm.count("drain") == 2
    assert values[("slurm_guard_drains_total", (("trigger", "auto"),))] == 1
    assert values[("slurm_guard_drains_total", (("trigger", "approved"),))] == 1
    assert total(values, "slurm_guard_requeues_total") == slurm.count("requeue_hold") == 3
    assert values[("slurm_guard_admin_actions_total", (("op", "approve"),))] == 1
    assert values[("slurm_guard_admin_actions_total", (("op", "return"),))] == 1
    assert values[("slurm_guard_rejected_files_total", ())] == 1
    # the ambiguous hold still waits; the breaker alarm was approved
    assert values[("slurm_guard_pending_approvals", ())] == 1
    assert values[("slurm_guard_pending_jobs", ())] == len(store.pending()) == 0
    # one automatic drain in the window, limit 1: the breaker is open
    assert values[("slurm_guard_circuit_breaker_drains", ())] == 1
    assert values[("slurm_guard_circuit_breaker_limit", ())] == 1
    assert values[("slurm_guard_circuit_breaker_open", ())] == 1
    # node2 returned, node3 drained (approved): one node out, by our reason
    ours = [n for n in slurm.nodes() if n.reason and n.reason.startswith("slurm-guard:")]
    assert [n.name for n in ours] == ["node3"]
    assert values[("slurm_guard_nodes_out", (("state", "drain"),))] == 1
    assert values[("slurm_guard_nodes_out", (("state", "fail"),))] == 0
    assert values[("slurm_guard_slurm_up", ())] == 1
    assert values[("slurm_guard_node_diagnosis_passed", (("node", "node2"),))] == 1
    assert values[("slurm_guard_node_diagnosis_passed", (("node", "node3"),))] == 0
    assert values[("slurm_guard_last_pass_timestamp_seconds", ())] > 1.7e9


def test_the_breaker_closes_when_the_window_has_passed(tmp_path: Path) -> None:
    _slurm, store, policy = scenario(tmp_path)
    later = render(store, max_drains=1, window_s=policy.window_s, nodes=None, now=4e9)
    values = samples(later)
    assert values[("slurm_guard_circuit_breaker_drains", ())] == 0
    assert values[("slurm_guard_circuit_breaker_open", ())] == 0
    assert values[("slurm_guard_last_pass_timestamp_seconds", ())] == 4e9


def test_slurm_down_still_writes_the_file(tmp_path: Path) -> None:
    slurm, store, _policy = scenario(tmp_path)
    slurm.unavailable = True
    path = tmp_path / "m.prom"
    assert update_metrics(path, store, max_drains=3, window_s=60, list_nodes=slurm.nodes)
    values = samples(path.read_text())
    assert values[("slurm_guard_slurm_up", ())] == 0
    assert not any(name == "slurm_guard_nodes_out" for name, _ in values)
    assert values[("slurm_guard_drains_total", (("trigger", "auto"),))] == 1


def test_an_empty_state_dir_gives_zeroes_and_the_write_is_atomic(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    path = tmp_path / "m.prom"
    path.write_text("old content\n")
    write_metrics(path, store, max_drains=3, window_s=60, nodes=[])
    values = samples(path.read_text())
    assert values[("slurm_guard_pending_approvals", ())] == 0
    assert values[("slurm_guard_circuit_breaker_open", ())] == 0
    assert total(values, "slurm_guard_alarms_total") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.prom"]  # no temp file left


def test_an_unwritable_path_is_reported_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = StateStore(tmp_path / "state")
    assert not update_metrics(blocker / "m.prom", store, max_drains=3, window_s=60)
    assert not update_metrics(None, store, max_drains=3, window_s=60)


def test_a_relative_metrics_file_is_in_the_state_dir_and_a_dry_run_writes_none(
    tmp_path: Path,
) -> None:
    slurm = FakeSlurm()
    store = StateStore(tmp_path / "state")
    store.ensure()
    run = tmp_path / "runs" / "r1"
    write_alarm(run, make_alarm("100"))
    slurm.add_job("100", ALLOC, user_id=os.getuid())
    policy = Policy(metrics_file="metrics/slurm_guard.prom")
    scan_once(Engine(slurm, store, policy, dry_run=True), run.parent)
    assert not (store.root / "metrics").exists()
    scan_once(engine(slurm, store, policy), run.parent)
    values = samples((store.root / "metrics" / "slurm_guard.prom").read_text())
    assert values[("slurm_guard_drains_total", (("trigger", "auto"),))] == 1
    with pytest.raises(PolicyError, match=r"\.prom"):
        Policy(metrics_file="/var/lib/node_exporter/slurm_guard.txt")


@pytest.mark.slurm
def test_on_the_cluster_the_controller_pass_writes_matching_metrics(
    idle_slurm_cluster: Any, tmp_path: Path
) -> None:
    """A real 3-node job ends with the guard's exit code and an alarm naming node2; one
    `slurm-guard controller` pass drains node2 and requeues the job, and the textfile it writes
    says so, with the nodes out read back from the real slurmctld."""
    from test_controller_slurm import finished_job_with_alarm

    from slurm_guard.cli import main
    from slurm_guard.slurm.client import CommandSlurmClient

    client = CommandSlurmClient(env=idle_slurm_cluster.env())
    state = tmp_path / "state"
    state.mkdir()
    Policy(metrics_file="slurm_guard.prom").save(state)
    job_id, run = finished_job_with_alarm(client, tmp_path)
    result = CliRunner().invoke(
        main,
        ["controller", "--runs-root", str(run.parent), "--state-dir", str(state)],
        obj={"slurm_client": client},
    )
    assert result.exit_code == 0, result.output
    assert client.node("node2").drained
    values = samples((state / "slurm_guard.prom").read_text())
    key = (("check", "replay"), ("outcome", "act"), ("verdict", "sdc"))
    assert values[("slurm_guard_alarms_total", key)] == 1
    assert values[("slurm_guard_drains_total", (("trigger", "auto"),))] == 1
    assert values[("slurm_guard_requeues_total", (("trigger", "auto"),))] == 1
    assert values[("slurm_guard_nodes_out", (("state", "drain"),))] == 1
    assert values[("slurm_guard_slurm_up", ())] == 1
    assert values[("slurm_guard_pending_approvals", ())] == 0
    del job_id  # the fixture cancels the requeued job and resumes node2
