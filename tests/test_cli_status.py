"""`slurm-guard status` on run directories written by real guarded runs, and on mistakes.

The run directories come from real gloo training (3 local ranks posing as node1..node3): a
persistent wrong gradient on node2 from step 13, replays every 5 steps, checkpoints every 5. The
guard stops at step 15 with step 10 as its last verified step; with trust_replays=2 the trusted
checkpoint is step 5, with trust_replays=1 it is step 10. A copy is kept as it was between the
alarm and the resume; then each run is resumed on node1,node3,node4 (restart 1) and finishes.

Status must say what the alarm says between alarm and resume, agree with the guard's own resume
function (`recovery.choose_resume_point`) in both states, and read the decision from the
controller state that handled the alarm.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import slurm_guard as sg
from slurm_guard.cli import main
from slurm_guard.controller.engine import Engine
from slurm_guard.controller.policy import Policy
from slurm_guard.controller.state import StateStore
from slurm_guard.controller.status_view import lineage_passes
from slurm_guard.local.launch import run_local
from slurm_guard.rundir.layout import RunDir
from slurm_guard.rundir.records import LedgerEntry, atomic_write_json, read_alarm
from slurm_guard.rundir.recovery import choose_resume_point
from slurm_guard.slurm.dry_run import DryRunSlurm
from slurm_guard.slurm.parsers import JobInfo, NodeInfo

JOB = "501"
NODES = ["node1", "node2", "node3"]
NO_SLURM = {"SLURM_CONF": "/nonexistent/slurm.conf"}  # a client that fails at once, no wait


def _scenarios(base: Path) -> list[dict[str, Any]]:
    from workers import SMALL

    fault = sg.Fault("grad-scale", step=13, node="node2", persistent=True, param=10)
    return [
        {
            "run_dir": str(base / f"k{k}"),
            "steps": 20,
            "checkpoint_every": 5,
            "model": SMALL,
            "config": sg.GuardConfig(
                replay_every=5, vote_every=5, trust_replays=k, faults=(fault,)
            ),
        }
        for k in (1, 2)
    ]


def _ok(outcomes: list[Any]) -> list[Any]:
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, f"rank {bad[0].rank} {bad[0].status}: {str(bad[0].value)[-2000:]}"
    return [o.value for o in outcomes]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Run dirs between alarm and resume (`between-k1/2`) and after the resume (`k1/2`)."""
    from workers import run_scenarios

    base = tmp_path_factory.mktemp("status-runs")
    scenarios = _scenarios(base)
    for sc in scenarios:
        Path(sc["run_dir"]).mkdir()
    first = _ok(
        run_local(run_scenarios, 3, (scenarios,), nodes=NODES, extra_env={"SLURM_JOB_ID": JOB})
    )
    assert all(r["alarm"] is not None for r in first[0]), "the fault was not caught"
    out = {}
    for k in (1, 2):
        out[f"between-k{k}"] = base / f"between-k{k}"
        shutil.copytree(base / f"k{k}", out[f"between-k{k}"], symlinks=True)
    _ok(
        run_local(
            run_scenarios,
            3,
            (scenarios,),
            nodes=["node1", "node3", "node4"],
            extra_env={"SLURM_JOB_ID": JOB, "SLURM_RESTART_COUNT": "1"},
        )
    )
    out["k1"], out["k2"] = base / "k1", base / "k2"
    return out


def status(*args: str, client: Any = None) -> Result:
    obj = {"slurm_client": client} if client is not None else None
    return CliRunner().invoke(main, ["status", *args], obj=obj, env=NO_SLURM)


def status_json(run_dir: Path, state: Path) -> dict[str, Any]:
    result = status(str(run_dir), "--state-dir", str(state), "--json")
    assert result.exit_code == 0, result.output
    view: dict[str, Any] = json.loads(result.output)
    return view


def the_alarm(run_dir: Path) -> sg.Alarm:
    (path,) = RunDir(run_dir).alarms_dir.glob("*.json")
    return read_alarm(path)


REAL_RUNS = [pytest.mark.distributed, pytest.mark.slow]


def real_runs(test: Any) -> Any:
    """Marks a test that uses the `runs` fixture (real multi-process training)."""
    for mark in REAL_RUNS:
        test = mark(test)
    return test


# ---------------------------------------------------------------------- what status shows


