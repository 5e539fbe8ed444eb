"""`slurm-guard status` and `slurm-guard report` tell the same story of a local run.

The run is what a user starts with `slurm-guard local`: 3 gloo ranks posing as node1..node3, no
Slurm job id, and a fault from SLURM_GUARD_INJECT (so `GuardConfig.faults` is empty): a
persistent wrong gradient on node2 from step 13, caught at the replay of step 15. The restart
runs on node1,node3,node4, again with restart count 0 (as every start outside Slurm), and
finishes at step 20. No controller saw any of it. The script records its loss with
`record_loss`. Two launches of 3 processes: about 30 s of CPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_guard.cli import main
from slurm_guard.local.launch import run_local
from slurm_guard.report import read_timeline, record_loss
from slurm_guard.report.html import NO_LOSS, render_page
from slurm_guard.rundir.records import read_alarm

FAULT = "kind=grad-scale,node=node2,step=13,persistent=1,param=10"
NO_SLURM = {"SLURM_CONF": "/nonexistent/slurm.conf"}


def _ok(outcomes: list[Any]) -> list[Any]:
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, f"rank {bad[0].rank} {bad[0].status}: {str(bad[0].value)[-2000:]}"
    return [o.value for o in outcomes]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from status_workers import train_recording_loss

    run_dir = tmp_path_factory.mktemp("local") / "run"
    run_dir.mkdir()
    env = {"SLURM_GUARD_INJECT": FAULT}
    first = _ok(
        run_local(
            train_recording_loss,
            3,
            (str(run_dir), 20),
            nodes=["node1", "node2", "node3"],
            extra_env=env,
        )
    )
    assert first[0]["alarm"] is not None, "the fault was not caught"
    again = _ok(
        run_local(
            train_recording_loss,
            3,
            (str(run_dir), 20),
            nodes=["node1", "node3", "node4"],
            extra_env=env,
        )
    )
    assert again[0]["alarm"] is None
    return run_dir


def _status(run_dir: Path, state: Path, *args: str) -> str:
    result = CliRunner().invoke(
        main, ["status", str(run_dir), "--state-dir", str(state), *args], env=NO_SLURM
    )
    assert result.exit_code == 0, result.output
    return result.output


def _runs_table(page: str) -> list[str]:
    section = page.split('id="runs"', 1)[1].split("</div>", 1)[0]
    return [re.sub(r"<[^>]+>", "|", row) for row in section.split("<tr>")[2:]]


pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_status_and_report_number_the_restart_and_its_step_alike(
    local_run: Path, tmp_path: Path
) -> None:
    (alarm_file,) = (local_run / "alarms").glob("*.json")
    alarm = read_alarm(alarm_file)
    (handled,) = (local_run / "handled").glob("*.json")
    resumed = json.loads(handled.read_text())
    assert resumed["restart_count"] == 0  # a local run: Slurm's count says nothing here
    step = resumed["resumed_from_step"]
    # the source is what the restarted run's guard recorded it loaded (rundir/resumes.py)
    phrase = f"restart 1 from step {step} (checkpoint) after alarm {alarm.alarm_id}"
    view = json.loads(_status(local_run, tmp_path / "state", "--json"))
    resumes = [(r["restart"], r["resumed_from_step"], r["source"]) for r in view["resumes"]]
    assert resumes == [(1, step, "checkpoint")]
    assert phrase in _status(local_run, tmp_path / "state")
    page = render_page(read_timeline(local_run), None)
    (first, restart) = _runs_table(page)
    assert first.startswith("|first run|")
    assert phrase in restart and f"|{step}|" in restart  # the "from step" column too


def test_status_of_a_run_no_controller_saw_says_so_and_shows_the_run(
    local_run: Path, tmp_path: Path
) -> None:
    text = _status(local_run, tmp_path / "state")
    lines = {line.split(":", 1)[0]: line for line in text.splitlines() if ":" in line}
    assert lines["job"].split()[1] == "none" and "without Slurm" in lines["job"]
    assert "no controller has seen this run" in lines["controller"]
    assert "pass --state-dir" not in text
    assert "trusted checkpoint:  step 20" in text and "last verified step:  15" in text
    assert "faults=" not in lines["checks"]  # the injected faults have their own line
    assert "grad-scale on node node2" in lines["injected faults"]
    view = json.loads(_status(local_run, tmp_path / "state", "--json"))
    assert [a["decision"] for a in view["alarms"]] == ["none"]


def test_the_report_plots_the_loss_the_script_recorded(local_run: Path) -> None:
    t = read_timeline(local_run)
    steps = [step for step, _, _ in t.losses]
    assert {1, 10, 20} <= set(steps)  # both runs, including the steps the restart redid
    assert {run for _, _, run in t.losses} == {0, 1}
    assert NO_LOSS not in render_page(t, None)


def test_the_empty_loss_message_names_the_way_to_record_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"schema": 1, "job_id": None}))
    page = render_page(read_timeline(run), "<svg></svg>")
    assert "record_loss(run_dir, step, loss)" in page
    record_loss(run, 3, 2.5)
    record_loss(run, 4, float("nan"))
    assert read_timeline(run).losses == [(3, 2.5, 0)]


def test_on_cpu_run_json_and_the_alarm_carry_null_gpus(local_run: Path) -> None:
    ranks = json.loads((local_run / "run.json").read_text())["ranks"]
    assert [(r["node"], r["gpu"]) for r in ranks] == [
        (n, None) for n in ("node1", "node3", "node4")
    ]
    (alarm_file,) = (local_run / "alarms").glob("*.json")
    record = json.loads(alarm_file.read_text())
    assert record["suspect_ranks"] == [1] and record["suspect_gpus"] == [None]
