"""A checked layer's state between its passes: what it checks with, and what it has seen.

A `Site` is created per checked GEMM (a Linear, a Conv1D, an attention projection) by `wrap.py`
and carries, across the forward and backward passes of one step, the results of its checks, its
fault injectors, and the weight norms and bound factors it reuses while the weight is unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from slurm_guard.abft.bounds import (
    Factors,
    check_dtype,
    factors,
    roundoff,
)
from slurm_guard.comm.torch_support import unsupported_torch
from slurm_guard.kernels import abft_native as nk
from slurm_guard.kernels import abft_triton as at

FWD, GRAD_X, GRAD_W = 0, 1, 2
# The weight norms are kept until the tensor's version counter moves, `Tensor._version`
# (private; tested on torch 2.13 and 2.14): without it a stale norm would bound another weight.
if not hasattr(torch.empty(0), "_version"):
    raise unsupported_torch("The ABFT check", "Tensor._version")

PASSES = ("fwd", "grad_x", "grad_w")
# Rows per checksum block at most for float16/bfloat16 products: their bound is the rounding of
# each stored output element, which grows as sqrt(block), not the GEMM's (docs/coverage.md)
HALF_BLOCK = 32
HALF = (torch.float16, torch.bfloat16)

Injector = Callable[[torch.Tensor], None]
# What checks a float32 product in one pass per tensor: the C passes (CPU) or the Triton ones
# (the module `abft_triton`: CUDA, or CPU under the interpreter in tests)
Passes = nk._Native | ModuleType


@dataclass
class Site:
    """One checked layer (or one projection inside attention) and what it has seen this step.

    `results` collects (pass, (residual / bound)^2): per block and column as a device tensor
    (torch path), its largest value as a 0-dim device tensor (the Triton path, CUDA), or as a
    number (the C path, CPU only, where the number is on the host anyway). `checking` False
    keeps the layer wrapped for fault injection only.
    `injectors[pass]` corrupt that pass's output in place before it is checked (software
    faults, `slurm_guard.faults.injection`).
    """

    index: int
    name: str
    kind: str  # "linear" (M = weight.t()) or "addmm" (M = weight)
    margin: float = 10.0
    block: int = 64
    checking: bool = True
    results: list[tuple[int, torch.Tensor | float]] = field(default_factory=list)
    injectors: dict[int, list[Injector]] = field(default_factory=dict)
    flops: list[int] | None = None  # coverage accounting: FLOPs of the GEMMs checked
    suspended: Callable[[], bool] = lambda: False
    norms: tuple[tuple[int, int, int, bool], torch.Tensor, torch.Tensor] | None = None
    bias_norms: tuple[tuple[int, int, int], torch.Tensor] | None = None
    # testing aid (benchmarks/campaign.py): {"which": pass} keeps that pass's next squared
    # bound under "bound2", so a harness can tell whether an injected error was above it
    probe: dict[str, Any] | None = None
    _factors: dict[tuple[int, int, float], Factors] = field(default_factory=dict, repr=False)

    def active(self) -> bool:
        return self.checking and not self.suspended()

    def block_for(self, dtype: torch.dtype) -> int:
        """Rows per checksum block for a product of this dtype."""
        return min(self.block, HALF_BLOCK) if dtype in HALF else self.block

    def inject(self, which: int, out: torch.Tensor) -> None:
        for fn in self.injectors.get(which, ()):
            fn(out)

    def count(self, n: int, k: int, m: int) -> None:
        if self.flops is not None:
            self.flops.append(2 * n * k * m)

    def bias_sq(self, b: torch.Tensor) -> torch.Tensor:
        """beta^2 in float64, kept like the weight norms (the bias changes only at the update)."""
        key = (b.data_ptr(), b._version, -1)
        if self.bias_norms is None or self.bias_norms[0] != key:
            self.bias_norms = (key, b.double().square())
        return self.bias_norms[1]

    def weight_norms(
        self, m: torch.Tensor, kernel: Passes | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(||M[:, c]||^2 per output column, ||M[l, :]||^2 per input row), one pass over the
        weight per step: kept until the weight changes (version counter) or the step ends.
        With the one-pass kernels they are float64 (what their compare passes read), else the
        check dtype."""
        key = (m.data_ptr(), m._version, m.shape[0], kernel is not None)
        norms = self.norms
        if norms is not None and norms[0] == key:
            return norms[1], norms[2]
        w = m.t() if self.kind == "linear" else m  # the stored, contiguous layout
        if isinstance(kernel, nk._Native):
            along, across = nk.weight_norms(kernel, w if w.is_contiguous() else w.contiguous())
        elif kernel is not None:
            along, across = at.weight_norms(w)
        else:
            sq = squares_into_scratch(w)
            along = sq.sum(1)
            across = torch.mv(sq.t(), torch.ones(sq.shape[0], dtype=sq.dtype, device=sq.device))
        col, row = (along, across) if self.kind == "linear" else (across, along)
        self.norms = (key, col, row)
        return col, row

    def kernel(self, which: int, *tensors: torch.Tensor | None) -> Passes | None:
        """The one-pass kernels when they can check this pass: float32 operands on one device
        (the C passes on the CPU, if built; the Triton ones on CUDA, if installed), outside
        autocast, and no bound probe waiting for this pass (the probe needs the torch path's
        per-element bound). None: the torch path."""
        probe = self.probe
        if probe is not None and probe.get("which") == which and "bound2" not in probe:
            return None
        device = next(t.device for t in tensors if t is not None)
        if torch.is_autocast_enabled(device.type):
            return None  # (autocast casts the operands to a half type first anyway)
        for t in tensors:
            if t is not None and (t.dtype != torch.float32 or t.device != device):
                return None
        if at.available(device):
            return at
        return nk.native() if device.type == "cpu" else None

    def factors(self, q: int, n_max: int, like: torch.Tensor) -> Factors:
        """The bound's numbers for a float32 product (`bounds.factors`), kept per shape: per
        step only the norms change, and hashing the full key costs more than the lookup here."""
        key = (q, n_max, self.margin)
        f = self._factors.get(key)
        if f is None:
            r = roundoff(like.dtype, like.device)
            f = self._factors[key] = factors(q, float(n_max), r, self.margin)
        return f


_SCRATCH: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}


_SCRATCH_LIMIT = 1 << 24  # elements kept for reuse (64 MiB in float32)


def squares_into_scratch(t: torch.Tensor) -> torch.Tensor:
    """Elementwise squares in the check dtype (float16 squares overflow above 256), written into
    a reused buffer: a fresh multi-megabyte temporary costs more in page faults than the squaring.
    Valid until the next call."""
    cdt = check_dtype(t.dtype)
    n = t.numel()
    if n > _SCRATCH_LIMIT:
        return t.to(cdt).square()
    key = (cdt, t.device, threading.get_ident())
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[key] = torch.empty(n, dtype=cdt, device=t.device)
    out = buf[:n].view(t.shape)
    return torch.mul(t, t, out=out) if t.dtype == cdt else out.copy_(t).square_()
