"""One Slurm task of the rendezvous test (run by srun in tests/test_launch_slurm.py).

Records every Slurm command this task runs (by wrapping the real client's `run`, which every
Slurm command of slurm-guard goes through), joins the process group with
`init_distributed_from_slurm`, checks it with an all-reduce and writes what it saw to
`<out>/rank-<N>.json`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurm_guard.slurm import client as slurm_client
from slurm_guard.slurm.task import init_distributed_from_slurm


def main(out: Path) -> None:
    torch.set_num_threads(1)
    commands: list[list[str]] = []
    real_run = slurm_client.CommandSlurmClient.run

    def recording_run(self: Any, argv: Sequence[str], timeout: float | None = None) -> Any:
        commands.append(list(argv))
        return real_run(self, argv, timeout)

    slurm_client.CommandSlurmClient.run = recording_run  # type: ignore[method-assign]
    task = init_distributed_from_slurm(timeout=datetime.timedelta(seconds=60))
    total = torch.ones(1)
    dist.all_reduce(total)
    result = {
        "rank": task.rank,
        "node": task.node,
        "world": int(total.item()),
        "master_addr": os.environ["MASTER_ADDR"],
        "commands": commands,
    }
    dist.destroy_process_group()
    (out / f"rank-{task.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
