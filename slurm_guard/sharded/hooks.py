"""Where the sharded guard sees gradients: FSDP2's reduce-scatter, through a custom comm.

FSDP2 hands each parameter group's unreduced local gradient (every parameter of the group,
`chunk_cat`'d into one buffer, chunk j bound for shard rank j) to its reduce-scatter. That is
the sharded analog of the DDP comm hook's bucket, and the last moment this rank's own
gradient exists as a whole: after it, every shard peer holds a mix. `GuardReduceScatter`
is FSDP's default reduce-scatter plus, on the input:

- the finite check: a float64 sum is non-finite iff some element is (as in `checks.comm_hook`);
- on verification steps, the exact fingerprint of the input, which a replay elsewhere must
  reproduce bit for bit (kept per call, in FSDP's call order, which is the same on every rank);
- conservation: the float64 sum of the output, this rank's chunk, right after the collective.
  Summed over the shard group, the outputs must give back the inputs' sum (times 1/S for AVG),
  up to rounding: a wrong value made by the reduce-scatter itself (network, NCCL, a wrong
  reduction on one GPU) breaks it, and nothing else would see it (replays compare inputs, and
  every replica of the shard receives the same wrong value, so the vote agrees).

Everything stays on the device as tensors until the step's one verdict gather. Faults for
tests are applied here too (`corrupt`), standing for a GPU whose backward is wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from slurm_guard.errors import GuardError
from slurm_guard.fingerprint.tree import Fingerprinter
from slurm_guard.sharded.fsdp_api import DefaultReduceScatter, FSDPModule

Corrupt = Callable[[torch.Tensor, int], None]
"""Fault injection: (the input buffer or the output chunk, call index in the backward)."""


@dataclass
class Conservation:
    """Per backward: what the group's reduce-scatters must conserve, and the rounding scale.

    `residual` is this rank's sum of (input sum - output sum x S/k)/S over the calls, where the
    op delivers k/S of the group's sum (k = 1 for AVG, S for SUM): summed over the shard group it
    is the reduction's error in units of one averaged sum, which `conservation_bound` bounds
    from the inputs' L1 norms. A call that cannot be stated (an asynchronous call, whose output
    is not there yet, or a PREMUL_SUM whose factor torch does not expose) is left out of the
    check, not guessed at; FSDP2 in torch 2.13 makes neither with its default divide factors.
    """

    residuals: list[torch.Tensor] = field(default_factory=list)
    l1: list[torch.Tensor] = field(default_factory=list)
    group_size: int = 1
    largest: int = 0
    unit_roundoff: float = 0.0

    def clear(self) -> None:
        self.residuals.clear()
        self.l1.clear()
        self.largest = 0
        self.unit_roundoff = 0.0

    def add(
        self,
        input_sum: torch.Tensor,
        input_tensor: torch.Tensor,
        output_tensor: torch.Tensor,
        group_size: int,
        op: object,
    ) -> None:
        if op == dist.ReduceOp.AVG:
            per_group = float(group_size)  # the output is the group's sum / S
        elif op == dist.ReduceOp.SUM:
            per_group = 1.0
        else:
            return  # PREMUL_SUM: its factor is not readable from the op
        out_sum = output_tensor.sum(dtype=torch.float64)
        self.residuals.append((input_sum - out_sum * per_group) / group_size)
        # The L1 only scales the bound: the input dtype's own accumulation is precise enough.
        self.l1.append(torch.linalg.vector_norm(input_tensor, 1).to(torch.float64))
        self.group_size = group_size
        self.largest = max(self.largest, input_tensor.numel())
        self.unit_roundoff = max(self.unit_roundoff, torch.finfo(input_tensor.dtype).eps / 2)

    def bound_inputs(self) -> tuple[float, int, int, int]:
        """(unit roundoff, largest input, calls, group size): what the bound needs besides the
        L1 norms, read before a replay's reduce-scatters overwrite them."""
        return self.unit_roundoff, self.largest, max(len(self.residuals), 1), self.group_size

    def summary(self, device: torch.device) -> torch.Tensor:
        """[residual, L1] as float64 on `device` (zeros when nothing was stated)."""
        if not self.residuals:
            return torch.zeros(2, dtype=torch.float64, device=device)
        return torch.stack([torch.stack(self.residuals).sum(), torch.stack(self.l1).sum()]).to(
            device
        )


@dataclass
class ReduceScatterState:
    """What the reduce-scatters of one backward measured (reset at each step and replay)."""

    fingerprinter: Fingerprinter
    fingerprint: bool = False  # a verification step (or a replay): fingerprint each input
    corrupt: Corrupt | None = None
    corrupt_output: Corrupt | None = None  # a wrong reduction, after the collective
    sums: list[torch.Tensor] = field(default_factory=list)  # float64, one per call
    fingerprints: list[torch.Tensor] = field(default_factory=list)
    conservation: Conservation = field(default_factory=Conservation)

    def reset(self, fingerprint: bool) -> None:
        self.fingerprint = fingerprint
        self.sums.clear()
        self.fingerprints.clear()
        self.conservation.clear()

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
    """FSDP's reduce-scatter, with the finite check and fingerprint of its input first and the
    conservation sums around it."""

    def __init__(self, state: ReduceScatterState) -> None:
        self.state = state

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work:
        state = self.state
        call = len(state.sums)
        if state.corrupt is not None:
            state.corrupt(input_tensor, call)
        input_sum = input_tensor.sum(dtype=torch.float64)
        state.sums.append(input_sum)
        if state.fingerprint:
            state.fingerprints.append(state.fingerprinter.tensor(input_tensor))
        work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        if async_op and work is not None:
            # FSDP2 in torch 2.13 and 2.14 calls synchronously. Should a later torch call
            # asynchronously, the output is not there yet: wait (on the device, a stream wait on
            # NCCL) rather than leave the conservation check out without a word.
            work.wait()
        if state.corrupt_output is not None:
            state.corrupt_output(output_tensor, call)
        # Ordered after the collective on the caller's stream, before FSDP's HSDP all-reduce
        # (which waits on an event recorded after this call) changes the output in place.
        state.conservation.add(input_sum, input_tensor, output_tensor, group.size(), op)
        return work


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
