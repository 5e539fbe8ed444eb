"""`slurm-guard report`: the run's timeline page, checked the way a user sees it.

The run directory is written with the project's own record writers (alarm, ledger, checkpoint
metadata, handled record, training events) as a faulty run leaves it: a fault at step 20, a
rollback to the checkpoint of step 10, a restart on other nodes that finishes. The page is then
rendered by headless Chromium (Debian's `chromium` package); that test is skipped only when
Chromium is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_guard.cli import main
from slurm_guard.report import read_timeline, write_report
from slurm_guard.report.html import render_page
from slurm_guard.rundir.records import Alarm, LedgerEntry, append_ledger, atomic_write_json

ALARM_ID = "job77-r0-step20-replay"
T0 = 1_790_000_000.0


def _meta(directory: Path, step: int, restart: int) -> None:
    atomic_write_json(
        directory / "meta.json",
        {
            "schema": 1,
            "step": step,
            "weight_fingerprint": "0" * 16,
            "clean_vote": True,
            "files": {},
            "world_size": 3,
            "restart_count": restart,
            "created": T0 + step,
        },
    )


def faulty_run(root: Path, message: str = "rank 1 (node2) disagrees") -> Path:
    """A run dir as the guard and the example trainer leave it after a caught fault."""
    run = root / "run"
    (run / "alarms").mkdir(parents=True)
    ledger = run / "ledger.jsonl"
    for restart, steps in ((0, range(0, 21)), (1, range(10, 31))):
        for step in steps:
            if step % 5:
                continue
            failed = restart == 0 and step == 20
            detail: dict[str, object] = {"comparisons": 3, "loss": 2.0 / (1 + step / 10)}
            if failed:
                detail = {"alarm": ALARM_ID}
            append_ledger(ledger, LedgerEntry(step, "replay", not failed, detail, restart))
            if not failed:
                append_ledger(ledger, LedgerEntry(step + 4, "vote", True, {}, restart))
    alarm = Alarm(
        alarm_id=ALARM_ID,
        job_id="77",
        restart_count=0,
        step=20,
        check="replay",
        verdict="sdc",
        suspect_ranks=(1,),
        suspect_nodes=("node2",),
        suspect_hosts=("host2",),
        last_verified_step=15,
        trusted_checkpoint="step-00000010",
        update_applied=False,
        evidence={"failed": [{"owner": 1, "replayer": 2}]},
        message=message,
        world_size=3,
        created=T0 + 20,
    )
    atomic_write_json(run / "alarms" / f"{ALARM_ID}.json", alarm.to_json(), overwrite=False)
    for step, restart in ((10, 0), (20, 1), (30, 1)):
        _meta(run / "checkpoints" / f"step-{step:08d}", step, restart)
    _meta(run / "quarantine" / ALARM_ID / "step-00000020", 20, 0)
    atomic_write_json(
        run / "handled" / f"{ALARM_ID}.json",
        {
            "alarm_id": ALARM_ID,
            "resumed_from_step": 10,
            "quarantined": ["step-00000020"],
            "restart_count": 1,
            "time": T0 + 60,
        },
    )
    events = [
        {"event": "start", "step": 0, "restart_count": 0, "nodes": ["node1", "node2", "node3"]},
        {"event": "alarm", "step": 20, "restart_count": 0, "alarm_id": ALARM_ID},
        {"event": "start", "step": 10, "restart_count": 1, "nodes": ["node1", "node3", "node4"]},
        {"event": "finish", "step": 30},
    ]
    (run / "train-events.jsonl").write_text(
        "".join(json.dumps({"job_id": "77", "time": T0, **e}) + "\n" for e in events)
        + '{"event": "torn'
    )
    atomic_write_json(run / "run.json", {"schema": 1, "job_id": "77", "world_size": 3})
    return run


def test_the_timeline_gathers_every_record(tmp_path: Path) -> None:
    t = read_timeline(faulty_run(tmp_path))
    assert [a.alarm_id for a in t.alarms] == [ALARM_ID]
    assert [(r.alarm_id, r.resumed_from_step, r.restart_count) for r in t.rollbacks] == [
        (ALARM_ID, 10, 1)
    ]
    assert t.segments() == [(0, 0, 20), (1, 10, 34)]
    assert [(c.step, c.quarantined_by) for c in t.checkpoints] == [
        (10, None),
        (20, None),
        (20, ALARM_ID),
        (30, None),
    ]
    assert next(c for c in t.checks if not c.passed).alarm_id == ALARM_ID
    assert len(t.losses) == 4 + 5  # passing replays carry the loss
    assert t.finished_step == 30 and t.problems == []


def test_the_page_is_self_contained_and_escapes_what_the_job_wrote(tmp_path: Path) -> None:
    run = faulty_run(tmp_path, message="<script>alert(1)</script>")
    out = tmp_path / "report.html"
    write_report(run, out)
    page = out.read_text()
    assert "<svg" in page and 'id="timeline"' in page
    assert "ALARM at step 20" in page and ALARM_ID in page
    assert "rollback to step 10" in page and "restart 1 on node1,node3,node4" in page
    assert "<script>" not in page and "&lt;script&gt;" in page
    for fetch in ("<script", "<link", "<img", "@import", 'src="http', 'href="http'):
        assert fetch not in page  # nothing to fetch: it opens offline, from a ticket, years later
    assert ">loss<" in page  # the loss panel's axis label (text stays text in the SVG)


def test_without_matplotlib_the_page_says_how_to_get_the_plot(tmp_path: Path) -> None:
    page = render_page(read_timeline(faulty_run(tmp_path)), None)
    assert "slurm-guard[report]" in page and "<svg" not in page
    assert ALARM_ID in page


def test_damaged_records_are_listed_not_fatal(tmp_path: Path) -> None:
    run = faulty_run(tmp_path)
    (run / "alarms" / "broken.json").write_text("{")
    (run / "handled" / "x.json").write_text("[1]")
    t = read_timeline(run)
    assert len(t.problems) == 2 and [a.alarm_id for a in t.alarms] == [ALARM_ID]
    page = render_page(t, None)
    assert 'id="problems"' in page and "broken.json" in page


def test_cli_report(tmp_path: Path) -> None:
    run = faulty_run(tmp_path)
    out = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", str(run), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["alarms"] == [ALARM_ID] and summary["restarts"] == 1 and summary["plot"]
    assert out.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = CliRunner().invoke(main, ["report", str(empty), "-o", str(out)])
    assert refused.exit_code == 1 and "not a slurm-guard run directory" in refused.output


def _chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.environ.get("SLURM_GUARD_REQUIRE_CHROMIUM") == "1":
        pytest.fail("SLURM_GUARD_REQUIRE_CHROMIUM=1 but no chromium on PATH (.ci/run installs it)")
    return found


def test_the_page_renders_in_headless_chromium_with_the_plot_and_the_alarm(tmp_path: Path) -> None:
    if _chromium() is None:
        pytest.skip("needs Chromium: apt-get install -y --no-install-recommends chromium")
    image = pytest.importorskip("matplotlib.image")
    run = faulty_run(tmp_path)
    out = tmp_path / "report.html"
    write_report(run, out)
    browser = [
        str(_chromium()),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1280,900",
    ]
    dom = subprocess.run(
        [*browser, "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=180
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    figure = html[html.index('<figure id="timeline">') :]
    figure = figure[: figure.index("</figure>")]
    assert "<svg" in figure and "ALARM step 20" in figure
    assert 'id="alarm-banner"' in html and "ALARM at step 20" in html
    assert ALARM_ID in html[html.index('id="alarms"') :]
    shot = tmp_path / "shot.png"
    png = subprocess.run(
        [*browser, f"--screenshot={shot}", out.as_uri()],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert png.returncode == 0 and shot.exists(), png.stderr[-2000:]
    pixels = image.imread(str(shot))[:, :, :3]
    assert pixels.shape[0] >= 800 and pixels.shape[1] >= 1200
    assert pixels.std() > 0.05, "the screenshot is blank"
    red = (pixels[:, :, 0] > 0.7) & (pixels[:, :, 1] < 0.35) & (pixels[:, :, 2] < 0.35)
    assert red.sum() > 500, "no alarm red on the page"
