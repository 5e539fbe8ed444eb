"""The timeline figure: loss, verification results and run events over steps, as inline SVG.

One figure with a shared step axis, because the questions a user asks are about alignment: did
the loss look normal when the check failed, which checkpoint did the rollback go back to, where
did the restart pick up. The alarm is a red line through every panel.

matplotlib is an optional extra (`slurm-guard[report]`); `svg_figure` returns None without it.
Text stays text in the SVG (`svg.fonttype: none`), so the page is searchable and small.
"""

from __future__ import annotations

import io
import re
from typing import Any

from slurm_guard.report.timeline import Timeline

PASS_COLOR = "#2e7d32"
FAIL_COLOR = "#d32f2f"
CHECKPOINT_COLOR = "#1565c0"
QUARANTINE_COLOR = "#9e9e9e"
ALARM_LIFT = 0.3  # lanes: the alarm marker sits this far above its run's bar
RUN_COLORS = ("#546e7a", "#8e24aa", "#ef6c00", "#00897b", "#6d4c41", "#3949ab")


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _run_color(restart: int) -> str:
    return RUN_COLORS[restart % len(RUN_COLORS)]


def svg_figure(t: Timeline) -> str | None:
    """The figure as an `<svg>` element, or None if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    style: Any = {
        "svg.fonttype": "none",
        "svg.hashsalt": "slurm-guard",
        "font.size": 9,
        "axes.spines.top": False,
        "axes.spines.right": False,
    }
    with plt.rc_context(style):
        return _draw(plt, t)


def _draw(plt: Any, t: Timeline) -> str:
    checks = t.check_names()
    segments = t.segments()
    panels: list[tuple[str, float]] = []
    if t.losses:
        panels.append(("loss", 2.2))
    panels.append(("checks", 0.9 + 0.35 * max(1, len(checks))))
    panels.append(("runs", 1.0 + 0.5 * max(1, len(segments))))
    fig, axes = plt.subplots(
        len(panels),
        1,
        sharex=True,
        figsize=(11, sum(h for _, h in panels)),
        gridspec_kw={"height_ratios": [h for _, h in panels]},
        squeeze=False,
    )
    ax_of = {name: axes[i][0] for i, (name, _) in enumerate(panels)}
    if "loss" in ax_of:
        _loss(ax_of["loss"], t)
    _checks(ax_of["checks"], t, checks)
    _runs(ax_of["runs"], t, segments)
    for alarm in t.alarms:
        for i, (name, _) in enumerate(panels):
            ax = axes[i][0]
            ax.axvline(alarm.step, color=FAIL_COLOR, lw=1.4, ls="--", zorder=1)
            if i == 0:
                suspects = ",".join(alarm.suspect_nodes) or "no node named"
                ax.annotate(
                    f"ALARM step {alarm.step}: {alarm.check} / {alarm.verdict} ({suspects})",
                    xy=(alarm.step, 1.0),
                    xycoords=("data", "axes fraction"),
                    xytext=(4, 2),
                    textcoords="offset points",
                    color=FAIL_COLOR,
                    fontweight="bold",
                    va="bottom",
                )
            del name
    axes[-1][0].set_xlabel("step")
    fig.align_ylabels([a[0] for a in axes])
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    svg = buf.getvalue()
    # Inline in HTML: drop the XML declaration and DOCTYPE, keep the <svg> element.
    start = svg.find("<svg")
    svg = svg[start:] if start >= 0 else svg
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, count=1, flags=re.S)
    size = r'<svg([^>]*?) width="[^"]*" height="[^"]*"'
    return re.sub(size, r'<svg\1 width="100%"', svg, count=1)


def _loss(ax: Any, t: Timeline) -> None:
    for restart in sorted({r for _, _, r in t.losses}):
        pts = [(s, v) for s, v, r in t.losses if r == restart]
        ax.plot(
            [s for s, _ in pts],
            [v for _, v in pts],
            marker=".",
            color=_run_color(restart),
            label=f"run {restart}" if restart else "first run",
        )
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", frameon=False, fontsize=8)


def _checks(ax: Any, t: Timeline, names: list[str]) -> None:
    row = {name: i for i, name in enumerate(names)}
    restarts = t.restarts or [0]
    offset = {r: 0.22 * (i - (len(restarts) - 1) / 2) for i, r in enumerate(restarts)}
    passed = [
        (c.step, row[c.check] + offset.get(c.restart_count, 0.0)) for c in t.checks if c.passed
    ]
    failed = [
        (c.step, row[c.check] + offset.get(c.restart_count, 0.0)) for c in t.checks if not c.passed
    ]
    if passed:
        ax.scatter(*zip(*passed, strict=True), marker="o", s=22, color=PASS_COLOR, label="passed")
    if failed:
        ax.scatter(
            *zip(*failed, strict=True), marker="X", s=90, color=FAIL_COLOR, label="failed", zorder=3
        )
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.6, max(len(names), 1) - 0.4)
    ax.set_ylabel("verification")
    ax.legend(loc="upper left", frameon=False, fontsize=8, ncol=2)


def _runs(ax: Any, t: Timeline, segments: list[tuple[int, int, int]]) -> None:
    lane = {r: i for i, (r, _, _) in enumerate(segments)}
    nodes_of = {s.restart_count: s.nodes for s in t.starts}
    for r, first, last in segments:
        y = lane[r]
        ax.plot([first, last], [y, y], lw=9, color=_run_color(r), alpha=0.35, solid_capstyle="butt")
        label = "first run" if r == 0 else f"restart {r}"
        if nodes_of.get(r):
            label += " on " + ",".join(nodes_of[r])
        # below the bar: the rollback arrow arrives at the bar's start from above
        ax.annotate(
            label, (first, y), xytext=(0, -9), textcoords="offset points", fontsize=8, va="top"
        )
    for c in t.checkpoints:
        at = lane.get(c.restart_count if c.restart_count is not None else -1)
        if at is None:
            continue
        if c.quarantined_by:
            ax.scatter(
                [c.step], [at], marker="D", s=46, facecolors="white", edgecolors=QUARANTINE_COLOR
            )
        else:
            ax.scatter([c.step], [at], marker="D", s=46, color=CHECKPOINT_COLOR, zorder=3)
    for a in t.alarms:
        if a.restart_count in lane:  # above the bar, so a checkpoint of that step stays visible
            lifted = lane[a.restart_count] - ALARM_LIFT
            ax.scatter([a.step], [lifted], marker="X", s=120, color=FAIL_COLOR, zorder=4)
    for rb in t.rollbacks:
        alarm = next((a for a in t.alarms if a.alarm_id == rb.alarm_id), None)
        if alarm is None or rb.resumed_from_step is None or alarm.restart_count not in lane:
            continue
        target = lane.get(rb.restart_count if rb.restart_count is not None else -1)
        if target is None:
            continue
        ax.annotate(
            "",
            xy=(rb.resumed_from_step, target),
            xytext=(alarm.step, lane[alarm.restart_count] - ALARM_LIFT),
            arrowprops={"arrowstyle": "->", "color": FAIL_COLOR, "lw": 1.3},
        )
        ax.annotate(
            f"rollback to step {rb.resumed_from_step}",
            (alarm.step, lane[alarm.restart_count] - ALARM_LIFT),
            xytext=(10, 0),
            textcoords="offset points",
            color=FAIL_COLOR,
            fontsize=8,
            va="center",
        )
    handles = [
        ax.scatter([], [], marker="D", s=46, color=CHECKPOINT_COLOR, label="checkpoint"),
        ax.scatter(
            [],
            [],
            marker="D",
            s=46,
            facecolors="white",
            edgecolors=QUARANTINE_COLOR,
            label="checkpoint moved aside",
        ),
        ax.scatter([], [], marker="X", s=90, color=FAIL_COLOR, label="alarm"),
    ]
    ax.legend(handles=handles, loc="lower right", frameon=False, fontsize=8, ncol=3)
    ax.set_yticks(
        range(len(segments)), ["first run" if r == 0 else f"restart {r}" for r, _, _ in segments]
    )
    ax.set_ylim(-0.8, max(len(segments), 1) + 0.1)
    ax.invert_yaxis()
    ax.set_ylabel("runs")
