"""What every replica must hold identically, and its fingerprint for the weight vote.

Parameters and optimizer state are replicated after every update. Buffers are replicated only
at the moment DDP broadcasts them, at the start of a step's first forward: the forward then
updates each rank's running statistics from its own microbatch, so after the update they differ
by design. The vote therefore takes the buffers' fingerprint as they were broadcast.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slurm_guard.checks.replay import is_replaying
from slurm_guard.fingerprint import Fingerprinter


class ReplicatedState:
    """The module's and optimizer's replicated tensors, with a buffer snapshot per step.

    Args:
        module: the plain module (not the DDP wrapper).
        optimizer: its optimizer, whose state is replicated too.
        fingerprinter: the run's fingerprints.
        broadcast_buffers: DDP broadcasts the buffers at each step's first forward; only then
            are they part of what replicas share.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        fingerprinter: Fingerprinter,
        broadcast_buffers: bool,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.fingerprinter = fingerprinter
        self.buffer_fingerprint: torch.Tensor | None = None
        self.snapshot_due = False
        if broadcast_buffers and next(module.buffers(), None) is not None:
            module.register_forward_pre_hook(self._snapshot_buffers)

    def _snapshot_buffers(self, _module: nn.Module, _args: Any) -> None:
        """Forward pre-hook: fingerprint the buffers as DDP just broadcast them.

        Only the step's first forward counts: under no_sync() DDP broadcasts for that one alone.
        """
        if self.snapshot_due and not is_replaying():
            self.buffer_fingerprint = self.fingerprinter.tensors(list(self.module.buffers()))
            self.snapshot_due = False

    def tensors(self, buffers: bool = True) -> list[torch.Tensor]:
        """Everything replicas must hold identically: parameters, buffers, optimizer state."""
        out = [t.detach() for t in self.module.parameters()]
        if buffers:
            out += [t.detach() for t in self.module.buffers()]
        state = self.optimizer.state_dict()["state"]
        for key in sorted(state):
            for name in sorted(state[key]):
                value = state[key][name]
                out.append(value if isinstance(value, torch.Tensor) else torch.tensor(value))
        return out

    def vote_fingerprint(self) -> torch.Tensor:
        """Parameters and optimizer state now; buffers as broadcast at this step's forward."""
        parts = [self.fingerprinter.tensors(self.tensors(buffers=False))]
        if self.buffer_fingerprint is not None:
            parts.append(self.buffer_fingerprint)
        return self.fingerprinter.combine(parts)
