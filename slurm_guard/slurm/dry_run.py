"""A SlurmClient that changes nothing and says, in words, what it would have changed.

The controller's dry run and the local drill both need "the real decision, no real change".
Instead of a `dry_run` test in front of every cluster change, the controller is handed this
wrapper: reads go to the real client (or to facts given up front when there is no cluster),
and every change is validated like the real one, recorded as a readable line ("would drain
node2: <reason>") and remembered, so that the next read sees the node drained or the job held,
exactly as the following steps of a real run would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path

from slurm_guard.slurm.client import (
    SlurmClient,
    SlurmCommandError,
    SlurmNotFound,
    validate_job_id,
    validate_node_name,
    validate_reason,
    validate_start_time,
)
from slurm_guard.slurm.parsers import JobInfo, NodeInfo, expand_hostlist

__all__ = ["DryRunSlurm"]

# States a resume clears, as `scontrol update State=RESUME` does.
_CLEARED_BY_RESUME = frozenset({"DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "DOWN"})


def _names(nodes: Sequence[str]) -> str:
    return ", ".join(nodes)


class DryRunSlurm:
    """Answers reads from `inner` (if any) or from the given facts; records changes as words.

    Args:
        inner: The real client to read from, or None where there is no cluster (the local
            drill); then only the given `jobs` and `nodes` exist.
        jobs, nodes: Facts that take precedence over `inner`'s answers.

    `changes` lists every change that would have been made, in order, in words an admin
    reads ("would requeue job 1001 and hold it"), never as internal operation tuples.
    """

    def __init__(
        self,
        inner: SlurmClient | None = None,
        *,
        jobs: Iterable[JobInfo] = (),
        nodes: Iterable[NodeInfo] = (),
    ) -> None:
        self.inner = inner
        self._jobs: dict[str, JobInfo] = {j.job_id: j for j in jobs}
        self._nodes: dict[str, NodeInfo] = {n.name: n for n in nodes}
        self.changes: list[str] = []
        self._told = 0

    def take_changes(self) -> list[str]:
        """The changes recorded since the last call (for a report built step by step)."""
        new = self.changes[self._told :]
        self._told = len(self.changes)
        return new

    # ------------------------------------------------------------- reads

    def job(self, job_id: str) -> JobInfo | None:
        if job_id in self._jobs:
            return self._jobs[job_id]
        return self.inner.job(job_id) if self.inner is not None else None

    def node(self, name: str) -> NodeInfo:
        if name in self._nodes:
            return self._nodes[name]
        if self.inner is not None:
            return self.inner.node(name)
        raise SlurmNotFound(f"Slurm knows no node {name!r} (dry run)", [], None, "")

    def nodes(self) -> list[NodeInfo]:
        found = self.inner.nodes() if self.inner is not None else []
        out = [self._nodes.get(n.name, n) for n in found]
        known = {n.name for n in out}
        out += [n for name, n in self._nodes.items() if name not in known]
        return out

    def expand_hostlist(self, expression: str) -> list[str]:
        if self.inner is not None:
            return self.inner.expand_hostlist(expression)
        return expand_hostlist(expression)

    # ------------------------------------------------------------- node changes

    def _node_change(self, name: str, line: str, **changes: object) -> None:
        info = self.node(validate_node_name(name))
        self._nodes[name] = dataclasses.replace(info, **changes)  # type: ignore[arg-type]
        self.changes.append(line)

    def drain(self, node: str, reason: str) -> None:
        validate_reason(reason)
        info = self.node(validate_node_name(node))
        self._node_change(
            node, f"would drain {node}: {reason}", states=info.states | {"DRAIN"}, reason=reason
        )

    def resume(self, node: str) -> None:
        info = self.node(validate_node_name(node))
        was = f" (its reason now: {info.reason})" if info.reason else ""
        self._node_change(
            node,
            f"would resume {node}{was}",
            states=(info.states - _CLEARED_BY_RESUME) or frozenset({"IDLE"}),
            reason=None,
        )

    def fail(self, node: str, reason: str) -> None:
        validate_reason(reason)
        info = self.node(validate_node_name(node))
        self._node_change(
            node,
            f"would set {node} FAIL: {reason}",
            states=info.states | {"DRAIN", "FAIL"},
            reason=reason,
        )

    # ------------------------------------------------------------- job changes

    def _job_change(self, job_id: str, line: str, **changes: object) -> None:
        info = self.job(validate_job_id(job_id))
        if info is None:
            # Slurm would refuse too; the caller handles it like the real error.
            raise SlurmCommandError(
                f"job {job_id} is not known to Slurm (dry run)", [], 1, "Invalid job id specified"
            )
        self._jobs[job_id] = dataclasses.replace(info, **changes)  # type: ignore[arg-type]
        self.changes.append(line)

    def requeue_hold(self, job_id: str) -> None:
        info = self.job(validate_job_id(job_id))
        restarts = info.restart_count + 1 if info is not None else 1
        self._job_change(
            job_id,
            f"would requeue job {job_id} and hold it",
            state="PENDING",
            held=True,
            nodes=(),
            restart_count=restarts,
        )

    def set_excluded_nodes(
        self,
        job_id: str,
        nodes: Sequence[str],
        *,
        node_count: int | None = None,
        task_count: int | None = None,
    ) -> None:
        if isinstance(nodes, str):
            raise TypeError("nodes must be a sequence of node names, not one string")
        names = tuple(validate_node_name(n) for n in nodes)
        line = (
            f"would exclude {_names(names)} from job {job_id}"
            if names
            else f"would clear job {job_id}'s excluded nodes"
        )
        if node_count is not None:
            line += f" and shrink it to {node_count} nodes, {task_count} tasks"
        self._job_change(job_id, line, excluded_nodes=names)

    def release(self, job_id: str) -> None:
        self._job_change(job_id, f"would release job {job_id}", held=False)

    def set_start_time(self, job_id: str, when: str) -> None:
        validate_start_time(when)
        self._job_change(job_id, f"would let job {job_id} start {_start_words(when)}")

    def submit(self, script: Path, args: Sequence[str] = ()) -> str:
        if isinstance(args, str):
            raise TypeError("args must be a sequence of sbatch options, not one string")
        options = f" with {' '.join(args)}" if args else ""
        self.changes.append(f"would submit {script}{options}")
        return "(dry run: not submitted)"


def _start_words(when: str) -> str:
    """`StartTime=now+2` in words with its unit (Slurm reads a bare `now+N` as seconds)."""
    if when.startswith("now+") and when[4:].isdigit():
        return f"{when[4:]} s from now (StartTime={when})"
    return f"at {when} (StartTime={when})"
