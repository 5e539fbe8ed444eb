"""The per-step verdict row: its layout, and how a rank's values become int64 fields.

Every rank sends one fixed-size row of int64 per verification round; float64 values travel as
their bit patterns, so a rank's numbers arrive exactly as it computed them and every rank can run
the same pure verdicts on them. The helpers keep each value on its device until the gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from slurm_guard.checks.replay import Captured, ReplayOutput
from slurm_guard.checks.verdicts import Finding
from slurm_guard.protocol import Check

# Row layout of the per-step gather (float64 values travel as their int64 bit patterns).
(
    LOCAL_NONFINITE,
    REDUCED_NONFINITE,
    OWN_LOSS,
    OWN_GRAD,
    REPLAYED,
    REPLAY_LOSS,
    REPLAY_GRAD,
    REPLAY_NONFINITE,
    LOCAL_SKETCH,
    LOCAL_L1,
    REDUCED_SKETCH,
    REDUCED_GRAD,
    REPLAY_FAILED,
    ABFT_RATIO,
    ABFT_WHERE,
) = range(15)
ROW = 15

ReplayFn = Callable[[Captured], ReplayOutput]
"""Recompute a captured step on this rank (the Guard binds module, loss_fn, scaler, faults)."""

LedgerFn = Callable[[int, Check, bool, dict[str, object]], None]
"""Record one verification result (the Guard writes on rank 0 only)."""


def loss_bits(loss: torch.Tensor) -> int:
    """The exact bit pattern of a scalar, widened to float64 (exact for every float type)."""
    return int(bits(loss).item())


def bits(x: torch.Tensor) -> torch.Tensor:
    """A scalar's float64 bit pattern as a one-element int64 tensor, on the scalar's device."""
    return x.detach().double().reshape(1).view(torch.int64)


TOLERANCE_FLOOR = 4 * torch.finfo(torch.float32).eps


def reference_vector(loss: torch.Tensor, sketches: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tolerance mode: [loss, (sketch, norm) per parameter] in float64 on the CPU, joined on
    the loss's device first: one device-to-host copy, not one per parameter."""
    device = loss.device
    parts = [loss.detach().double().reshape(1)] + [s.to(device) for s in sketches]
    return torch.cat(parts).cpu()


def discrepancy(reference: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """Relative distance of a replay from the owner: the worst of the loss and every parameter.

    A sketch difference <e, r> has the size of ||e||_2 for random signs r, so dividing by the
    owner's gradient norm gives a relative error that does not depend on the layer's scale.
    """
    tiny = 1e-30
    loss_error = (mine[0] - reference[0]).abs() / reference[0].abs().clamp_min(tiny)
    ref_pairs, my_pairs = reference[1:].view(-1, 2), mine[1:].view(-1, 2)
    grad_error = (my_pairs[:, 0] - ref_pairs[:, 0]).abs() / ref_pairs[:, 1].clamp_min(tiny)
    worst = torch.cat([loss_error.reshape(1), grad_error]).max()
    return torch.nan_to_num(worst, nan=float("inf"))


def upload(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host numbers as a tensor on `device` without waiting for the device: a blocking
    host-to-device copy synchronises the stream (on CUDA it would wait for the whole backward
    before the verdict round could even be launched)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def replay_fields(
    own_grad: int, owner: int, replayed: Replayed, reduced_grad: int
) -> tuple[list[int], list[int]]:
    """The row's replay fields: [OWN_GRAD .. REPLAY_NONFINITE] and [REDUCED_GRAD, REPLAY_FAILED]."""
    middle = [own_grad, owner, replayed.loss, replayed.grad, int(replayed.nonfinite)]
    return middle, [reduced_grad, int(replayed.failed)]


def with_complements(values: torch.Tensor) -> torch.Tensor:
    """int64 values followed by their bitwise complements: what `same_on_every_rank` reads after
    a MAX all-reduce."""
    return torch.cat([values, torch.bitwise_not(values)])


def total(values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum per-bucket float64 scalars in a fixed order (bitwise equal on every rank)."""
    if not values:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(values).sum()


@dataclass(frozen=True)
class StepResult:
    """What the checks of one step decided.

    Attributes:
        finding: the failed check, or None.
        skip_update: the optimizer step must not run (a finding, or a skipped numerical step).
        verified: a ring replay of this step passed on every rank; the step is now the newest
            verified one.
    """

    finding: Finding | None
    skip_update: bool
    verified: bool = False


@dataclass(frozen=True)
class Replayed:
    loss: int = 0
    grad: int = 0
    nonfinite: bool = False
    failed: bool = False
