"""Where the sharded guard sees gradients: FSDP2's reduce-scatter, through a custom comm.

FSDP2 hands each parameter group's unreduced local gradient (every parameter of the group,
`chunk_cat`'d into one buffer, chunk j bound for shard rank j) to its reduce-scatter. That is
the sharded analog of the DDP comm hook's bucket, and the last moment this rank's own
gradient exists as a whole: after it, every shard peer holds a mix. `GuardReduceScatter`
is FSDP's default reduce-scatter plus, on the input:

- the finite check: a float64 sum is non-finite iff some element is (as in `checks.comm_hook`);
- on verification steps, the exact fingerprint of the input, which a replay elsewhere must
  reproduce bit for bit (kept per call, in FSDP's call order, which is the same on every rank).

Everything stays on the device as tensors until the step's one verdict gather. Faults for
tests are applied here too (`corrupt`), standing for a GPU whose backward is wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

# FSDP2's comm interface is not exported publicly in torch 2.13 (see docs/integrations/fsdp.md)
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from slurm_guard.errors import GuardError
from slurm_guard.fingerprint.tree import Fingerprinter

Corrupt = Callable[[torch.Tensor, int], None]
"""Fault injection on the unreduced gradient: (input buffer, call index in the backward)."""


@dataclass
class ReduceScatterState:
    """What the reduce-scatters of one backward measured (reset at each step and replay)."""

    fingerprinter: Fingerprinter
    fingerprint: bool = False  # a verification step (or a replay): fingerprint each input
    corrupt: Corrupt | None = None
    sums: list[torch.Tensor] = field(default_factory=list)  # float64, one per call
    fingerprints: list[torch.Tensor] = field(default_factory=list)

    def reset(self, fingerprint: bool) -> None:
        self.fingerprint = fingerprint
        self.sums.clear()
        self.fingerprints.clear()

    def nonfinite(self, device: torch.device) -> torch.Tensor:
        """1 if any input of this backward held a NaN/Inf, as int64 on `device` (no host read)."""
        if not self.sums:
            return torch.zeros(1, dtype=torch.int64, device=device)
        total = torch.stack(self.sums).sum().to(device)
        return (~torch.isfinite(total)).to(torch.int64).reshape(1)

    def input_fingerprint(self) -> torch.Tensor:
        """One fingerprint of every input of this backward, in call order."""
        return self.fingerprinter.combine(self.fingerprints)


class GuardReduceScatter(DefaultReduceScatter):
    """FSDP's reduce-scatter, with the finite check and fingerprint of its input first."""

    def __init__(self, state: ReduceScatterState) -> None:
        self.state = state

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work:
        state = self.state
        if state.corrupt is not None:
            state.corrupt(input_tensor, len(state.sums))
        state.sums.append(input_tensor.sum(dtype=torch.float64))
        if state.fingerprint:
            state.fingerprints.append(state.fingerprinter.tensor(input_tensor))
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every module `fully_shard` wrapped, root first; raises if the root is not one."""
    if not isinstance(model, FSDPModule):
        raise GuardError(
            f"ShardedGuard needs a model wrapped with fully_shard, got {type(model).__name__}; "
            "call fully_shard on each block and then on the root module"
        )
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def install(model: nn.Module, state: ReduceScatterState) -> None:
    """Put the checked reduce-scatter on every FSDP module (FSDP2 sets it per module)."""
    comm = GuardReduceScatter(state)
    for module in fsdp_modules(model):
        try:
            module.set_custom_reduce_scatter(comm)
        except ValueError as exc:  # more than one parameter group (shard_placement_fn)
            raise GuardError(
                f"ShardedGuard cannot check {type(module).__name__}'s gradients: {exc}"
            ) from None
