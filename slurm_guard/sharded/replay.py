"""Replay across data-parallel indices: every rank recomputes another index's step, together.

No rank of a sharded job can recompute a microbatch alone: the forward needs the full
parameters, which FSDP all-gathers within the shard group, and under tensor parallel the TP
group computes each layer together. So the replay is a step every rank takes at once: the rank
at data-parallel index d and TP index t receives the batch and RNG state of the rank at
(d + shift, t), and the whole job runs forward and backward on the received batches, so FSDP's
all-gathers and TP's collectives line up as in a real step. The unreduced gradient that reaches
the reduce-scatter depends only on the parameters, the batch and the TP index, not on which
data-parallel index computed it, so it must reproduce the owner's bit for bit.

The replay must not disturb training: every parameter's `.grad` is set aside before it and put
back after (plain FSDP2 assigns the replay's reduce-scatter output to `.grad`), under HSDP
`set_requires_all_reduce(False)` skips the all-reduce across replicas, and
`reset_iter_state()` on the root discards the partial result FSDP would otherwise add into the
next real backward. Measured on CPU/gloo with torch 2.13: a guarded clean run is bit-identical
to an unguarded one in every layout (tests/test_sharded_layouts.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from slurm_guard.checks.replay import Captured, LossFn, preserved_state, replaying, set_rng
from slurm_guard.checks.rows import loss_bits
from slurm_guard.fingerprint.tree import as_int
from slurm_guard.sharded.hooks import ReduceScatterState


@dataclass(frozen=True)
class ReplayValues:
    """What this rank's replay of someone's step produced, as the verdict row carries it."""

    owner: int = -1
    loss: int = 0
    grad: int = 0
    nonfinite: bool = False
    failed: bool = False


def replay_step(
    model: nn.Module,
    loss_fn: LossFn,
    captured: Captured,
    owner: int,
    state: ReduceScatterState,
    on_failure: Callable[[Exception], None],
) -> ReplayValues:
    """Forward and backward of `owner`'s step, leaving training as it was.

    Every rank must call it together (the forward all-gathers, TP's collectives). An exception
    from the user's loss_fn is reported through `on_failure` and the row's failed slot; a shard
    peer already inside an all-gather is then left to the watchdog (see docs/integrations/fsdp.md).
    """
    assert isinstance(model, FSDPModule)
    params = list(model.parameters())
    kept = [p.grad for p in params]  # the real step's gradients, put back untouched
    for p in params:
        p.grad = None
    model.set_requires_all_reduce(False)
    state.reset(fingerprint=True)
    try:
        with preserved_state(model), replaying():
            set_rng(captured.cpu_rng, captured.cuda_rng)
            loss = loss_fn(model, captured.batch)
            loss.backward()  # type: ignore[no-untyped-call]
        grad = as_int(state.input_fingerprint())
        nonfinite = bool(state.nonfinite(loss.device).item()) or not bool(
            torch.isfinite(loss.detach()).item()
        )
        return ReplayValues(owner, loss_bits(loss), grad, nonfinite)
    except Exception as exc:
        on_failure(exc)
        return ReplayValues(owner, failed=True)
    finally:
        model.reset_iter_state()  # drop the partial reduce output FSDP keeps for HSDP
        model.set_requires_all_reduce(True)
        state.reset(fingerprint=False)
        for p, real in zip(params, kept, strict=True):
            p.grad = real
