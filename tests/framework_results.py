"""What the framework test runs (HF Trainer, Lightning) hand back, collected one way for both.

The workers (tests/hf_workers.py, tests/lightning_workers.py) and the Slurm training commands
(tests/hf_slurm_train.py, tests/lightning_slurm_train.py) differ only in the framework they
drive; the weights' hash, the alarms, the checkpoint listing and the Slurm task's result file
are read the same way, so the HF and Lightning tests compare like with like.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SlurmRun = Callable[[str, str, str | None, int], dict[str, Any]]
"""(run dir, framework output dir, fault node or None, fault step) -> the rank's result."""


def state_sha(model: torch.nn.Module) -> str:
    """sha256 over the state dict's names and raw bytes: equal iff bit for bit equal."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def alarms(run_dir: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(run_dir, "alarms").glob("*.json"))]


def status_json(run_dir: Path, state_dir: Path) -> dict[str, Any]:
    """What `slurm-guard status --json` says about the run (no Slurm: its client fails fast)."""
    from click.testing import CliRunner

    from slurm_guard.cli.main import main

    args = ["status", str(run_dir), "--state-dir", str(state_dir), "--json"]
    result = CliRunner().invoke(main, args, env={"SLURM_CONF": "/nonexistent/slurm.conf"})
    assert result.exit_code == 0, result.output
    view: dict[str, Any] = json.loads(result.output)
    return view


def listing(path: str, pattern: str) -> list[str]:
    """The framework's checkpoints under `path`, quarantined ones included, relative to it."""
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob(pattern))


def slurm_task_main(
    doc: str,
    run: SlurmRun,
    result_file: str,
    fault_step: int,
    argv: Sequence[str] | None,
    join: bool = True,
) -> int:
    """One srun task: join the process group from Slurm (`join`; else the framework joins it
    from the torchrun variables `slurm-guard task` exported), `run`, rank 0 writes
    `result_file` into `$SLURM_GUARD_RUN_DIR`. Returns the run's exit code (86 after an
    alarm)."""
    from slurm_guard.rundir.records import atomic_write_json
    from slurm_guard.slurm.task import RUN_DIR_ENV, init_distributed_from_slurm, task_from_env

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", required=True, help="the framework's output (checkpoints)")
    parser.add_argument("--fault-node", default=None, help="Slurm node name of the bad GPU")
    parser.add_argument("--fault-step", type=int, default=fault_step)
    args = parser.parse_args(argv)
    run_dir = os.environ[RUN_DIR_ENV]
    task = init_distributed_from_slurm() if join else task_from_env()
    try:
        result = run(run_dir, args.out, args.fault_node, args.fault_step)
        code = int(result.get("exit_code") or 0)
        if code == 0 and dist.get_rank() == 0:
            atomic_write_json(
                Path(run_dir) / result_file,
                {**result, "restart_count": task.restart_count, "nodes": list(task.nodes)},
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return code
