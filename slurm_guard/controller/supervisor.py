"""The in-job supervisor: run the training step, and after an alarm restart it on spares.

A short loop, read top to bottom, in the batch script of a job with spare nodes (`slurm-guard
supervise`, which the sbatch template and `launch(spares=S)` run):

1. start the training step on N nodes of the allocation (journaled: `job_step` start);
2. when it ends (journaled: `job_step` end with its status), stop on success;
3. otherwise ask the engine, under the same lock, journal, policy and circuit breaker as the
   epilog and the watcher. It decides every undecided alarm and answers with one of: restart
   on these N nodes (a spare replaces the convicted node, which is drained), requeue the job
   (no healthy spare left, or the policy says so), hold it (the alarms follow the job, or its
   restart budget is spent), or nothing to do (no alarm: a crash is not ours to retry);
4. restart the step on the nodes the engine named, or exit with the step's status.

The supervisor decides nothing itself: every choice of node, restart, requeue or hold is the
engine's, and the restart count lives in the journal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from slurm_guard.controller.engine import Engine
from slurm_guard.controller.in_job import Allocation
from slurm_guard.slurm.task import ATTEMPT_ENV

StepRunner = Callable[[Sequence[str], int, Sequence[str], Mapping[str, str]], int]
"""Runs one training step on the nodes (`client.run_training_step`): returns its status."""


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def first_nodes(allocation: Sequence[str], train_nodes: int, left: set[str]) -> tuple[str, ...]:
    """The first step's nodes: the allocation's first N, passing over nodes the job left after
    an alarm (an admin may have returned one that Slurm then allocated again)."""
    fresh = [n for n in allocation if n not in left]
    chosen = fresh[:train_nodes]
    if len(chosen) < train_nodes:
        chosen += [n for n in allocation if n in left][: train_nodes - len(chosen)]
    order = {n: i for i, n in enumerate(allocation)}
    return tuple(sorted(chosen, key=order.__getitem__))


def supervise(
    engine: Engine,
    job_id: str,
    run_dir: Path,
    allocation: Sequence[str],
    train_nodes: int,
    tasks_per_node: int,
    command: Sequence[str],
    run_step: StepRunner,
    *,
    deciding: Callable[[], AbstractContextManager[None]] = _nothing,
    echo: Callable[[str], None] = print,
) -> int:
    """Run the training step until it succeeds or the engine says stop; return the status.

    `deciding` wraps each engine call (the CLI ignores SIGTERM there: a requeue of this job
    signals the batch script while the plan finishes).
    """
    nodes = tuple(allocation)
    if len(nodes) < train_nodes:
        raise ValueError(f"{len(nodes)} node(s) allocated, {train_nodes} needed for training")
    active = first_nodes(nodes, train_nodes, engine.store.read().nodes_left_by(job_id))
    attempt = 0
    while True:
        engine.record_step(
            job_id, event="start", attempt=attempt, nodes=list(active), run_dir=str(run_dir)
        )
        echo(f"slurm-guard supervise: step attempt {attempt} on {','.join(active)}")
        status = run_step(active, tasks_per_node, command, {ATTEMPT_ENV: str(attempt)})
        engine.record_step(job_id, event="end", attempt=attempt, nodes=list(active), rc=status)
        if status == 0:
            if attempt > 0:  # journal the restart as done (its first step ran) before leaving
                with deciding():
                    engine.process_job(job_id, run_dir, in_job=True)
            return 0
        view = Allocation(nodes, active, train_nodes, tasks_per_node, attempt)
        with deciding():
            report = engine.process_job(job_id, run_dir, in_job=True, spares=view)
        for line in report.lines():
            echo(line)
        if report.in_job is None or not report.in_job.restart_on:
            echo(f"slurm-guard supervise: step ended with status {status}; no restart here")
            return status
        active = tuple(report.in_job.restart_on)
        attempt += 1
