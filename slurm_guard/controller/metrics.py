"""Prometheus metrics for the controller, written as a node_exporter textfile.

Admins already watch their clusters through Prometheus, and node_exporter's textfile collector
is how a batch tool without a server of its own exposes numbers: the tool writes a `.prom` file
into a directory, node_exporter serves it. The controller has no long-lived process in the
epilog case, so a file it rewrites after every pass fits, where an HTTP endpoint would not.

Every number is derived from the journal (and, for the drained nodes, from Slurm), not counted
in memory: the epilog, the in-job step and the watcher are separate processes, and a counter
kept in any one of them would be wrong. Counters are therefore totals over the journal's life;
Prometheus' `rate()`/`increase()` work on them as on any counter (a rotated journal reads as a
counter reset).

The file is written with prometheus_client's `write_to_textfile` (a temporary file renamed into
place), so node_exporter never reads half a file. prometheus_client is imported only when a
metrics file is configured (`"metrics_file"` in policy.json).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_guard.controller.policy import Policy
from slurm_guard.controller.state import ADMIN, APPROVAL, DONE, FAILED, Journal, StateStore
from slurm_guard.diagnose.evidence import diagnosed_nodes, latest_diagnosis
from slurm_guard.protocol import REASON_PREFIX

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from slurm_guard.slurm.parsers import NodeInfo

logger = logging.getLogger(__name__)

PREFIX = "slurm_guard"
WAITING_OUTCOMES = ("await_approval", "hold")


class MetricsError(RuntimeError):
    """The metrics file cannot be written; the message says what to install or fix."""


def _counts(journal: Journal) -> dict[str, Counter[tuple[str, ...]]]:
    """Totals by label values, from the journal alone."""
    alarms: Counter[tuple[str, ...]] = Counter()
    for e in journal.alarms.values():
        alarms[(str(e.get("verdict")), str(e.get("check")), str(e.get("outcome")))] += 1
    drains: Counter[tuple[str, ...]] = Counter()
    requeues: Counter[tuple[str, ...]] = Counter()
    failed: Counter[tuple[str, ...]] = Counter()
    for plan in journal.plans.values():
        trigger = "auto" if plan.auto else "approved"
        for action in plan.actions:
            result = journal.results.get(action.key)
            if result is None:
                continue
            if result["type"] == FAILED:
                failed[(action.op,)] += 1
            elif result["type"] == DONE and action.op == "drain":
                drains[(trigger,)] += 1
            elif result["type"] == DONE and action.op == "requeue_hold":
                requeues[(trigger,)] += 1
    admin: Counter[tuple[str, ...]] = Counter()
    for e in journal.entries:
        if e.get("type") == ADMIN:
            admin[(str(e.get("op")),)] += 1
        elif e.get("type") == APPROVAL:
            admin[("approve",)] += 1
    return {
        "alarms": alarms,
        "drains": drains,
        "requeues": requeues,
        "failed": failed,
        "admin": admin,
        **_in_job_counts(journal),
    }


def _in_job_counts(journal: Journal) -> dict[str, Counter[tuple[str, ...]]]:
    """Restarts inside the allocation, and jobs held, by the rule that held them."""
    restarts: Counter[tuple[str, ...]] = Counter()
    restarts[()] = len(journal.in_job_restarts)
    holds: Counter[tuple[str, ...]] = Counter()
    for e in journal.alarms.values():
        if e.get("outcome") == "hold":
            holds[(str(e.get("hold_kind") or "ambiguous"),)] += 1
    return {"in_job_restarts": restarts, "holds": holds}


def families(
    journal: Journal,
    *,
    pending_jobs: int,
    max_drains: int,
    window_s: float,
    now: float,
    nodes: Sequence[NodeInfo] | None,
    diagnoses: dict[str, bool] | None = None,
) -> list[Metric]:
    """The metric families for one pass. `nodes` is None when Slurm could not be asked."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    counts = _counts(journal)
    out: list[Metric] = []

    def counter(name: str, doc: str, labels: Sequence[str], key: str) -> None:
        fam = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels))
        for values, n in sorted(counts[key].items()):
            fam.add_metric(list(values), n)
        out.append(fam)

    counter(
        "alarms",
        "Alarms decided by the controller, by verdict, check and decision.",
        ("verdict", "check", "outcome"),
        "alarms",
    )
    counter(
        "drains", "Nodes drained by slurm-guard (auto or admin-approved).", ("trigger",), "drains"
    )
    counter(
        "requeues", "Jobs requeued (held, then released) after an alarm.", ("trigger",), "requeues"
    )
    counter(
        "action_failures", "Cluster actions that Slurm refused, by operation.", ("op",), "failed"
    )
    counter("admin_actions", "Admin approvals, returns and retirements.", ("op",), "admin")
    counter(
        "in_job_restarts",
        "Training steps restarted on a spare node of the job's own allocation.",
        (),
        "in_job_restarts",
    )
    counter(
        "holds",
        "Alarms that held their job, by rule: loop (the fault follows the job), budget "
        "(restart budget spent), ambiguous (no majority).",
        ("rule",),
        "holds",
    )
    bad = CounterMetricFamily(f"{PREFIX}_rejected_files", "Alarm files that could not be read.")
    bad.add_metric([], len(journal.bad_files))
    out.append(bad)

    waiting = sum(
        1
        for alarm_id, e in journal.alarms.items()
        if e.get("outcome") in WAITING_OUTCOMES and alarm_id not in journal.approvals
    )
    gauge = GaugeMetricFamily(
        f"{PREFIX}_pending_approvals",
        "Alarms waiting for `slurm-guard review approve`.",
        value=waiting,
    )
    out.append(gauge)
    out.append(
        GaugeMetricFamily(
            f"{PREFIX}_pending_jobs",
            "Jobs the controller must look at again (slurmctld down, job running, lock busy).",
            value=pending_jobs,
        )
    )
    in_window = journal.auto_drains_since(now - window_s)
    out.append(
        GaugeMetricFamily(
            f"{PREFIX}_circuit_breaker_drains",
            "Automatic drains in the circuit breaker's window.",
            value=in_window,
        )
    )
    out.append(
        GaugeMetricFamily(
            f"{PREFIX}_circuit_breaker_limit",
            "Automatic drains allowed per window (policy max_drains).",
            value=max_drains,
        )
    )
    out.append(
        GaugeMetricFamily(
            f"{PREFIX}_circuit_breaker_open",
            "1 when the next automatic drain would exceed the limit (alarms wait for approval).",
            value=1 if in_window >= max_drains else 0,
        )
    )
    up = GaugeMetricFamily(f"{PREFIX}_slurm_up", "1 if Slurm answered the node listing.")
    up.add_metric([], 0 if nodes is None else 1)
    out.append(up)
    if nodes is not None:
        drained = GaugeMetricFamily(
            f"{PREFIX}_nodes_out",
            "Nodes out of service with a reason slurm-guard wrote, by state (drain or fail).",
            labels=["state"],
        )
        # Slurm 24.11 keeps the reason of a resumed node: count only nodes it still holds out.
        ours = [n for n in nodes if (n.effective_reason or "").startswith(REASON_PREFIX)]
        failed_nodes = sum(1 for n in ours if n.failed)
        drained.add_metric(["fail"], failed_nodes)
        drained.add_metric(["drain"], len(ours) - failed_nodes)
        out.append(drained)
    if diagnoses:
        diag = GaugeMetricFamily(
            f"{PREFIX}_node_diagnosis_passed",
            "1 if the node's latest `slurm-guard diagnose` passed, 0 if it failed.",
            labels=["node"],
        )
        for node, passed in sorted(diagnoses.items()):
            diag.add_metric([node], 1 if passed else 0)
        out.append(diag)
    out.append(
        GaugeMetricFamily(
            f"{PREFIX}_last_pass_timestamp_seconds",
            "When the controller last finished a pass (Unix time).",
            value=now,
        )
    )
    return out


