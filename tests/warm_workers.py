"""The logging compiler wrapper, and a guarded run that reads its log after `Guard()` and again
after its first steps, for the kernel build and set-up warm-up tests."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from workers import SMALL

import slurm_guard as sg
from slurm_guard.comm.errors import RankFailed
from slurm_guard.core.setup import bucket_numels
from slurm_guard.examples.tiny_gpt import TinyGPT, lm_loss, make_batch
from slurm_guard.kernels import build, native, sketch

GCC = shutil.which("gcc")


def logging_compiler(tmp_path: Path) -> tuple[Path, Path]:
    """($CC, its log): a script that appends its arguments to the log and execs gcc, so that
    each compile is a line in the log."""
    log = tmp_path / "cc.log"
    cc = tmp_path / "logging-cc"
    cc.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {GCC} "$@"\n')
    cc.chmod(0o755)
    return cc, log


def _compiles(log: str) -> int:
    path = Path(log)
    return len(path.read_text().splitlines()) if path.exists() else 0


def compiles_around_setup(run_dir: str, log: str, steps: int) -> dict[str, Any]:
    """Compiler runs logged after `Guard()` and after `steps` steps (replay steps and votes
    among them), with what the warm-up loaded."""
    torch.manual_seed(0)
    ddp = DDP(TinyGPT(SMALL))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    config = sg.GuardConfig(replay_every=2, vote_every=2)
    guard = sg.Guard(ddp, opt, lm_loss, run_dir, config=config)
    after_setup = _compiles(log)
    buckets = bucket_numels(ddp, guard.params)
    dist.barrier()  # every rank has read the count before any rank steps
    for step in range(steps):
        guard.step(make_batch(step, dist.get_rank(), SMALL))
    dist.barrier()
    return {
        "after_setup": after_setup,
        "after_steps": _compiles(log),
        "native": guard.kernels.native,
        "buckets": buckets,
        "verified": list(guard.verified_steps),
        "voted_at": guard.voted_at,
    }


def warm_up_fails_on_one_rank(run_dir: str, bad_cache: str) -> str:
    """Rank 1's kernel cache holds a bucket-check library without its symbols (a damaged node
    cache: it loads, then its wrapper raises); `Guard()` must stop every rank alike."""
    if dist.get_rank() == 1:
        os.environ["SLURM_GUARD_CACHE"] = bad_cache
        cc = build.compiler()
        assert cc is not None
        name = sketch.C_SOURCE
        target = Path(bad_cache) / native.library_name(
            name, sketch.kernel_defines(), cc, native.NATIVE_FLAGS
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        empty = target.with_suffix(".c")
        empty.write_text("int sg_nothing(void) { return 0; }\n")
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(target), str(empty)], check=True)
    torch.manual_seed(0)
    ddp = DDP(TinyGPT(SMALL))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    try:
        sg.Guard(ddp, opt, lm_loss, run_dir)
    except RankFailed as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
