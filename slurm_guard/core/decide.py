"""Decisions one rank makes for all: `guard.agree_on(value)` and `save_checkpoint(if_=...)`.

A loop's "validation improved, save" is computed on rank 0 (which logged the validation loss),
or computed on every rank from values that may differ in their last bit. `if improved:
guard.save_checkpoint()` then runs on some ranks only and stops the job with
CollectiveMismatch. Broadcasting the decision from one rank makes every rank take the same
branch. Not for the step path: the value is read on the host (one copy per call).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from slurm_guard.comm.collective import Collective
from slurm_guard.errors import GuardError

MAX_BYTES = 1 << 16  # a decision, not a payload


def _encode(value: Any) -> bytes:
    data = json.dumps(value, allow_nan=False, sort_keys=True).encode()
    if len(data) > MAX_BYTES:
        raise GuardError(f"agree_on(): {len(data)} bytes of JSON; at most {MAX_BYTES}")
    return data


def agree_on(comm: Collective, value: Any, src: int = 0) -> Any:
    """Rank `src`'s `value` (JSON-able) on every rank; all must call with the same `src`.

    A value rank `src` cannot encode is a RankFailed on every rank, not a hang.
    """
    if not 0 <= src < comm.world_size:
        raise GuardError(f"agree_on(src={src}): the world has ranks 0..{comm.world_size - 1}")
    what = f"agree_on(src={src})"
    comm.arrive(what)
    data = comm.agree(lambda: _encode(value) if comm.rank == src else b"", what)
    root = dist.get_global_rank(comm.group, src) if comm.group is not None else src
    size = torch.tensor([len(data)], dtype=torch.int64, device=comm.device)
    dist.broadcast(size, src=root, group=comm.group)
    n = int(size.item())
    buf = torch.zeros(n, dtype=torch.uint8, device=comm.device)
    if comm.rank == src:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=root, group=comm.group)
    return json.loads(bytes(buf.cpu().tolist()).decode())
