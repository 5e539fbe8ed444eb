"""FSDP2's parts the sharded guard stands on, imported once, or refused by name.

The package's `__init__` imports this first, so a torch without FSDP2 (or one that moved its
private comm interface) stops every sharded entry point with `UnsupportedTorch`, naming the
torch version and the API, before DCP or anything else fails on a raw ImportError.
"""

from __future__ import annotations

from slurm_guard.comm.torch_support import require_api, unsupported_torch

__all__ = ["DefaultReduceScatter", "FSDPModule"]

try:
    from torch.distributed.fsdp import FSDPModule

    # FSDP2's comm interface is private (tested on torch 2.13 and 2.14; docs/architecture.md,
    # "Torch versions"): the checked reduce-scatter subclasses it.
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except ImportError as exc:
    raise unsupported_torch(
        "ShardedGuard", "FSDP2's DefaultReduceScatter (torch.distributed.fsdp._fully_shard)"
    ) from exc

# set_custom_reduce_scatter appeared in torch 2.9, reset_iter_state in 2.13 (sharded.replay).
require_api(
    "ShardedGuard",
    FSDPModule,
    ("set_custom_reduce_scatter", "set_requires_all_reduce", "reset_iter_state"),
)
