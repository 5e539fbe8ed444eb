"""How much of a model's matrix-multiply work the checked GEMMs cover.

Counted, not estimated: one forward and backward runs under `torch.utils.flop_counter.
FlopCounterMode` (every matmul-like aten op the model executes, attention included), while the
checked layers add up the FLOPs of the GEMMs they check. The checks themselves are suspended
during the count so their own small GEMMs do not inflate the total.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from slurm_guard.abft.wrap import ATTR, Abft

ATTENTION_OPS = ("attention", "bmm", "baddbmm")


@dataclass(frozen=True)
class Coverage:
    """Matmul FLOPs of one forward+backward: all of them, the checked ones, the rest by op."""

    total_flops: int
    checked_flops: int
    unchecked_by_op: dict[str, int] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        return self.checked_flops / self.total_flops if self.total_flops else 1.0

    @property
    def attention_flops(self) -> int:
        """Attention score and value products (batched matmuls, fused attention kernels)."""
        return sum(
            f for op, f in self.unchecked_by_op.items() if any(a in op for a in ATTENTION_OPS)
        )

    @property
    def fraction_without_attention(self) -> float:
        rest = self.total_flops - self.attention_flops
        return self.checked_flops / rest if rest else 1.0

    def as_dict(self) -> dict[str, object]:
        return {
            "total_matmul_flops": self.total_flops,
            "checked_flops": self.checked_flops,
            "checked_fraction": round(self.fraction, 6),
            "attention_flops": self.attention_flops,
            "checked_fraction_without_attention": round(self.fraction_without_attention, 6),
            "unchecked_by_op": dict(self.unchecked_by_op),
        }

    def describe(self) -> str:
        lines = [
            f"checked GEMMs cover {100 * self.fraction:.1f}% of the matmul FLOPs "
            f"({self.checked_flops:,} of {self.total_flops:,} per forward+backward)",
            f"attention score/value products (not checked): {self.attention_flops:,} FLOPs, "
            f"{100 * self.attention_flops / max(self.total_flops, 1):.1f}%; without them the "
            f"checked share is {100 * self.fraction_without_attention:.1f}%",
        ]
        for op, flops in sorted(self.unchecked_by_op.items(), key=lambda kv: -kv[1]):
            lines.append(f"  unchecked {op}: {flops:,} FLOPs")
        return "\n".join(lines)


def measure_coverage(model: nn.Module, loss: Callable[[], torch.Tensor]) -> Coverage:
    """Run `loss()` (a forward that returns a scalar) and its backward once and count.

    Args:
        model: a model the checks are attached to (`attach` or `GuardConfig(abft=True)`).
        loss: computes the model's loss for one representative batch. Gradients it leaves are
            the caller's to zero; the checks' results of this pass are discarded.
    """
    handle: Abft | None = getattr(model, ATTR, None)
    if handle is None:
        raise ValueError(
            "measure_coverage needs a model with checked GEMMs: call "
            "slurm_guard.abft.attach(model) first (the Guard does it with abft=True)"
        )
    previous = [(s.suspended, s.flops) for s in handle.sites]
    counted: list[int] = []
    for s in handle.sites:
        s.suspended = lambda: True
        s.flops = counted if s.checking else None
    try:
        with FlopCounterMode(display=False) as counter:
            loss().backward()  # type: ignore[no-untyped-call]
    finally:
        for s, (suspended, flops) in zip(handle.sites, previous, strict=True):
            s.suspended, s.flops = suspended, flops
            s.results.clear()
    by_op: dict[str, int] = {}
    for op, flops in counter.get_flop_counts().get("Global", {}).items():
        by_op[str(op).split(".")[-1] if "." in str(op) else str(op)] = int(flops)
    total = int(counter.get_total_flops())
    checked = sum(counted)
    unchecked = dict(by_op)
    # the checked GEMMs are all mm/addmm: take their FLOPs off those ops first
    remaining = checked
    for op in ("mm", "addmm"):
        take = min(unchecked.get(op, 0), remaining)
        if op in unchecked:
            unchecked[op] -= take
            remaining -= take
    unchecked = {op: f for op, f in unchecked.items() if f > 0}
    return Coverage(total, checked, unchecked)
