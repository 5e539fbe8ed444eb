"""Triage at the alarm (issue 14): the suspect repeats the failing microbatch, a rank on another
node computes it once, and the alarm says how often the wrong result came back."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from triage_workers import triage_raises
from workers import SMALL, run_scenarios

import slurm_guard as sg
from slurm_guard.checks.triage import MAX_RUNS, effective_budget, plan, repeat
from slurm_guard.checks.verdicts import Finding
from slurm_guard.comm.topology import Topology
from slurm_guard.config import ConfigError
from slurm_guard.diagnose.history import node_history
from slurm_guard.local.launch import run_local
from slurm_guard.protocol import Check, Verdict
from slurm_guard.rundir.records import RankInfo

NODES = ["node1", "node2", "node3"]
FAULTY = 1
DENSE_WEIGHT = 10  # a dense layer's weight: its gradient is never all zeros


def _topology(nodes: list[str]) -> Topology:
    return Topology.build([RankInfo(rank=r, node=n, hostname=n) for r, n in enumerate(nodes)])


def _replay_finding(suspects: tuple[int, ...], pairs: list[tuple[int, int]]) -> Finding:
    failed = [{"owner": o, "replayer": r} for o, r in pairs]
    return Finding(Check.REPLAY, Verdict.SDC, suspects, "m", {"failed": failed})


# ---------------------------------------------------------------- the plan (pure)


def test_plan_repeats_the_suspects_own_microbatch_when_its_own_result_failed() -> None:
    topo = _topology(NODES)  # ring: 0 -> 1 -> 2 -> 0
    assert topo.replayer == (1, 2, 0)
    # a persistent fault on rank 1: its own result and its replay of rank 0 both fail
    p = plan(_replay_finding((1,), [(0, 1), (1, 2)]), topo)
    assert p is not None and (p.suspect, p.owner, p.witness) == (1, 1, 2)


def test_plan_repeats_the_replayed_microbatch_when_only_the_replay_failed() -> None:
    topo = _topology(NODES)
    settled = Finding(
        Check.REPLAY,
        Verdict.SDC,
        (1,),
        "m",
        {"disputed": {"owner": 0, "replayer": 1}, "third": 2},
    )
    p = plan(settled, topo)
    # rank 1 computed rank 0's microbatch wrong; the owner (node1) is the witness
    assert p is not None and (p.suspect, p.owner, p.witness) == (1, 0, 0)


def test_plan_witness_is_never_on_a_suspect_node() -> None:
    topo = _topology(["a", "a", "b", "b"])
    p = plan(_replay_finding((0, 1), [(0, 2), (1, 3), (2, 0), (3, 1)]), topo)
    assert p is not None and p.suspect == 0
    assert topo.node_of(p.witness) == "b"


def test_plan_on_one_node_uses_another_gpu_and_skips_what_it_cannot_triage() -> None:
    one_node = _topology(["n", "n", "n"])
    p = plan(_replay_finding((1,), [(0, 1), (1, 2)]), one_node)
    assert p is not None and p.witness not in (1,)
    two = _topology(["a", "b"])
    assert plan(_replay_finding((0, 1), [(0, 1)]), two) is None  # no node outside the suspects
    topo = _topology(NODES)
    ambiguous = Finding(Check.REPLAY, Verdict.AMBIGUOUS, (0, 1), "m", {"failed": []})
    vote = Finding(Check.VOTE, Verdict.SDC, (2,), "m", {})
    assert plan(ambiguous, topo) is None and plan(vote, topo) is None
    abft = plan(Finding(Check.ABFT, Verdict.SDC, (2,), "m", {"ranks": {}}), topo)
    assert abft is not None and (abft.suspect, abft.owner, abft.witness) == (2, 2, 0)


def test_repeat_stops_when_another_run_would_not_fit_into_the_budget() -> None:
    now = [0.0]

    def clock() -> float:
        return now[0]

    def run(seconds: float) -> Any:
        def once() -> int:
            now[0] += seconds
            return 1

        return once

    assert len(repeat(run(1.0), budget=10.0, clock=clock)[0]) == MAX_RUNS
    runs, took = repeat(run(4.0), budget=10.0, clock=clock)
    assert (len(runs), took) == (2, 8.0)  # a third would end at 12 s
    assert len(repeat(run(30.0), budget=10.0, clock=clock)[0]) == 1  # always at least once
    assert effective_budget(20.0, 300.0) == 20.0
    assert effective_budget(20.0, 10.0) == 5.0  # the others wait under the watchdog
    assert effective_budget(20.0, 0.0) == 20.0


@pytest.mark.parametrize("value", ["5", True, -1.0, 3601])
def test_triage_seconds_is_validated(value: object) -> None:
    with pytest.raises(ConfigError, match="triage_seconds"):
        sg.GuardConfig(triage_seconds=value)  # type: ignore[arg-type]


# ---------------------------------------------------------------- real gloo jobs


def _scenario(tmp_path: Path, name: str, fault: sg.Fault | None, **config: Any) -> dict[str, Any]:
    run_dir = tmp_path / name
    run_dir.mkdir()
    faults = (fault,) if fault is not None else ()
    return {
        "run_dir": str(run_dir),
        "steps": 12,
        "config": sg.GuardConfig(replay_every=5, vote_every=5, faults=faults, **config),
        "model": SMALL,
    }


def _grad_scale(step: int, persistent: bool) -> sg.Fault:
    return sg.Fault("grad-scale", rank=FAULTY, step=step, persistent=persistent, param=DENSE_WEIGHT)


@pytest.mark.distributed
def test_alarm_says_whether_the_fault_reproduces(tmp_path: Path) -> None:
    forward = sg.Fault(
        "gemm", step=3, rank=FAULTY, layer=2, element=5, factor=0.05, persistent=True
    )
    scenarios = [
        # persistent from step 7: caught by the replay at step 10, every repeat wrong again
        _scenario(tmp_path, "persistent", _grad_scale(7, True)),
        # one-off on the verified step 10: the replay catches it, no repeat reproduces it
        _scenario(tmp_path, "one-off", _grad_scale(10, False)),
        # the same in tolerance mode (sketches within the calibrated tolerance)
        _scenario(tmp_path, "tol-persistent", _grad_scale(7, True), deterministic=False),
        _scenario(tmp_path, "tol-one-off", _grad_scale(10, False), deterministic=False),
        # a persistent wrong GEMM value on an unverified step, caught by its check
        _scenario(tmp_path, "abft", forward, abft=True),
        # off: the alarm is as before
        _scenario(tmp_path, "off", _grad_scale(7, True), triage_seconds=0),
    ]
    outcomes = run_local(run_scenarios, 3, args=(scenarios,), nodes=NODES)
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.value for o in outcomes]
    alarms: dict[str, dict[str, Any]] = {}
    for index, sc in enumerate(scenarios):
        name = Path(sc["run_dir"]).name
        per_rank = [o.value[index]["alarm"] for o in outcomes]
        alarm = per_rank[0]
        assert alarm is not None, name
        assert all(a == alarm for a in per_rank), name  # every rank raised the same record
        assert alarm["verdict"] == "sdc" and alarm["suspect_ranks"] == [FAULTY], name
        # the record on disk (what the controller and `review` read) carries it too
        on_disk = json.loads(
            (Path(sc["run_dir"]) / "alarms" / f"{alarm['alarm_id']}.json").read_text()
        )
        assert on_disk["evidence"] == alarm["evidence"], name
        alarms[name] = alarm

    assert "triage" not in alarms["off"]["evidence"]

    for name in ("persistent", "tol-persistent", "abft"):
        triage = alarms[name]["evidence"]["triage"]
        assert triage["suspect"] == FAULTY and triage["suspect_node"] == "node2", name
        assert triage["witness"]["node"] != "node2", name
        assert 1 <= triage["runs"] <= MAX_RUNS, name
        assert triage["reproduced"] == triage["runs"], (name, triage)  # n of n: persistent
        assert len(triage["suspect_runs"]) == triage["runs"]
        assert f"reproduced {triage['runs']} of {triage['runs']}" in alarms[name]["message"]
    assert alarms["abft"]["check"] == "abft" and alarms["abft"]["step"] == 3

    for name in ("one-off", "tol-one-off"):
        alarm = alarms[name]
        assert alarm["step"] == 10 and alarm["check"] == "replay", name
        triage = alarm["evidence"]["triage"]
        assert triage["microbatch_of"] == FAULTY  # its own step was the wrong one
        assert triage["runs"] >= 1 and triage["reproduced"] == 0, (name, triage)  # 0 of n
        assert f"reproduced 0 of {triage['runs']}" in alarm["message"]

    # The repeats are the alarm's computation again (same batch, RNG state and weights): the
    # witness gets exactly the healthy replayer's value at the alarm, and a persistent fault
    # gives exactly the suspect's own wrong value at the alarm, every time.
    evidence = alarms["persistent"]["evidence"]
    exact = evidence["triage"]
    (at_alarm,) = [f for f in evidence["failed"] if f["owner"] == FAULTY]
    assert exact["witness"]["grad_fingerprint"] == at_alarm["replay_grad_fingerprint"]
    assert {r["grad_fingerprint"] for r in exact["suspect_runs"]} == {
        at_alarm["owner_grad_fingerprint"]
    }
    assert {r["loss_bits"] for r in exact["suspect_runs"]} == {exact["witness"]["loss_bits"]}
    evidence = alarms["one-off"]["evidence"]
    one_off = evidence["triage"]
    disputed = evidence["disputed"]
    assert disputed["owner"] == FAULTY
    assert one_off["witness"]["grad_fingerprint"] == disputed["replay_grad_fingerprint"]
    assert {r["grad_fingerprint"] for r in one_off["suspect_runs"]} == {
        disputed["replay_grad_fingerprint"]
    }
    assert disputed["owner_grad_fingerprint"] != disputed["replay_grad_fingerprint"]
    # what `slurm-guard review` shows per node: the journal keeps the alarm's evidence
    entry = {**alarms["persistent"], "time": 1.0, "outcome": "act"}
    (shown,) = node_history([entry], set(), "node2")
    assert shown["confirmed"] and shown["triage"] == exact

    tolerant = alarms["tol-persistent"]["evidence"]["triage"]
    assert all(r["discrepancy"] > tolerant["tolerance"] for r in tolerant["suspect_runs"])
    tol_one_off = alarms["tol-one-off"]["evidence"]["triage"]
    assert all(r["discrepancy"] <= tol_one_off["tolerance"] for r in tol_one_off["suspect_runs"])


@pytest.mark.distributed
def test_a_triage_that_fails_is_recorded_and_the_alarm_still_stops_every_rank(
    tmp_path: Path,
) -> None:
    outcomes = run_local(triage_raises, 3, args=(str(tmp_path),), nodes=NODES)
    assert [o.status for o in outcomes] == ["ok"] * 3, [o.value for o in outcomes]
    alarm = outcomes[0].value
    assert alarm is not None and all(o.value == alarm for o in outcomes)
    assert (alarm["step"], alarm["verdict"], alarm["suspect_ranks"]) == (10, "sdc", [FAULTY])
    triage = alarm["evidence"]["triage"]
    assert "reproduced" not in triage and "runs" not in triage
    assert triage["suspect"] == FAULTY
    # the other ranks learnt which rank failed and why, instead of waiting for it
    assert "rank 1 (node2)" in triage["error"] and "out of memory" in triage["error"]
    assert "triage" not in alarm["message"]
    (path,) = (tmp_path / "alarms").glob("*.json")
    assert json.loads(path.read_text())["evidence"]["triage"] == triage


# ---------------------------------------------------------------- the real local cluster


@pytest.mark.slurm
@pytest.mark.slow
def test_on_a_real_cluster_a_persistent_fault_reproduces_and_a_one_off_does_not(
    idle_slurm_cluster: Any, slurm_client: Any, tmp_path: Path
) -> None:
    """Two guarded 3-node jobs under sbatch (submitit), a fault on rank 1's node: persistent from
    step 7 (alarm at the replay of step 10: reproduced n of n) and one-off at step 10 (the same
    alarm step: reproduced 0 of n). The alarm files are what the controller reads."""
    from slurm_utils import wait_for

    from slurm_guard.examples.train import TrainSettings, slurm_task
    from slurm_guard.rundir.layout import RunDir
    from slurm_guard.rundir.records import read_alarm
    from slurm_guard.slurm.launch import launch

    faults = {
        "persistent": "kind=grad-scale,node=@rank1,step=7,persistent=1,param=10",
        "one-off": "kind=grad-scale,node=@rank1,step=10,param=10",
    }
    jobs = {}
    for name, inject in faults.items():
        run_dir = tmp_path / name
        settings = TrainSettings(run_dir=str(run_dir), steps=14, checkpoint_every=5, inject=inject)
        job = launch(
            slurm_task, settings, nodes=3, run_dir=run_dir, job_name=f"sg-triage-{name}", time=30
        )
        jobs[name] = (str(job.job_id), run_dir)
    ended = {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}

    def stopped(job_id: str) -> Any:
        info = slurm_client.job(job_id)
        return info if info is not None and info.state in ended else None

    for name, (job_id, run_dir) in jobs.items():
        info = wait_for(functools.partial(stopped, job_id), 600, f"the {name} job to stop")
        assert info.state == "FAILED", (name, info)
        (path,) = RunDir(run_dir).alarms_dir.glob("*.json")
        alarm = read_alarm(path)
        assert (alarm.step, alarm.check, alarm.verdict) == (10, "replay", "sdc"), alarm.message
        triage = alarm.evidence["triage"]
        (suspect,) = alarm.suspect_nodes
        assert triage["suspect_node"] == suspect and triage["witness"]["node"] != suspect
        assert 1 <= triage["runs"] <= MAX_RUNS
        expected = triage["runs"] if name == "persistent" else 0
        assert triage["reproduced"] == expected, (name, triage)
        assert f"reproduced {expected} of {triage['runs']}" in alarm.message