@real_runs
@pytest.mark.parametrize(("k", "trusted"), [(1, 10), (2, 5)])
def test_between_alarm_and_resume_status_says_what_the_alarm_says(
    runs: dict[str, Path], tmp_path: Path, k: int, trusted: int
) -> None:
    run_dir = runs[f"between-k{k}"]
    alarm = the_alarm(run_dir)
    assert alarm.step == 15 and alarm.last_verified_step == 10
    assert alarm.trusted_checkpoint == f"step-{trusted:08d}"
    view = status_json(run_dir, tmp_path / "state")
    assert view["trust_replays"] == k  # from run.json, not a default
    assert view["trusted_checkpoint"] == trusted
    # The guard's own resume function, on the same files, picks the same checkpoint.
    assert choose_resume_point(RunDir(run_dir), k).step == trusted
    # Not the vote at step 14 (verifies no computation), not anything after the alarm.
    assert view["last_verified_step"] == 10
    assert view["latest_checkpoint"] == 15


@real_runs
def test_status_says_which_faults_were_injected_on_purpose(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """The runs' fault came from GuardConfig(faults=...): status names it and marks the alarm,
    so an injected fault is never read as a hardware one (a forgotten SLURM_GUARD_INJECT)."""
    run_dir = runs["between-k1"]
    assert the_alarm(run_dir).injected
    view = status_json(run_dir, tmp_path / "state")
    assert len(view["injected_faults"]) == 1 and "grad-scale" in view["injected_faults"][0]
    assert [a["injected"] for a in view["alarms"]] == [True]
    text = status(str(run_dir), "--state-dir", str(tmp_path / "state")).output
    assert "injected faults:" in text and "grad-scale" in text
    assert "sdc (injected)" in text


@real_runs
@pytest.mark.parametrize(("k", "resumed"), [(1, 10), (2, 5)])
def test_after_the_resume_status_follows_the_current_history(
    runs: dict[str, Path], tmp_path: Path, k: int, resumed: int
) -> None:
    run_dir = runs[f"k{k}"]
    view = status_json(run_dir, tmp_path / "state")
    (resume,) = view["resumes"]
    assert resume["resumed_from_step"] == resumed and resume["restart_count"] == 1
    assert view["trusted_checkpoint"] == 20 == choose_resume_point(RunDir(run_dir), k).step
    assert view["last_verified_step"] == 15  # the restart's own replay at step 15 passed
    (alarm,) = view["alarms"]
    assert alarm["handled"] is True
    # No controller journal here: say so and where it looked, never "undecided".
    assert alarm["decision"] == "none" and str(tmp_path / "state") in alarm["decision_reason"]
    assert "no controller has seen this run" in view["controller"]


@real_runs
def test_decision_comes_from_the_controller_state_that_handled_the_alarm(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    run_dir = runs["between-k2"]
    state = StateStore(tmp_path / "state")
    job = JobInfo(
        job_id=JOB,
        state="FAILED",
        reason="NonZeroExitCode",
        nodes=tuple(NODES),
        user="u",
        user_id=os.getuid(),
        restart_count=0,
        exit_code=86,
        exit_signal=0,
        excluded_nodes=(),
        work_dir=str(tmp_path),
        name="train",
        requeue=True,
        held=False,
    )
    slurm = DryRunSlurm(
        None,
        jobs=[job],
        nodes=[NodeInfo(n, frozenset({"IDLE"}), None, None, "127.0.0.1", "h") for n in NODES],
    )
    report = Engine(slurm, state, Policy()).process_job(JOB, run_dir, allocation=tuple(NODES))
    assert any(d[0] == "act" for d in report.decisions.values()), report.lines()
    view = status_json(run_dir, state.root)
    (alarm,) = view["alarms"]
    assert alarm["decision"] == "act"
    assert {a["op"] for a in view["controller_actions"]} >= {"drain", "requeue_hold"}
    text = status(str(run_dir), "--state-dir", str(state.root))
    assert text.exit_code == 0, text.output
    assert "act" in text.output and "trusted checkpoint:  step 5" in text.output


# ---------------------------------------------------------------------- mistakes


def _one_line_error(result: Result, *needles: str) -> None:
    assert result.exit_code == 1, result.output
    assert ("Traceback" not in result.output and result.exception is None) or isinstance(
        result.exception, SystemExit
    )
    text = result.output.strip()
    assert text.count("\n") == 0, text
    for needle in needles:
        assert needle in text, text


def test_mistakes_exit_1_with_one_line_that_says_what_to_do(tmp_path: Path) -> None:
    state = ["--state-dir", str(tmp_path / "state")]
    missing = tmp_path / "nope"
    _one_line_error(status(str(missing), *state), "no such directory", "give a run directory")
    (tmp_path / "file.txt").write_text("x")
    _one_line_error(status(str(tmp_path / "file.txt"), *state), "is a file")
    (tmp_path / "empty").mkdir()
    _one_line_error(status(str(tmp_path / "empty"), *state), "is empty", "Guard(")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    _one_line_error(status(str(tmp_path / "other"), *state), "not a slurm-guard run directory")
    _one_line_error(status("not-a-job", *state), "neither a run directory nor a Slurm job id")
    # A job Slurm does not know (a client that holds no jobs) and the journal does not name.
    unknown = status("4242", *state, client=DryRunSlurm(None))
    _one_line_error(unknown, "job 4242 is not known to Slurm", "give its run directory")
    # Slurm unreachable (no configuration): says so, and what to give instead.
    _one_line_error(status("4242", *state), "Slurm is unreachable", "give the run directory")


@real_runs
def test_a_file_inside_a_run_dir_points_at_the_run_dir(runs: dict[str, Path]) -> None:
    run_file = runs["k2"] / "run.json"
    _one_line_error(status(str(run_file)), "is a file", f"slurm-guard status {runs['k2']}")


def test_mistakes_with_json_are_json(tmp_path: Path) -> None:
    for target in (str(tmp_path / "nope"), "4242", "x y"):
        result = status(target, "--json", "--state-dir", str(tmp_path / "s"))
        assert result.exit_code == 1, result.output
        error = json.loads(result.output)
        assert error["exit_code"] == 1 and error["error"], error


# ---------------------------------------------------------------------- hostile content


@real_runs
def test_control_characters_never_reach_the_terminal(runs: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(runs["between-k2"], run_dir, symlinks=True)
    alarm = the_alarm(run_dir)
    path = RunDir(run_dir).alarm_path(alarm.alarm_id)
    obj = json.loads(path.read_text())
    obj["message"] = "\x1b[2J\x1b[31mhidden\nFAKE LINE: all clear"
    obj["evidence"] = {"note": "\x1b]0;title\x07\r\nFAKE LINE: evidence"}
    path.unlink()
    atomic_write_json(path, obj, overwrite=False)
    run = json.loads((run_dir / "run.json").read_text())
    run["config"]["note"] = "\x1b[2J\nFAKE LINE: config"
    atomic_write_json(run_dir / "run.json", run)
    result = status(str(run_dir), "--state-dir", str(tmp_path / "state"))
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert not any(line.startswith("FAKE LINE") for line in result.output.splitlines())
    assert "\\x1b[2J" in result.output  # shown, escaped
    as_json = status(str(run_dir), "--state-dir", str(tmp_path / "state"), "--json")
    assert "\x1b" not in as_json.output  # JSON escapes it as \u001b
    assert json.loads(as_json.output)["checks"]["note"].startswith("\x1b[2J")


@real_runs
def test_odd_fields_give_no_traceback(runs: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(runs["k2"], run_dir, symlinks=True)
    atomic_write_json(
        run_dir / "run.json",
        {"schema": 1, "config": [1, 2], "job_id": 5, "started": "yesterday", "seed": "x"},
    )
    (handled,) = (run_dir / "handled").glob("*.json")
    atomic_write_json(
        handled,
        {
            "time": "yesterday",
            "quarantined": "step-1",
            "restart_count": "1",
            "resumed_from_step": [],
        },
    )
    (run_dir / "ledger.jsonl").write_text('{"step": "x"}\n[1,2]\nnot json\n')
    for args in ([], ["--json"]):
        result = status(str(run_dir), "--state-dir", str(tmp_path / "s"), *args)
        assert result.exit_code == 0, result.output
        assert result.exception is None, result.exception


# ---------------------------------------------------------------------- the current history


def _entry(step: int, restart: int, when: float, passed: bool = True) -> LedgerEntry:
    return LedgerEntry(step, "replay", passed, {}, restart, time=when)


def test_lineage_drops_what_a_rollback_discarded_even_outside_slurm() -> None:
    """Outside Slurm every attempt has restart count 0: only the rollback record separates
    the discarded steps (15, 20 of the first attempt) from the current history."""
    first = [_entry(s, 0, 100 + s) for s in (0, 5, 10, 15, 20)] + [_entry(25, 0, 126, False)]
    rollback = {"time": 200.0, "resumed_from_step": 10, "restart_count": 0}
    second = [_entry(10, 0, 210)]
    assert lineage_passes(first + second, [rollback]) == [0, 5, 10]
    assert lineage_passes(first + second, []) == [0, 5, 10, 15, 20]  # what counting all says


def test_lineage_of_a_requeue_without_alarm_starts_at_its_first_step() -> None:
    first = [_entry(s, 0, 100 + s) for s in (0, 5, 10, 15)]
    second = [_entry(s, 1, 300 + s) for s in (10, 15)]  # resumed from a checkpoint <= 10
    assert lineage_passes(first + second, []) == [0, 5, 10, 15]
    assert lineage_passes([*first, _entry(10, 1, 310, False)], []) == [0, 5]
    votes = [LedgerEntry(14, "vote", True, {}, 0, time=114.0)]
    assert lineage_passes(first + votes, []) == [0, 5, 10, 15]  # a vote is not a replay


# ---------------------------------------------------------------------- a real cluster


@pytest.mark.slurm
@pytest.mark.slow
def test_status_on_a_real_cluster_between_drain_and_resume(
    idle_slurm_cluster: Any, slurm_client: Any, tmp_path: Path
) -> None:
    """A guarded 3-node job (fault on rank 1's node from step 13, replays and checkpoints every
    5, trust_replays=2) stops at step 15; the controller drains the node and requeues the job,
    which the test holds before it can resume. Status must then say what the alarm says
    (checkpoint 5, last verified 10), the decision `act`; after the resume, the resumed run."""
    from slurm_utils import wait_for

    from slurm_guard.examples.train import TrainSettings, read_result, slurm_task
    from slurm_guard.slurm.launch import launch

    run_dir, state = tmp_path / "run", tmp_path / "state"
    settings = TrainSettings(
        run_dir=str(run_dir),
        steps=20,
        checkpoint_every=5,
        replay_every=5,
        vote_every=5,
        inject="kind=grad-scale,node=@rank1,step=13,persistent=1,param=10",
    )
    job = launch(
        slurm_task,
        settings,
        nodes=3,
        run_dir=run_dir,
        job_name="sg-status",
        time=30,
        additional_parameters={"requeue": True},
    )
    job_id = str(job.job_id)
    ended = {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}
    info = wait_for(
        lambda: (i := slurm_client.job(job_id)) is not None and i.state in ended and i,
        300,
        "the faulty job to stop",
    )
    assert info.state == "FAILED", info
    alarm = the_alarm(run_dir)
    assert alarm.last_verified_step == 10 and alarm.trusted_checkpoint == "step-00000005"
    (suspect,) = alarm.suspect_nodes

    report = Engine(slurm_client, StateStore(state), Policy()).process_job(job_id, run_dir)
    slurm_client.run(["scontrol", "hold", job_id])  # keep it from resuming while we look
    try:
        assert slurm_client.node(suspect).drained, report.lines()
        assert not (run_dir / "handled").exists() or not list((run_dir / "handled").iterdir())
        result = CliRunner().invoke(
            main, ["status", job_id, "--state-dir", str(state), "--json"], obj=None
        )
        assert result.exit_code == 0, result.output
        view = json.loads(result.output)
        assert view["trusted_checkpoint"] == 5 == choose_resume_point(RunDir(run_dir), 2).step
        assert view["last_verified_step"] == 10
        (row,) = view["alarms"]
        assert row["decision"] == "act" and row["suspect_nodes"] == [suspect]
        assert suspect in view["job"]["excluded_nodes"] and view["job"]["held"]
    finally:
        slurm_client.run(["scontrol", "release", job_id])
    wait_for(lambda: read_result(run_dir), 300, "the requeued job to finish")
    after = status_json(run_dir, state)
    (resume,) = after["resumes"]
    assert resume["resumed_from_step"] == 5
    assert after["trusted_checkpoint"] == 20 and after["last_verified_step"] == 15
    assert after["alarms"][0]["decision"] == "act"
    slurm_client.resume(suspect)
