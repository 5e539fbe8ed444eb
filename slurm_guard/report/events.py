"""`record_loss`: how a training script puts its loss on the report's plot.

The guard's ledger holds verification results, not the loss (a replay compares losses, but a
plain step never sends its loss to the host). The report reads losses from the run
directory's `train-events.jsonl`, the file the example trainer writes its start, alarm and
finish events to; one line per call, appended with a single write, so a crash leaves at worst
a torn last line, which the report skips. Standard library only: importing it costs a training
script nothing.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, SupportsFloat

from slurm_guard.errors import GuardError
from slurm_guard.report.timeline import EVENTS_FILE


def record_loss(
    run_dir: str | os.PathLike[str],
    step: int,
    loss: SupportsFloat,
    *,
    restart_count: int | None = None,
) -> None:
    """Append `{"event": "loss", "step", "loss", "restart_count", "time"}` for the report.

    Call it on one rank (rank 0), after the step: `float(loss)` of a CUDA tensor waits for
    the GPU, so record every N steps rather than every step if that matters to you.
    `restart_count` defaults to `$SLURM_RESTART_COUNT` (0 outside Slurm); the report numbers
    the runs by time either way. A non-finite loss is recorded as null (JSON has no NaN).

    Raises:
        GuardError: `step` is not a non-negative int, or the file cannot be written.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise GuardError(f"record_loss: step must be a non-negative int, got {step!r}")
    value = float(loss)
    count = restart_count
    if count is None:
        env = os.environ.get("SLURM_RESTART_COUNT", "0")
        count = int(env) if env.isdigit() else 0
    event: dict[str, Any] = {
        "event": "loss",
        "step": step,
        "loss": value if math.isfinite(value) else None,
        "restart_count": count,
        "time": time.time(),
    }
    line = (json.dumps(event, sort_keys=True) + "\n").encode()
    path = Path(run_dir) / EVENTS_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as exc:
        raise GuardError(f"record_loss: cannot append to {path}: {exc.strerror}") from None
