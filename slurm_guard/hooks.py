"""The DDP communication hook: checks on each gradient bucket, in the pass DDP makes anyway.

Per bucket, before the all-reduce: one float64 sum of the local gradients (a sum is non-finite iff
some element is; float64 cannot overflow on float32/bf16 inputs), and on verification steps the
exact fingerprint of each parameter's local gradient (the reduction overwrites the buffer). After
the all-reduce: one float64 sum of the averaged bucket. The sums stay on the device as tensors;
the guard reads them once per step in its verdict collective, so the hook adds no synchronisation.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # the class DDP compares against

from slurm_guard.fingerprint import Fingerprinter


@dataclass
class HookState:
    """Mutable per-step state shared by the guard and its hook."""

    group: dist.ProcessGroup | None
    world_size: int
    fingerprinter: Fingerprinter
    param_index: dict[int, int]  # id(param) -> position in the guard's parameter list
    active: bool = True
    fingerprint_local: bool = False
    local_sums: list[torch.Tensor] = field(default_factory=list)
    reduced_sums: list[torch.Tensor] = field(default_factory=list)
    local_fingerprints: dict[int, torch.Tensor] = field(default_factory=dict)

    def reset(self, *, fingerprint_local: bool) -> None:
        self.fingerprint_local = fingerprint_local
        self.local_sums = []
        self.reduced_sums = []
        self.local_fingerprints = {}


# No `from __future__ import annotations` in this module: DDP inspects the hook's signature and
# insists that the `bucket` annotation is the real dist.GradBucket class, not a string.
def guard_comm_hook(state: HookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    if state.active:
        state.local_sums.append(buffer.sum(dtype=torch.float64))
        if state.fingerprint_local:
            for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                index = state.param_index[id(param)]
                state.local_fingerprints[index] = state.fingerprinter.tensor(grad)
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    assert work is not None

    def average(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = fut.value()[0].div_(state.world_size)
        if state.active:
            state.reduced_sums.append(reduced.sum(dtype=torch.float64))
        return reduced

    return work.get_future().then(average)  # type: ignore[no-any-return]
