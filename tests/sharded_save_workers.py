"""A sharded save that fails on one rank only (spawned processes import this module).

Two real failures of one rank, injected in that rank's process only: its DCP storage writer
raises (a full or unwritable disk on that node), or torch cannot turn tensors into numpy arrays
there (what a venv without numpy does to DCP's plan exchange on the coordinator).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from sharded_guard_workers import train


def _no_numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("Numpy is not available")  # torch's own words without numpy


def save_fails_on_one_rank(run_dir: str, failing_rank: int, how: str) -> dict[str, Any]:
    """Train 2 steps under ShardedGuard and save; `how` breaks the save on `failing_rank`."""
    if dist.get_rank() == failing_rank:
        if how == "writer":
            from torch.distributed.checkpoint.filesystem import FileSystemWriter

            def write_data(self: Any, *args: Any, **kwargs: Any) -> Any:
                raise OSError(28, "No space left on device (injected on this rank)")

            FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
        elif how == "numpy":
            torch.Tensor.numpy = _no_numpy  # type: ignore[method-assign]
        else:
            raise ValueError(how)
    return train(run_dir, 3, hsdp=False, save_at=(2,), config={"watchdog_seconds": 600})
