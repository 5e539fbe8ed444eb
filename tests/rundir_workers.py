"""Trainings for test_failsafe_rundir.py (importable: the processes are spawned).

`run_cases` runs several cases one after another in one process group (spawning is the slow
part). Each case is a fresh model, DDP wrapper and Guard: one start of a run. A GuardError is
the case's result, not the end of the worker, so one launch can show many refusals.
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from workers import SMALL, weights

import slurm_guard as sg
from slurm_guard.examples.tiny_gpt import TinyGPT, lm_loss, make_batch


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Train `steps` steps from wherever resume() says, saving every `checkpoint_every` steps.

    Optional: `vanish_at` (rank 0 deletes and recreates the run directory before that step),
    `resume` (False: do not call resume()).
    """
    rank = dist.get_rank()
    run_dir = case["run_dir"].format(rank=rank)
    torch.manual_seed(0)
    model = TinyGPT(SMALL)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    guard = sg.Guard(ddp, opt, lm_loss, run_dir, config=case.get("config"))
    start = guard.resume() if case.get("resume", True) else 0
    every = case.get("checkpoint_every", 0)
    try:
        for step in range(start, case["steps"]):
            if case.get("vanish_at") == step:
                if rank == 0:
                    shutil.rmtree(run_dir)
                    os.mkdir(run_dir)  # recreated empty, as a missing mount point would look
                dist.barrier()
            guard.step(make_batch(step, rank, SMALL))
            if every and (step + 1) % every == 0:
                guard.save_checkpoint()
    except sg.SilentDataCorruption as exc:
        return {"start": start, "alarm": exc.alarm.to_json(), "final": weights(model)}
    return {"start": start, "alarm": None, "final": weights(model)}


def run_cases(cases: list[dict[str, Any]], as_nobody: str | None = None) -> list[dict[str, Any]]:
    """Each case's result dict, or {"error": message} for a GuardError raised by the guard.

    With `as_nobody` (a scratch directory) the process first becomes uid/gid 65534: root reads
    and writes anything, so permission failures are only real for an unprivileged user. Python
    and torch live under /root (mode 0700 here), so a warm-up run as root first imports every
    module the guard and torch.save import lazily.
    """
    if as_nobody is not None:
        run_case({"run_dir": as_nobody, "steps": 6, "checkpoint_every": 5, "config": CONFIG})
        run_case({"run_dir": as_nobody, "steps": 6, "checkpoint_every": 5, "config": CONFIG})
        torch.load(io.BytesIO(_saved()), weights_only=False)
        dist.barrier()
        os.setgid(65534)
        os.setuid(65534)
    results: list[dict[str, Any]] = []
    for case in cases:
        saved = {k: os.environ.get(k) for k in case.get("env", {})}
        os.environ.update(case.get("env", {}))
        try:
            results.append(run_case(case))
        except sg.GuardError as exc:
            results.append({"error": str(exc)})
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        dist.barrier()
    return results


def _saved() -> bytes:
    buffer = io.BytesIO()
    torch.save({"t": torch.zeros(1)}, buffer)
    return buffer.getvalue()


def make_template(run_dir: str, steps: int) -> None:
    """A clean run with checkpoints every 5 steps, to copy and damage."""
    run_case({"run_dir": run_dir, "steps": steps, "checkpoint_every": 5, "config": CONFIG})
    dist.barrier()


CONFIG = sg.GuardConfig(replay_every=5, vote_every=5)


def fault_config(onset: int = 7) -> sg.GuardConfig:
    """A persistent fault on rank 1 (node2) from `onset`: caught by the replay at step 10."""
    fault = sg.Fault("grad-scale", rank=1, step=onset, persistent=True, param=10)
    return sg.GuardConfig(replay_every=5, vote_every=5, faults=(fault,))


def chown_tree(path: Path, uid: int = 65534) -> None:
    os.chown(path, uid, uid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)
