"""Recovery inside the allocation: which spare replaces the convicted node, and its record.

A job submitted with spares holds N+S nodes and trains on N. When the engine convicts a node
of the running step, the in-job supervisor asks here for N healthy nodes of the same
allocation: the step's nodes without the convicted ones, topped up with spares in allocation
order. A spare is healthy when Slurm shows it in service (not drained, failed or down, by
anyone) and the job never left it after an alarm. No spare left: the caller requeues instead.

The restart resumes from what `resume_source` picks, the same rule the guard applies when the
training command starts again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_guard.controller.resume_source import pick_resume_source
from slurm_guard.slurm.client import SlurmClient


@dataclass(frozen=True)
class Allocation:
    """The job's allocation as the in-job supervisor sees it.

    Args:
        nodes: every node of the allocation, in Slurm's order (SLURM_JOB_NODELIST).
        active: the nodes of the training step that just ended.
        train_nodes: N, the nodes a training step runs on.
        tasks_per_node: tasks of a training step on each node.
        attempt: the supervisor's step attempt that just ended (0 for the first).
    """

    nodes: tuple[str, ...]
    active: tuple[str, ...]
    train_nodes: int
    tasks_per_node: int
    attempt: int = 0

    @property
    def spares(self) -> int:
        return len(self.nodes) - self.train_nodes


@dataclass
class InJobOutcome:
    """What the engine decided for the supervisor: restart on `restart_on`, or stop."""

    restart_on: tuple[str, ...] = ()
    record: dict[str, Any] = field(default_factory=dict)


def healthy_nodes(
    allocation: Allocation, leave: set[str], left_before: set[str], client: SlurmClient
) -> tuple[str, ...] | None:
    """N nodes for the next step: the step's own minus `leave`, then spares; None if short."""
    keep = [n for n in allocation.active if n not in leave]
    for node in allocation.nodes:
        if len(keep) >= allocation.train_nodes:
            break
        if node in keep or node in leave or node in left_before:
            continue
        if node in allocation.active:
            continue
        info = client.node(node)
        if info.out_of_service or not info.responding:
            continue
        keep.append(node)
    if len(keep) < allocation.train_nodes:
        return None
    order = {n: i for i, n in enumerate(allocation.nodes)}
    return tuple(sorted(keep[: allocation.train_nodes], key=lambda n: order.get(n, 0)))


def restart_record(
    job_id: str,
    plan_id: str,
    alarm_ids: Sequence[str],
    alarm_times: Sequence[float],
    allocation: Allocation,
    nodes: tuple[str, ...],
    run_dir: Path,
    restart_count: int = 0,
) -> dict[str, Any]:
    """The journal fields of one in-job restart (see state.IN_JOB_RESTART): the plan.

    `resume_*` is where the restart is expected to resume from; what it really loaded is the
    guard's record (`rundir.resumes`), journaled with `restart_done` once its first step ran.
    `restart_count` (Slurm's), `attempt`, `train_nodes` and `tasks_per_node` find that record
    and, if the restart never runs, size the requeue that completes it.
    """
    source = pick_resume_source(run_dir)
    return {
        "job_id": job_id,
        "plan_id": plan_id,
        "alarm_ids": list(alarm_ids),
        "alarm_time": min(alarm_times, default=None),
        "attempt": allocation.attempt + 1,
        "restart_count": restart_count,
        "train_nodes": allocation.train_nodes,
        "tasks_per_node": allocation.tasks_per_node,
        "spares": allocation.spares,
        "left": sorted(set(allocation.active) - set(nodes)),
        "joined": sorted(set(nodes) - set(allocation.active)),
        "nodes": list(nodes),
        "resume_source": source.kind,
        "resume_step": source.step,
        "resume_detail": source.detail,
        "run_dir": str(run_dir),
    }