class _Snapshot:
    """A prometheus_client collector over families computed once, before writing."""

    def __init__(self, metrics: Iterable[Metric]) -> None:
        self._metrics = list(metrics)

    def collect(self) -> Iterator[Metric]:
        yield from self._metrics


def latest_diagnoses(state_dir: Path) -> dict[str, bool]:
    """Each diagnosed node's latest result (passed or not)."""
    out: dict[str, bool] = {}
    for node in diagnosed_nodes(state_dir):
        latest = latest_diagnosis(state_dir, node)
        if latest is not None:
            out[node] = latest.passed
    return out


def render(
    store: StateStore,
    *,
    max_drains: int,
    window_s: float,
    nodes: Sequence[NodeInfo] | None,
    now: float | None = None,
) -> str:
    """The textfile's content for the state directory as it is now."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_snapshot(store, max_drains, window_s, nodes, now))
    return generate_latest(registry).decode()


def _snapshot(
    store: StateStore,
    max_drains: int,
    window_s: float,
    nodes: Sequence[NodeInfo] | None,
    now: float | None,
) -> _Snapshot:
    return _Snapshot(
        families(
            store.read(),
            pending_jobs=len(store.pending()),
            max_drains=max_drains,
            window_s=window_s,
            now=time.time() if now is None else now,
            nodes=nodes,
            diagnoses=latest_diagnoses(store.root),
        )
    )


def write_metrics(
    path: Path,
    store: StateStore,
    *,
    max_drains: int,
    window_s: float,
    nodes: Sequence[NodeInfo] | None,
    now: float | None = None,
) -> None:
    """Write the textfile atomically (prometheus_client writes a temporary file and renames it).

    Raises MetricsError if prometheus_client is missing or the file cannot be written.
    """
    try:
        from prometheus_client import CollectorRegistry, write_to_textfile
    except ImportError:
        raise MetricsError(
            "policy.json sets metrics_file, but prometheus_client is not installed: "
            "pip install 'slurm-guard[metrics]'"
        ) from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_snapshot(store, max_drains, window_s, nodes, now))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(path), registry)
    except OSError as exc:
        raise MetricsError(f"cannot write metrics file {path}: {exc}") from None


def update_metrics(
    path: Path | None,
    store: StateStore,
    *,
    max_drains: int,
    window_s: float,
    list_nodes: Any = None,
) -> bool:
    """After a controller pass: rewrite the metrics file if one is configured; never raise.

    `list_nodes` is a callable returning the cluster's nodes (the SlurmClient's `nodes`); if it
    fails, the file still gets written, with `slurm_guard_slurm_up 0`. Metrics are a view: a
    failure to write them is logged and must not fail the pass that drained a node.
    """
    if path is None:
        return False
    nodes = None
    if list_nodes is not None:
        try:
            nodes = list(list_nodes())
        except Exception as exc:  # Slurm down or refusing: report it through slurm_up
            logger.warning("metrics: cannot list nodes (%s); slurm_guard_slurm_up is 0", exc)
    try:
        write_metrics(path, store, max_drains=max_drains, window_s=window_s, nodes=nodes)
    except MetricsError as exc:
        logger.error("%s", exc)
        return False
    except Exception:  # a view must never fail the pass that drained a node
        logger.exception("metrics: cannot write %s", path)
        return False
    return True


def metrics_path(state_dir: Path, metrics_file: str | None) -> Path | None:
    """policy.json's `metrics_file`; a relative name is relative to the state directory."""
    if metrics_file is None:
        return None
    path = Path(metrics_file)
    return path if path.is_absolute() else Path(state_dir) / path


def publish(store: StateStore, policy: Policy, client: Any, *, dry_run: bool = False) -> bool:
    """The end of every controller pass: rewrite the textfile the policy names, if any.

    A dry run changes nothing on disk, the metrics file included.
    """
    if dry_run:
        return False
    return update_metrics(
        metrics_path(store.root, policy.metrics_file),
        store,
        max_drains=policy.max_drains,
        window_s=policy.window_s,
        list_nodes=getattr(client, "nodes", None),
    )
