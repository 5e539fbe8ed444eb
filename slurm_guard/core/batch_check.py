"""Does a resumed run see the data the run saw? Rank 0's batch fingerprints on verification steps.

A resume is bit-identical to the uninterrupted run only if every step sees the same batch. An
unseeded dataset (random data made at start), sampler or augmentation breaks that silently:
the resumed run trains on other data and nothing says so. So on every verification step rank 0
fingerprints its batch (the first microbatch's tensors, on their device: no host read then)
and appends it to `batches.jsonl` when the fingerprints are read (at each checkpoint save and
at the end of the run: one host read for all pending steps). A step that an earlier start of
the run recorded with another fingerprint is a warning naming the step and the likely cause.
Rank 0's batch stands for all: the causes above change every rank's data alike.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from slurm_guard.checks.replay import Microbatches
from slurm_guard.fingerprint import Fingerprinter, as_int
from slurm_guard.rundir.records import fsync_dir

logger = logging.getLogger(__name__)

BATCHES_FILE = "batches.jsonl"
BATCHES_SCHEMA = 1
_FLUSH_AT = 64  # pending fingerprints (a few int64 each) before a read regardless of saves


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for key in sorted(obj):
            _tensors(obj[key], out)
    elif isinstance(obj, (list, tuple, Microbatches)):
        for item in obj:
            _tensors(item, out)
    return out


class BatchRecord:
    """Rank 0's batch fingerprints: noted on verification steps, compared when read."""

    def __init__(self, run_dir: Path, fingerprinter: Fingerprinter, attempt: str) -> None:
        self.path = run_dir / BATCHES_FILE
        self.fingerprinter = fingerprinter
        self.attempt = attempt
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.earlier = self._read_earlier()
        self.warned = False

    def _read_earlier(self) -> dict[int, str]:
        """What earlier starts recorded; an unreadable line is skipped (a hint, not the trust)."""
        seen: dict[int, str] = {}
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            return seen
        for line in lines:
            try:
                obj = json.loads(line)
                seen[int(obj["step"])] = str(obj["fingerprint"])
            except (ValueError, KeyError, TypeError):
                continue
        return seen

    def note(self, step: int, batch: Any) -> None:
        first = batch[0] if isinstance(batch, Microbatches) and len(batch) else batch
        tensors = _tensors(first, [])
        if not tensors:
            return
        self.pending.append((step, self.fingerprinter.tensors(tensors)))
        if len(self.pending) >= _FLUSH_AT:
            self.flush()

    def flush(self) -> list[str]:
        """Reads the pending fingerprints (one host read), records them, and returns the
        warning for the first step whose batch differs from an earlier start's (once)."""
        if not self.pending:
            return []
        steps = [s for s, _ in self.pending]
        device = self.pending[0][1].device
        values = torch.stack([fp.to(device) for _, fp in self.pending]).cpu()  # one read
        self.pending = []
        hexes = [f"{as_int(v):016x}" for v in values]
        differ = [(s, h) for s, h in zip(steps, hexes, strict=True) if self.earlier.get(s, h) != h]
        lines = [
            json.dumps(
                {
                    "schema": BATCHES_SCHEMA,
                    "step": s,
                    "fingerprint": h,
                    "attempt": self.attempt,
                    "time": time.time(),
                }
            )
            for s, h in zip(steps, hexes, strict=True)
            if s not in self.earlier
        ]
        try:
            if lines:
                with open(self.path, "a", encoding="utf-8") as out:
                    out.write("\n".join(lines) + "\n")
                    out.flush()
                    os.fsync(out.fileno())
                fsync_dir(self.path.parent)
        except OSError as exc:
            logger.warning("could not record the batch fingerprints in %s: %s", self.path, exc)
        for s, h in zip(steps, hexes, strict=True):
            self.earlier.setdefault(s, h)
        if not differ or self.warned:
            return []
        self.warned = True
        step, now = differ[0]
        return [
            f"slurm-guard: the data differs at step {step} from what an earlier start of this "
            f"run saw there (rank 0's batch fingerprint {now}, was {self.earlier[step]}"
            + (f"; {len(differ) - 1} more step(s) differ" if len(differ) > 1 else "")
            + "): this resume will not be bit-identical. Likely cause: an unseeded dataset, "
            "sampler or augmentation; seed it (torch.manual_seed before building the dataset, "
            "DistributedSampler(seed=...), a seeded generator) and loop with sg.resumable"
        ]
