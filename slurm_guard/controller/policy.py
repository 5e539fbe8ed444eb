"""Controller policy and the pure decision for one alarm.

The decision is a function of the alarm, what Slurm says about the job and the nodes, and the
policy; it never calls Slurm. Keeping it pure means every safety rule can be tested on its own,
and the engine is the only code that changes the cluster.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from slurm_guard.protocol import REASON_PREFIX
from slurm_guard.rundir.gpus import gpu_label
from slurm_guard.rundir.records import Alarm, RecordError, read_json_file
from slurm_guard.slurm.parsers import NodeInfo

"""Every drain reason we write starts with this; we only ever touch nodes whose reason does."""

POLICY_FILE = "policy.json"
AUTO = "auto"
APPROVE = "approve"
AMBIGUOUS_HOLD = "hold"
AMBIGUOUS_DRAIN = "drain"

# Job states in which the batch script may still be running: an alarm of the current run of such
# a job is acted on only after the job ends (or by `recover`, which runs inside it).
ACTIVE_JOB_STATES = frozenset(
    {"RUNNING", "CONFIGURING", "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT"}
)


class PolicyError(ValueError):
    """The policy file or a policy option is invalid; the message names the field."""


@dataclass(frozen=True)
class Policy:
    """What the controller may do on its own.

    Args:
        mode: `auto` drains and requeues at once; `approve` records the decision and waits for
            `slurm-guard review approve`.
        ambiguous: `hold` requeue-holds the job of an ambiguous alarm (nothing drained) until an
            admin approves; `drain` treats it like an SDC verdict.
        max_drains: circuit breaker, automatic drains allowed per `window_s`. Past it, alarms wait
            for approval: a fleet-wide cause (a bad driver roll-out) must not empty the cluster.
        window_s: the circuit-breaker window in seconds.
        retire_after: a node with this many confirmed alarms (sdc, drained or approved) within
            `retire_days` days is one to retire: `review` says so and `review return` refuses it
            without --force. None: no such rule.
        retire_days: the window of `retire_after`, in days.
        metrics_file: where the controller writes its Prometheus textfile after every pass
            (node_exporter's --collector.textfile.directory, a name ending in .prom); None: none.
        restart_budget: restarts (in-job restarts and requeues together) one job may get per
            `restart_window_s`; the next alarm holds the job instead. 0: never restart.
        restart_window_s: the window of `restart_budget`, in seconds (default 24 h).
        loop_nodes: alarms of one check on this many different nodes of one job mean the fault
            follows the job (software, data, image), not a node: the job is held, nothing
            more drained. The same check failing again at the same step after a resume on
            another node means the same at once.
        in_job_restarts: restart on a healthy spare of the allocation when the job has one
            (`--spares`); False: always requeue.
    """

    mode: str = AUTO
    ambiguous: str = AMBIGUOUS_HOLD
    max_drains: int = 3
    window_s: float = 3600.0
    retire_after: int | None = None
    retire_days: float = 30.0
    metrics_file: str | None = None
    restart_budget: int = 3
    restart_window_s: float = 86400.0
    loop_nodes: int = 3
    in_job_restarts: bool = True

    def __post_init__(self) -> None:
        if self.mode not in (AUTO, APPROVE):
            raise PolicyError(f"policy mode {self.mode!r}: use {AUTO!r} or {APPROVE!r}")
        if self.ambiguous not in (AMBIGUOUS_HOLD, AMBIGUOUS_DRAIN):
            raise PolicyError(
                f"ambiguous {self.ambiguous!r}: use {AMBIGUOUS_HOLD!r} or {AMBIGUOUS_DRAIN!r}"
            )
        if self.max_drains < 0 or self.window_s <= 0:
            raise PolicyError("max_drains must be >= 0 and window_s > 0")
        if (self.retire_after is not None and self.retire_after < 1) or self.retire_days <= 0:
            raise PolicyError("retire_after must be >= 1 (or null) and retire_days > 0")
        if self.metrics_file is not None and not self.metrics_file.endswith(".prom"):
            raise PolicyError(
                f"metrics_file {self.metrics_file!r}: node_exporter reads only *.prom files"
            )
        if self.restart_budget < 0 or self.restart_window_s <= 0 or self.loop_nodes < 2:
            raise PolicyError(
                "restart_budget must be >= 0, restart_window_s > 0 and loop_nodes >= 2"
            )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, source: str = "policy") -> Policy:
        if not isinstance(obj, dict):
            raise PolicyError(f"{source}: expected a JSON object")
        unknown = set(obj) - {
            "mode",
            "ambiguous",
            "max_drains",
            "window_s",
            "retire_after",
            "retire_days",
            "metrics_file",
            "restart_budget",
            "restart_window_s",
            "loop_nodes",
            "in_job_restarts",
        }
        if unknown:
            raise PolicyError(f"{source}: unknown keys {sorted(unknown)}")
        try:
            return cls(
                mode=str(obj.get("mode", AUTO)),
                ambiguous=str(obj.get("ambiguous", AMBIGUOUS_HOLD)),
                max_drains=int(obj.get("max_drains", 3)),
                window_s=float(obj.get("window_s", 3600.0)),
                retire_after=(
                    int(obj["retire_after"]) if obj.get("retire_after") is not None else None
                ),
                retire_days=float(obj.get("retire_days", 30.0)),
                metrics_file=(
                    str(obj["metrics_file"]) if obj.get("metrics_file") is not None else None
                ),
                restart_budget=int(obj.get("restart_budget", 3)),
                restart_window_s=float(obj.get("restart_window_s", 86400.0)),
                loop_nodes=int(obj.get("loop_nodes", 3)),
                in_job_restarts=_flag(obj.get("in_job_restarts", True), "in_job_restarts"),
            )
        except (TypeError, ValueError) as exc:
            raise PolicyError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, state_dir: Path) -> Policy:
        """The policy the epilog and the watcher share: `<state_dir>/policy.json` or defaults."""
        path = state_dir / POLICY_FILE
        if not path.exists():
            return cls()
        try:
            return cls.from_json(read_json_file(path), str(path))
        except RecordError as exc:
            raise PolicyError(str(exc)) from None

    def save(self, state_dir: Path) -> None:
        from slurm_guard.rundir.records import atomic_write_json

        atomic_write_json(state_dir / POLICY_FILE, self.to_json())


def _flag(value: Any, name: str) -> bool:
    """A JSON boolean; "false" as a string is refused rather than read as true."""
    if not isinstance(value, bool):
        raise PolicyError(f"{name}: expected true or false, got {value!r}")
    return value


class Outcome(str, Enum):
    """What the controller decided for one alarm."""

    ACT = "act"  # drain the suspects and requeue excluding them
    HOLD = "hold"  # requeue-hold the job, drain nothing, wait for review
    AWAIT_APPROVAL = "await_approval"  # do nothing until `review approve`
    NO_ACTION = "no_action"  # valid alarm, nothing to do (numerical)
    REJECTED = "rejected"  # failed a safety rule: never acted on
    DEFER = "defer"  # cannot decide yet (job still running): retried later


@dataclass(frozen=True)
class JobFacts:
    """What Slurm says about the alarm's job, reduced to what the safety rules need."""

    exists: bool
    state: str = ""
    nodes: frozenset[str] = frozenset()
    user_id: int = -1
    restart_count: int = 0


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    reason: str
    drain_nodes: tuple[str, ...] = ()
    exclude_nodes: tuple[str, ...] = ()
    hold_kind: str = ""  # why a HOLD holds: "ambiguous", "loop" (follows the job), "budget"


def foreign_reason(reason: str | None) -> bool:
    """A node reason set by anything but slurm-guard: such a node is never touched.

    Pass the reason in force (`NodeInfo.effective_reason`), not the raw one: Slurm 24.11 keeps
    a resumed node's old reason, and an admin's long-finished maintenance note must not stop
    slurm-guard from draining a node that corrupts training now.
    """
    return bool(reason) and not str(reason).startswith(REASON_PREFIX)


def foreign_node(node: NodeInfo) -> bool:
    """The node is held out of service by someone else (drained, failed or down with a reason
    slurm-guard did not write): never touched."""
    return foreign_reason(node.effective_reason)


def drain_reason(alarm: Alarm) -> str:
    """Readable in `sinfo -R`, and parseable back into the alarm it came from; names the
    suspect GPU (`gpu 3`) where the alarm recorded one, so the admin knows which to pull."""
    gpu = gpu_label(alarm.suspect_gpus)
    return (
        f"{REASON_PREFIX} job {alarm.job_id} step {alarm.step} check {alarm.check} "
        + (f"{gpu} " if gpu else "")
        + f"alarm {alarm.alarm_id}"
    )


def check_safety(alarm: Alarm, job_id: str, job: JobFacts, file_uid: int) -> str | None:
    """The safety rules every alarm must pass before anything acts on it; None means it passed."""
    if alarm.job_id != job_id:
        return f"alarm names job {alarm.job_id}, not job {job_id}"
    if not job.exists:
        return f"job {job_id} does not exist in Slurm"
    if file_uid != job.user_id:
        return (
            f"alarm file is owned by uid {file_uid}, but job {job_id} belongs to uid "
            f"{job.user_id}: only the job's own user may raise its alarms"
        )
    if alarm.verdict == "sdc" and not alarm.suspect_nodes:
        return "sdc verdict without a suspect node"
    outside = [n for n in alarm.suspect_nodes if n not in job.nodes]
    if outside:
        if not job.nodes:
            return (
                f"suspect node(s) {', '.join(outside)} cannot be checked: job {job_id} has no "
                "allocation any more (it was requeued before the controller saw this alarm)"
            )
        return (
            f"suspect node(s) {', '.join(outside)} not in job {job_id}'s allocation "
            f"({', '.join(sorted(job.nodes))})"
        )
    return None


def decide(
    alarm: Alarm,
    job_id: str,
    job: JobFacts,
    file_uid: int,
    policy: Policy,
    *,
    drains_in_window: int,
    in_job: bool = False,
) -> Decision:
    """Decide one alarm. `drains_in_window` is the circuit breaker's count of automatic drains."""
    if (
        job.exists
        and not in_job
        and job.state in ACTIVE_JOB_STATES
        and alarm.restart_count >= job.restart_count
    ):
        return Decision(Outcome.DEFER, f"job {job_id} is still {job.state}; decided once it ends")
    if job.exists and not job.nodes and job.state == "COMPLETING":
        # While EpilogSlurmctld runs, Slurm shows no node list; only the job's own epilog knows
        # it (SLURM_JOB_NODELIST). Anyone else waits: rejecting here would lose the alarm.
        return Decision(
            Outcome.DEFER,
            f"job {job_id} is completing and Slurm shows no node list yet; decided once it ends",
        )
    problem = check_safety(alarm, job_id, job, file_uid)
    if problem is not None:
        return Decision(Outcome.REJECTED, problem)
    nodes = tuple(sorted(set(alarm.suspect_nodes)))
    if alarm.verdict == "numerical":
        return Decision(
            Outcome.NO_ACTION,
            "numerical verdict: the replay on another node reproduced the value, so the model "
            "or the data produced it, not the hardware; nothing drained, job not requeued",
        )
    if alarm.verdict == "ambiguous" and policy.ambiguous == AMBIGUOUS_HOLD:
        return Decision(
            Outcome.HOLD,
            "ambiguous verdict: no strict majority names a node; job held for review "
            "(approve to drain the suspects and release it)",
            exclude_nodes=nodes,
            hold_kind="ambiguous",
        )
    if policy.mode == APPROVE:
        return Decision(
            Outcome.AWAIT_APPROVAL,
            "policy 'approve': waiting for `slurm-guard review approve`",
            drain_nodes=nodes,
            exclude_nodes=nodes,
        )
    if drains_in_window + len(nodes) > policy.max_drains:
        return Decision(
            Outcome.AWAIT_APPROVAL,
            f"circuit breaker open: {drains_in_window} automatic drain(s) in the last "
            f"{policy.window_s:g} s, limit {policy.max_drains}; nothing drained, approve to act",
            drain_nodes=nodes,
            exclude_nodes=nodes,
        )
    return Decision(
        Outcome.ACT,
        f"{alarm.verdict} verdict on {', '.join(nodes)}: drain and requeue excluding them",
        drain_nodes=nodes,
        exclude_nodes=nodes,
    )
