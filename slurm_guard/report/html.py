"""One self-contained HTML page for a run: the figure inline, the records as tables.

Self-contained means no script, no external style sheet, font or image: the page is mailed,
attached to a ticket or opened from a shared filesystem years later. Everything read from the
run directory is escaped: a user's job wrote those files.
"""

from __future__ import annotations

import html
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from slurm_guard.report.timeline import Rollback, Start, Timeline, resume_phrase
from slurm_guard.rundir import fault_effects
from slurm_guard.rundir.gpus import gpu_label
from slurm_guard.rundir.records import RecordError

STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px auto;
       max-width: 1180px; color: #212121; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.sub { color: #616161; margin-top: 0; }
.banner { padding: 10px 14px; border-radius: 6px; margin: 14px 0; font-weight: 600; }
.banner.alarm { background: #ffebee; border-left: 6px solid #d32f2f; color: #b71c1c; }
.banner.ok { background: #e8f5e9; border-left: 6px solid #2e7d32; color: #1b5e20; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #e0e0e0;
         vertical-align: top; }
th { background: #fafafa; }
tr.alarm td { background: #fff5f5; }
.fail { color: #d32f2f; font-weight: 600; } .pass { color: #2e7d32; }
code, pre { font-family: ui-monospace, 'SFMono-Regular', Menlo, monospace; font-size: 12px; }
pre { white-space: pre-wrap; word-break: break-all; background: #fafafa; padding: 6px; }
figure { margin: 0; } .note { color: #757575; font-style: italic; }
"""


NO_LOSS = (
    "No loss recorded, so the plot shows verification results and run events only. To plot "
    "it, call slurm_guard.report.record_loss(run_dir, step, loss) on rank 0 after each step "
    "(docs/user-guide.md, section 5)."
)


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _table(headers: list[str], rows: list[list[str]], row_class: list[str] | None = None) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_class[i]}"' if row_class and row_class[i] else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def render_page(t: Timeline, svg: str | None) -> str:
    """The page. `svg` is the figure (None: matplotlib missing, said on the page)."""
    run = t.run
    job = run.get("job_id") or next((s.job_id for s in t.starts if s.job_id), None)
    title = f"slurm-guard run report: {t.run_dir.name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="sub"><code>{_e(t.run_dir)}</code> &middot; job {_e(job or "?")} &middot; '
        f"world size {_e(run.get('world_size', '?'))} &middot; "
        f"{len(t.restarts) - 1 if t.restarts else 0} restart(s)</p>",
    ]
    if t.alarms:
        last = t.alarms[-1]
        fixed = any(r.alarm_id == last.alarm_id for r in t.rollbacks)
        after = (
            f"; rolled back and resumed, finished at step {t.finished_step}"
            if fixed and t.finished_step is not None
            else ("; rolled back and resumed" if fixed else "; not resumed yet")
        )
        parts.append(
            f'<div class="banner alarm" id="alarm-banner">ALARM at step {last.step}: '
            f"{_e(last.check)} check, verdict {_e(last.verdict)}"
            f"{' (injected)' if last.injected else ''}, suspect "
            f"{_e(', '.join(last.suspect_nodes) or 'none named')}{_e(after)}</div>"
        )
    else:
        done = f", finished at step {t.finished_step}" if t.finished_step is not None else ""
        parts.append(f'<div class="banner ok">No alarm{_e(done)}.</div>')
    for warning in _fault_warnings(t.run_dir):
        parts.append(f'<p class="note fault-warning">{_e(warning)}</p>')
    parts.append('<h2>Timeline</h2><figure id="timeline">')
    if svg is not None:
        parts.append(svg)
        loss_note = "" if t.losses else f'<p class="note" id="no-loss">{_e(NO_LOSS)}</p>'
        parts.append(f"</figure>{loss_note}")
    else:
        parts.append(
            '<p class="note">No plot: matplotlib is not installed '
            "(<code>pip install 'slurm-guard[report]'</code>).</p></figure>"
        )
    parts.append(_alarms_section(t))
    parts.append(_runs_section(t))
    parts.append(_checks_section(t))
    parts.append(_checkpoints_section(t))
    if t.problems:
        items = "".join(f"<li>{_e(p)}</li>" for p in t.problems)
        parts.append(f'<h2>Unreadable records</h2><ul id="problems">{items}</ul>')
    config = run.get("config")
    if isinstance(config, dict):
        parts.append(
            "<h2>Guard configuration</h2><pre>"
            + _e(json.dumps(config, indent=2, sort_keys=True))
            + "</pre>"
        )
    parts.append(f'<p class="note">Generated by slurm-guard report at {_when(time.time())}.</p>')
    parts.append("</body></html>")
    return "\n".join(parts)


def _fault_warnings(run_dir: Path) -> list[str]:
    """The injected faults that changed no value (faults/<attempt>.json), or why unreadable."""
    try:
        return fault_effects.warnings_of(fault_effects.read_newest(run_dir))
    except (OSError, RecordError) as exc:
        return [f"injected faults' effects unreadable: {exc}"]


def _alarms_section(t: Timeline) -> str:
    if not t.alarms:
        return '<h2>Alarms</h2><p id="alarms">None.</p>'
    rows, classes = [], []
    for a in t.alarms:
        evidence = json.dumps(a.evidence, indent=1, sort_keys=True)
        if len(evidence) > 4000:
            evidence = evidence[:4000] + "\n..."
        rows.append(
            [
                f"<code>{_e(a.alarm_id)}</code>",
                _e(a.step),
                _e(a.check),
                f'<span class="fail">{_e(a.verdict)}</span>'
                + (" (injected)" if a.injected else ""),
                _e(", ".join(a.suspect_nodes) or "-")
                + (
                    f" (ranks {_e(', '.join(map(str, a.suspect_ranks)))})"
                    if a.suspect_ranks
                    else ""
                )
                + _e(f" {gpu_label(a.suspect_gpus)}" if gpu_label(a.suspect_gpus) else ""),
                _e(a.last_verified_step),
                _e(a.trusted_checkpoint or "-"),
                _e(a.message)
                + f"<details><summary>evidence</summary><pre>{_e(evidence)}</pre></details>",
            ]
        )
        classes.append("alarm")
    table = _table(
        ["alarm", "step", "check", "verdict", "suspects", "last verified", "trusted", "message"],
        rows,
        classes,
    )
    return f'<h2>Alarms</h2><div id="alarms">{table}</div>'


def _runs_section(t: Timeline) -> str:
    rollback_of = {r.restart_count: r for r in t.rollbacks}
    start_of = {s.restart_count: s for s in t.starts}
    alarm_of = {a.restart_count: a for a in t.alarms}
    rows = []
    for r, first, last in t.segments():
        s = start_of.get(r)
        rb = rollback_of.get(r)
        a = alarm_of.get(r)
        how = "first run" if r == 0 else f"restart {r}"
        if rb is not None:
            how = resume_phrase(
                r, rb.resumed_from_step, rb.alarm_id, list(rb.quarantined), t.resume_source(rb)
            )
        end = f"alarm at step {a.step}" if a is not None else f"step {last}"
        rows.append(
            [
                _e(how),
                _e(", ".join(s.nodes) if s else "-"),
                _e(_from_step(rb, s, first)),
                _e(end),
                _e(_when(s.time if s else None)),
            ]
        )
    return (
        '<h2>Runs and restarts</h2><div id="runs">'
        + _table(["run", "nodes", "from step", "until", "started"], rows)
        + "</div>"
    )


def _from_step(rb: Rollback | None, s: Start | None, first: int) -> int | None:
    """The step a run began from: its rollback's resume step, else its start event's, else
    its first record's (a run without either, seen only through its ledger)."""
    if rb is not None and rb.resumed_from_step is not None:
        return rb.resumed_from_step
    return s.step if s is not None else first


def _checks_section(t: Timeline) -> str:
    counts: Counter[tuple[str, bool]] = Counter((c.check, c.passed) for c in t.checks)
    rows = []
    for name in t.check_names():
        failed = [c.step for c in t.checks if c.check == name and not c.passed]
        rows.append(
            [
                _e(name),
                f'<span class="pass">{counts[(name, True)]}</span>',
                (f'<span class="fail">{counts[(name, False)]}</span>' if failed else "0"),
                _e(", ".join(map(str, failed)) or "-"),
            ]
        )
    return (
        '<h2>Verification results by check</h2><div id="checks">'
        + _table(["check", "passed", "failed", "failed at steps"], rows)
        + "</div>"
    )


def _checkpoints_section(t: Timeline) -> str:
    trusted = {a.trusted_checkpoint for a in t.alarms if a.trusted_checkpoint}
    rows = []
    for c in t.checkpoints:
        name = c.location or f"step-{c.step:08d}"
        if c.quarantined_by:
            status = f"moved aside after alarm {c.quarantined_by}"
        elif name in trusted:
            status = "trusted (rollback target)"
        else:
            status = "clean vote" if c.clean_vote else "no clean vote"
        if c.location:
            status += f" ({c.location})"
        rows.append([_e(c.step), _e(c.restart_count), _e(status), _e(_when(c.created))])
    if not rows:
        return '<h2>Checkpoints</h2><p id="checkpoints">None saved.</p>'
    return (
        '<h2>Checkpoints</h2><div id="checkpoints">'
        + _table(["step", "saved by run", "status", "saved"], rows)
        + "</div>"
    )
